"""The package users install: an sdist and a wheel build from a clean copy of the checkout (the wheel also
from the sdist), and the wheel installs into a fresh environment beside a given DeepSpeed, where
``python -m ds_odc report`` and a 2-rank training step run from outside the checkout. The wheel carries the
operators' sources, and the installed (non-editable) package finds them, reports them and can build from them.

Slow (two builds, a fresh virtual environment, a JIT build, a 2-rank run: about 40 s), but it runs in CI: a
wheel that silently drops ``ops/`` or the autoload ``.pth``, or metadata that refuses the DeepSpeed a user has,
is exactly how a user would find out too late.

The fresh environment sees torch and DeepSpeed (the "given DeepSpeed": this interpreter's) through a ``.pth``
line naming this interpreter's site-packages (directories named in a ``.pth`` are put on ``sys.path`` without
running their own ``.pth`` files, so the checkout's editable finder does not come along). pip installs the wheel
with ``--no-index``: its resolver finds ds_odc's requirements (torch, DeepSpeed in the declared range, pydantic,
ninja) already there, or fails; it must never download torch into the new environment.
"""
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zipfile

import pytest

from ds_odc.integration.versions import DEEPSPEED_RANGE
from tests.support.harness import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OP_SOURCES = {"odc_atomics.cpp", "odc_kernels.cu", "odc_kernels.h", "odc_ops.cpp"}

pytestmark = pytest.mark.slow


