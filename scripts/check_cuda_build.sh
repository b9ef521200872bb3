#!/usr/bin/env bash
# Compile and link ds_odc's operators here, without a GPU, exactly as the GPU machine will. Not part of CI: it installs ~4 GB into .gpu_build/ (git-ignored) and takes a few minutes.
#
#     bash scripts/check_cuda_build.sh
#
# What it does, and why each step:
#  1. a Python 3.12 virtual environment with the CUDA 13.0 build of torch 2.11.0 (PyPI's Linux wheel is
#     the cu130 build the GPU machine runs) and the NVIDIA libraries it loads at import (any cu13 wheels;
#     only their sonames matter here), so that `import torch` works without a GPU;
#  2. the kit's wheels (scripts/gpu_kit.sh) and a wheel of this checkout, installed as on the GPU machine;
#  3. from a directory outside the checkout, ds_odc.ops_builder.load_op() of both operators: the JIT
#     build the GPU machine's first allocation runs, through torch.utils.cpp_extension with torch
#     2.11's own flags, for sm_80 and sm_90 (TORCH_CUDA_ARCH_LIST, since no GPU says which), from the
#     sources inside the installed wheel. Python imports the result with RTLD_NOW, so every symbol of
#     the operator must resolve against torch 2.11's libraries; then `python -m ds_odc report`;
#  4. `ldd -r` of the built library against the wheel's libraries: no undefined symbol, no missing library.
# Results go to .gpu_build/check_cuda_build.log; the summary and the exact flags are printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
B=$ROOT/.gpu_build
find_py312() {  # the first interpreter that really is CPython 3.12 (a pyenv shim may exist and fail)
  for candidate in "${PY312:-}" python3.12 "$(ls -d "$HOME"/.pyenv/versions/3.12.*/bin/python3 2>/dev/null | tail -1)"; do
    [ -n "$candidate" ] && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null \
      && { echo "$candidate"; return; }
  done
  echo "check_cuda_build: needs CPython 3.12 (set PY312=...)" >&2; exit 2
}
PY312=$(find_py312)
TORCH_VERSION=2.11.0
ARCHS="8.0;9.0"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
LOG=$B/check_cuda_build.log
mkdir -p "$B/wheels" "$B/dist" "$B/clean"
: >"$LOG"
say() { echo "check_cuda_build: $*" | tee -a "$LOG"; }

[ -d .gpu_kit/wheels ] || bash scripts/gpu_kit.sh

VENV=$B/venv312
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  "$PY312" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip -q --disable-pip-version-check)
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64)
if ! ls "$B"/wheels/torch-$TORCH_VERSION-cp312-*.whl >/dev/null 2>&1; then
  say "downloading torch $TORCH_VERSION (cp312, x86-64)"
  "${PIP[@]}" download --no-deps "${PLAT[@]}" -d "$B/wheels" "torch==$TORCH_VERSION" >>"$LOG" 2>&1
fi
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null
then
  say "installing torch $TORCH_VERSION, the NVIDIA libraries it loads, and what the GPU image has besides"
  "${PIP[@]}" install --no-deps "$B"/wheels/torch-$TORCH_VERSION-cp312-*.whl >>"$LOG" 2>&1
  "${PIP[@]}" install --no-deps nvidia-cuda-runtime nvidia-cublas nvidia-cudnn-cu13 nvidia-cuda-nvrtc \
      nvidia-cuda-cupti nvidia-cufft nvidia-curand nvidia-nvjitlink nvidia-cusparse nvidia-cusparselt-cu13 \
      nvidia-cusolver nvidia-nccl-cu13 nvidia-nvshmem-cu13 nvidia-cufile nvidia-nvtx >>"$LOG" 2>&1
  "${PIP[@]}" install filelock sympy networkx jinja2 fsspec setuptools wheel numpy ninja psutil py-cpuinfo \
      msgpack einops tqdm packaging >>"$LOG" 2>&1
