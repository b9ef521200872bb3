"""ZeRO-3, ZeRO-3 with hpZ, and ODC across two hosts (2 nodes x 2 CPU ranks) under long-tailed lengths.

The two hosts are the test bed's (``tests/support/netns.py``): network, mount and UTS namespaces on
this machine, joined by a veth pair; each host its own ``/dev/shm``. Optionally the link is throttled
with ``tc`` (a token bucket on both ends of the veth). Every cell starts 4 fresh rank processes (2 per
host, one thread each) that run ``balance_matrix``'s cell: the same model, lengths and planning, with
the world of 4. Methods:

    ZeRO-3 + LB-Micro, ZeRO-3 with hpZ (secondary partition over a node's 2 ranks) + LB-Micro,
    ODC + LB-Micro, ODC + LB-Mini

Reported per (link, samples per rank): samples/s (median over measured steps), the ratio to
ZeRO-3 + LB-Micro, utilisation per rank, peak RSS per rank.

    .venv/bin/python benchmarks/multinode.py                       # unthrottled and 1 Gbit/s, b = 1, 2, 4, 8
    .venv/bin/python benchmarks/multinode.py --write               # the same, into benchmarks/results/ and docs
    .venv/bin/python benchmarks/multinode.py --write --append      # another round, added to those
    .venv/bin/python benchmarks/multinode.py --quick               # b = 1 and 4, 2 measured steps, no docs

This machine has 2 cores: 4 ranks share them, so absolute times are twice a quiet rank's; every method
shares the cores the same way.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]

METHODS = [("zero3", "lb-micro"), ("zero3-hpz2", "lb-micro"), ("odc", "lb-micro"), ("odc", "lb-mini")]
NODES, LOCAL = 2, 2
WORLD = NODES * LOCAL
DOC_START, DOC_END = "<!-- multinode:start -->", "<!-- multinode:end -->"


# -- on each host: this node's ranks --------------------------------------------------------------
def node_main(node: int, master_addr: str, port: int, cell_path: str, out_dir: str) -> None:
    """Start this node's ranks (plain processes with torch.distributed's environment), wait for them."""
    procs = []
    for local in range(LOCAL):
        env = dict(os.environ, RANK=str(node * LOCAL + local), LOCAL_RANK=str(local), WORLD_SIZE=str(WORLD),
                   LOCAL_WORLD_SIZE=str(LOCAL), MASTER_ADDR=master_addr, MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, __file__, "rank", cell_path, out_dir], env=env))
    sys.exit(max(abs(proc.wait()) for proc in procs))


def rank_main(cell_path: str, out_dir: str) -> None:
    import torch

    from benchmarks.balance_matrix import _run_cell

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    with open(cell_path) as f:
        cell = json.load(f)
    result = _run_cell(rank, cell)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


# -- the driver -------------------------------------------------------------------------------------
def throttle(hosts, mbit: int | None) -> None:
    """A token bucket of ``mbit`` on both ends of the veth (None: remove it)."""
    for host in hosts.hosts:
        subprocess.run(["ip", "netns", "exec", host.netns, "tc", "qdisc", "del", "dev", host.ifname, "root"],
                       capture_output=True, timeout=10)
        if mbit:
            subprocess.run(["ip", "netns", "exec", host.netns, "tc", "qdisc", "add", "dev", host.ifname, "root", "tbf",
                            "rate", f"{mbit}mbit", "burst", "1mb", "latency", "100ms"], check=True, timeout=10)


def run_cell(hosts, cell: dict, work: str, port: int, timeout_s: float) -> list:
    import torch

    cell_dir = os.path.join(work, cell["label"].replace(" ", "_").replace("+", "").replace("/", "_"))
    os.makedirs(cell_dir, exist_ok=True)
    cell_path = os.path.join(cell_dir, "cell.json")
    with open(cell_path, "w") as f:
        json.dump(cell, f)
    argvs = [[sys.executable, __file__, "node", str(i), hosts.master_addr, str(port), cell_path, cell_dir]
             for i in range(NODES)]
    results = hosts.run_on_both(argvs, timeout=timeout_s)
    for result in results:
        if result.timed_out or result.returncode != 0:
            raise RuntimeError(f"cell {cell['label']} failed:\n" + "\n".join(r.tail() for r in results))
    return [torch.load(os.path.join(cell_dir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="b = 1 and 4, 2 measured steps, unthrottled; no docs")
    parser.add_argument("--samples-per-rank", default="1,2,4,8")
    parser.add_argument("--links", default="0,1000", help="Mbit/s of the throttled veth, 0 = unthrottled")
    parser.add_argument("--steps", type=int, default=4, help="measured steps per cell")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--write", action="store_true", help="write the tracked files: the results file "
                        "(default benchmarks/results/multinode.json) and the section of --docs")
    parser.add_argument("--docs", default=os.path.join(ROOT, "docs", "benchmarks.md"),
                        help="the page whose section --write updates")
    parser.add_argument("--results", help="the results file (default: benchmarks/results/multinode.json with "
                        "--write, else one in a new temp folder)")
    parser.add_argument("--append", action="store_true",
                        help="add a round to the results file; the docs show each cell's median over rounds")
    args = parser.parse_args(argv)
    if args.results is None:
        args.results = os.path.join(ROOT, "benchmarks", "results", "multinode.json") if args.write else \
            os.path.join(tempfile.mkdtemp(prefix="multinode_"), "multinode.json")
    from benchmarks import balance_matrix as bm
    from tests.support.netns import available, two_hosts

    ok, reason = available()
    if not ok:
        raise SystemExit(f"cannot create two hosts here: {reason}")
    samples = [1, 4] if args.quick else [int(b) for b in args.samples_per_rank.split(",")]
    links = [0] if args.quick else [int(x) for x in args.links.split(",")]
    steps = 2 if args.quick else args.steps
    token_cap = 65536 // bm.SCALE
    cost_model = bm.fit_cost_model(token_cap)
    earlier = []
    if args.append and os.path.exists(args.results):
        with open(args.results) as f:
            earlier = json.load(f)["rows"]
    this_round = 1 + max((row.get("round", 0) for row in earlier), default=0)
    rows = []
    port = 29611
    started = time.monotonic()
    with two_hosts(prefix="odcb") as hosts:
        work = hosts.workdir
        for mbit in links:
            throttle(hosts, mbit)
            for b in samples:
                minibatches = bm.workload_steps("longalign", b, args.warmup + steps, world=WORLD)
                baseline_plans = None
                for engine, policy in METHODS:
                    cell_steps, plans = bm.plan_cell(engine, policy, minibatches, cost_model, token_cap, world=WORLD)
                    if baseline_plans is None:
                        baseline_plans = plans
                    label = f"{mbit or 'veth'} b={b} {engine}+{policy}"
                    cell = {"label": label, "engine": engine, "policy": policy, "token_cap": token_cap,
                            "steps": cell_steps, "warmup": args.warmup, "metrics": True, "keep_events": False}
                    port += 1
                    results = run_cell(hosts, cell, work, port, timeout_s=900)
                    seconds = bm.step_seconds(results)
                    from ds_odc.metrics import utilisation
                    row = {"round": this_round, "link_mbit": mbit, "samples_per_rank": b, "engine": engine,
                           "policy": policy,
                           "samples_per_s": WORLD * b / statistics.median(seconds), "step_seconds": seconds,
                           "utilisation": [utilisation(r["reports"]) for r in results],
                           "peak_rss_mib": [r["peak_rss_mib"] for r in results],
                           "micro_batches": [[len(rank) for rank in p.micro_batches] for p in plans[args.warmup:]]}
                    rows.append(row)
                    print(f"{label}: {row['samples_per_s']:.2f} samples/s, utilisation "
                          f"{[round(u, 2) for u in row['utilisation']]}, peak RSS "
                          f"{[round(m) for m in row['peak_rss_mib']]} MiB", flush=True)
        throttle(hosts, None)
    print(f"{len(rows)} cells in {time.monotonic() - started:.0f} s")
    if args.quick:
        return
    rows = earlier + rows
    os.makedirs(os.path.dirname(args.results), exist_ok=True)
    with open(args.results, "w") as f:
        json.dump({"rows": rows, "cost_model": str(cost_model)}, f, indent=1)
    extra = sys.argv[1:] if argv is None else argv
    command = " ".join(["`.venv/bin/python benchmarks/multinode.py", *extra]) + "`"
    section = markdown(rows, command)
    if args.write:
        _update_docs(args.docs, section)
    print(section)
    print(f"results in {args.results}" + (f"; updated {args.docs}" if args.write else ""))


def markdown(rows: list, command: str) -> str:
    """The docs section: per cell, each method's samples/s over ZeRO-3 + LB-Micro's *of the same round*,
    as the mean over rounds with the range; utilisation and memory of the last round."""
    rounds = sorted({row.get("round", 1) for row in rows})
    lines = [DOC_START, "## Across two hosts: 2 nodes x 2 CPU ranks (`benchmarks/multinode.py`)", "",
             f"Command: {command}. Two hosts made on this machine (network, mount and UTS namespaces, a veth pair; "
             "each its own `/dev/shm`), 2 ranks each, one thread per rank on this 2-core machine (so every rank "
             "shares a core), `balance_matrix`'s model (4.5M parameters, fp32) and LongAlign-like lengths / 32 (cap "
             "2048), 4 measured steps per cell after one warm-up. \"veth\": the link as it is; a number: throttled "
             "to that many Mbit/s each way with `tc`. ZeRO-3's hpZ keeps a secondary copy of each gathered layer over "
             f"the node's 2 ranks. {len(rounds)} rounds (the whole matrix, one run after the other); each ratio is to "
             "ZeRO-3 + LB-Micro of the same round: the mean over rounds, the range in brackets.", "",
             "| link | b | ZeRO-3 + LB-Micro (samples/s) | ZeRO-3 hpZ + LB-Micro | ODC + LB-Micro | ODC + LB-Mini | "
             "utilisation ZeRO-3 / ODC LB-Mini | peak RSS per rank ZeRO-3 / hpZ / ODC LB-Mini (MiB) |",
             "|---|---|---|---|---|---|---|---|"]
    cells = {(r.get("round", 1), r["link_mbit"], r["samples_per_rank"], r["engine"], r["policy"]): r for r in rows}
    for link, b in sorted({(r["link_mbit"], r["samples_per_rank"]) for r in rows}):
        def of(method, rnd):
            return cells[(rnd, link, b) + method]  # noqa: B023 - called within this iteration only

        def ratio(method):
            values = [of(method, rnd)["samples_per_s"] / of(("zero3", "lb-micro"), rnd)["samples_per_s"]
                      for rnd in rounds]
            return f"{statistics.mean(values):.2f}x ({min(values):.2f}-{max(values):.2f})"

        last = rounds[-1]
        base, hpz = of(("zero3", "lb-micro"), last), of(("zero3-hpz2", "lb-micro"), last)
        mini = of(("odc", "lb-mini"), last)
        speed = statistics.mean(of(("zero3", "lb-micro"), rnd)["samples_per_s"] for rnd in rounds)
        lines.append(f"| {link or 'veth'} | {b} | {speed:.2f} | {ratio(('zero3-hpz2', 'lb-micro'))} | "
                     f"{ratio(('odc', 'lb-micro'))} | {ratio(('odc', 'lb-mini'))} | {_span(base['utilisation'])} / "
                     f"{_span(mini['utilisation'])} | {max(base['peak_rss_mib']):.0f} / "
                     f"{max(hpz['peak_rss_mib']):.0f} / {max(mini['peak_rss_mib']):.0f} |")
    lines += ["", DOC_END]
    return "\n".join(lines)


def _span(values) -> str:
    return f"{100 * min(values):.0f}-{100 * max(values):.0f}%"


def _update_docs(path: str, section: str) -> None:
    text = open(path).read() if os.path.exists(path) else ""
    if DOC_START in text and DOC_END in text:
        text = text[:text.index(DOC_START)] + section + text[text.index(DOC_END) + len(DOC_END):]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    with open(path, "w") as f:
        f.write(text)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "node":
        node_main(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6])
    elif len(sys.argv) > 1 and sys.argv[1] == "rank":
        rank_main(sys.argv[2], sys.argv[3])
    else:
        main()
