"""A soak: one long training job on the odc stage, watched for leaks and checked against references (opt-in; CI
runs the short soak of tests/distributed/test_step_failures.py instead).

    python tests/compat/run_soak.py                          # 2,000 steps on 2 ranks
    python tests/compat/run_soak.py --steps 2000 --ranks 2 4
    python tests/compat/run_soak.py --steps 100              # an estimate of what the full run costs

The job (tests/support/soak_workloads.py): real DeepSpeed engines, ``"stage": "odc"`` with deterministic sums, a
4-block MLP of width 256. Each step every rank runs its own number of micro-batches, 0 to 3, some without a loss
token, per-token loss, after random sleeps (0-4 ms before each micro-batch; one step in 20 a rank stalls 50 ms
first); every 50 steps ``engine.offload_states()`` then ``reload_states()``, alternately between steps and in the
middle of a step; every 200 steps ``save_checkpoint`` into a temporary directory that keeps the last two tags, and
at the first checkpoint and every other one after it (200, 600, 1000, ...) ``load_checkpoint`` of the tag just
saved into the running engine.

What must hold, else the runner names it and exits 1:

* **The numbers.** A reference run, the same job on as many ranks without sleeps, offloads or checkpoints, must
  agree bit for bit: every micro-batch's loss at every step, and the full parameters at every checkpoint and 5 steps
  either side of it (deterministic sums make the run independent of the order pushes arrive in; docs/
  normalisation.md, "Bit for bit on request"). Each load round trip gives back exactly the parameters it saved.
  And, so that both runs cannot be wrong alike, one process (plain PyTorch, float64 sums of every rank's
  micro-batches, per-token rule, ZeRO-3's clipping, torch's Adam) starts from the soak's parameters and Adam moments
  5 steps before each checkpoint and runs to 5 steps after it: its parameters must be within ``--atol`` of the
  soak's (fp32 arithmetic: ~1e-7 here; 10 steps move a weight by ~1e-2, a lost or mis-weighted micro-batch by
  ~1e-5 or more).
* **Flat after warm-up.** Every ``--sample-every`` steps each rank samples its resident memory (VmRSS), open
  descriptors, threads, mappings of ds_odc segments, its own ds_odc files in ``/dev/shm`` (each rank unlinks its
  files once every rank has mapped them: there should be none), this job's DeepSpeed files there (named after its
  port), and the checkpoint directory's size. Warm-up is ``--warmup`` steps (default: half the run, at most 1,000,
  when the step recorder's history of 1,000 step reports is full). After it, on every rank: the counts
  (descriptors, threads, mappings, files) stay exactly constant; the checkpoint directory never holds more than
  two checkpoints' bytes; resident memory's median over the last quarter of the samples is at most
  ``--rss-growth-mib`` above its median over the first quarter, and its spread (max - min) at most
  ``--rss-spread-mib``.

Prints the figures as markdown tables with the command and the date (docs/failures.md, "Soak"). Run it from the
checkout root with the test environment (``DS_ACCELERATOR=cpu OMP_NUM_THREADS=1`` and the JIT-built operators'
directory, as tests/README.md shows for pytest).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if CHECKOUT not in sys.path:
    sys.path.insert(0, CHECKOUT)

#: resources sampled besides resident memory: constant after warm-up (the checkpoint directory: at most ``keep`` tags)
COUNTED = ("fds", "threads", "maps_ds_odc", "shm_ds_odc_own", "shm_deepspeed", "checkpoint_kib")
LABELS = {"rss_kib": "resident memory (MiB)", "fds": "open descriptors", "threads": "threads",
          "maps_ds_odc": "ds_odc segment mappings", "shm_ds_odc_own": "the rank's own ds_odc files in /dev/shm",
          "shm_deepspeed": "this job's DeepSpeed files in /dev/shm", "checkpoint_kib": "checkpoint directory (KiB)"}


@dataclass
class Verdict:
    rows: list = field(default_factory=list)      # markdown rows
    failures: list = field(default_factory=list)  # sentences

    def check(self, ok: bool, failure: str) -> str:
        if not ok:
            self.failures.append(failure)
        return "yes" if ok else "**no**"


def default_warmup(steps: int) -> int:
    """Half the run, at most 1,000 steps: the step recorder keeps the last 1,000 step reports (engine.odc_metrics),
    so resident memory may grow until then; a 2,000-step run has its first load round trip at step 200."""
    return min(steps // 2, 1000)


def _run_with_progress(fn, world, plan, timeout, progress):
    """run_ranks in a thread, echoing rank 0's progress lines as they come (the job takes many minutes)."""
    from tests.support.harness import run_ranks

    outcome: dict = {}

    def target():
        try:
            outcome["results"] = run_ranks(fn, world, plan, timeout=timeout)
        except BaseException as err:  # noqa: BLE001 - re-raised below
            outcome["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    seen = 0
    while thread.is_alive():
        thread.join(timeout=5)
        if progress and os.path.exists(progress):
            with open(progress) as lines:
                new = lines.readlines()[seen:]
            seen += len(new)
            for line in new:
                print("    " + line.rstrip(), flush=True)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["results"]


def compare_numbers(plan, world, soak, reference, records, verdict: Verdict, atol: float) -> None:
    import torch

    from tests.support.soak_workloads import one_process_segment

    ran = sum(int((~r["losses"].isnan()).sum()) for r in soak)
    same = sum(int(((a["losses"] == b["losses"]) | (a["losses"].isnan() & b["losses"].isnan())).all(dim=1).sum())
               for a, b in zip(soak, reference, strict=True))
    total = plan.steps * world
    verdict.rows.append(("losses against the reference run (every micro-batch of every step)",
                         f"{same} of {total} rank-steps equal bit for bit ({ran} micro-batches)",
                         verdict.check(same == total, f"losses: {total - same} rank-steps differ from the "
                                                      "reference run")))
    marks = plan.recorded_steps()
    differing = []
    for step in sorted(marks):
        a = torch.load(os.path.join(records["soak"], f"step{step}.pt"), weights_only=False)["params"]
        b = torch.load(os.path.join(records["reference"], f"step{step}.pt"), weights_only=False)["params"]
        differing += [f"step {step} {name}" for name in a if not torch.equal(a[name], b[name])]
    verdict.rows.append(("parameters against the reference run (each checkpoint, 5 steps either side)",
                         f"{len(marks)} steps, {'all equal bit for bit' if not differing else differing[:3]}",
                         verdict.check(not differing, f"parameters differ from the reference run: {differing[:5]}")))
    if not plan.checkpoints():
        verdict.rows.append(("checkpoints", f"none in {plan.steps} steps", "n/a"))
        return
    loads = [(plan.checkpoints()[i], int(v)) for r in soak for i, v in enumerate(r["loads"].tolist()) if v]
    bad = sorted({step for step, v in loads if v != 1})
    verdict.rows.append(("load_checkpoint round trips give back the saved parameters",
                         f"steps {sorted({s for s, _ in loads})}: {'exact' if not bad else f'differ at {bad}'}",
                         verdict.check(bool(loads) and not bad, f"load round trips differ at steps {bad}")))
    worst, where = 0.0, ""
    for step in plan.checkpoints():
        first, last = max(step - plan.segment, 0), min(step + plan.segment, plan.steps)
        start = torch.load(os.path.join(records["soak"], f"step{first}.pt"), weights_only=False)
        end = torch.load(os.path.join(records["soak"], f"step{last}.pt"), weights_only=False)["params"]
        expected = one_process_segment(plan, world, start, first, last)
        for name, value in expected.items():
            diff = float((value - end[name]).abs().max())
            if diff > worst:
                worst, where = diff, f"steps {first}-{last} {name}"
    verdict.rows.append((f"one process from the soak's state, steps c-{plan.segment} to c+{plan.segment} of each "
                         f"checkpoint c", f"max abs difference {worst:.1e} ({where}; bound {atol:.0e})",
                         verdict.check(worst <= atol, f"one process differs by {worst:.2e} > {atol:.0e} at "
                                                      f"{where}")))


def judge_resources(soak, warmup: int, keep: int, growth_mib: float, spread_mib: float, verdict: Verdict) -> list:
    from tests.support.soak_workloads import COLUMNS

    table = []
    for rank, result in enumerate(soak):
        rows = [dict(zip(COLUMNS, row)) for row in result["samples"].tolist()]
        rows = [rows[0]] + [r for r in rows[1:] if r["step"]]
        after = [r for r in rows if r["step"] >= warmup]
        quarter = max(len(after) // 4, 1)
        for key in ("rss_kib", *COUNTED):
            values = [r[key] for r in after]
            scale = 1024 if key == "rss_kib" else 1
            first_q, last_q = statistics.median(values[:quarter]) / scale, statistics.median(values[-quarter:]) / scale
            low, high = min(values) / scale, max(values) / scale
            if key == "rss_kib":
                ok = last_q - first_q <= growth_mib and high - low <= spread_mib
                why = (f"rank {rank}: resident memory grew {last_q - first_q:+.1f} MiB (median of the last quarter "
                       f"{last_q:.1f} against the first {first_q:.1f}; bound {growth_mib}), spread "
                       f"{high - low:.1f} MiB (bound {spread_mib}) after step {warmup}")
                fmt = "{:.1f}"
            elif key == "checkpoint_kib":  # one tag after the first save, ``keep`` tags from then on
                one = next((r[key] for r in rows if r[key]), 0)
                ok = high <= keep * one
                why = f"rank {rank}: the checkpoint directory reached {high:g} KiB, over {keep} x {one:g} KiB"
                fmt = "{:g}"
            else:
                ok = low == high
                why = (f"rank {rank}: {LABELS[key]} not constant after step {warmup}: {low:g} to {high:g} "
                       f"(first at {next(r['step'] for r in after if r[key] != after[0][key])})" if not ok else "")
                fmt = "{:g}"
            table.append((LABELS[key], rank, fmt.format(rows[0][key] / scale), fmt.format(after[0][key] / scale),
                          f"{fmt.format(low)}-{fmt.format(high)}", f"{fmt.format(first_q)} → {fmt.format(last_q)}",
                          verdict.check(ok, why)))
    return table


def leftovers(sessions) -> list:
    return sorted(n for n in os.listdir("/dev/shm") if any(s and n.startswith(f"ds_odc_{s}") for s in sessions))


def run_world(args, world: int) -> tuple:
    from tests.support.soak_workloads import SoakPlan, soak_rank

    with tempfile.TemporaryDirectory(prefix="ds_odc_soak_") as work:
        records = {kind: os.path.join(work, kind) for kind in ("soak", "reference")}
        for path in (*records.values(), os.path.join(work, "checkpoints")):
            os.makedirs(path)
        plan = SoakPlan(steps=args.steps, seed=args.seed, hidden=args.hidden, sample_every=args.sample_every,
                        max_delay_s=args.max_delay_ms / 1000, checkpoint_dir=os.path.join(work, "checkpoints"),
                        records=records["soak"], progress=os.path.join(work, "progress"))
        timeout = 600 + 3.0 * args.steps
        print(f"{world} ranks, {args.steps} steps: the soak", flush=True)
        started = time.monotonic()
        soak = _run_with_progress(soak_rank, world, plan, timeout, plan.progress)
        soak_s = time.monotonic() - started
        print(f"{world} ranks: the reference run", flush=True)
        started = time.monotonic()
        reference = _run_with_progress(soak_rank, world, plan.reference(records["reference"]), timeout, None)
        reference_s = time.monotonic() - started
        verdict = Verdict()
        left = leftovers({r["session"] for r in soak + reference})
        verdict.rows.append(("ds_odc files of either run left in /dev/shm after the job", str(len(left)),
                             verdict.check(not left, f"left in /dev/shm: {left}")))
        compare_numbers(plan, world, soak, reference, records, verdict, args.atol)
    warmup = args.warmup if args.warmup is not None else default_warmup(args.steps)
    table = judge_resources(soak, warmup, plan.keep, args.rss_growth_mib, args.rss_spread_mib, verdict)
    return plan, warmup, verdict, table, soak_s, reference_s, soak


def write_samples(path: str, soak) -> None:
    """Every resource sample of every rank, one CSV row each (rank first)."""
    from tests.support.soak_workloads import COLUMNS

    with open(path, "w") as out:
        out.write(",".join(("rank", *COLUMNS)) + "\n")
        for rank, result in enumerate(soak):
            for index, row in enumerate(result["samples"].tolist()):
                if index == 0 or row[0]:  # rows past the last sample stay zero
                    out.write(",".join(map(str, (rank, *row))) + "\n")


def section(world, plan, warmup, verdict, table, soak_s, reference_s) -> str:
    lines = [f"{world} ranks, {plan.steps} steps: the soak took {soak_s / 60:.1f} min, the reference run "
             f"{reference_s / 60:.1f} min. Warm-up: {warmup} steps.\n",
             "| check | result | holds |", "| --- | --- | --- |"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in verdict.rows]
    lines += ["", f"| resource | rank | at start | at step {warmup} | min-max after | median, first → last quarter "
                  "after | flat |", "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in table]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2], help="world sizes, one job each")
    parser.add_argument("--seed", type=int, default=36)
    parser.add_argument("--hidden", type=int, default=256, help="width of the model's blocks")
    parser.add_argument("--max-delay-ms", type=float, default=4.0, help="random sleep before each micro-batch")
    parser.add_argument("--sample-every", type=int, default=10, help="steps between resource samples")
    parser.add_argument("--warmup", type=int, default=None, help="steps before resources must be flat")
    parser.add_argument("--rss-growth-mib", type=float, default=2.0)
    parser.add_argument("--rss-spread-mib", type=float, default=16.0)
    parser.add_argument("--atol", type=float, default=1e-6, help="one process against the soak's parameters")
    parser.add_argument("--samples", default=None, help="directory for every resource sample (CSV per world size)")
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    started = datetime.datetime.now(datetime.timezone.utc)
    given = sys.argv[1:] if argv is None else argv
    command = " ".join(["python", "tests/compat/run_soak.py", *map(shlex.quote, given)])
    header = f"`{command}`, {started:%Y-%m-%d}, Python {platform.python_version()}, CPU (gloo)"
    print(header, flush=True)
    failures, sections = [], []
    for world in args.ranks:
        plan, warmup, verdict, table, soak_s, reference_s, soak = run_world(args, world)
        if args.samples:
            os.makedirs(args.samples, exist_ok=True)
            write_samples(os.path.join(args.samples, f"soak_{world}_ranks.csv"), soak)
        failures += [f"{world} ranks: {f}" for f in verdict.failures]
        sections.append(section(world, plan, warmup, verdict, table, soak_s, reference_s))
        print("\n" + sections[-1] + "\n", flush=True)
    if len(sections) > 1:
        print("\n\n".join(["", header, *sections]))
    for failure in failures:
        print("FAIL " + failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
