"""Side-by-side step time and peak memory, DeepSpeed ZeRO-3 vs ODC, on 2 CPU ranks.

    .venv/bin/python benchmarks/step_time.py            # runs every case, prints a markdown table
    .venv/bin/python benchmarks/step_time.py --one odc --case skewed --odc '{"deterministic": true}'
                                                        # one run: a JSON line (step_ms, accumulator_bytes)

Model: the examples' PackedCausalLM (examples/packed_lm.py: 4 layers, dim 128). Each step, every rank runs 4
micro-batches (one sequence each, equal counts so ZeRO-3 can run them too). "balanced": all sequences 256
tokens. "skewed": rank 0 gets 64-token sequences, rank 1 448-token ones (same total as balanced),
the per-layer imbalance ZeRO-3's collectives turn into waiting. Median over 8 steps after 2 warm-up
steps; memory is each rank's peak RSS.
"""
import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CASES = {"balanced": (256, 256), "skewed": (64, 448)}


def _load_model_class():
    """The examples' packed causal LM (examples/packed_lm.py), one sequence per micro-batch here."""
    spec = importlib.util.spec_from_file_location("packed_lm", os.path.join(ROOT, "examples", "packed_lm.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PackedCausalLM


def rank_main(stage, case, steps=8, warmup=2, micro_batches=4, odc_options=None):
    import deepspeed
    import torch
    import torch.nn.functional as F
    from deepspeed import comm as dist

    import ds_odc  # noqa: F401

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _load_model_class()()
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": micro_batches,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "gradient_clipping": 1.0, "steps_per_print": 10**9,
              "zero_optimization": {"stage": "odc" if stage == "odc" else 3}}
    if stage == "odc" and odc_options:
        config["zero_optimization"]["odc"] = odc_options
    engine, *_ = deepspeed.initialize(model=model, config=config)
    runtime = getattr(engine, "odc_runtime", None)
    accumulator = runtime.transport.local_grad_accumulator() if runtime is not None else None
    length = CASES[case][rank]
    step_times, compute_times = [], []
    for step in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        compute = 0.0
        for index in range(micro_batches):
            tokens = torch.randint(0, 128, (1, length + 1), generator=torch.Generator().manual_seed(step * 10 + index))
            t0 = time.perf_counter()
            logits = engine(tokens[0, :-1], torch.arange(length), [0, length])
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), tokens[0, 1:])
            engine.backward(loss)
            compute += time.perf_counter() - t0
            engine.step()
        elapsed = time.perf_counter() - start
        if step >= warmup:
            step_times.append(elapsed)
            compute_times.append(compute)
    result = {"rank": rank, "step_s": statistics.median(step_times), "fwd_bwd_s": statistics.median(compute_times),
              "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "accumulator_bytes": 0 if accumulator is None else accumulator.numel() * accumulator.element_size()}
    engine.destroy()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if rank == 0:
        print("RESULT " + json.dumps(gathered), flush=True)


def run_case(stage, case, port, odc_options=None):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           os.path.abspath(__file__), "--rank-main", "--stage", stage, "--case", case,
           "--odc", json.dumps(odc_options or {})]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)  # a rank of run_case's job
    parser.add_argument("--stage", help=argparse.SUPPRESS)  # the rank's stage (with --rank-main)
    parser.add_argument("--case", choices=tuple(CASES), help="the workload of --one (default: skewed)")
    parser.add_argument("--odc", default="{}", help="the odc stage's odc block, as JSON")
    parser.add_argument("--one", help="run only this stage (3 or odc) on --case and print one JSON line")
    args = parser.parse_args()
    if args.rank_main:
        rank_main(args.stage, args.case, odc_options=json.loads(args.odc))
        return
    if args.one:
        ranks = run_case(args.one, args.case or "skewed", 29590 + os.getpid() % 400, json.loads(args.odc))
        print(json.dumps({"step_ms": 1000 * max(r["step_s"] for r in ranks),
                          "accumulator_bytes": max(r["accumulator_bytes"] for r in ranks),
                          "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks)}))
        return
    print("| workload | engine | step time (median) | time ratio to ZeRO-3 | rank 0 fwd+bwd | rank 1 fwd+bwd "
          "| peak RSS r0 / r1 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    port = 29600
    for case in CASES:
        rows = {}
        for stage in ("3", "odc"):
            port += 1
            rows[stage] = run_case(stage, case, port)
        for stage, ranks in rows.items():
            step = max(r["step_s"] for r in ranks)
            ratio = step / max(r["step_s"] for r in rows["3"])
            print(f"| {case} | {'ZeRO-3' if stage == '3' else 'ODC'} | {step * 1000:.0f} ms | {ratio:.2f} | "
                  f"{ranks[0]['fwd_bwd_s'] * 1000:.0f} ms | {ranks[1]['fwd_bwd_s'] * 1000:.0f} ms | "
                  f"{ranks[0]['peak_rss_mib']:.0f} / {ranks[1]['peak_rss_mib']:.0f} MiB |")


if __name__ == "__main__":
    main()
