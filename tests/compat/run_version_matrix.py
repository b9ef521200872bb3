"""The releases ds_odc declares, each tested against its own ZeRO-3: a virtual environment per stack, then
subsets of the test suite run in it.

Opt-in (CI does not run it: it installs DeepSpeed releases). One stack per DeepSpeed release at the edges of the
declared range and where its private names change (0.18.0, the newest 0.18 patch, 0.19.0, 0.19.6, 0.19.8), each with
the newest transformers and accelerate; then the two ends of the transformers / accelerate range on DeepSpeed
0.19.8; then a release below the range, which must be refused at ``import ds_odc``. The "split policy" subset runs
the split runtime's tests (balance policy "lb-mini-split"); on a release that refuses the policy by name
(``require_feature``, e.g. DeepSpeed before 0.18.2) its cell passes as "refused by name" only if every failing test
failed on that refusal at ``initialize``. Then the torch axis: DeepSpeed 0.19.8 with the newest transformers and
accelerate on each torch release of ``TORCH_RELEASES`` (the GPU machine's 2.11.0, the development environment's
2.13.0, the newest release on PyPI), each with the parity, uneven-count, checkpoint, frozen-engine, offload_states
and Trainer subsets. Every environment is made the way a user makes one: the stack's torch first (2.13.0 but on
the torch axis), held there by a constraints file (a package that asks for another torch fails to install instead
of downloading one), then the stack's pins, then ds_odc from this checkout through pip's resolver (so its declared
ranges must admit the stack). The torch wheel is the one pip's configured indexes serve (PyPI's Linux wheel is a
CUDA build, which runs on the CPU as well; ``--torch-index`` names another index, e.g. PyTorch's CPU one); the table
names the build installed. A stack whose environment cannot be made (a torch the pins refuse) is a row of its own
with pip's reason, not an abort. The runs put this checkout first on ``PYTHONPATH``: they test this checkout even in
an environment built from another one. Each subset is run against that release's own ZeRO-3: the parity,
checkpoint and Trainer tests run ZeRO-3 and ODC side by side in the same environment.

    python tests/compat/run_version_matrix.py                       # set up what is missing, run everything
    python tests/compat/run_version_matrix.py --only 0.18.9 --subset parity
    python tests/compat/run_version_matrix.py --setup-only
    python tests/compat/run_version_matrix.py --torch 2.11.0 --torch 2.15.0  # only the torch axis, these releases

Prints a markdown table (stacks by subsets, passed / failed / skipped counts) with the command and the date,
for docs/frameworks.md. Exits 1 if any cell fails.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKOUT = os.path.dirname(os.path.dirname(HERE))
TORCH_DEFAULT = "2.13.0"  # every stack's torch but the torch axis's
TORCH = f"torch=={TORCH_DEFAULT}"
TEST_TOOLS = ["pytest>=8", "hypothesis==6.170.15"]

#: subset -> the test files it runs (from the checkout root). Each compares ODC with ZeRO-3 or one process.
SUBSETS = {
    "surface": ["tests/unit/test_surface.py", "tests/unit/test_hf_versions.py"],
    "parity": ["tests/distributed/test_parity.py"],
    "uneven counts": ["tests/distributed/test_uneven.py"],
    "checkpoint": ["tests/distributed/test_checkpoint.py"],
    "frozen engines": ["tests/distributed/test_frozen_engines.py"],
    "offload_states": ["tests/distributed/test_offload_states.py"],
    "HF Trainer": ["tests/distributed/test_hf_trainer.py"],
    "split policy": ["tests/unit/test_split_runtime.py", "tests/distributed/test_split_runtime.py"],
}
#: subset -> the Feature (its constant in ds_odc/integration/surface_table.py) it exercises. Where the release
#: refuses that feature (require_feature), the cell passes only if every failing test failed on that refusal.
FEATURE_SUBSETS = {"split policy": "SPLIT_POLICY"}
DEEPSPEED_SUBSETS = [s for s in SUBSETS if s != "offload_states"]
#: the torch axis's subsets (the split policy's tests exercise DeepSpeed's Ulysses, not torch)
TORCH_SUBSETS = ["surface", "parity", "uneven counts", "checkpoint", "frozen engines", "offload_states", "HF Trainer"]
HF_SUBSETS = ["surface", "HF Trainer"]
REFUSED = "refused at import"


@dataclass
class Stack:
    """One environment: its pins (besides torch and the test tools) and the subsets run in it."""
    name: str
    deepspeed: str
    transformers: str
    accelerate: str
    subsets: list = field(default_factory=lambda: list(DEEPSPEED_SUBSETS))
    torch: str = TORCH_DEFAULT

    @property
    def pins(self) -> list:
        return [f"deepspeed=={self.deepspeed}", f"transformers=={self.transformers}",
                f"accelerate=={self.accelerate}", *TEST_TOOLS]

    @property
    def torch_pin(self) -> str:
        return f"torch=={self.torch}"

    @property
    def venv_name(self) -> str:
        name = f"ds{self.deepspeed}-tf{self.transformers}-acc{self.accelerate}"
        return name if self.torch == TORCH_DEFAULT else f"torch{self.torch}-{name}"

    def spec(self, torch_index: str = "") -> dict:
        return {"torch": self.torch_pin, "pins": self.pins, "installs_ds_odc": self.installs_ds_odc,
                **({"torch_index": torch_index} if torch_index else {})}

    @property
    def installs_ds_odc(self) -> bool:
        """A release below the range cannot have ds_odc installed beside it: pip refuses, which is the point."""
        return REFUSED not in self.subsets


NEWEST_TF, NEWEST_ACC = "5.23.0", "1.15.0"
OLDEST_TF, OLDEST_ACC = "4.57.1", "1.11.0"
#: the torch axis: the GPU machine's release (docs/gpu.md), the development environment's, the newest on PyPI
TORCH_RELEASES = {"2.11.0": "the GPU machine's", TORCH_DEFAULT: "development", "2.15.0": "newest"}


def torch_stack(release: str) -> Stack:
    """DeepSpeed 0.19.8 with the newest transformers and accelerate on ``release`` of torch."""
    why = TORCH_RELEASES.get(release)
    return Stack(f"torch {release}" + (f" ({why})" if why else ""), "0.19.8", NEWEST_TF, NEWEST_ACC,
                 list(TORCH_SUBSETS), release)


STACKS = [
    Stack("deepspeed 0.18.0 (oldest)", "0.18.0", NEWEST_TF, NEWEST_ACC),
    Stack("deepspeed 0.18.9 (newest 0.18)", "0.18.9", NEWEST_TF, NEWEST_ACC),
    Stack("deepspeed 0.19.0", "0.19.0", NEWEST_TF, NEWEST_ACC),
    Stack("deepspeed 0.19.6 (OpenRLHF 0.11.2's pin)", "0.19.6", NEWEST_TF, NEWEST_ACC),
    Stack("deepspeed 0.19.8", "0.19.8", NEWEST_TF, NEWEST_ACC),
    Stack(f"transformers {OLDEST_TF} + accelerate {OLDEST_ACC} (oldest)", "0.19.8", OLDEST_TF, OLDEST_ACC,
          list(HF_SUBSETS)),
    Stack(f"transformers {NEWEST_TF} + accelerate {NEWEST_ACC} (newest)", "0.19.8", NEWEST_TF, NEWEST_ACC,
          list(HF_SUBSETS)),
    Stack("deepspeed 0.17.6 (below the range)", "0.17.6", NEWEST_TF, NEWEST_ACC, [REFUSED]),
    *(torch_stack(release) for release in TORCH_RELEASES),
]


# -- environments ---------------------------------------------------------------------------------------
class SetupFailed(Exception):
    """pip could not make a stack's environment: the stack's row says why."""


def _pip(python: str, constraints: str, *args: str) -> None:
    """``pip install`` in the environment with its constraints file as pip's only one: PIP_CONSTRAINT replaces a
    constraints file from pip's configuration (a machine's cap on torch would otherwise be added to it)."""
    done = subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
                          env={**os.environ, "PIP_CONSTRAINT": constraints}, capture_output=True, text=True)
    if done.returncode:
        lines = [line for line in (done.stdout + done.stderr).splitlines()
                 if line.strip() and "is ignored: it is neither a file nor a directory" not in line]
        raise SetupFailed(f"pip install {' '.join(args)}:\n" + "\n".join(lines[-25:]))


def ensure_env(stack: Stack, root: str, torch_index: str = "") -> str:
    """The venv's python, building the venv when its recorded spec differs from ``stack.spec()``."""
    path = os.path.join(root, stack.venv_name)
    python, stamp = os.path.join(path, "bin", "python"), os.path.join(path, "ds_odc_matrix.json")
    if os.path.exists(stamp):
        with open(stamp) as handle:
            if json.load(handle) == stack.spec(torch_index):
                return python
    print(f"setting up {path}", flush=True)
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", "--clear", path], check=True)
    constraints = os.path.join(path, "constraints.txt")
    with open(constraints, "w") as handle:
        handle.write(stack.torch_pin + "\n")
    _pip(python, constraints, "--upgrade", "pip", "setuptools", "wheel")
    _pip(python, constraints, *(["--index-url", torch_index] if torch_index else []), stack.torch_pin)
    # DeepSpeed builds against the installed torch: without build isolation (an isolated build pulls a torch)
    _pip(python, constraints, "--no-build-isolation", *stack.pins)
    if stack.installs_ds_odc:
        _pip(python, constraints, "--no-build-isolation", "-e", CHECKOUT)
    with open(stamp, "w") as handle:
        json.dump(stack.spec(torch_index), handle)
    print(f"set up {path} in {time.monotonic() - started:.0f} s", flush=True)
    return python


