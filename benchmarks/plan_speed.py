"""How long planning one global minibatch takes: 1024 LongAlign-like samples for 32 ranks.

    .venv/bin/python benchmarks/plan_speed.py

Median of 20 plans (different minibatches) per policy, with the quadratic cost model, token cap
65,536 (full-scale lengths, packing ratio 1). Also prints the plan quality: the ODC step cost
(largest rank total) over the perfect split (mean rank total). Prints a markdown table; writes nothing.
"""
import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]


def measure(samples=1024, ranks=32, repeats=20):
    from ds_odc.balance import CostModel, plan_minibatch

    from packed_lm import longalign_like_lengths

    model = CostModel.quadratic_linear(1.982122, 2.611821, 32_000)
    print(f"{samples} samples, {ranks} ranks, cap 65536, median of {repeats} minibatches")
    print("| policy | plan time (median) | plan time (max) | max rank cost / mean rank cost | micro-batches per rank |")
    print("|---|---|---|---|---|")
    for policy in ("lb-mini", "lb-micro", "local-sort"):
        times, quality, counts = [], [], set()
        for seed in range(repeats):
            lengths = longalign_like_lengths(samples, scale=1, seed=seed)
            start = time.perf_counter()
            plan = plan_minibatch(lengths, ranks, 65_536, policy, model, seed=seed)
            times.append(time.perf_counter() - start)
            quality.append(plan.odc_step_cost() / (sum(plan.rank_costs()) / ranks))
            counts.update(plan.micro_batch_counts())
        print(f"| {policy} | {1000 * statistics.median(times):.1f} ms | {1000 * max(times):.1f} ms | "
              f"{statistics.median(quality):.4f} | {min(counts)}-{max(counts)} |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=1024, help="samples per global minibatch (default 1024)")
    parser.add_argument("--ranks", type=int, default=32, help="ranks to plan for (default 32)")
    parser.add_argument("--repeats", type=int, default=20, help="minibatches timed per policy (default 20)")
    args = parser.parse_args(argv)
    measure(args.samples, args.ranks, args.repeats)


if __name__ == "__main__":
    main()
