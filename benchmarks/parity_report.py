"""How close ODC is to DeepSpeed ZeRO-3, in numbers (the tests only assert the bounds).

    .venv/bin/python benchmarks/parity_report.py

For each configuration of tests/distributed/test_parity.py: the worst relative difference over
10 steps (max |a - b| / max |b| per tensor) of losses, full gradients and full fp32 parameters.
Prints a markdown table; writes nothing.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = [
    ("2 ranks, gas 1, Adam", 2, 1, {"optimizer": "adam"}),
    ("2 ranks, gas 3, SGD momentum", 2, 3, {"optimizer": "sgd"}),
    ("4 ranks, gas 3, Adam", 4, 3, {"optimizer": "adam"}),
    ("4 ranks, gas 3, Adam, fp64 accumulators", 4, 3, {"optimizer": "adam", "odc": {"accumulator_dtype": "fp64"}}),
    ("4 ranks, gas 1, SGD momentum", 4, 1, {"optimizer": "sgd"}),
    ("2 ranks, gas 2, AdamW + WarmupLR + clip 0.02", 2, 2, {"optimizer": "adamw", "scheduler": True, "clip": 0.02}),
    ("2 ranks, gas 2, client AdamW, 2 param groups", 2, 2, {"optimizer": "client"}),
    ("2 ranks, gas 2, bf16 (vs ZeRO-3 bf16)", 2, 2, {"bf16": True}),
]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.parse_args(argv)
    from tests.support.compare import worst_rel_diff
    from tests.support.harness import run_ranks
    from tests.support.workloads import train_pair

    print("| configuration | losses | full grads | full fp32 params |")
    print("| --- | --- | --- | --- |")
    for name, world, gas, options in CASES:
        runs = run_ranks(train_pair, world, [("odc", options), (3, options)], 10, gas)  # "odc" key: ODC only
        losses = max(abs(a - b) / max(abs(b), 1e-12)
                     for odc, zero3 in runs for a, b in zip(odc["losses"], zero3["losses"]))
        odc, zero3 = runs[0]
        grads = max(worst_rel_diff(odc["grads"][s], zero3["grads"][s]) for s in range(10))
        params = max(worst_rel_diff(odc["params"][s], zero3["params"][s]) for s in range(10))
        print(f"| {name} | {losses:.1e} | {grads:.1e} | {params:.1e} |", flush=True)


if __name__ == "__main__":
    main()
