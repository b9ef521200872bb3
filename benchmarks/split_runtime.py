"""Long samples split over ranks (policy "lb-mini-split") against ODC + LB-Mini and fixed SP, 4 CPU ranks.

4 CPU ranks (one node), a small Llama (sdpa, hidden 128, 2 layers, 4 heads), LongAlign-like lengths scaled
to a 4096-token cap (``examples/packed_lm.py``: lognormal, mean about 1030, most samples short, a few near the
cap), ``--samples-per-rank`` samples per rank per step, 16 measured steps after one warm-up. The same
minibatches, three plans:

* ``odc-lb-mini``: LB-Mini, whole samples packed per rank;
* ``odc-split``: ``plan_split`` (groups of 2, ranks 0-1 and 2-3), priced by this machine's fits: compute
  ``c + a·s² + b·s`` (``fit_cost_model``) and the all-to-alls (``fit_all_to_all`` of
  ``benchmarks/split_all_to_all.py``), both in seconds;
* ``fixed-sp``: fixed SP 2 as a split plan (``fixed_groups``: every sample over a group, LB-Mini over the two
  groups, packed), run by the same split runtime (the same Ulysses attention as ALST's mpu route).

Every rank runs its list (``plan.for_rank(rank)``), each entry inside ``engine.odc_micro_batch(entry)`` on its
slice, per-token loss, AdamW; every method on the same engine (the split policy's attention hook), so packed
samples attend each within itself in all three (transformers' own sdpa path masks a packed micro-batch densely
and computes its total length squared: 3.5x the time of four ~1K samples here, a handicap only for the plans that
pack whole samples). One invocation runs one method and prints one JSON line:

* ``samples_per_s``: samples over the wall time of the measured steps (a barrier before them and one after);
* ``cpu_makespan_samples_per_s``: samples over the sum, per step, of the busiest rank's CPU seconds in it.
  Here 4 ranks share 2 cores, so a rank that waits lends its core to one that computes: LB-Mini's idle ranks
  speed up the rank with the long sample, which devices of their own cannot do. A step's busiest CPU time is
  what it would take with a core per rank (members of a split micro-batch work equally, so they wait little);
* ``busy`` (each rank's share of the wall in forward/backward), the samples run split per step, and the cost
  model's (the simulator's) projection of the same plans on a 4-rank machine with a core per rank.

Pair methods with ``benchmarks/paired.py``:

    .venv/bin/python benchmarks/paired.py -n 3 \\
        --a ".venv/bin/python benchmarks/split_runtime.py --method odc-split --samples-per-rank 1" \\
        --b ".venv/bin/python benchmarks/split_runtime.py --method odc-lb-mini --samples-per-rank 1" \
        --figure samples_per_s --figure cpu_makespan_samples_per_s

``--fit`` measures the two cost fits on this machine and prints them (the constants below were measured so).
(4 ranks share this machine's 2 cores: ratios are indicative, absolute rates are not a GPU's.)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]

WORLD, TOKEN_CAP, STEPS, WARMUP, LENGTH_SCALE = 4, 4096, 17, 1, 16
METHODS = ("odc-lb-mini", "odc-split", "fixed-sp")
MODEL = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=TOKEN_CAP + 2)
#: ``--fit`` on this machine, 2026-11-27 (one rank, one thread; middle of 3 noisy fits): forward+backward of one
#: sample of s tokens (seconds), and one all-to-all over 2 ranks (benchmarks/split_all_to_all.py, 4 ranks).
COMPUTE = dict(per_micro_batch=4.1e-3, quadratic=3.2e-8, linear=4.4e-5)
ALL_TO_ALL = dict(latency=2.05e-4, bandwidth=5.94e8)


def _model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**MODEL, tie_word_embeddings=False)
    config.use_cache = False
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def cost_models():
    from ds_odc.balance import AllToAllCost, CostModel

    # Ulysses: per layer 4 all-to-alls forward and 4 backward, each token's hidden values in fp32
    return (CostModel(**COMPUTE),
            AllToAllCost(layers=MODEL["num_hidden_layers"], all_to_alls_per_layer=8,
                         bytes_per_token=4.0 * MODEL["hidden_size"], **ALL_TO_ALL))


def plans(method: str, samples_per_rank: int):
    """Every step's plan (a ``SplitPlan``; LB-Mini's as one without splits) and the simulator's step seconds."""
    from benchmarks.sim.hardware import Hardware
    from benchmarks.sim.split import simulate_split_step
    from ds_odc.balance import plan_minibatch, plan_split
    from ds_odc.balance.split import fixed_groups
    from ds_odc.balance.split_cost import SplitCostModel
    from ds_odc.balance.split_plan import SplitPlan

    from packed_lm import longalign_like_lengths

    compute, a2a = cost_models()
    cost = SplitCostModel(compute, a2a)
    size = WORLD * samples_per_rank
    lengths = [max(2, n) for n in longalign_like_lengths(size * STEPS, LENGTH_SCALE, seed=samples_per_rank)]
    hardware = Hardware(layers=MODEL["num_hidden_layers"])  # compute only, priced by the fits: the ideal machine
    out = []
    for step in range(STEPS):
        chunk = lengths[step * size:(step + 1) * size]
        if method == "odc-lb-mini":
            whole = plan_minibatch(chunk, WORLD, TOKEN_CAP, "lb-mini", compute, seed=step).micro_batches
            plan = SplitPlan(tuple(chunk), TOKEN_CAP, cost, WORLD, (), whole)
        elif method == "fixed-sp":
            plan = fixed_groups(chunk, WORLD, TOKEN_CAP, cost, WORLD, 2, seed=step)
        else:
            plan = plan_split(chunk, WORLD, TOKEN_CAP, compute, a2a, node_size=WORLD, max_group=2,
                              min_chunk_tokens=64, seed=step)
        out.append((plan, simulate_split_step(plan, hardware).step_seconds))
    return out


