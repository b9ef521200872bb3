"""Activation offload (``odc.activation_offload``): bytes routed and copy cost per token; on a GPU, peak memory.

One ODC rank (world size 1: the offload is per rank and communicates nothing) trains ``examples/packed_lm.py``'s
PackedCausalLM on one sample per micro-batch at several lengths, under each variant:

    off        no offload
    all        "budget_mb": 0 (every saved activation goes to the host)
    planned    "budget_mb": what the shortest length's micro-batch saves, so only longer ones offload
    save_on_cpu  (GPU only) torch.autograd.graph.save_on_cpu(pin_memory=True) around the forward, no ODC offload:
               the naive baseline, which copies parameters too

Reported per variant and length: bytes moved to the host per token, the naive hook's bytes per token (every
saved tensor, parameters included, counted once per storage), the median forward+backward time and the
extra time per token over "off" (the copy cost per token; on CPU the copies are synchronous, so this is the
whole copy, nothing hidden), and with ``--device cuda`` the peak device memory of the micro-batch above what
was allocated before it (``torch.cuda.max_memory_allocated``).

    .venv/bin/python benchmarks/activation_offload.py                  # CPU, prints the table
    .venv/bin/python benchmarks/activation_offload.py --write          # CPU, and updates docs/benchmarks.md
    .venv/bin/python benchmarks/activation_offload.py --quick          # smoke run, nothing written
    python benchmarks/activation_offload.py --device cuda --lengths 4096 8192 16384 32768 --dim 1024 --layers 8
                                                                        # GPU: exits 0 with a note when no CUDA
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

SECTION = "## Activation offload: bytes routed and copy cost per token"


def _naive_bytes(model, batch) -> int:
    """What a hook that copies every saved tensor (``save_on_cpu``) would move: storages counted once."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    from packed_lm import loss_sum

    seen, total = {}, [0]

    def pack(tensor):
        storage = tensor.untyped_storage()
        known = seen.get(storage.data_ptr())
        if known is None or known.expired():
            seen[storage.data_ptr()] = StorageWeakRef(storage)
            total[0] += storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = loss_sum(model, batch)
    del loss
    return total[0]


def _time_copies(clock: list) -> None:
    """Add the seconds spent in the hooks' copies (out in forward, back in backward) to ``clock[0]``: this
    process only, so the copy cost per token is measured directly, not as a difference of noisy step times."""
    from ds_odc.activations.hooks import MicroBatchOffload

    def timed(original):
        def run(self, *args):
            start = time.perf_counter()
            try:
                return original(self, *args)
            finally:
                clock[0] += time.perf_counter() - start
        return run

    MicroBatchOffload._offload = timed(MicroBatchOffload._offload)
    MicroBatchOffload._bring_back = timed(MicroBatchOffload._bring_back)


def run_variant(rank: int, cell: dict) -> dict:
    import deepspeed
    import torch

    from packed_lm import PackedCausalLM, loss_sum, make_sample, pack

    clock = [0.0]
    _time_copies(clock)

    device = torch.device(cell["device"])
    if device.type == "cuda":
        torch.cuda.set_device(0)
    torch.manual_seed(0)
    model = PackedCausalLM(vocab=256, dim=cell["dim"], heads=4, layers=cell["layers"], max_len=max(cell["lengths"]))
    odc = {"activation_offload": cell["offload"]} if cell["offload"] is not None else {}
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 6,
              "optimizer": {"type": "SGD", "params": {"lr": 1e-3}}, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": "odc", "odc": odc},
              "bf16": {"enabled": device.type == "cuda"}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    rows = []
    for length in cell["lengths"]:
        batch = pack([make_sample(i, length) for i in range(1)])
        naive = _naive_bytes(engine, batch) if cell["variant"] == "off" else None  # the hooks would nest
        times, peaks, copies = [], [], []
        for repeat in range(cell["warmup"] + cell["repeats"]):
            clock[0] = 0.0
            sync()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
            start = time.perf_counter()
            if cell["variant"] == "save_on_cpu":
                with torch.autograd.graph.save_on_cpu(pin_memory=True):
                    loss = loss_sum(engine, batch)
            else:
                loss = loss_sum(engine, batch)
            engine.backward(loss)
            sync()
            if repeat >= cell["warmup"]:
                times.append(time.perf_counter() - start)
                copies.append(clock[0])
                if device.type == "cuda":
                    peaks.append(torch.cuda.max_memory_allocated(device) - before)
            engine.step()
        offload = engine.odc_activation_offload
        moved = offload.history[-1].moved_bytes if offload is not None else 0
        rows.append({"length": length, "seconds": statistics.median(times), "moved": moved, "naive": naive,
                     "copy_seconds": statistics.median(copies),
                     "peak": statistics.median(peaks) if peaks else None})
    result = {"rows": rows}
    if engine.odc_activation_offload is not None:
        offload = engine.odc_activation_offload
        result.update(bytes_per_token=offload.profile.bytes_per_token, profile_tokens=offload.profile_tokens,
                      copy_rate=offload.copy_rate,
                      pool=vars(offload.pool.stats))
    engine.destroy()
    return result


