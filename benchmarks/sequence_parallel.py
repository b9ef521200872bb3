"""Ulysses sequence parallelism under long-tailed lengths: ODC + LB-Mini against ZeRO-3 + LB-Micro.

4 CPU ranks = 2 SP groups of 2 (ALST's mpu, sdpa attention), a small Llama, LongAlign-like lengths scaled to
a 1024-token cap; every step plans the same global minibatch over the 2 SP groups, each group's micro-batches
packed (one sequence of concatenated samples, sliced over the group's 2 ranks). ZeRO-3 + SP needs the same
number of micro-batches in every group (its gathers are collectives over the world): LB-Micro. ODC lets the
groups run different counts: LB-Mini, planned with the same cost model (fitted here, length² and length).

One invocation runs one method and prints one JSON line: samples/s over the measured steps (from a barrier
before them to one after), the utilisation of each rank (its forward/backward seconds over the measured wall),
and the plan's micro-batch counts per group. For a speed claim, pair the two methods: run them in turn,
several times, on the same machine, and compare the medians, e.g.

    for i in 1 2 3; do
        .venv/bin/python benchmarks/sequence_parallel.py --method odc-lb-mini
        .venv/bin/python benchmarks/sequence_parallel.py --method zero3-lb-micro
    done

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

WORLD, SP, TOKEN_CAP, SAMPLES_PER_GROUP, STEPS, WARMUP = 4, 2, 1024, 4, 21, 1
METHODS = {"odc-lb-mini": ("odc", "lb-mini"), "zero3-lb-micro": (3, "lb-micro"), "odc-lb-micro": ("odc", "lb-micro")}
MODEL = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=TOKEN_CAP)


def _model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**MODEL, attn_implementation="sdpa", tie_word_embeddings=False))


def _plans(policy: str, cost_model):
    from ds_odc.balance import plan_minibatch

    from packed_lm import longalign_like_lengths

    size = SAMPLES_PER_GROUP * (WORLD // SP)
    lengths = [max(2, n - n % 2) for n in longalign_like_lengths(size * STEPS, 64, seed=0)]
    steps = []
    for step in range(STEPS):
        chunk = lengths[step * size:(step + 1) * size]
        plan = plan_minibatch(chunk, WORLD // SP, TOKEN_CAP, policy, cost_model, seed=step)
        steps.append([[[chunk[i] for i in batch] for batch in group] for group in plan.micro_batches])
    return steps


def _run(rank: int, cell: dict) -> dict:
    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    import ds_odc  # noqa: F401

    deepspeed.init_distributed(dist_backend="gloo")
    model = _model()
    mpu = UlyssesSPAttentionHF.register_with_transformers(model_name_or_path=model, core_attn_implementation="sdpa",
                                                           sequence_parallel_size=SP, micro_batch_size=1)
    stage = cell["stage"]
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "managed_gradient_accumulation": False, "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=mpu)
    group, sp_rank = rank // SP, mpu.get_sequence_parallel_rank()
    generator = torch.Generator().manual_seed(group)
    busy, wall_start = 0.0, None
    for step, groups in enumerate(cell["steps"]):
        if step == WARMUP:
            dist.barrier()
            busy, wall_start = 0.0, time.perf_counter()
        total_tokens = sum(sum(batch) for g in groups for batch in g)
        mine = groups[group]
        if stage == 3:  # equal counts by construction (LB-Micro); checked, a mismatch would hang ZeRO-3
            assert len({len(g) for g in groups}) == 1
        for batch in mine:
            start = time.perf_counter()
            length = sum(batch)
            ids = torch.randint(0, MODEL["vocab_size"], (1, length), generator=generator)
            positions = torch.cat([torch.arange(n) for n in batch]).unsqueeze(0)
            half = length // SP
            piece = slice(sp_rank * half, (sp_rank + 1) * half)
            labels = torch.cat([ids[:, 1:], torch.zeros(1, 1, dtype=ids.dtype)], dim=1)
            logits = engine(input_ids=ids[:, piece], position_ids=positions[:, piece]).logits.float()
            loss = F.cross_entropy(logits.reshape(-1, MODEL["vocab_size"]), labels[:, piece].reshape(-1),
                                   reduction="sum") / total_tokens
            engine.backward(loss)
            busy += time.perf_counter() - start
        engine.step()
    dist.barrier()
    wall = time.perf_counter() - wall_start
    engine.destroy()
    samples = sum(len(b) for groups in cell["steps"][WARMUP:] for g in groups for b in g)
    return {"wall_s": wall, "busy_s": busy, "samples": samples}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", choices=sorted(METHODS), required=True)
    args = parser.parse_args(argv)
    from benchmarks import cells
    from ds_odc.balance import CostModel

    stage, policy = METHODS[args.method]
    cost_model = CostModel.quadratic_linear(1.0, 64.0, 1.0)  # a·s² + b·s: attention and the linear layers
    steps = _plans(policy, cost_model)
    results = cells.run_cell(_run, WORLD, {"stage": stage, "steps": steps}, args.method, timeout_s=1500)
    wall = max(r["wall_s"] for r in results)
    print(json.dumps({"method": args.method, "samples_per_s": round(results[0]["samples"] / wall, 3),
                      "wall_s": round(wall, 2), "utilisation": [round(r["busy_s"] / r["wall_s"], 3) for r in results],
                      "micro_batches_per_group": [[len(g) for g in groups] for groups in steps[WARMUP:]]}))


if __name__ == "__main__":
    main()