def _env(python: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ODC_STAGE3", "DS_ODC_OPTIONS")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=CHECKOUT, HF_HUB_OFFLINE="1",
               TORCH_EXTENSIONS_DIR=os.path.join(os.path.dirname(os.path.dirname(python)), "torch_extensions"))
    return env


#: DeepSpeed's JIT-built CPU operators the subsets use (the offload_states tests' Adam is FusedAdam, or
#: DeepSpeedCPUAdam with the optimizer offloaded)
DEEPSPEED_OPERATORS = {"deepspeed_shm_comm": "ShareMemCommBuilder", "fused_adam": "FusedAdamBuilder",
                       "cpu_adam": "CPUAdamBuilder"}


def build_operators(python: str) -> None:
    """Build DeepSpeed's CPU communication operator, FusedAdam and CPU Adam, and ds_odc's memory-ordering operator,
    in the environment's extensions directory before any test runs. Ranks would otherwise build them on first use,
    inside a test's hang timeout on a loaded machine (CPU Adam took 3 min 48 s there once, and its test timed out):
    a build killed there leaves its lock behind, and every later rank of that environment waits on the lock until
    its test times out. A lock found here is such a leftover (this runner is the directory's only user): the build,
    perhaps cut short, is done again."""
    for name in DEEPSPEED_OPERATORS:
        build = os.path.join(_env(python)["TORCH_EXTENSIONS_DIR"], name)
        if os.path.exists(os.path.join(build, "lock")):
            print(f"removing {build}: a killed build left its lock there", flush=True)
            shutil.rmtree(build)
    code = ("import sys; sys.path.insert(0, sys.argv[1])\n"
            "from deepspeed.accelerator import get_accelerator\n"
            "for builder in sys.argv[2:]:\n    assert get_accelerator().create_op_builder(builder).load() is not None\n"
            "from ds_odc.ops_builder import ATOMICS, load_op\nload_op(ATOMICS)\n")
    subprocess.run([python, "-c", code, CHECKOUT, *DEEPSPEED_OPERATORS.values()], env=_env(python), check=True,
                   capture_output=True, timeout=1800)