def _table(results: dict, lengths, device: str) -> list[str]:
    off = {row["length"]: row for row in results["off"]["rows"]}
    lines = ["| variant | tokens | moved B/token | a naive hook's B/token | copy µs/token (out + back) | fwd+bwd ms | "
             "fwd+bwd vs off |" + (" peak MiB |" if device == "cuda" else ""),
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if device == "cuda" else "")]
    for variant, result in results.items():
        for row in result["rows"]:
            ratio = row["seconds"] / off[row["length"]]["seconds"]
            line = (f"| {variant} | {row['length']} | {row['moved'] / row['length']:.0f} | "
                    f"{off[row['length']]['naive'] / row['length']:.0f} | "
                    f"{row['copy_seconds'] / row['length'] * 1e6:.2f} | {row['seconds'] * 1e3:.1f} | {ratio:.2f}x |")
            if device == "cuda":
                line += f" {row['peak'] / 2 ** 20:.1f} |"
            lines.append(line)
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="short lengths, one repeat, nothing written")
    parser.add_argument("--json", help="also write the raw results here")
    parser.add_argument("--write", action="store_true",
                        help="update the section in docs/benchmarks.md (tracked; CPU runs without --quick only)")
    args = parser.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("activation_offload benchmark: no CUDA device here; skipped (run it on a GPU machine)")
        return 0
    if args.quick:
        args.lengths, args.repeats = [64, 128], 1
    # "all" first: its calibration gives the planned budget, what the shortest length saves (so only the longer
    # micro-batches offload)
    results = run_cells(args, {"all": {"budget_mb": 0}}, "measure")
    planned_budget = results["all"]["bytes_per_token"] * min(args.lengths) / 2 ** 20
    variants = {"off": None, "planned": {"budget_mb": planned_budget}}
    if args.device == "cuda":
        variants["save_on_cpu"] = None
    results = {**run_cells(args, variants, "measure"), **results}
    lines = _table(results, args.lengths, args.device)
    host = results["all"]
    summary = (f"Profile after the {host['profile_tokens']}-token micro-batch: {host['bytes_per_token']:.0f} saved "
               f"bytes per token (parameters excluded); host copy probe {host['copy_rate'] / 1e9:.2f} GB/s; planned "
               f"budget {planned_budget:.3f} MiB; \"all\" pool capacity "
               f"{host['pool']['capacity']} B = high-water {host['pool']['high_water']} B "
               "(the largest single offload).")
    shortest = min(args.lengths)
    naive = {row["length"]: row["naive"] for row in results["off"]["rows"]}[shortest]
    moved = {row["length"]: row["moved"] for row in results["all"]["rows"]}[shortest]
    summary += (f" At {shortest} tokens a naive hook would also copy {(naive - moved) / 2 ** 20:.1f} MiB of parameters "
                "(ZeRO-3's gathered ones) every micro-batch; offload copies none.")
    print("\n".join(lines) + "\n\n" + summary)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)
    if args.write and not args.quick and args.device == "cpu":
        _write_docs(lines, summary, args)
    return 0


def run_cells(args, variants: dict, label: str) -> dict:
    from benchmarks import cells

    results = {}
    for variant, offload in variants.items():
        cell = {"device": args.device, "lengths": args.lengths, "dim": args.dim, "layers": args.layers,
                "offload": offload, "variant": variant, "repeats": args.repeats, "warmup": 1}
        results[variant] = cells.run_cell(run_variant, 1, cell, f"{label} {variant}", timeout_s=900)[0]
    return results


def _write_docs(lines, summary, args) -> None:
    path = os.path.join(ROOT, "docs", "benchmarks.md")
    with open(path) as docs:
        text = docs.read()
    command = "benchmarks/activation_offload.py --write" + (
        "" if args.lengths == [256, 512, 1024, 2048] else " --lengths " + " ".join(map(str, args.lengths)))
    body = "\n".join([
        SECTION, "",
        f"`.venv/bin/python {command}` — one CPU rank (1 thread), PackedCausalLM dim {args.dim}, "
        f"{args.layers} layers, one "
        f"sample per micro-batch, median of {args.repeats} forward+backward passes. On CPU the copies are synchronous "
        "memcpy into the separate host pool, timed inside the hooks (copy µs/token: both ways, nothing overlaps on "
        "CPU); fwd+bwd times on this shared 2-core machine are noisy (±20%), so their ratio to off says little; a "
        "naive hook (`save_on_cpu`) would move every saved storage, parameters included (ZeRO-3's gathered ones). "
        "The GPU "
        "measurements (peak memory and step time against sequence length, with `save_on_cpu` beside it) are "
        "`--device cuda`, **not run yet** (no GPU on this machine).", "",
        *lines, "", summary, ""])
    if SECTION in text:
        start = text.index(SECTION)
        end = text.find("\n## ", start + len(SECTION))
        text = text[:start] + body + (text[end + 1:] if end != -1 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + body
    with open(path, "w") as docs:
        docs.write(text)


if __name__ == "__main__":
    sys.exit(main())
