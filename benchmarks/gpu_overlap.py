"""How much of the pull and push time overlaps compute, on a small causal LM, 2 ranks sharing one GPU.

    python benchmarks/gpu_overlap.py                          # cuda_ipc, 2 ranks, a 8-layer dim-1024 LM
    python benchmarks/gpu_overlap.py --json out.json --png timeline.png
    python benchmarks/gpu_overlap.py --transport shm --dim 64 --layers 2 --tokens 256   # CPU dry run

Each rank trains ``examples/packed_lm.py``'s PackedCausalLM in bf16 with ``"stage": "odc"`` and ZeRO-3's
prefetch on (its default bucket), ``--micro-batches`` packed micro-batches of ``--tokens`` tokens per
step. The engine's step recorder times its spans with CUDA events ([Note: GPU spans] in
``ds_odc/metrics/timing.py``); this script adds the side-stream work to the same timeline by recording
each of the transport's pulls and pushes with ``StepRecorder.device_span`` (instance wrappers, this
script only):

* a pull is measured on a probe stream that first waits for the caller's stream (where the pull
  stream starts) and then for the pull's completion;
* a push runs on the caller's stream (ZeRO-3's reduce stream), so it is marked there.

Reported, over the measured steps of every rank: how far the timeline's step length is from the host's
clock around the same step (``timeline_over_host``, the ratio farthest from 1: a sound timeline is near 1),
the fraction of pull and of push time that overlaps compute (``ds_odc.metrics.overlap``: micro-batches less the
stalls charged inside them), the median
step, utilisation, and a timeline PNG of the last two steps. Two ranks on one GPU share its SMs: the
figures say how much transfer is hidden behind this rank's own compute on a shared GPU, not on a GPU
of its own.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, "examples")):
    if path not in sys.path:
        sys.path.insert(0, path)

VOCAB = 8192


def trace_side_streams(recorder, transport, device) -> None:
    """Record every pull and push of ``transport`` as a device span of ``recorder`` (see the module
    docstring for where each is marked). On CPU the calls are synchronous: the host marks suffice."""
    import torch

    cuda = device.type == "cuda"
    probe = torch.cuda.Stream(device) if cuda else None

    def wrap(name, kind, batched):
        original = getattr(transport, name)

        def traced(*args, **kwargs):
            if not cuda or kind == "push":
                with recorder.device_span(kind):
                    return original(*args, **kwargs)
            current = torch.cuda.current_stream(device)
            probe.wait_stream(current)
            with recorder.device_span(kind, stream=probe):
                result = original(*args, **kwargs)
                if batched:
                    with torch.cuda.stream(probe):
                        result.wait()  # the probe waits for the pulls' completion event
                else:
                    probe.wait_stream(current)  # read() made the caller's stream wait for the pull
            return result

        setattr(transport, name, traced)

    for name, kind, batched in (("read", "pull", False), ("read_many", "pull", True),
                                ("accumulate", "push", False), ("accumulate_many", "push", True)):
        wrap(name, kind, batched)


def rank_main(name, dim, layers, heads, tokens, micro_batches, steps, warmup):
    """In a rank (tests/support/harness.py): train, return this rank's step reports after warm-up."""
    import deepspeed
    import torch
    import torch.distributed as tdist

    from tests.support.transports import CASES

    from packed_lm import PackedCausalLM, loss_sum, make_sample, pack

    device = CASES[name].device()
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    model = PackedCausalLM(vocab=VOCAB, dim=dim, heads=heads, layers=layers, max_len=tokens)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "managed_gradient_accumulation": False,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0, "torch_adam": True}},
              "steps_per_print": 10**9, "bf16": {"enabled": cuda},
              "zero_optimization": {"stage": "odc", "stage3_param_persistence_threshold": 0,
                                    "odc": {"timeout_s": 120}}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    recorder = engine.odc_metrics
    trace_side_streams(recorder, engine.optimizer.odc.transport, engine.device)
    rank = tdist.get_rank()
    lengths = [tokens // 2, tokens // 4, tokens - tokens // 2 - tokens // 4]
    host_s = []  # the host's clock around each step, to check the timeline against (overlap_verdict)
    for step in range(warmup + steps):
        batches = [pack([make_sample(1000 * step + 10 * micro + rank + i, length, VOCAB)
                         for i, length in enumerate(lengths)]) for micro in range(micro_batches)]
        if cuda:
            torch.cuda.synchronize(engine.device)
        start = time.perf_counter()
        for batch in batches:
            engine.backward(loss_sum(engine, batch), loss_tokens=len(batch[1]))
        engine.step()  # the recorder resolves the step's events here, after synchronising the device
        host_s.append(time.perf_counter() - start)
    reports = list(recorder.reports)[warmup:]
    result = {"rank": rank, "timing": recorder.timing, "device": str(engine.device), "host_step_s": host_s[warmup:],
              "device_name": torch.cuda.get_device_name(engine.device) if cuda else "CPU",
              "params": sum(p.ds_numel for p in engine.module.parameters()), "reports": reports}
    engine.destroy()
    return result


def summarise(results, args) -> dict:
    from ds_odc.metrics import utilisation
    from ds_odc.metrics.overlap import hidden_over

    reports = [r for result in results for r in result["reports"]]
    figures = {"transport": args.transport, "world": args.world, "timing": results[0]["timing"],
               "device": results[0]["device_name"], "params": results[0]["params"], "steps": args.steps,
               "micro_batches": args.micro_batches, "tokens": args.tokens,
               "median_step_s": statistics.median(r.wall_s for r in reports), "utilisation": utilisation(reports)}
    # the timeline's length of each step over the host's clock around it: far from 1, the timeline is wrong
    ratios = [report.wall_s / host for result in results for report, host in zip(result["reports"],
                                                                                   result["host_step_s"])]
    figures["timeline_over_host"] = max(ratios, key=lambda r: abs(r - 1.0)) if ratios else None
    for kind in ("pull", "push"):
        total = hidden_over(reports, kind)
        figures[kind] = {"busy_s": total.busy_s, "hidden_s": total.hidden_s, "hidden_fraction": total.fraction,
                         "per_rank": {str(res["rank"]): hidden_over(res["reports"], kind).fraction for res in results}}
    return figures


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transport", default="cuda_ipc", choices=["cuda_ipc", "shm"])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per packed micro-batch")
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=400.0)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--png", help="write the timeline of the last two steps here")
    args = parser.parse_args(argv)
    from benchmarks import gpu_overlap  # the rank function travels by name: not from __main__
    from tests.support.harness import run_ranks
    from tests.support.transports import CASES, rank_env

    if not CASES[args.transport].usable():
        sys.exit(f"benchmarks/gpu_overlap.py: {CASES[args.transport].why_not}; nothing was measured")
    results = run_ranks(gpu_overlap.rank_main, args.world, args.transport, args.dim, args.layers, args.heads,
                        args.tokens, args.micro_batches, args.steps, args.warmup,
                        env=rank_env(args.transport, args.world), timeout=args.timeout)
    figures = summarise(results, args)
    figures["command"] = "python benchmarks/gpu_overlap.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.png:
        from ds_odc.metrics import plot_timelines

        last = [r for result in results for r in result["reports"][-2:]]
        plot_timelines({f"ODC ({args.transport}), {args.world} ranks on one {figures['device']}": last}, args.png,
                       title=f"pulls hidden {100 * figures['pull']['hidden_fraction']:.0f}%, pushes hidden "
                             f"{100 * figures['push']['hidden_fraction']:.0f}% ({figures['timing']} timing)")
    print(json.dumps({k: v for k, v in figures.items()}, indent=1))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=1)


if __name__ == "__main__":
    main()
