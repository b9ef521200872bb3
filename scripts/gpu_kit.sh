#!/usr/bin/env bash
# GPU validation kit, step 1 of 2 (here, where the package registry is reachable):
#
#     bash scripts/gpu_kit.sh
#
# gathers into .gpu_kit/ (git-ignored) what the GPU machine lacks:
#  * wheels/: CPython 3.12 x86-64 wheels of deepspeed 0.19.8 (a pure-Python wheel built here from its
#    sdist, no op compiled) and the pure-Python packages it needs that the GPU image does not have (pydantic,
#    pydantic-core, hjson, annotated-types, typing-inspection, typing-extensions), at the versions this
#    checkout's .venv runs, so the GPU machine runs the combination CI tests; .gpu_kit/MANIFEST.json names
#    the commit, each wheel's size and sha256;
#  * the NVSHMEM wheels of the kit's `nvshmem` item (NVSHMEM_PINS below: nvshmem4py-cu13 and the cuda-python
#    parts it imports, ~20 MB), cu13 like the GPU machine's torch 2.11+cu130; the install step puts them in a
#    folder of their own that only that item imports. The NVSHMEM library itself (nvidia-nvshmem-cu13, 100+ MB:
#    more than the device's 64 MiB carry) is not carried: torch 2.11+cu130 depends on nvidia-nvshmem-cu13==3.4.5,
#    so the GPU image has it. GPU_KIT_NVSHMEM_LIB=1 downloads that wheel too (for a machine whose torch lacks it
#    and whose carry allows it);
#  * ops/: ds_odc's CUDA operator prebuilt for the GPU machine's software (torch 2.11.0+cu130, CPython 3.12,
#    sm_80 and sm_90) with its fingerprint, ops/PREBUILT.json (scripts/prebuild_cuda_op.py; needs nvcc 13.0
#    and a CPython 3.12 here, and fetches torch 2.11's wheel once into .gpu_build/). There the kit loads it
#    when the fingerprint matches and builds only on a mismatch, saying which. Without nvcc 13.0 here the
#    step is skipped with a note and the GPU machine builds the operator (30-60 s of its time).
# The GPU image already has torch 2.11+cu130, nvcc 13, ninja, numpy, psutil, py-cpuinfo, msgpack, einops,
# tqdm, packaging, pytest and matplotlib (docs/gpu.md). Everything carried: about 26 MB (5 MB without the
# NVSHMEM wheels), the checkout's 3 MB on top, under the device's 64 MiB.
#
# Step 2, on the GPU machine, from the repository root, with .gpu_kit carried (docs/gpu.md):
#     python3 scripts/gpu_validate.py --out $OUT              # first command: ~330 s, give it 420 s
#     python3 scripts/gpu_validate.py --second --out $OUT     # only if six minutes or more are left
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=${GPU_KIT_DIR:-.gpu_kit}
PY=.venv/bin/python
[ -x "$PY" ] || bash scripts/bootstrap.sh
PLATFORMS=(--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_28_x86_64)
# the versions this checkout's .venv runs (deepspeed is pinned by setup.py)
read -r -a PINNED < <("$PY" - <<'EOF'
from importlib.metadata import version
names = ["pydantic", "pydantic-core", "hjson", "annotated-types", "typing-inspection", "typing-extensions"]
print(" ".join(f"{name}=={version(name)}" for name in names))
EOF
)
# the nvshmem item's wheels: cu13 builds (the GPU machine's torch is cu130); numpy is on the GPU image
NVSHMEM_PINS=(nvshmem4py-cu13==0.4.1 cuda-core==1.2.2 cuda-bindings==13.5.0 cuda-pathfinder==1.9.1)
[ "${GPU_KIT_NVSHMEM_LIB:-0}" = 1 ] && NVSHMEM_PINS+=(nvidia-nvshmem-cu13==3.4.5)  # torch 2.11+cu130's pin
DS_VERSION=$(grep -o '"deepspeed==[0-9.]*"' setup.py | tr -d '"' | cut -d= -f3)

rm -rf "$KIT/wheels"
mkdir -p "$KIT/wheels"
echo "gpu_kit: building deepspeed $DS_VERSION as a pure-Python wheel (no ops: the GPU machine JIT-builds what it uses)"
# --no-build-isolation: DeepSpeed's setup.py imports torch; an isolated build would fetch an unpinned one
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation --no-binary deepspeed -w "$KIT/wheels" \
    "deepspeed==$DS_VERSION"
ls "$KIT"/wheels/deepspeed-"$DS_VERSION"-py3-none-any.whl >/dev/null || {
    echo "gpu_kit: the deepspeed wheel is not pure Python (py3-none-any): $(ls "$KIT/wheels")" >&2; exit 1; }
echo "gpu_kit: downloading ${PINNED[*]} for CPython 3.12 x86-64"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --abi abi3 --abi none "${PLATFORMS[@]}" -d "$KIT/wheels" "${PINNED[@]}"
echo "gpu_kit: downloading ${NVSHMEM_PINS[*]} for CPython 3.12 x86-64 (the nvshmem item)"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --abi abi3 --abi none "${PLATFORMS[@]}" -d "$KIT/wheels" "${NVSHMEM_PINS[@]}"

"$PY" - "$KIT" <<'EOF'
"""MANIFEST.json: what was gathered, from which commit; checked again by scripts/gpu_validate.py."""
import hashlib, json, os, subprocess, sys, time
kit = sys.argv[1]
def git(*args):
    done = subprocess.run(["git", *args], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None
wheels = []
for name in sorted(os.listdir(os.path.join(kit, "wheels"))):
    path = os.path.join(kit, "wheels", name)
    with open(path, "rb") as handle:
        digest = hashlib.sha256(handle.read()).hexdigest()
    wheels.append({"file": name, "bytes": os.path.getsize(path), "sha256": digest})
names = [w["file"].split("-")[0].lower().replace("_", "-") for w in wheels]
if len(names) != len(set(names)):
    sys.exit(f"gpu_kit: two versions of one package in {kit}/wheels: {names}")
manifest = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": git("rev-parse", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no")), "python_tag": "cp312",
            "wheels": wheels}
with open(os.path.join(kit, "MANIFEST.json"), "w") as out:
    json.dump(manifest, out, indent=1)
total = sum(w["bytes"] for w in wheels)
for w in wheels:
    print(f"  {w['file']}  {w['bytes'] / 1e6:.2f} MB")
print(f"gpu_kit: {len(wheels)} wheels, {total / 1e6:.1f} MB in {kit}/wheels (commit {manifest['commit']}"
      f"{', uncommitted changes' if manifest['dirty'] else ''})")
EOF
echo "gpu_kit: the CUDA operator, prebuilt for the GPU machine"
"$PY" scripts/prebuild_cuda_op.py --out "$KIT/ops"
echo "gpu_kit: $(du -sh "$KIT" | cut -f1) to carry in $KIT"
cat <<EOF
gpu_kit: ready. On the GPU machine (carry "$KIT"), from the repository root:
    python3 scripts/gpu_validate.py --out \$OUT              # first command: ~330 s, give it 420 s
    python3 scripts/gpu_validate.py --second --out \$OUT     # only if six minutes or more are left
EOF
