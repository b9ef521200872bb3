"""Set-up item of the validation kit: install the carried wheels and a wheel of this checkout into a
private folder (``--site``), without a package index, and lay out the copy of the tests the items run.

    python scripts/gpu_validation/install.py --root REPO --wheels .gpu_kit/wheels --site DIR --dist DIR --suite DIR

The carried wheels (scripts/gpu_kit.sh) are checked against ``MANIFEST.json`` beside them first: a
truncated or stale copy is named, not installed. A missing wheels folder is allowed (the CPU smoke run
uses its own interpreter's packages) and said so. The ds_odc wheel is built without build isolation
(the GPU machine has setuptools and wheel, and no index to fetch them from). Nothing is installed into
the interpreter's own site-packages: items find the folder through ``PYTHONPATH``. The installed files are
compiled to bytecode once here, so that the many processes the items start do not each compile them.

The NVSHMEM wheels (nvshmem4py and the ``cuda-python`` parts it imports: :data:`NVSHMEM_WHEELS`) go into a
folder of their own (``--nvshmem-site``), put on ``PYTHONPATH`` by the ``nvshmem`` item only: no other item
imports them, and their ``cuda-bindings`` does not shadow the machine's for torch.

When the site already holds exactly this checkout's package and these wheels (a second command on the same
machine), nothing is installed again (``reused``).

``--suite``: tests/, benchmarks/, examples/ and pytest.ini are copied there, and the items run from that
copy: run from the checkout, pytest (and ``python benchmarks/...``) would put the checkout first on
``sys.path`` and import its ``ds_odc``, not the installed wheel's.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys


def pip(*args: str) -> None:
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True)


def check_manifest(wheels_dir: str) -> dict:
    path = os.path.join(os.path.dirname(os.path.abspath(wheels_dir)), "MANIFEST.json")
    if not os.path.exists(path):
        return {"manifest": "absent"}
    with open(path) as handle:
        manifest = json.load(handle)
    for wheel in manifest["wheels"]:
        file = os.path.join(wheels_dir, wheel["file"])
        if not os.path.exists(file):
            raise SystemExit(f"{file}: listed in {path} but not carried (was .gpu_kit named in carry?)")
        with open(file, "rb") as handle:
            digest = hashlib.sha256(handle.read()).hexdigest()
        if digest != wheel["sha256"]:
            raise SystemExit(f"{file}: sha256 {digest} differs from {path} ({wheel['sha256']}): a broken copy")
    extra = sorted(set(os.listdir(wheels_dir)) - {w["file"] for w in manifest["wheels"]})
    if extra:
        raise SystemExit(f"{wheels_dir} holds wheels the manifest does not list: {extra} (rerun scripts/gpu_kit.sh)")
    return {"manifest": "checked", "prepared_at_commit": manifest.get("commit"),
            "prepared_with_uncommitted_changes": manifest.get("dirty"), "prepared": manifest.get("created")}


#: What goes into the ds_odc wheel (setup.py): a change in any of them means a new wheel.
PACKAGE_INPUTS = ("ds_odc", "ops/csrc", "setup.py", "MANIFEST.in", "ds_odc_autoload.py", "ds_odc_import_hooks.py")
SUITE = ("tests", "benchmarks", "examples", "pytest.ini")


def package_hash(root: str, carried) -> str:
    """sha256 over this checkout's package inputs and the carried wheels' names and contents."""
    digest = hashlib.sha256()
    paths = []
    for entry in PACKAGE_INPUTS:
        full = os.path.join(root, entry)
        if os.path.isdir(full):
            paths += [os.path.join(d, f) for d, _, files in os.walk(full) if "__pycache__" not in d for f in files]
        elif os.path.exists(full):
            paths.append(full)
    for path in sorted(paths) + sorted(carried):
        digest.update(os.path.relpath(path, root).encode())
        with open(path, "rb") as handle:
            digest.update(handle.read())
    return digest.hexdigest()[:16]


#: Wheel-name prefixes installed into ``--nvshmem-site`` instead of the site every item uses.
NVSHMEM_WHEELS = ("nvshmem4py", "nvidia_nvshmem", "cuda_core", "cuda_bindings", "cuda_pathfinder")


def split_carried(carried):
    """(wheels for the site, wheels for the NVSHMEM site), by file name."""
    def nvshmem(path):
        return os.path.basename(path).lower().replace("-", "_").startswith(NVSHMEM_WHEELS)
    return [w for w in carried if not nvshmem(w)], [w for w in carried if nvshmem(w)]


def lay_out_suite(root: str, suite: str) -> None:
    shutil.rmtree(suite, ignore_errors=True)
    os.makedirs(suite)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for entry in SUITE:
        source = os.path.join(root, entry)
        if os.path.isdir(source):
            shutil.copytree(source, os.path.join(suite, entry), ignore=ignore)
        elif os.path.exists(source):
            shutil.copy(source, suite)
    # the pytest plugin that checks where ds_odc comes from (-p kit_installed_check)
    shutil.copy(os.path.join(os.path.dirname(os.path.abspath(__file__)), "kit_installed_check.py"), suite)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--wheels", default="", help="the carried wheels' folder; empty: none")
    parser.add_argument("--site", required=True)
    parser.add_argument("--dist", required=True)
    parser.add_argument("--suite", help="copy the tests, benchmarks and examples here")
    parser.add_argument("--nvshmem-site", help="install the NVSHMEM wheels here (default: beside --site)")
    args = parser.parse_args(argv)
    if args.suite:
        lay_out_suite(args.root, args.suite)
    figures = {"python": sys.version.split()[0], "site": args.site}
    if args.wheels and not os.path.isdir(args.wheels):
        raise SystemExit(f"{args.wheels}: no such folder. Run `bash scripts/gpu_kit.sh` where a package index is "
                         "reachable, and carry .gpu_kit to this machine")
    carried = sorted(glob.glob(os.path.join(args.wheels, "*.whl"))) if args.wheels else []
    if carried:
        figures.update(check_manifest(args.wheels))
    else:
        figures["manifest"] = "no carried wheels: this interpreter's own packages are used"
    stamp = os.path.join(args.site, ".ds_odc_kit_installed")
    wanted = package_hash(args.root, carried)
    if os.path.exists(stamp) and open(stamp).read() == wanted:
        figures.update(reused=True, installed=sorted(os.listdir(args.site)))
        print("INSTALLED " + json.dumps(figures), flush=True)
        return
    nvshmem_site = args.nvshmem_site or args.site.rstrip(os.sep) + "-nvshmem"
    shutil.rmtree(args.site, ignore_errors=True)
    shutil.rmtree(nvshmem_site, ignore_errors=True)
    os.makedirs(args.dist, exist_ok=True)
    for old in glob.glob(os.path.join(args.dist, "ds_odc-*.whl")):
        os.unlink(old)
    pip("wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir", "-q", "-w", args.dist, args.root)
    built = glob.glob(os.path.join(args.dist, "ds_odc-*.whl"))
    if len(built) != 1:
        raise SystemExit(f"expected one ds_odc wheel in {args.dist}, found {built}")
    general, nvshmem = split_carried(carried)
    pip("install", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "-q", "--upgrade", "--target",
        args.site, *general, built[0])
    if nvshmem:
        pip("install", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "-q", "--upgrade", "--target",
            nvshmem_site, *nvshmem)
    figures["nvshmem_site"] = nvshmem_site if nvshmem else "no NVSHMEM wheels carried"
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", args.site], check=False,
                   stdout=subprocess.DEVNULL)
    with open(stamp, "w") as out:
        out.write(wanted)
    figures["installed"] = sorted(os.path.basename(w) for w in carried + built)
    figures["reused"] = False
    print("INSTALLED " + json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
