"""A frozen engine (a reference model, no optimizer) on ODC against ZeRO-3: its start-up and its forwards.

    .venv/bin/python benchmarks/frozen_engines.py --stage odc     # one 2-rank run, prints RESULT {...}
    .venv/bin/python benchmarks/frozen_engines.py --stage 3       # the same run on ZeRO-3
    .venv/bin/python benchmarks/frozen_engines.py --compare       # both, alternating, a markdown table

Model: a small LlamaForCausalLM built from a config (no download): 8 layers, hidden size 256, bf16, every
parameter released after use (``stage3_param_persistence_threshold: 0``, ``stage3_max_live_parameters: 0``,
as for any model of real size). 2 CPU ranks (gloo, shm transport), each running the same ``--forwards``
no-grad forwards of one 128-token sequence (equal counts: ZeRO-3 cannot run uneven ones). Per rank: the
seconds ``deepspeed.initialize`` took (ODC's adds a session: the job's nodes, the window's allocation,
one round), the median forward, and the window's bytes. ``--compare`` reports, per stage, the median over
runs of the slower rank's figures.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

LAYERS, HIDDEN, SEQ, VOCAB = 8, 256, 128, 1024
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(rank, cell):
    import deepspeed
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import ds_odc  # noqa: F401  registers the "odc" stage

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=SEQ)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    zero = {"stage": cell["stage"], "stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 0}
    ds_config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": zero}
    torch.distributed.barrier()
    start = time.perf_counter()
    engine, *_ = deepspeed.initialize(model=model, config=ds_config)
    initialize_s = time.perf_counter() - start
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
    forwards = []
    with torch.no_grad():
        for _ in range(cell["forwards"] + 2):
            start = time.perf_counter()
            engine(input_ids=ids)
            forwards.append(time.perf_counter() - start)
    runtime = getattr(engine, "odc_runtime", None)
    window = runtime.transport.local_param_window() if runtime is not None else None
    result = {"engine": type(engine).__name__, "initialize_s": initialize_s,
              "forward_s": statistics.median(forwards[2:]),
              "window_bytes": window.numel() * window.element_size() if window is not None else None}
    engine.destroy()
    return result


def one_run(stage: str, forwards: int) -> list:
    sys.path.insert(0, ROOT)
    from benchmarks.cells import run_cell

    return run_cell(run, 2, {"stage": "odc" if stage == "odc" else 3, "forwards": forwards}, f"stage {stage}", 600)


def compare(runs: int, forwards: int) -> str:
    figures = {"3": [], "odc": []}
    for _ in range(runs):
        for stage in ("odc", "3"):
            done = subprocess.run([sys.executable, __file__, "--stage", stage, "--forwards", str(forwards)],
                                  capture_output=True, text=True, check=True,
                                  env={**os.environ, "DS_ACCELERATOR": "cpu"})
            line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
            figures[stage].append(json.loads(line[len("RESULT "):]))
    rows = ["| stage | engine | initialize (s) | forward (s) | window per rank |", "| --- | --- | --- | --- | --- |"]
    for stage in ("3", "odc"):
        worst = [{key: max(rank[key] for rank in ranks) if key.endswith("_s") else ranks[0][key] for key in ranks[0]}
                 for ranks in figures[stage]]
        med = {key: statistics.median(run[key] for run in worst) for key in ("initialize_s", "forward_s")}
        window = worst[0]["window_bytes"]
        rows.append(f"| {stage} | {worst[0]['engine']} | {med['initialize_s']:.3f} | {med['forward_s']:.4f} | "
                    f"{'-' if window is None else f'{window / 2**20:.2f} MiB'} |")
    return "\n".join(rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", choices=["3", "odc"])
    parser.add_argument("--forwards", type=int, default=20)
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    if args.compare:
        print(compare(args.runs, args.forwards))
    else:
        print("RESULT " + json.dumps(one_run(args.stage or "odc", args.forwards)))


if __name__ == "__main__":
    main()
