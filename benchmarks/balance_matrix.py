"""ZeRO-3 vs ODC under long-tailed sequence lengths, with the balancers each can use.

One invocation, 2 CPU ranks with one thread each, the same model, data and seed for every cell:

    methods   ZeRO-3 + LB-Micro (the baseline), ZeRO-3 + LocalSort, ODC + LB-Micro, ODC + LB-Mini
    workloads LongAlign-like lengths (scaled 1/32: 64K -> 2048 tokens) at 1, 2, 4, 8 samples per rank;
              a balanced control (every sample the same length) at 4 samples per rank

Each cell runs in a fresh pair of processes (so peak memory is the cell's own), warms up, then
times steps with the step recorder (``ds_odc.metrics``) on both engines. Reported: samples/s (median
over measured steps; a step spans from the first rank's first micro-batch to the last rank's
optimizer step), the ratio to ZeRO-3 + LB-Micro, utilisation per rank, peak RSS per rank, the
*balance bound* (the baseline plan's ``Σ_m max_rank cost`` over this plan's ``max_rank Σ_m cost``,
with the cost model fitted on this machine and communication free), and a timeline PNG.

    .venv/bin/python benchmarks/balance_matrix.py --write       # full matrix: updates benchmarks/results/,
                                                                # docs/benchmarks.md and its timeline PNG
    .venv/bin/python benchmarks/balance_matrix.py               # full matrix, results into a temp folder
    .venv/bin/python benchmarks/balance_matrix.py --quick       # a smoke run (small, not written to docs)
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

METHODS = [("zero3", "lb-micro"), ("zero3", "local-sort"), ("odc", "lb-micro"), ("odc", "lb-mini")]
WORLD = 2
SCALE = 32  # LongAlign's lengths divided by this; the token cap (packing ratio 1) is 65,536 / SCALE
FIT_LENGTHS = (64, 128, 256, 512, 1024, 2048)
# Width chosen so that, like a 1.5B model on LongAlign, a cap-length sample costs ~8x a quarter-cap one
# (measured 7.9x on this CPU: 2048 vs 512 tokens; a 1.5B model's fitted curve gives 7.3x for 64K vs 16K).
MODEL = {"dim": 384, "heads": 4, "layers": 2}
DOC_START, DOC_END = "<!-- balance_matrix:start -->", "<!-- balance_matrix:end -->"


# -- ranks -----------------------------------------------------------------------------------------
def _ds_config(engine, metrics):
    zero = {"stage": "odc", "odc": {"metrics": metrics}} if engine == "odc" else {"stage": 3}
    if engine.startswith("zero3-hpz"):  # "zero3-hpz<n>": ZeRO++'s secondary partition over n ranks
        zero["zero_hpz_partition_size"] = int(engine[len("zero3-hpz"):])
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "managed_gradient_accumulation": False, "gradient_clipping": 1.0, "steps_per_print": 1_000_000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True, "weight_decay": 0.0}},
            "zero_optimization": zero}


def _run_cell(rank, cell):
    import deepspeed
    import torch

    import ds_odc  # noqa: F401
    import ds_odc.metrics

    from packed_lm import PackedCausalLM, loss_sum, make_sample, pack

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=PackedCausalLM(max_len=cell["token_cap"], **MODEL),
                                      config=_ds_config(cell["engine"], cell["metrics"]))
    recorder = ds_odc.metrics.attach(engine) if cell["metrics"] else None
    manual_walls = []
    for step in cell["steps"]:
        lengths, ids = step["lengths"], step["sample_ids"]
        mine = step["micro_batches"][rank]
        if cell["engine"].startswith("zero3"):  # collectives need equal counts: pad with empty micro-batches
            depth = max(len(r) for r in step["micro_batches"])
            mine = mine + [None] * (depth - len(mine))
        global_tokens = sum(lengths)
        start = time.perf_counter()
        for batch in mine:
            if batch is None:
                loss = loss_sum(engine, pack([make_sample(0, 1)])) * 0.0
            else:
                loss = loss_sum(engine, pack([make_sample(ids[i], lengths[i]) for i in batch])) / global_tokens
            engine.backward(loss)
        engine.step()
        manual_walls.append(time.perf_counter() - start)
    warmup = cell["warmup"]
    reports = list(recorder.reports)[warmup:] if recorder else []
    result = {"reports": [r if cell["keep_events"] else r.without_events() for r in reports],
              "manual_walls": manual_walls[warmup:],
              "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    engine.destroy()
    return result


#: What a smoke run's forkserver imports once (benchmarks/cells.py): most of a fresh rank's start.
SMOKE_PRELOAD = ("torch", "deepspeed", "ds_odc")


def run_cell(cell, timeout_s=1800, smoke=False):
    from benchmarks import cells

    return cells.run_cell(_run_cell, WORLD, cell, cell["label"], timeout_s, preload=SMOKE_PRELOAD if smoke else None)


# -- planning --------------------------------------------------------------------------------------
def fit_cost_model(token_cap):
    """Time single-sample forward+backward of the benchmark's model here, at lengths up to the cap."""
    import torch

    from ds_odc.balance import fit_cost_model as fit
    from ds_odc.balance import forward_backward_timer

    from packed_lm import PackedCausalLM, loss_sum, make_sample, pack

    torch.manual_seed(0)
    model = PackedCausalLM(max_len=token_cap, **MODEL)
    lengths = [n for n in FIT_LENGTHS if n <= token_cap] or [token_cap]
    lengths = sorted(set(lengths + [max(1, token_cap // 4), max(1, token_cap // 2), token_cap]))
    return fit(forward_backward_timer(lambda n: loss_sum(model, pack([make_sample(0, n)])).backward()),
               lengths, repeats=3)


def workload_steps(kind, samples_per_rank, count, seed=0, scale=SCALE, world=WORLD):
    """``count`` global minibatches: lists of (sample id, length), identical for every method."""
    from packed_lm import longalign_like_lengths

    size = samples_per_rank * world
    lengths = longalign_like_lengths(size * count, scale, seed=seed)
    if kind == "balanced":
        lengths = [round(statistics.mean(lengths))] * len(lengths)
    return [[(start + i, lengths[start + i]) for i in range(size)] for start in range(0, size * count, size)]


def plan_cell(engine, policy, minibatches, cost_model, token_cap, world=WORLD):
    from ds_odc.balance import plan_minibatch

    steps, plans = [], []
    for number, minibatch in enumerate(minibatches):
        lengths = [length for _, length in minibatch]
        plan = plan_minibatch(lengths, world, token_cap, policy, cost_model, seed=number)
        plans.append(plan)
        steps.append({"lengths": lengths, "sample_ids": [sid for sid, _ in minibatch],
                      "micro_batches": [[list(b) for b in rank] for rank in plan.micro_batches]})
    return steps, plans


# -- reporting -------------------------------------------------------------------------------------
def step_seconds(results):
    """Per measured step: last rank's step end minus first rank's first micro-batch start."""
    per_rank = [r["reports"] for r in results]
    return [max(r.start + r.wall_s for r in group) - min(r.start for r in group) for group in zip(*per_rank)]


def summarise(cell, results, measured_plans, measured_baseline):
    seconds = step_seconds(results)
    samples = WORLD * cell["samples_per_rank"]
    from ds_odc.metrics import utilisation
    collective = sum(p.collective_step_cost() for p in measured_baseline)
    own = sum(p.collective_step_cost() if cell["engine"] == "zero3" else p.odc_step_cost() for p in measured_plans)
    return {"label": cell["label"], "workload": cell["workload"], "samples_per_rank": cell["samples_per_rank"],
            "engine": cell["engine"], "policy": cell["policy"], "step_seconds": seconds,
            "samples_per_s": samples / statistics.median(seconds),
            "utilisation": [utilisation(r["reports"]) for r in results],
            "peak_rss_mib": [r["peak_rss_mib"] for r in results],
            "balance_bound": collective / own if own else float("nan"),
            "plan_utilisation": _plan_utilisation(measured_plans, cell["engine"] == "zero3"),
            "micro_batches": [[len(rank) for rank in p.micro_batches] for p in measured_plans],
            "per_micro_batch_s": _per_micro_batch(results),
            "steps": [{"lengths": list(p.lengths),
                       "micro_batches": [[list(b) for b in rank] for rank in p.micro_batches]}
                      for p in measured_plans]}


def _plan_utilisation(plans, collective):
    """The utilisation the cost model predicts for these plans with free communication: the ceiling
    a perfect engine reaches (a sample longer than the rest combined leaves idle time no plan removes)."""
    busy = sum(sum(p.rank_costs()) for p in plans)
    wall = sum(WORLD * (p.collective_step_cost() if collective else p.odc_step_cost()) for p in plans)
    return busy / wall if wall else 0.0


def _per_micro_batch(results):
    """Median communication and fixed costs of this cell, for the simulator (``benchmarks.sim``)."""
    steps = list(zip(*(r["reports"] for r in results)))

    def least(group, field):  # the rank that waited least: closest to the transfer cost alone
        return min(getattr(rep, field) / max(rep.micro_batches, 1) for rep in group)
    return {"gather": statistics.median(least(group, "gather_s") for group in steps),
            "reduce": statistics.median(least(group, "reduce_s") for group in steps),
            "optimizer": statistics.median(rep.optimizer_s for group in steps for rep in group),
            "least_step_wait": statistics.median(min(rep.step_wait_s for rep in group) for group in steps)}


def measured_comm(rows):
    """Communication constants in the form the simulator reads, medians over the cells of each engine."""
    def median_of(engine, key):
        values = [r["per_micro_batch_s"][key] for r in rows if r["engine"] == engine]
        return statistics.median(values) if values else 0.0
    return {"layers": 4, "gather_per_micro_batch": median_of("zero3", "gather"),
            "reduce_per_micro_batch": median_of("zero3", "reduce"),
            "pull_per_micro_batch": median_of("odc", "gather"), "push_per_micro_batch": median_of("odc", "reduce"),
            "optimizer": median_of("odc", "optimizer"), "fence": median_of("odc", "least_step_wait")}


def markdown(rows, cost_model, command, overhead):
    lines = [f"Command: `{command}` (2 ranks, 1 thread each, fresh processes per cell; samples/s is the "
             "median over every measured step of every round).", "",
             f"Cost model fitted on this machine (`fit_cost_model`, single-sample fwd+bwd at {list(FIT_LENGTHS)} "
             f"tokens): {cost_model.quadratic:.3e}·s² + {cost_model.linear:.3e}·s + {cost_model.per_micro_batch:.3e} "
             "s per micro-batch.", "",
             "| workload | samples/rank | method | samples/s | vs ZeRO-3+LB-Micro | balance bound | % of bound "
             "| utilisation r0 / r1 (plan ceiling) | peak RSS MiB r0 / r1 "
             "| micro-batches per rank (first measured step) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    baseline = {(r["workload"], r["samples_per_rank"]): r for r in rows
                if (r["engine"], r["policy"]) == ("zero3", "lb-micro")}
    for r in rows:
        base = baseline[(r["workload"], r["samples_per_rank"])]
        ratio = r["samples_per_s"] / base["samples_per_s"]
        bound = r["balance_bound"]
        method = f"{'ZeRO-3' if r['engine'] == 'zero3' else 'ODC'} + {r['policy']}"
        lines.append(f"| {r['workload']} | {r['samples_per_rank']} | {method} | {r['samples_per_s']:.3f} | "
                     f"{ratio:.3f}× | {bound:.3f}× | {100 * ratio / bound:.0f}% | "
                     f"{' / '.join(f'{100 * u:.1f}%' for u in r['utilisation'])} "
                     f"({100 * r['plan_utilisation']:.1f}%) | "
                     f"{' / '.join(f'{m:.0f}' for m in r['peak_rss_mib'])} | {r['micro_batches'][0]} |")
    if overhead:
        lines += ["", f"Metrics overhead (ODC + LB-Mini, long-tailed, 4 samples/rank, median step wall of rank 0): "
                      f"recorder on {overhead['on']:.3f} s, off {overhead['off']:.3f} s "
                      f"({100 * (overhead['on'] / overhead['off'] - 1):+.1f}%)."]
    return "\n".join(lines)


def update_docs(path, section):
    with open(path) as doc:
        text = doc.read()
    block = f"{DOC_START}\n{section}\n{DOC_END}"
    if DOC_START in text:
        text = text[:text.index(DOC_START)] + block + text[text.index(DOC_END) + len(DOC_END):]
    else:
        text = text.rstrip() + "\n\n## Balancers: ZeRO-3 vs ODC under long-tailed lengths\n\n" + block + "\n"
    with open(path, "w") as doc:
        doc.write(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 measured steps, 1 and 4 samples/rank; no docs")
    parser.add_argument("--smoke", action="store_true",
                        help="a seconds-long check of the pipeline (1/256 scale, 2 methods, 1 step); no docs")
    parser.add_argument("--steps", type=int, default=8, help="measured steps per cell")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2, help="repetitions of every cell, interleaved")
    parser.add_argument("--write", action="store_true",
                        help="write the tracked files: the JSON and markdown into benchmarks/results/ and, on a full "
                        "run, the section of --docs and its timeline PNG")
    parser.add_argument("--results", help="folder for balance_matrix.json/.md and the PNG (default: "
                        "benchmarks/results/ with --write, else a new temp folder)")
    parser.add_argument("--docs", default=os.path.join(ROOT, "docs", "benchmarks.md"),
                        help="the page whose section a full run with --write updates")
    args = parser.parse_args()
    if args.results is None:
        args.results = os.path.join(ROOT, "benchmarks", "results") if args.write else \
            tempfile.mkdtemp(prefix="balance_matrix_")
    import torch

    torch.set_num_threads(1)
    steps = 1 if args.smoke else 2 if args.quick else args.steps
    rounds = 1 if (args.smoke or args.quick) else args.rounds
    scale = 256 if args.smoke else SCALE
    token_cap = 65_536 // scale
    methods = [("zero3", "lb-micro"), ("odc", "lb-mini")] if args.smoke else METHODS
    grid = [("long-tailed", 4)] if args.smoke else \
        [("long-tailed", b) for b in ((1, 4) if args.quick else (1, 2, 4, 8))] + [("balanced", 4)]
    os.makedirs(args.results, exist_ok=True)

    print("fitting the cost model ...", flush=True)
    cost_model = fit_cost_model(token_cap)
    print(f"  {cost_model}", flush=True)
    rows, timeline_runs, overhead = [], {}, {}
    for workload, per_rank in grid:
        minibatches = workload_steps(workload, per_rank, args.warmup + steps, seed=per_rank, scale=scale)
        baseline_steps, baseline_plans = plan_cell("zero3", "lb-micro", minibatches, cost_model, token_cap)
        collected = {method: [] for method in methods}
        for round_number in range(rounds):  # rounds interleave the methods, so slow spells hit all of them
            for engine, policy in methods:
                label = f"{workload} b={per_rank} {engine}+{policy}"
                plan_steps, plans = plan_cell(engine, policy, minibatches, cost_model, token_cap)
                keep_events = round_number == 0 and workload == "long-tailed" and per_rank == 4 and \
                    (engine, policy) in (("zero3", "lb-micro"), ("odc", "lb-mini"))
                cell = {"label": label, "workload": workload, "samples_per_rank": per_rank, "engine": engine,
                        "policy": policy, "steps": plan_steps, "warmup": args.warmup, "metrics": True,
                        "keep_events": keep_events, "token_cap": token_cap}
                started = time.perf_counter()
                results = run_cell(cell, smoke=args.smoke)
                collected[(engine, policy)].append((cell, results, plans))
                print(f"round {round_number} {label:42s} median step "
                      f"{statistics.median(step_seconds(results)):.3f} s ({time.perf_counter() - started:.0f} s)",
                      flush=True)
                if keep_events:
                    title = "ZeRO-3 + LB-Micro" if engine == "zero3" else "ODC + LB-Mini"
                    timeline_runs[title] = [rep for r in results for rep in r["reports"]]
                if keep_events and engine == "odc" and not args.smoke:
                    off = run_cell(dict(cell, metrics=False, label=label + " (metrics off)"))
                    overhead = {"on": statistics.median(results[0]["manual_walls"]),
                                "off": statistics.median(off[0]["manual_walls"])}
        for method in methods:
            runs = collected[method]
            merged = [{"reports": [rep for _, results, _ in runs for rep in results[rank]["reports"]],
                       "peak_rss_mib": max(results[rank]["peak_rss_mib"] for _, results, _ in runs)}
                      for rank in range(WORLD)]
            measured = [p for _, _, plans in runs for p in plans[args.warmup:]]
            row = summarise(runs[0][0], merged, measured, baseline_plans[args.warmup:] * len(runs))
            rows.append(row)
            print(f"{row['label']:42s} {row['samples_per_s']:.3f} samples/s  bound {row['balance_bound']:.3f}x  "
                  f"util {[round(u, 3) for u in row['utilisation']]}", flush=True)

    from ds_odc.metrics import plot_timelines
    writes_docs = args.write and not (args.quick or args.smoke)
    png = os.path.join(ROOT, "docs", "timeline_long_tailed_b4.png") if writes_docs else \
        os.path.join(args.results, "timeline.png")
    if timeline_runs:
        plot_timelines(timeline_runs, png, "2 CPU ranks, LongAlign-like lengths (1/32 scale), 4 samples per rank")
    command = "python benchmarks/balance_matrix.py" + (" --write" if args.write else "") + (
        " --quick" if args.quick else " --smoke" if args.smoke else "")
    section = markdown(rows, cost_model, command, overhead)
    results_section = section
    if timeline_runs:  # the image linked relative to each page that shows it
        section += f"\n\n![per-rank timelines]({os.path.relpath(png, os.path.dirname(args.docs))})"
        results_section += f"\n\n![per-rank timelines]({os.path.relpath(png, args.results)})"
    with open(os.path.join(args.results, "balance_matrix.json"), "w") as out:
        json.dump({"cost_model": {"quadratic": cost_model.quadratic, "linear": cost_model.linear,
                                  "per_micro_batch": cost_model.per_micro_batch},
                   "comm": measured_comm(rows), "runs": rows, "metrics_overhead": overhead}, out, indent=1)
    with open(os.path.join(args.results, "balance_matrix.md"), "w") as out:
        out.write(results_section + "\n")
    if writes_docs:
        update_docs(args.docs, section)
    print(section)
    print(f"results in {args.results}" + (f"; updated {args.docs}" if writes_docs else ""))


if __name__ == "__main__":
    main()
