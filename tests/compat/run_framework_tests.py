"""Post-training frameworks on ODC: each scenario run twice on 2 CPU ranks, once asking for the odc stage
the way that framework's users can, once on ZeRO-3, on the same data; the losses are compared step by step.

Opt-in (CI does not run it: it installs frameworks). Each framework gets a virtual environment of its own
(``--venv-root``, outside the checkout) made as its users would make it: torch 2.13.0 first, with a
constraints file holding torch at 2.13.0 for every later install (a framework that asks for another torch
fails to install instead of downloading one); then ONE pip install of the framework at its release together
with ds_odc (``-e <checkout>[hf]``), so pip's resolver meets the framework's own requirements and ds_odc's
declared ranges at once: no DeepSpeed, transformers or accelerate is forced (OpenRLHF pins deepspeed 0.19.6 and
transformers 5.15.0 itself). A requirement that cannot be met on this CPU machine is named in ``unmet`` with the
reason; the framework's other requirements are then resolved the same way and the framework itself installed
after them without dependencies. The runs put this checkout first on ``PYTHONPATH``, so they test this
checkout's ds_odc even in a venv built from another one. The
scenarios are small scripts in ``tests/compat/frameworks/``; a probe (``frameworks/probe/sitecustomize.py``)
records which engine every ``deepspeed.initialize`` built, and a route whose engines are not the ones asked
for fails, whatever its losses.

    python tests/compat/run_framework_tests.py                         # set up what is missing, run all
    python tests/compat/run_framework_tests.py --only trl/dpo --steps 6
    python tests/compat/run_framework_tests.py --setup-only

Prints a markdown table: framework, version, scenario, route, steps, max |loss diff|, max |grad-norm diff|,
the engines seen, pass/fail, wall time of both runs. Exits 1 if a scenario fails.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKOUT = os.path.dirname(os.path.dirname(HERE))
SCRIPTS = os.path.join(HERE, "frameworks")
PROBE_DIR = os.path.join(SCRIPTS, "probe")
STUBS_DIR = os.path.join(SCRIPTS, "stubs")
TORCH = "torch==2.13.0"
TOLERANCE = 1e-4  # |loss diff|; fp32 ODC and ZeRO-3 differ by summation order only (docs/normalisation.md, Numerics)
WEIGHT_TOLERANCE = 1e-3  # |diff| of per-tensor sums of saved weights (sums of up to ~25k fp32 values)


@dataclass
class Env:
    """One framework's virtual environment: ``framework`` (its release) resolved by pip together with ds_odc and
    ``extra`` (what a scenario needs that the framework does not declare), its ``unmet`` requirements left out
    with the reason (the framework then installed without dependencies, after the rest were resolved)."""
    name: str
    framework: str
    extra: list = field(default_factory=list)
    unmet: dict = field(default_factory=dict)  # requirement name -> why it cannot be met here
    stubs: bool = False  # put frameworks/stubs (an empty torchaudio) on PYTHONPATH

    @property
    def version(self) -> str:
        return self.framework.replace("==", " ")

    def spec(self) -> dict:
        return {"torch": TORCH, "framework": self.framework, "extra": self.extra, "unmet": sorted(self.unmet),
                "checkout": CHECKOUT}

    @staticmethod
    def same_packages(recorded: dict, wanted: dict) -> bool:
        """A venv built from another checkout is reused: the runs import ds_odc from this one (``PYTHONPATH``)."""
        return {k: v for k, v in recorded.items() if k != "checkout"} == {k: v for k, v in wanted.items()
                                                                          if k != "checkout"}


NO_TORCH_PAIR = "no release pairs with torch 2.13.0 (each pins the torch it was built with)"
CUDA_BUILD_ONLY = ("its one release for torch 2.13.0 (0.28.0) is a CUDA build whose operators do not load with the "
                   "CPU torch, and transformers imports it whenever it is installed")
ENVS = {env.name: env for env in (
    Env("trl", "trl==1.16.0"),
    # OpenRLHF itself needs CUDA to run (the OpenRLHF-shaped loop stands in for it), but its pinned stack installs
    Env("openrlhf", "openrlhf==0.11.2", unmet={"flash-attn": "builds CUDA kernels: needs nvcc and a CUDA torch"}),
    Env("llamafactory", "llamafactory==0.9.5", unmet={"torchaudio": NO_TORCH_PAIR, "torchvision": CUDA_BUILD_ONLY},
        stubs=True),
    # ArcticTraining's own requirements leave peft and datasets open; its transformers<5 code needs these
    Env("arctic", "arctic-training==0.8.0", extra=["peft<0.19", "datasets>=4,<5"]),
)}
@dataclass
class Scenario:
    """``argv`` after the interpreter; ``torchrun`` starts 2 ranks, else the script starts them itself.
    ``route`` is compared with the baseline route "3"; ``route_env`` / ``base_env`` are set for each."""
    framework: str
    env: str
    name: str
    argv: list
    route: str = "odc"
    torchrun: bool = True
    route_env: dict = field(default_factory=dict)
    base_env: dict = field(default_factory=dict)


def _trl(name):
    return Scenario("TRL", "trl", name, ["trl_scenarios.py", name])


AXOLOTL = {"ACCELERATE_USE_DEEPSPEED": "true"}  # what axolotl exports; ZERO3_INIT only when the stage is exactly 3
SCENARIOS = [
    _trl("sft"), _trl("dpo"), _trl("grpo"), _trl("dpo_balance"), _trl("grpo_long"), _trl("grpo_long_nogather"),
    Scenario("LLaMA-Factory", "llamafactory", "sft", ["llamafactory_driver.py", "sft"], "marker", torchrun=False),
    Scenario("LLaMA-Factory", "llamafactory", "dpo", ["llamafactory_driver.py", "dpo"], "marker", torchrun=False),
    Scenario("OpenRLHF-shaped loop", "openrlhf", "dynamic batches", ["openrlhf_loop.py"], "env",
             route_env={"DS_ODC_STAGE3": "odc", "DS_ODC_OPTIONS": '{"timeout_s": 120}'}),
    Scenario("accelerate (axolotl's variables)", "trl", "sft", ["accelerate_env.py"], "env",
             route_env={**AXOLOTL, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "odc"},
             base_env={**AXOLOTL, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3", "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true"}),
    Scenario("ArcticTraining", "arctic", "sft", ["arctic_driver.py", "sft"], "odc", torchrun=False),
    Scenario("ArcticTraining", "arctic", "sft (marker form)", ["arctic_driver.py", "sft_marker"], "marker",
             torchrun=False),
]


# -- environments ---------------------------------------------------------------------------------------
def ensure_env(env: Env, root: str) -> str:
    """The venv's python, building the venv when its recorded spec differs from ``env.spec()``."""
    path = os.path.join(root, env.name)
    python, stamp = os.path.join(path, "bin", "python"), os.path.join(path, "ds_odc_compat.json")
    if os.path.exists(stamp):
        with open(stamp) as handle:
            if Env.same_packages(json.load(handle), env.spec()):
                return python
    print(f"setting up {path} ({env.version})", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", path], check=True)
    constraints = os.path.join(path, "constraints.txt")
    with open(constraints, "w") as handle:
        handle.write(TORCH + "\n")
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "--upgrade", "pip", "setuptools", "wheel"], check=True)
    subprocess.run([*pip, TORCH], check=True)
    # DeepSpeed builds against the installed torch, so nothing is built in isolation (that would pull a torch)
    resolve = [*pip, "-c", constraints, "--no-build-isolation", "-e", f"{CHECKOUT}[hf]", *env.extra]
    if not env.unmet:
        subprocess.run([*resolve, env.framework], check=True)
    else:
        subprocess.run([*resolve, *declared_requirements(env, python, path)], check=True)
        subprocess.run([*pip, "--no-deps", env.framework], check=True)
    with open(stamp, "w") as handle:
        json.dump(env.spec(), handle)
    return python