def _run(rank: int, cell: dict) -> dict:
    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import ds_odc  # noqa: F401
    from ds_odc.balance import split_batch

    deepspeed.init_distributed(dist_backend="gloo")
    model = _model()
    odc = {"balance": {"policy": "lb-mini-split", "token_cap": TOKEN_CAP, "max_group": 2}}
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "managed_gradient_accumulation": False, "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": "odc", "odc": odc}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    busy, wall_start, cpu = 0.0, None, []
    for step, plan in enumerate(cell["plans"]):
        if step == WARMUP:
            dist.barrier()
            busy, wall_start = 0.0, time.perf_counter()
        cpu_start = time.process_time()
        for entry in plan.for_rank(rank):
            start = time.perf_counter()
            pieces = []
            for i in entry.samples:
                g = torch.Generator().manual_seed(100_000 * step + i)
                pieces.append(torch.randint(0, MODEL["vocab_size"], (plan.lengths[i],), generator=g))
            ids = torch.cat(pieces).unsqueeze(0)
            batch = {"input_ids": ids, "labels": ids.clone(),
                     "position_ids": torch.cat([torch.arange(len(p)) for p in pieces]).unsqueeze(0)}
            part = split_batch(batch, entry, rank)
            with engine.odc_micro_batch(entry):
                logits = engine(input_ids=part["input_ids"], position_ids=part["position_ids"]).logits.float()
                labels = part["shift_labels"]
                loss = F.cross_entropy(logits.reshape(-1, MODEL["vocab_size"]), labels.reshape(-1), reduction="sum")
                engine.backward(loss, loss_tokens=int((labels != -100).sum()))
            busy += time.perf_counter() - start
        engine.step()
        cpu.append(time.process_time() - cpu_start)
    dist.barrier()
    wall = time.perf_counter() - wall_start
    engine.destroy()
    return {"wall_s": wall, "busy_s": busy, "cpu_s": cpu[WARMUP:]}


def fit() -> dict:
    """This machine's compute fit (one rank, one thread): what ``COMPUTE`` holds."""
    import torch
    import torch.nn.functional as F

    from ds_odc.balance import fit_cost_model, forward_backward_timer

    torch.set_num_threads(1)
    model = _model()

    def run(length: int) -> None:
        ids = torch.randint(0, MODEL["vocab_size"], (1, length))
        logits = model(input_ids=ids, position_ids=torch.arange(length).unsqueeze(0)).logits
        F.cross_entropy(logits.reshape(-1, MODEL["vocab_size"]), ids.reshape(-1)).backward()

    fitted = fit_cost_model(forward_backward_timer(run), [256, 512, 1024, 2048, 4096], repeats=5)
    return {"per_micro_batch": fitted.per_micro_batch, "quadratic": fitted.quadratic, "linear": fitted.linear}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", choices=METHODS)
    parser.add_argument("--samples-per-rank", type=int, choices=(1, 2), default=1)
    parser.add_argument("--fit", action="store_true", help="measure and print the compute fit, then stop")
    args = parser.parse_args(argv)
    from benchmarks import cells

    if args.fit:
        print(json.dumps({"compute": fit()}))
        return
    if args.method is None:
        parser.error("--method is required (or --fit)")
    planned = plans(args.method, args.samples_per_rank)
    steps = [plan for plan, _ in planned]
    results = cells.run_cell(_run, WORLD, {"plans": steps}, args.method, timeout_s=1500)
    wall = max(r["wall_s"] for r in results)
    measured = steps[WARMUP:]
    samples = sum(len(plan.lengths) for plan in measured)
    projected = sum(seconds for _, seconds in planned[WARMUP:])
    cpu_makespan = sum(max(step) for step in zip(*(r["cpu_s"] for r in results)))
    print(json.dumps({"method": args.method, "samples_per_rank": args.samples_per_rank,
                      "samples_per_s": round(samples / wall, 3), "wall_s": round(wall, 2),
                      "cpu_makespan_samples_per_s": round(samples / cpu_makespan, 3),
                      "busy": [round(r["busy_s"] / r["wall_s"], 3) for r in results],
                      "split_samples_per_step": round(sum(len(s.samples) for p in measured for s in p.splits)
                                                      / len(measured), 2),
                      "projected_samples_per_s": round(samples / projected, 3),
                      "projected_idle": round(sum(p.idle_fraction() for p in measured) / len(measured), 3)}))


if __name__ == "__main__":
    main()
