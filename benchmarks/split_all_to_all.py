"""Ulysses' all-to-all for split micro-batches: torch.distributed on a pre-created group against one-sided
pushes through shared-memory windows (what an all-to-all through ODC's own windows would be), 4 CPU ranks.

The split runtime (``ds_odc/integration/split_attention.py``) needs, inside each attention layer of a split
micro-batch, the all-to-alls of Ulysses among the members of its aligned group. Two ways:

* ``group``: DeepSpeed's ``_dim_zero_all_to_all`` (``all_to_all_single`` on a process group created at start
  for every aligned block; gloo here, NCCL on GPUs);
* ``one-sided``: each member pushes the chunk for member ``j`` straight into ``j``'s window (shared memory
  mapped by every member, two buffers by parity), publishes a flag word, waits for the other members'
  flags with ODC's backoff and copies its received chunks out (the window is reused two rounds later).

Both groups of 2 (ranks 0-1, 2-3) exchange at once, as the runtime does on 4 ranks; each member holds
``tokens`` tokens of ``hidden`` fp32 values and sends ``(p-1)/p`` of them. One invocation prints a markdown
table and a JSON line: per size, the median seconds of each way over ``--repeats`` exchanges after a warm-up,
their ratio, and ``fit_all_to_all`` of the group's times (latency and bandwidth: what the planner prices):

    .venv/bin/python benchmarks/split_all_to_all.py

(4 ranks share this machine's 2 cores: ratios are indicative, absolute times are not a GPU's.)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

WORLD, GROUP = 4, 2


def _exchange_one_sided(state: dict, inp: torch.Tensor, out: torch.Tensor) -> None:
    """One all-to-all of ``inp`` ([p, chunk]) into ``out`` ([p, chunk]) through the members' windows."""
    from ds_odc.comm.backoff import Backoff

    state["round"] += 1
    k, me, members = state["round"], state["me"], state["members"]
    parity = k % 2
    for j, peer in enumerate(members):
        if peer == me:
            out[j].copy_(inp[j])
            continue
        state["data"][peer][parity, members.index(me), :inp.shape[1]].copy_(inp[j])  # push into the peer's window
        state["ordering"].store_release(state["flags"][peer], members.index(me), k)
    backoff = Backoff()
    mine = state["flags"][me]
    for j, peer in enumerate(members):
        if peer == me:
            continue
        while state["ordering"].load_acquire(mine, j) < k:
            backoff.sleep()
        out[j].copy_(state["data"][me][parity, j, :inp.shape[1]])


def _run(rank: int, cell: dict) -> dict:
    from multiprocessing import shared_memory

    import deepspeed
    import torch
    import torch.distributed as dist

    from ds_odc.comm.ordering import memory_ordering

    deepspeed.init_distributed(dist_backend="gloo")
    members = [r for r in range(WORLD) if r // GROUP == rank // GROUP]
    groups = [dist.new_group(list(range(g, g + GROUP))) for g in range(0, WORLD, GROUP)]
    group = groups[rank // GROUP]
    hidden, repeats, biggest = cell["hidden"], cell["repeats"], max(cell["tokens"])
    chunk_max = biggest // GROUP * hidden
    tag = cell["tag"]
    own = shared_memory.SharedMemory(f"{tag}_{rank}", create=True, size=(2 * GROUP * chunk_max + 64) * 4)
    dist.barrier()
    mapped = {peer: (own if peer == rank else shared_memory.SharedMemory(f"{tag}_{peer}")) for peer in members}
    state = {"round": 0, "me": rank, "members": members, "ordering": memory_ordering(),
             "data": {p: torch.frombuffer(m.buf, dtype=torch.float32, count=2 * GROUP * chunk_max).view(2, GROUP, -1)
                      for p, m in mapped.items()},
             "flags": {p: torch.frombuffer(m.buf, dtype=torch.int64, count=8, offset=2 * GROUP * chunk_max * 4)
                       for p, m in mapped.items()}}
    state["flags"][rank].zero_()
    dist.barrier()
    rows = []
    try:
        for tokens in cell["tokens"]:
            local = tokens // GROUP
            inp = torch.randn(GROUP, local // GROUP * hidden, generator=torch.Generator().manual_seed(rank))
            out_a, out_b = torch.empty_like(inp), torch.empty_like(inp)
            times = {"group": [], "one-sided": []}
            for i in range(cell["warmup"] + repeats):
                for way in ("group", "one-sided"):
                    dist.barrier(group=group)
                    start = time.perf_counter()
                    if way == "group":
                        dist.all_to_all_single(out_a, inp, group=group)
                    else:
                        _exchange_one_sided(state, inp, out_b)
                    if i >= cell["warmup"]:
                        times[way].append(time.perf_counter() - start)
            assert torch.equal(out_a, out_b), "the two ways disagree"
            rows.append({"tokens": tokens, **{way: statistics.median(t) for way, t in times.items()}})
    finally:
        dist.barrier()
        for segment in mapped.values():
            segment.close()
        own.unlink()
    return {"rows": rows}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=128, help="values per token (the benchmark Llama's hidden)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192, 32768],
                        help="tokens of the split micro-batch (each member holds tokens / 2)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args(argv)
    from benchmarks import cells
    from ds_odc.balance import fit_all_to_all

    cell = {"hidden": args.hidden, "tokens": args.tokens, "repeats": args.repeats, "warmup": args.warmup,
            "tag": f"ds_odc_bench_a2a_{os.getpid()}"}
    results = cells.run_cell(_run, WORLD, cell, "split_all_to_all", timeout_s=1200)
    # per size, the slowest member (an all-to-all ends for the group when its last member has its chunks)
    rows = []
    for i, tokens in enumerate(args.tokens):
        group = max(r["rows"][i]["group"] for r in results)
        one_sided = max(r["rows"][i]["one-sided"] for r in results)
        rows.append({"tokens": tokens, "bytes_per_member": tokens // GROUP * args.hidden * 4, "group_s": group,
                     "one_sided_s": one_sided, "group_over_one_sided": group / one_sided})
    measured = {row["tokens"]: row["group_s"] for row in rows}
    fit = fit_all_to_all(lambda n: measured[n], args.tokens, GROUP, repeats=1, warmup=0, layers=1,
                         all_to_alls_per_layer=1, bytes_per_token=4.0 * args.hidden)
    print("| tokens (split over 2) | bytes per member | group all-to-all (gloo) | one-sided (shm windows) | ratio |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['tokens']} | {row['bytes_per_member']} | {row['group_s'] * 1e3:.3f} ms | "
              f"{row['one_sided_s'] * 1e3:.3f} ms | {row['group_over_one_sided']:.2f} |")
    print(json.dumps({"rows": rows, "fit": {"latency_s": fit.latency, "bandwidth_bytes_per_s": fit.bandwidth,
                                            "bytes_per_token": fit.bytes_per_token}}))


if __name__ == "__main__":
    main()