def installed(python: str) -> dict:
    """The releases the environment really has (the resolver may have moved a pin's neighbours), and the build of
    its torch (a CUDA build from PyPI, or a CPU one)."""
    code = ("import importlib.metadata as m, json, torch\n"
            "found = {p: m.version(p) for p in ('torch', 'deepspeed', 'transformers', 'accelerate')}\n"
            "cuda = torch.version.cuda\n"
            "found['torch'] += f' (CUDA {cuda} build)' if cuda else '' if '+cpu' in found['torch'] else ' (CPU)'\n"
            "print(json.dumps(found))")
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True, env=_env(python))
    return json.loads(done.stdout)


# -- one cell -------------------------------------------------------------------------------------------
def feature_refusal(python: str, key: str) -> str:
    """The first line of the ODCConfigError ``require_feature`` raises for the feature ``key`` in the environment,
    or "" where the feature is not refused there."""
    code = ("import sys; sys.path.insert(0, sys.argv[1])\n"
            "from ds_odc.errors import ODCConfigError\n"
            "from ds_odc.integration import surface, surface_table\n"
            "try:\n    surface.require_feature(getattr(surface_table, sys.argv[2]))\n"
            "except ODCConfigError as err:\n    print(str(err).splitlines()[0])\n")
    done = subprocess.run([python, "-c", code, CHECKOUT, key], capture_output=True, text=True, check=True,
                          env={**_env(python), "DS_ODC_AUTOLOAD": "0"}, timeout=300)
    return done.stdout.strip()