fi
say "installing the kit's wheels and a wheel of this checkout (as on the GPU machine)"
"${PIP[@]}" install --no-deps --force-reinstall .gpu_kit/wheels/*.whl >>"$LOG" 2>&1
rm -f "$B"/dist/ds_odc-*.whl
"${PIP[@]}" wheel --no-deps --no-build-isolation -w "$B/dist" . >>"$LOG" 2>&1
"${PIP[@]}" install --no-deps --force-reinstall "$B"/dist/ds_odc-*.whl >>"$LOG" 2>&1

EXT=$B/torch_extensions
rm -rf "$EXT"
say "JIT build of both operators from the installed wheel (TORCH_CUDA_ARCH_LIST=$ARCHS, nvcc $("$CUDA_HOME"/bin/nvcc --version | grep -o 'V[0-9][0-9.]*' | tail -1))"
(cd "$B/clean" && DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$EXT TORCH_CUDA_ARCH_LIST=$ARCHS PATH=$VENV/bin:$PATH \
  "$VENV/bin/python" - >>"$LOG" 2>&1 <<'EOF'
import time
import torch
import ds_odc.ops_builder as ob
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), cuda available: {torch.cuda.is_available()}")
print(f"ds_odc from {ob.__file__}; operator sources {ob.OPS_DIR}")
assert "site-packages" in ob.__file__, "ds_odc must come from the installed wheel, not the checkout"
for spec in ob.OPS:
    start = time.monotonic()
    module = ob.load_op(spec, verbose=True)
    print(f"BUILT {spec.name} in {time.monotonic() - start:.1f} s: {ob.build_directory(spec)}")
cuda = ob.load_op(ob.CUDA_IPC)
print("IMPORTED", cuda.__name__, sorted(n for n in dir(cuda) if not n.startswith("_")))
EOF
) || { tail -40 "$LOG"; say "FAILED: the JIT build (log: $LOG)"; exit 1; }
(cd "$B/clean" && DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$EXT TORCH_CUDA_ARCH_LIST=$ARCHS \
  "$VENV/bin/python" -m ds_odc report >>"$LOG" 2>&1) || { tail -40 "$LOG"; say "FAILED: python -m ds_odc report"; exit 1; }

SO=$(ls "$EXT"/ds_odc/ds_odc_cuda_ipc_*/ds_odc_cuda_ipc.so)
SITE=$("$VENV/bin/python" -c "import site; print(site.getsitepackages()[0])")
LIBS=$SITE/torch/lib:$(ls -d "$SITE"/nvidia/*/lib "$SITE"/nvidia/cu13/lib 2>/dev/null | paste -sd:)
# The Python C API comes from the interpreter that imports the operator: preload its libpython (an
# interpreter built without one exports the API from its executable; then those symbols are listed).
LIBPYTHON=$("$VENV/bin/python" -c "import os, sysconfig as s; p = os.path.join(s.get_config_var('LIBDIR'), s.get_config_var('INSTSONAME') or ''); print(p if os.path.isfile(p) else '')")
say "ldd -r $SO (libraries: torch 2.11's and the NVIDIA wheels'; Python API: ${LIBPYTHON:-the interpreter})"
LD_PRELOAD=$LIBPYTHON LD_LIBRARY_PATH=$LIBS ldd -r "$SO" >"$B/ldd.txt" 2>&1 || true
cat "$B/ldd.txt" >>"$LOG"
UNRESOLVED=$(grep -E "undefined symbol|not found" "$B/ldd.txt" || true)
[ -n "$LIBPYTHON" ] || UNRESOLVED=$(echo "$UNRESOLVED" | grep -v -E "undefined symbol: _?Py" || true)
if [ -n "$UNRESOLVED" ]; then echo "$UNRESOLVED"; say "FAILED: unresolved symbols or libraries"; exit 1; fi
UNDEF=$(nm -D --undefined-only "$SO" | wc -l)
say "all $UNDEF undefined dynamic symbols of the operator resolve; it needs: $(grep -oE '^\s*(libc10|libc10_cuda|libtorch|libtorch_cpu|libtorch_cuda|libtorch_python|libcudart)\.so[.0-9]*' "$B/ldd.txt" | tr -d ' \t' | sort -u | paste -sd' ')"
NINJA=$(ls "$EXT"/ds_odc/ds_odc_cuda_ipc_*/build.ninja)
say "device code: $(grep -o -- '-gencode=[^ ]*' "$NINJA" | sort -u | paste -sd' '); $(grep -m1 '^cuda_cflags' "$NINJA" | grep -o -- '-std=[^ ]*')"
say "link: $(grep -m1 '^ldflags' "$NINJA" | sed 's/^ldflags = //; s|-L[^ ]*torch/lib|-L<torch 2.11>/lib|')"
grep -E "^(torch |BUILT|IMPORTED)|ds_odc_cuda_ipc|ds_odc_atomics|operator sources" "$LOG" | sed 's/^/  /'
say "OK: both operators compile, link and import against torch $TORCH_VERSION (CUDA 13.0), Python 3.12"
