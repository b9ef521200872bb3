"""A wheel built from the repository installs a working engine: it carries the operators' sources,
and the installed (non-editable) package finds them, reports them and can build from them.

Slow (a wheel build, a fresh virtual environment, a JIT build: about 15 s), but it runs in CI: a
wheel that silently drops ``ops/`` is exactly how a GPU user would find out too late.

The fresh environment sees torch and DeepSpeed through a ``.pth`` line naming this interpreter's
site-packages (directories named in a ``.pth`` are put on ``sys.path`` without running their own
``.pth`` files, so the checkout's editable finder does not come along). pip is always run with
``--no-deps --no-index``: it must never resolve torch into the new environment.
"""
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile

import pytest

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
        _run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "--no-index",
              "-q", "-w", dist], cwd=source)
        (wheel,) = [os.path.join(dist, f) for f in os.listdir(dist) if f.endswith(".whl")]
        _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=work)
        python = os.path.join(venv, "bin", "python")
        site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=work).strip()
        with open(os.path.join(site, "zz_ds_odc_test_base.pth"), "w") as pth:
            pth.write(sysconfig.get_paths()["purelib"] + "\n")
        _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel],
             cwd=work)
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
