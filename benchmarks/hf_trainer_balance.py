"""The Hugging Face Trainer on long-tailed SFT lengths: ZeRO-3 as users run it, ZeRO-3 + LB-Micro, ODC + LB-Mini.

One invocation, 2 CPU ranks with one thread each, an unmodified ``Trainer`` on a small Llama, the same
model, data, seed and samples per step in every cell:

    zero3           "stage": 3, per_device_train_batch_size 1, gradient_accumulation_steps b: what a
                    Trainer user runs today (one sample per micro-batch, b micro-batches per rank)
    zero3+lb-micro  "stage": 3 with the same step's samples planned by LB-Micro (equal counts, packed
                    under the token cap) through ds_odc's Trainer slots (``hf_balance.balanced_loader``)
    odc+lb-micro    "stage": "odc" + "balance": {"policy": "lb-micro", ...}
    odc+lb-mini     "stage": "odc" + "balance": {"policy": "lb-mini", ...}: the config this is about

Lengths are LongAlign-like (mean 16.5K, clipped to [512, 64K]) divided by 64 (cap 65,536 -> 1,024 tokens);
a padding collator (each micro-batch padded to its longest sample, as ``DataCollatorWithPadding`` does),
so a micro-batch costs n × longest and the plans are priced that way; the cost model is "measure"
(fitted at the start of each run on this machine). Each cell runs in a fresh pair of processes, warms up
2 steps, then times 8: samples/s from the wall time between consecutive optimizer steps (median),
utilisation per rank from ``ds_odc.metrics`` (attached to ZeRO-3 too), peak RSS per rank. The
*balance bound* is the cost model's prediction of ZeRO-3 + LB-Micro's step over ODC + LB-Mini's
(``Σ_m max_rank`` over ``max_rank Σ_m``, communication free), over the measured steps.

    .venv/bin/python benchmarks/hf_trainer_balance.py --write      # updates docs/benchmarks.md and the PNG
    .venv/bin/python benchmarks/hf_trainer_balance.py              # the same run; prints the section, PNG to --out
    .venv/bin/python benchmarks/hf_trainer_balance.py --quick      # 2 measured steps, nothing written
    .venv/bin/python benchmarks/hf_trainer_balance.py --smoke      # 1 warm-up and 1 measured step (the test's)
    .venv/bin/python benchmarks/hf_trainer_balance.py --only odc+lb-mini --samples-per-rank 4 --measured 24
                                                                   # one cell, for whole-process timing
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]

WORLD = 2
SCALE = 64
TOKEN_CAP = 65_536 // SCALE
VOCAB = 512
MODEL = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 4}
METHODS = ("zero3", "zero3+lb-micro", "odc+lb-micro", "odc+lb-mini")
DOC_START, DOC_END = "<!-- hf_trainer_balance:start -->", "<!-- hf_trainer_balance:end -->"


# -- ranks ----------------------------------------------------------------------------------------------
def _dataset(samples: int, seed: int):
    import torch

    from packed_lm import longalign_like_lengths

    gen = torch.Generator().manual_seed(seed)
    lengths = longalign_like_lengths(samples, scale=SCALE, seed=seed)
    return [{"input_ids": ids, "labels": ids} for ids in
            (torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths)]


def _pad(samples):
    import torch

    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    labels = torch.full((len(samples), longest), -100, dtype=torch.long)
    mask = torch.zeros(len(samples), longest, dtype=torch.long)
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        ids[row, :n], labels[row, :n], mask[row, :n] = torch.tensor(sample["input_ids"]), torch.tensor(
            sample["labels"]), 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def _ds_config(method: str) -> dict:
    engine, _, policy = method.partition("+")
    zero: dict = {"stage": 3}
    if engine == "odc":
        zero = {"stage": "odc", "odc": {"balance": {"policy": policy, "token_cap": TOKEN_CAP,
                                                    "cost_model": "measure"}}}
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "steps_per_print": 10 ** 9,
            "zero_optimization": zero}


def _run_cell(rank: int, cell: dict) -> dict:
    import torch

    import ds_odc  # noqa: F401  registers the odc stage before transformers is imported
    import ds_odc.metrics

    # isort: split
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from ds_odc.config import BalanceConfig
    from ds_odc.integration import hf_balance

    method, b = cell["method"], cell["samples_per_rank"]

    class LBMicroOnZero3(Trainer):
        def get_train_dataloader(self):
            return hf_balance.balanced_loader(self, super().get_train_dataloader(), BalanceConfig(
                policy="lb-micro", token_cap=TOKEN_CAP, cost_model="measure"))

    ends, headers, reports = [], [], []

    class Timer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())
            balance = hf_balance.balance_state(trainer)
            headers.append(balance.last_header if balance is not None else None)
            recorder = getattr(trainer.model_wrapped, "odc_metrics", None) or recorders.get("zero3")
            if recorder is not None and recorder.last is not None:
                reports.append(recorder.last)

        def on_train_begin(self, args, state, control, **kwargs):
            if not hasattr(trainer.model_wrapped, "odc_metrics"):
                recorders["zero3"] = ds_odc.metrics.attach(trainer.model_wrapped)

    recorders: dict = {}
    output = tempfile.mkdtemp(prefix="ds_odc_bench_")
    args = TrainingArguments(
        output_dir=output, deepspeed=_ds_config(method), use_cpu=True, max_steps=cell["warmup"] + cell["measured"],
        per_device_train_batch_size=1, gradient_accumulation_steps=b, learning_rate=1e-4, weight_decay=0.0,
        max_grad_norm=1.0, lr_scheduler_type="constant", logging_steps=10 ** 6, save_strategy="no",
        report_to="none", seed=0, data_seed=0, disable_tqdm=True, remove_unused_columns=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, max_position_embeddings=TOKEN_CAP,
                                         tie_word_embeddings=False, **MODEL))
    cls = LBMicroOnZero3 if method == "zero3+lb-micro" else Trainer
    samples = WORLD * b * (cell["warmup"] + cell["measured"])
    trainer = cls(model=model, args=args, train_dataset=_dataset(samples, seed=cell["seed"]), data_collator=_pad,
                  callbacks=[Timer()])
    trainer.train()
    warm = cell["warmup"]
    return {"step_s": [b2 - a for a, b2 in zip(ends[warm - 1:], ends[warm:])],
            "utilisation": [r.utilisation for r in reports[warm:]],
            "micro_batches": [r.micro_batches for r in reports[warm:]],
            "reports": [r if i >= len(reports) - 2 else r.without_events() for i, r in enumerate(reports)][warm:],
            "costs": [(h.collective_cost, h.odc_cost) if h is not None else None for h in headers[warm:]],
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


#: What a smoke run's forkserver imports once (benchmarks/cells.py): most of a fresh rank's start.
SMOKE_PRELOAD = ("torch", "deepspeed", "ds_odc", "transformers", "transformers.trainer",
                 "transformers.models.llama.modeling_llama")


def run_cell(cell, timeout_s=1200, smoke=False):
    from benchmarks import cells

    return cells.run_cell(_run_cell, WORLD, cell, cell["method"], timeout_s, preload=SMOKE_PRELOAD if smoke else None)


# -- summary --------------------------------------------------------------------------------------------
def summarise(method: str, b: int, results: list[dict]) -> dict:
    step = statistics.median(results[0]["step_s"])
    return {"method": method, "b": b, "step_s": step, "samples_per_s": WORLD * b / step,
            "utilisation": [statistics.mean(r["utilisation"]) if r["utilisation"] else None for r in results],
            "micro_batches": [statistics.mean(r["micro_batches"]) if r["micro_batches"] else None for r in results],
            "peak_rss_mib": [r["peak_rss_mib"] for r in results], "costs": results[0]["costs"]}


def balance_bound(rows: dict) -> float | None:
    """ZeRO-3 + LB-Micro's predicted steps over ODC + LB-Mini's (same samples; each run priced by its own fit)."""
    micro, mini = rows.get("zero3+lb-micro"), rows.get("odc+lb-mini")
    if not micro or not mini or None in micro["costs"] or None in mini["costs"]:
        return None
    return sum(collective for collective, _ in micro["costs"]) / sum(odc for _, odc in mini["costs"])


def markdown(table: dict, command: str, png: str | None) -> str:
    lines = [DOC_START, "### Hugging Face Trainer + balance block (`benchmarks/hf_trainer_balance.py`)", "",
             f"`{command}` — 2 CPU ranks × 1 thread, an unmodified `Trainer` on a Llama "
             f"({MODEL['num_hidden_layers']} layers, hidden {MODEL['hidden_size']}), LongAlign-like lengths / {SCALE} "
             f"(cap {TOKEN_CAP} tokens), padding collator, cost model \"measure\"; median of 8 timed steps after 2 "
             "warm-up steps, fresh processes per cell. Ratio: samples/s over ZeRO-3 as users run it (one sample "
             "per micro-batch) and over ZeRO-3 + LB-Micro; bound: the cost model's ZeRO-3 + LB-Micro step over "
             "ODC + LB-Mini's.", "",
             "| samples/rank | method | samples/s | vs ZeRO-3 | vs ZeRO-3+LB-Micro | micro-batches r0/r1 | "
             "utilisation r0/r1 | peak RSS MiB r0/r1 |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for b, rows in table.items():
        base, micro = rows["zero3"]["samples_per_s"], rows["zero3+lb-micro"]["samples_per_s"]
        for method in METHODS:
            row = rows[method]
            util = "/".join(f"{100 * u:.1f}%" if u is not None else "-" for u in row["utilisation"])
            mbs = "/".join(f"{m:.1f}" if m is not None else "-" for m in row["micro_batches"])
            rss = "/".join(f"{m:.0f}" for m in row["peak_rss_mib"])
            lines.append(f"| {b} | {method} | {row['samples_per_s']:.2f} | {row['samples_per_s'] / base:.2f}× | "
                         f"{row['samples_per_s'] / micro:.2f}× | {mbs} | {util} | {rss} |")
        bound = balance_bound(rows)
        ratio = rows["odc+lb-mini"]["samples_per_s"] / micro
        if bound:
            lines.append(f"| {b} | balance bound | | | {bound:.2f}× (ODC+LB-Mini reaches {100 * ratio / bound:.0f}% "
                         "of it) | | | |")
    if png:
        lines += ["", f"![Trainer timelines]({os.path.relpath(png, os.path.join(ROOT, 'docs'))})"]
    lines.append(DOC_END)
    return "\n".join(lines)


def update_docs(path: str, section: str) -> None:
    with open(path) as docs:
        text = docs.read()
    if DOC_START in text:
        head, rest = text.split(DOC_START, 1)
        text = head + section + rest.split(DOC_END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    with open(path, "w") as docs:
        docs.write(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples-per-rank", default="4,8")
    parser.add_argument("--quick", action="store_true", help="2 measured steps, b=2, nothing written")
    parser.add_argument("--smoke", action="store_true", help="1 warm-up and 1 measured step, b=2, nothing written "
                        "(tests/distributed/test_benchmark_smoke.py: the cells start, train and report)")
    parser.add_argument("--rounds", type=int, default=1, help="repeat every cell (interleaved); medians kept")
    parser.add_argument("--only", choices=METHODS, help="run one cell (for whole-process timing), print its "
                        "median step; with --measured steps")
    parser.add_argument("--measured", type=int, default=8)
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md's section and "
                        "docs/img/hf_trainer_balance_timelines.png (tracked; not with --quick or --smoke)")
    parser.add_argument("--out", help="folder for the timeline PNG without --write (default: a new temp folder)")
    options = parser.parse_args()
    if options.only:
        b = int(options.samples_per_rank.split(",")[0])
        results = run_cell({"method": options.only, "samples_per_rank": b, "warmup": 2,
                            "measured": options.measured, "seed": 0})
        print(f"{options.only} b={b}: median step {statistics.median(results[0]['step_s']):.3f}s")
        return
    options.quick = options.quick or options.smoke
    sizes = [2] if options.quick else [int(b) for b in options.samples_per_rank.split(",")]
    measured = 1 if options.smoke else 2 if options.quick else options.measured
    warmup = 1 if options.smoke else 2
    table, reports = {}, {}
    for b in sizes:
        runs: dict = {m: [] for m in METHODS}
        for round_ in range(options.rounds):
            for method in METHODS:
                cell = {"method": method, "samples_per_rank": b, "warmup": warmup, "measured": measured, "seed": 0}
                started = time.time()
                results = run_cell(cell, smoke=options.smoke)
                runs[method].append(results)
                print(f"b={b} {method} round {round_}: median step {statistics.median(results[0]['step_s']):.3f}s "
                      f"({time.time() - started:.0f}s)", flush=True)
        table[b] = {}
        for method, rounds in runs.items():
            best = sorted(rounds, key=lambda r: statistics.median(r[0]["step_s"]))[len(rounds) // 2]
            table[b][method] = summarise(method, b, best)
            if b == sizes[-1]:
                reports[method] = [r for rank in best for r in rank["reports"][-2:]]
    print(json.dumps({b: {m: {k: v for k, v in row.items() if k != "costs"} for m, row in rows.items()}
                      for b, rows in table.items()}, indent=1))
    if options.quick:
        return
    from ds_odc.metrics import plot_timelines

    if options.write:
        png = os.path.join(ROOT, "docs", "img", "hf_trainer_balance_timelines.png")
    else:
        png = os.path.join(options.out or tempfile.mkdtemp(prefix="hf_trainer_balance_"), "timelines.png")
    os.makedirs(os.path.dirname(png), exist_ok=True)
    plot_timelines({"ZeRO-3 (Trainer as run today)": reports["zero3"], "ZeRO-3 + LB-Micro": reports["zero3+lb-micro"],
                    "ODC + LB-Mini (balance block)": reports["odc+lb-mini"]}, png,
                   title=f"Trainer, {sizes[-1]} samples per rank, last 2 steps")
    command = "python benchmarks/hf_trainer_balance.py" + (" --write" if options.write else "") + (
        f" --rounds {options.rounds}" if options.rounds > 1 else "")
    section = markdown(table, command, png)
    if options.write:
        update_docs(os.path.join(ROOT, "docs", "benchmarks.md"), section)
        print(f"updated docs/benchmarks.md and {os.path.relpath(png, ROOT)}")
    else:
        print(section)
        print(f"timelines in {png}; docs/benchmarks.md not updated (--write does)")


if __name__ == "__main__":
    main()
