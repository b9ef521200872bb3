"""TRL GRPO without vLLM, long-tailed completion lengths, 2 CPU ranks: ODC (each rank's ``generate`` at its own
pace) against ZeRO-3 (transformers' ``synced_gpus`` lockstep). One run of one stage per invocation.

It runs the framework suite's scenario ``grpo_long`` (``--no-gather``: ``grpo_long_nogather``) exactly as the
suite does (``tests/compat/run_framework_tests.py``'s ``run_route``: torchrun, 2 ranks, one thread each, TRL's
real ``GRPOTrainer``), so it needs the suite's TRL environment (transformers 5.23.0, trl 1.16.0, ...):

    python tests/compat/run_framework_tests.py --setup-only --only trl/grpo_long   # builds VENV_ROOT/trl
    TRL=VENV_ROOT/trl/bin/python
    $TRL benchmarks/grpo_rollouts.py --stage odc          # one run: a table per rank, then a JSON line
    $TRL benchmarks/grpo_rollouts.py --stage 3
    python benchmarks/paired.py -n 3 --figure rollout_s --figure generate_s --figure step_s \\
        --a "$TRL benchmarks/grpo_rollouts.py --stage odc" --b "$TRL benchmarks/grpo_rollouts.py --stage 3"

The scenario (``tests/compat/frameworks/long_tail.py``): the suite's tiny Llama (2 layers, hidden 32), 2
completions per prompt, 4 completions per rank per step, completion lengths long-tailed (4 to 64 tokens, a
logits processor standing in for a real model's EOS), parameters released after use, a frozen reference
model (``beta`` 0.04). Per rank and step it records the seconds inside ``generate``, TRL's generation phase
(``_generate``: the gather of parameters when ``ds3_gather_for_generation``, ``generate``, and TRL's
all-gathers of completion lengths, where the ranks meet), the whole optimizer step, and the forwards run
inside ``generate``.

The JSON line's figures are sums over the steps after the first (the first carries one-time costs):
``generate_s`` the slower rank's seconds inside ``generate`` per step, ``generate_short_s`` the faster
rank's, ``rollout_s`` the slower rank's generation phase, ``step_s`` the slower rank's step; and over every
step, ``forwards_rank0`` / ``forwards_rank1`` (forwards inside ``generate``) and ``tokens_rank0`` /
``tokens_rank1`` (each rank's longest completion, the forwards it needs).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.compat.run_framework_tests import SCENARIOS, SCRIPTS, run_route  # noqa: E402


def figures(ranks: list) -> dict:
    """The JSON line's figures (module docstring) from every rank's per-step records."""
    steps = list(zip(*ranks))
    measured = steps[1:]
    out = {"steps": len(steps)}
    for key, pick in (("generate_s", max), ("rollout_s", max), ("step_s", max)):
        out[key] = sum(pick(row[key] for row in rows) for rows in measured)
    out["generate_short_s"] = sum(min(row["generate_s"] for row in rows) for rows in measured)
    for rank, records in enumerate(ranks):
        out[f"forwards_rank{rank}"] = sum(row["forwards"] for row in records)
        out[f"tokens_rank{rank}"] = sum(row["longest"] for row in records)
    return out


def table(ranks: list) -> str:
    lines = ["| step | rank | longest completion | forwards in generate | generate s | generation phase s | step s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for step, rows in enumerate(zip(*ranks)):
        for rank, row in enumerate(rows):
            lines.append(f"| {step + 1} | {rank} | {row['longest']} | {row['forwards']} | {row['generate_s']:.3f} "
                         f"| {row['rollout_s']:.3f} | {row['step_s']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", choices=["odc", "3"], required=True)
    parser.add_argument("--no-gather", action="store_true",
                        help="ds3_gather_for_generation=False (default: TRL's True)")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps (the first is not summed)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter of the suite's TRL venv")
    parser.add_argument("--timeout-s", type=int, default=900)
    args = parser.parse_args(argv)
    name = "grpo_long_nogather" if args.no_gather else "grpo_long"
    scenario = next(s for s in SCENARIOS if s.env == "trl" and s.argv[-1] == name)
    with tempfile.TemporaryDirectory(prefix="ds_odc_grpo_") as work:
        model_dir = os.path.join(work, "model")
        subprocess.run([args.python, "-c", f"import common; common.write_tiny_model({model_dir!r})"], cwd=SCRIPTS,
                       check=True, capture_output=True)
        result = run_route(scenario, scenario.route if args.stage == "odc" else "3", args.python, model_dir, work,
                           SimpleNamespace(steps=args.steps, timeout_s=args.timeout_s))
        if result["code"] != 0 or "rollouts" not in result:
            with open(result["log"]) as log:
                sys.stderr.write(log.read()[-4000:])
            raise SystemExit(f"the {name} run on stage {args.stage} exited {result['code']}")
    ranks = result["rollouts"]
    print(f"{name}, stage {args.stage}, engines {sorted({row['engine'] for row in result['engines']})}, "
          f"losses {[round(x, 6) for x in result['losses']]}, wall {result['wall_s']:.1f} s")
    print(table(ranks))
    print(json.dumps({"stage": args.stage, "scenario": name, **figures(ranks)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