def _run(args, cwd, env=None, timeout=300):
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{args}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _copy_of_the_checkout(target):
    """The working tree (tracked and untracked, not ignored files): builds leave build/ and
    *.egg-info behind, which must not land in the shared checkout."""
    listed = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT)
    for rel in filter(None, listed.split("\0")):
        source = os.path.join(ROOT, rel)
        if os.path.isfile(source):
            os.makedirs(os.path.dirname(os.path.join(target, rel)), exist_ok=True)
            shutil.copy2(source, os.path.join(target, rel))


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(wheel path, python of a fresh venv with that wheel installed, its site-packages)."""
    work = tempfile.mkdtemp(prefix="ds_odc_wheel_")
    try:
        source, dist, venv = (os.path.join(work, d) for d in ("src", "dist", "venv"))
        _copy_of_the_checkout(source)
        _run([sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_sdist({dist!r})"],
             cwd=source)  # PEP 517's hook, as `python -m build --sdist` calls it
        _run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "--no-index",
              "-q", "-w", dist], cwd=source)
        (wheel,) = [os.path.join(dist, f) for f in os.listdir(dist) if f.endswith(".whl")]
        _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=work)
        python = os.path.join(venv, "bin", "python")
        site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=work).strip()
        with open(os.path.join(site, "zz_ds_odc_test_base.pth"), "w") as pth:
            pth.write(sysconfig.get_paths()["purelib"] + "\n")
        _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-index", "-q", wheel], cwd=work)
        yield wheel, python, site, work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_wheel_carries_the_operator_sources_and_no_projection_tooling(installed):
    wheel, *_ = installed
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.rsplit("/", 1)[-1] for n in names if n.startswith("ds_odc/ops/csrc/")} == OP_SOURCES, names
    assert not [n for n in names if n.startswith(("ds_odc/sim/", "benchmarks/", "tests/"))], names


def test_installed_package_reports_and_builds_from_its_own_sources(installed):
    _, python, site, work = installed
    outside = os.path.join(work, "elsewhere")  # not the checkout: '' on sys.path must not find it
    os.makedirs(outside)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=os.path.join(work, "extensions"))
    before = json.loads(_run([python, "-m", "ds_odc", "report", "--json"], cwd=outside, env=env))
    package = os.path.join(site, "ds_odc")
    assert package in before["versions"]["ds_odc"], before["versions"]
    for op in before["ops"]:
        assert op["sources"] == os.path.join(package, "ops", "csrc"), op
        assert not op["sources"].startswith(ROOT + os.sep), op
        assert "sources missing" not in op["reason"], op
    atomics = next(op for op in before["ops"] if op["name"] == "ds_odc_atomics")
    assert atomics["buildable"] and not atomics["built"], atomics  # a fresh cache: nothing built yet
    # the CPU operator really compiles from the installed sources (CUDA's needs a CUDA torch: tests/gpu)
    _run([python, "-c", "from ds_odc.ops_builder import ATOMICS, load_op; load_op(ATOMICS)"], cwd=outside, env=env)
    after = json.loads(_run([python, "-m", "ds_odc", "report", "--json"], cwd=outside, env=env))
    assert next(op for op in after["ops"] if op["name"] == "ds_odc_atomics")["built"], after["ops"]
    text = _run([python, "-m", "ds_odc", "report"], cwd=outside, env=env)
    assert f"operator sources ...... {os.path.join(package, 'ops', 'csrc')}" in text, text
    for lib in ("deepspeed", "transformers", "accelerate"):  # each found, and whether it is in its tested range
        assert "in the tested range" in before["versions"][lib], before["versions"]


def test_sdist_carries_what_a_build_needs_and_builds_the_same_wheel(installed):
    wheel, _, _, work = installed
    dist = os.path.dirname(wheel)
    (sdist,) = [os.path.join(dist, f) for f in os.listdir(dist) if f.endswith(".tar.gz")]
    names = {name.split("/", 1)[1] for name in tarfile.open(sdist).getnames() if "/" in name}
    assert {"LICENSE", "pyproject.toml", "setup.py", "ds_odc_autoload.py", "ds_odc/__init__.py",
            "ops/csrc/odc_atomics.cpp"} <= names, sorted(names)
    from_sdist = os.path.join(work, "from_sdist")
    _run([sys.executable, "-m", "pip", "wheel", sdist, "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", from_sdist], cwd=work)
    (rebuilt,) = os.listdir(from_sdist)
    assert rebuilt == os.path.basename(wheel)
    assert sorted(zipfile.ZipFile(os.path.join(from_sdist, rebuilt)).namelist()) == \
        sorted(zipfile.ZipFile(wheel).namelist())


def test_wheel_metadata_declares_the_ranges_and_the_license(installed):
    wheel, *_ = installed
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = archive.read(name).decode()
        assert any(n.endswith(".dist-info/licenses/LICENSE") for n in archive.namelist())
    assert "License-Expression: Apache-2.0" in metadata
    low, high = DEEPSPEED_RANGE
    assert f"Requires-Dist: deepspeed<={high},>={low}" in metadata, metadata[:3000]


TRAIN_STEP = """
import json, os
import deepspeed, torch  # no `import ds_odc`: the installed autoload .pth registers the odc stage
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": "odc"},
          "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
torch.manual_seed(1 + engine.global_rank)
loss = engine(torch.randn(2, 8)).pow(2).mean()
engine.backward(loss)
engine.step()
import ds_odc
if engine.global_rank == 0:
    print("RESULT " + json.dumps({"engine": type(engine).__name__, "steps": engine.global_steps,
                                  "ds_odc": ds_odc.__file__, "world": engine.world_size, "loss": float(loss)}))
engine.destroy()
"""


def test_installed_wheel_trains_two_ranks_from_outside_the_checkout(installed):
    _, python, site, work = installed
    outside = os.path.join(work, "job")
    os.makedirs(outside, exist_ok=True)
    with open(os.path.join(outside, "train_step.py"), "w") as script:
        script.write(TRAIN_STEP)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DS_ODC_AUTOLOAD", "DS_ODC_STAGE3")}
    # the caller's operator cache (DeepSpeed's CPU comm op is built there already: ~50 s in a fresh one)
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    output = _run([python, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
                   "train_step.py"], cwd=outside, env=env, timeout=240)
    (line,) = [line for line in output.splitlines() if line.startswith("RESULT ")]
    result = json.loads(line[len("RESULT "):])
    assert result["engine"] == "ODCEngine" and result["steps"] == 1 and result["world"] == 2, result
    assert result["ds_odc"].startswith(os.path.join(site, "ds_odc") + os.sep), result