def _failures(suite) -> dict:
    """``{test id: text}`` of each failing or erring test case of a junit report."""
    found = {}
    for case in suite.iter("testcase"):
        for bad in list(case.findall("failure")) + list(case.findall("error")):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            found[name] = found.get(name, "") + f"{bad.get('message', '')}\n{bad.text or ''}"
    return found


def run_subset(python: str, subset: str, work: str, timeout_s: int, refusal: str = "") -> dict:
    report = os.path.join(work, "junit.xml")
    if os.path.exists(report):
        os.remove(report)
    cmd = [python, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={report}", *SUBSETS[subset]]
    started = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=CHECKOUT, env=_env(python), capture_output=True, text=True, timeout=timeout_s)
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as err:
        code, output = "timeout", str(err.stdout or "")
    counts = {"passed": 0, "failed": 0, "skipped": 0, "refused": 0}
    unexpected: list = []  # on a release that refuses the feature: the tests that failed otherwise
    if os.path.exists(report):
        suite = ET.parse(report).getroot()
        suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
        total = int(suite.get("tests", 0))
        counts["failed"] = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        counts["skipped"] = int(suite.get("skipped", 0))
        counts["passed"] = total - counts["failed"] - counts["skipped"]
        if refusal:  # the feature is refused on this release: its tests fail on that refusal, and only on it
            # its head, or its tail where pytest's repr of a rank's error cut the middle out
            fragments = (refusal.split(";")[0].split(" (")[0], refusal[-60:])
            failures = _failures(suite)
            unexpected = [f"{name}: {text.strip().splitlines()[0] if text.strip() else ''}"
                          for name, text in failures.items() if not any(f in text for f in fragments)]
            counts["refused"] = len(failures) - len(unexpected)
            counts["failed"] -= counts["refused"]
    if refusal:
        ok = code in (0, 1) and counts["refused"] > 0 and counts["failed"] == 0
    else:
        ok = code == 0 and counts["passed"] > 0 and counts["failed"] == 0
    named = "\n".join(["failed other than on the refusal:", *unexpected, ""]) if unexpected else ""
    return {**counts, "ok": ok, "code": code, "wall_s": time.monotonic() - started,
            "tail": "" if ok else named + output[-3000:]}


def check_refused(python: str) -> dict:
    """``import ds_odc`` from this checkout must raise ImportError naming the declared range."""
    from_checkout = "import sys; sys.path.insert(0, sys.argv[1]); import ds_odc"
    started = time.monotonic()
    done = subprocess.run([python, "-c", from_checkout, CHECKOUT], capture_output=True, text=True,
                          env={**_env(python), "DS_ODC_AUTOLOAD": "0"}, timeout=300)
    last = (done.stderr.strip().splitlines() or [""])[-1]
    ok = done.returncode != 0 and "ImportError" in done.stderr and "deepspeed>=" in done.stderr
    return {"passed": int(ok), "failed": int(not ok), "skipped": 0, "refused": 0, "ok": ok, "code": done.returncode,
            "wall_s": time.monotonic() - started, "tail": last if ok else done.stderr[-3000:], "message": last}


def cell(result: dict | None) -> str:
    if result is None:
        return "-"
    if result.get("setup"):
        return "not installable (below the table)"
    counts = f"{result['passed']} passed" + (f", {result['failed']} failed" if result["failed"] else "") + \
        (f", {result['skipped']} skipped" if result["skipped"] else "")
    if result.get("refused"):
        return f"{'refused by name' if result['ok'] else 'FAIL'} ({result['refused']} refused at initialize, {counts})"
    return f"{'pass' if result['ok'] else 'FAIL'} ({counts})"