def declared_requirements(env: Env, python: str, scratch: str) -> list:
    """The framework's own requirements (its wheel's metadata), less ``env.unmet`` and optional extras."""
    wheels = os.path.join(scratch, "framework_wheel")
    subprocess.run([python, "-m", "pip", "download", "-q", "--no-deps", "-d", wheels, env.framework], check=True)
    from email.parser import Parser
    from zipfile import ZipFile

    (wheel,) = [os.path.join(wheels, name) for name in os.listdir(wheels) if name.endswith(".whl")]
    with ZipFile(wheel) as archive:
        (metadata,) = [name for name in archive.namelist() if name.endswith(".dist-info/METADATA")]
        declared = Parser().parsestr(archive.read(metadata).decode()).get_all("Requires-Dist") or []
    kept = []
    for requirement in declared:
        name = re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0].lower().replace("_", "-")
        if "extra ==" in requirement or name in env.unmet:
            continue
        kept.append(requirement)
    print(f"{env.framework}: its {len(kept)} requirements resolved with ds_odc; left out: "
          + "; ".join(f"{name} ({why})" for name, why in env.unmet.items()), flush=True)
    return kept


# -- one run --------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_route(scenario: Scenario, route: str, python: str, model_dir: str, work: str, args) -> dict:
    """One run of ``scenario`` on ``route``; returns its result file plus the engines the probe saw."""
    tag = f"{scenario.env}_{scenario.argv[-1]}_{route}".replace(" ", "_").replace(".py", "")
    out, probe, log = (os.path.join(work, f"{tag}.{ext}") for ext in ("json", "probe", "log"))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "DS_ODC_COMPAT_ROUTE": route,
           "DS_ODC_COMPAT_OUT": out, "DS_ODC_COMPAT_PROBE": probe, "DS_ODC_COMPAT_CPU_COMM": "1",
           "DS_ODC_COMPAT_STEPS": str(args.steps), "MASTER_PORT": str(free_port()), "WANDB_MODE": "disabled",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([CHECKOUT, PROBE_DIR] + ([STUBS_DIR] if ENVS[scenario.env].stubs else [])),
           **(scenario.route_env if route != "3" else scenario.base_env)}
    for name in ("DS_ODC_STAGE3", "DS_ODC_OPTIONS", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_ZERO_STAGE",
                 "ACCELERATE_DEEPSPEED_ZERO3_INIT"):
        if name not in (scenario.route_env if route != "3" else scenario.base_env):
            env.pop(name, None)
    for stale in (out, probe):
        if os.path.exists(stale):
            os.remove(stale)
    script = [os.path.join(SCRIPTS, scenario.argv[0]), *scenario.argv[1:], model_dir, os.path.join(work, tag)]
    launch = ([python, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", env["MASTER_PORT"]]
              if scenario.torchrun else [python])
    started = time.monotonic()
    with open(log, "w") as handle:
        try:
            code = subprocess.run([*launch, *script], env=env, stdout=handle, stderr=subprocess.STDOUT,
                                  timeout=args.timeout_s).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    result = {"wall_s": time.monotonic() - started, "code": code, "log": log, "engines": []}
    if os.path.exists(out):
        with open(out) as handle:
            result.update(json.load(handle))
    if os.path.exists(probe):
        with open(probe) as handle:
            result["engines"] = [json.loads(line) for line in handle if line.strip()]
    return result


def engines_ok(result: dict, want_odc: bool) -> bool:
    kinds = {row["engine"] for row in result["engines"]}
    return bool(kinds) and kinds == ({"ODCEngine"} if want_odc else {"DeepSpeedEngine"})


def engine_summary(result: dict) -> str:
    rows = [row for row in result["engines"] if row["rank"] == 0]
    return " + ".join(f"{row['engine']}{' (frozen)' if row.get('frozen') else ''}" for row in rows) or "none"


def max_diff(a: list, b: list):
    if not a or len(a) != len(b):
        return None
    return max(abs(x - y) for x, y in zip(a, b))


def weights_diff(a, b):
    """Max difference of the per-tensor sums a scenario reports for its saved weights (``weights``: {name:
    [sum, sum of |x|]}); inf when the tensor names differ, None when the scenario saves nothing."""
    if a is None and b is None:
        return None
    if a is None or b is None or set(a) != set(b):
        return float("inf")
    return max(abs(x - y) for name in a for x, y in zip(a[name], b[name]))


def resolved_stack(python: str) -> str:
    """``deepspeed / transformers / accelerate`` as pip resolved them in the environment."""
    code = ("import importlib.metadata as m\n"
            "print(' / '.join(m.version(p) for p in ('deepspeed', 'transformers', 'accelerate')))")
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def compare(scenario: Scenario, python: str, model_dir: str, work: str, args) -> dict:
    odc = run_route(scenario, scenario.route, python, model_dir, work, args)
    zero3 = run_route(scenario, "3", python, model_dir, work, args)
    loss = max_diff(odc.get("losses"), zero3.get("losses"))
    norms = max_diff(odc.get("grad_norms"), zero3.get("grad_norms"))
    problems = [f"{label} exited {r['code']} (log: {r['log']})" for label, r in (("route", odc), ("zero-3", zero3))
                if r["code"] != 0]
    if not problems and loss is None:
        problems.append(f"losses missing or of different lengths: {odc.get('losses')} vs {zero3.get('losses')}")
    if not problems and loss > TOLERANCE:
        problems.append(f"losses differ by {loss:.3g} > {TOLERANCE}")
    weights = weights_diff(odc.get("weights"), zero3.get("weights"))
    if not problems and weights is not None and weights > WEIGHT_TOLERANCE:
        problems.append(f"saved weights differ: max |per-tensor sum diff| {weights:.3g} > {WEIGHT_TOLERANCE}")
    if not engines_ok(odc, True):
        problems.append(f"route {scenario.route} built {engine_summary(odc)}, not ODCEngine")
    if not engines_ok(zero3, False):
        problems.append(f"baseline built {engine_summary(zero3)}, not DeepSpeedEngine")
    return {"framework": scenario.framework, "version": ENVS[scenario.env].version, "scenario": scenario.name,
            "stack": resolved_stack(python),
            "route": scenario.route, "steps": len(odc.get("losses") or []), "loss_diff": loss, "norm_diff": norms,
            "engines": engine_summary(odc), "micro_batches": " ".join(odc.get("micro_batches") or []),
            "weights_diff": weights, "ok": not problems, "problems": problems,
            "wall_s": (odc["wall_s"], zero3["wall_s"])}


def table(rows: list) -> str:
    def num(value):
        return "-" if value is None else f"{value:.1e}"

    lines = ["| framework | version | deepspeed / transformers / accelerate (resolved) | scenario | route | steps "
             "| max \\|loss diff\\| | max \\|grad-norm diff\\| | engines (rank 0) | result | wall s (route / zero-3) |",
             "|" + " --- |" * 11]
    for row in rows:
        lines.append(f"| {row['framework']} | {row['version']} | {row['stack']} | {row['scenario']} | {row['route']} "
                     f"| {row['steps']} "
                     f"| {num(row['loss_diff'])} | {num(row['norm_diff'])} | {row['engines']} "
                     f"| {'pass' if row['ok'] else 'FAIL'} | {row['wall_s'][0]:.0f} / {row['wall_s'][1]:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv-root", default=os.path.expanduser("~/.cache/ds_odc_compat"),
                        help="where the per-framework virtual environments live (outside the checkout)")
    parser.add_argument("--only", action="append", default=[],
                        help="run scenarios whose 'env/scenario-script-argument' contains this (repeatable)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run")
    parser.add_argument("--timeout-s", type=int, default=900, help="bound on one run")
    parser.add_argument("--setup-only", action="store_true", help="build the environments and stop")
    parser.add_argument("--workdir", help="keep models, outputs and logs here (default: a temporary directory)")
    args = parser.parse_args(argv)
    chosen = [s for s in SCENARIOS if not args.only or any(o in f"{s.env}/{s.argv[-1]}" for o in args.only)]
    pythons = {name: ensure_env(ENVS[name], args.venv_root) for name in sorted({s.env for s in chosen})}
    if args.setup_only:
        return 0
    with tempfile.TemporaryDirectory(prefix="ds_odc_frameworks_") as scratch:
        work = os.path.abspath(args.workdir or scratch)
        os.makedirs(work, exist_ok=True)
        rows = []
        for scenario in chosen:
            python = pythons[scenario.env]
            model_dir = os.path.join(work, f"model_{scenario.env}")
            subprocess.run([python, "-c", f"import common; common.write_tiny_model({model_dir!r})"], cwd=SCRIPTS,
                           check=True, capture_output=True)
            row = compare(scenario, python, model_dir, work, args)
            rows.append(row)
            saved = "" if row["weights_diff"] is None else \
                f"saved weights: max |per-tensor sum diff| {row['weights_diff']:.1e} "
            print(f"{row['framework']} {row['scenario']}: {'pass' if row['ok'] else 'FAIL'} "
                  f"{'; '.join(row['problems'])} {saved}{row['micro_batches']}", flush=True)
        print("\n" + table(rows))
    failed = [row for row in rows if not row["ok"]]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} scenarios pass")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