def table(rows: list, subsets: list) -> str:
    lines = ["| stack | torch / deepspeed / transformers / accelerate | " + " | ".join(subsets) + " |",
             "|" + " --- |" * (len(subsets) + 2)]
    for stack, versions, results in rows:
        found = " / ".join(versions.get(p, "not installed") for p in ("torch", "deepspeed", "transformers",
                                                                       "accelerate"))
        lines.append(f"| {stack.name} | {found} | " + " | ".join(cell(results.get(s)) for s in subsets) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv-root", default=os.path.expanduser("~/.cache/ds_odc_matrix"),
                        help="where the per-stack virtual environments live (outside the checkout)")
    parser.add_argument("--only", action="append", default=[], help="stacks whose name contains this (repeatable)")
    parser.add_argument("--torch", action="append", default=[], metavar="RELEASE",
                        help="only the torch axis, on these torch releases (repeatable; any release pip can install)")
    parser.add_argument("--torch-index", default="", metavar="URL",
                        help="the index torch is installed from (default: pip's configured indexes)")
    parser.add_argument("--subset", action="append", default=[], choices=[*SUBSETS, REFUSED],
                        help="run only these subsets (repeatable)")
    parser.add_argument("--timeout-s", type=int, default=1200, help="bound on one subset's pytest run")
    parser.add_argument("--setup-only", action="store_true", help="build the environments and stop")
    args = parser.parse_args(argv)
    stacks = [torch_stack(release) for release in args.torch] if args.torch else STACKS
    stacks = [s for s in stacks if not args.only or any(o in s.name for o in args.only)]
    pythons, unmade = {}, {}  # stack name -> its python; -> why its environment could not be made
    for stack in stacks:
        try:
            pythons[stack.name] = ensure_env(stack, args.venv_root, args.torch_index)
        except SetupFailed as err:
            unmade[stack.name] = str(err)
            print(f"{stack.name}: its environment could not be made: {err}", flush=True)
    for python in dict.fromkeys(pythons.values()):
        build_operators(python)
    if args.setup_only:
        return 1 if unmade else 0
    started = datetime.datetime.now(datetime.timezone.utc)
    rows, cache = [], {}  # (venv, subset) -> result: two stacks on one environment run a subset once
    with tempfile.TemporaryDirectory(prefix="ds_odc_matrix_") as work:
        for stack in stacks:
            if stack.name in unmade:
                failed_setup = {"setup": unmade[stack.name], "ok": False}
                rows.append((stack, {}, {s: failed_setup for s in stack.subsets
                                         if not args.subset or s in args.subset}))
                continue
            python, results = pythons[stack.name], {}
            for subset in stack.subsets:
                if args.subset and subset not in args.subset:
                    continue
                key = (stack.venv_name, subset)
                if key not in cache:
                    refusal = feature_refusal(python, FEATURE_SUBSETS[subset]) if subset in FEATURE_SUBSETS else ""
                    if refusal:
                        print(f"{stack.name} / {subset}: the release refuses it: {refusal}", flush=True)
                    cache[key] = check_refused(python) if subset == REFUSED else \
                        run_subset(python, subset, work, args.timeout_s, refusal)
                results[subset] = result = cache[key]
                print(f"{stack.name} / {subset}: {cell(result)} in {result['wall_s']:.0f} s", flush=True)
                if result.get("message"):
                    print(f"    {result['message']}", flush=True)
                if not result["ok"]:
                    print(result["tail"], flush=True)
            rows.append((stack, installed(python), results))
    subsets = [s for s in [*SUBSETS, REFUSED] if any(s in results for _, _, results in rows)]
    command = " ".join(["python", "tests/compat/run_version_matrix.py", *map(shlex.quote, argv or sys.argv[1:])])
    print(f"\n`{command}`, {started:%Y-%m-%d}, Python {platform.python_version()}, CPU (gloo, 2 ranks)\n")
    print(table(rows, subsets))
    for name, why in unmade.items():
        print(f"\n{name}: not installable:\n{why}")
    failed = [(stack.name, s) for stack, _, results in rows for s, r in results.items() if not r["ok"]]
    print(f"\n{sum(len(r) for _, _, r in rows) - len(failed)} of {sum(len(r) for _, _, r in rows)} cells pass"
          + (f"; failing: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
