"""The kit's operator item: load ds_odc's CUDA operator the fastest honest way, and say which way it was.

    PYTHONPATH=<site> TORCH_EXTENSIONS_DIR=<work>/torch_extensions python cuda_op.py --prebuilt .gpu_kit/ops

* already in the work folder's extensions cache (an earlier command on this machine): loaded;
* else the carried prebuilt one (``scripts/prebuild_cuda_op.py``) when its fingerprint matches this machine
  (the sources' hash of the *installed* ds_odc, ``py312_torch2.11.0_cu130``, this GPU's architecture among
  the prebuilt ones, the file's sha256): copied where ``ops_builder`` looks, then loaded;
* else (a mismatch, named) or if the prebuilt one does not load (its error, named): a JIT build.

Prints ``CUDA_OP {json}`` (``how``: "cached", "prebuilt" or "built", ``why``, seconds); exit 1 if the
operator does not load in the end. Without a CUDA build of torch it prints ``not_measurable`` and exits 0.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time


def mismatch(prebuilt: dict, library: str, actual: dict) -> list:
    """What differs between the carried operator and this machine (empty: it fits)."""
    found = []
    for key in ("sources", "torch_tag"):
        if prebuilt.get(key) != actual[key]:
            found.append(f"{key}: prebuilt {prebuilt.get(key)}, here {actual[key]}")
    if actual["arch"] not in prebuilt.get("archs", []):
        found.append(f"GPU architecture {actual['arch']} not among the prebuilt {prebuilt.get('archs')}")
    if not os.path.exists(library):
        found.append(f"{library} was not carried")
    else:
        with open(library, "rb") as handle:
            if hashlib.sha256(handle.read()).hexdigest() != prebuilt.get("sha256"):
                found.append(f"{library}: sha256 differs from PREBUILT.json (a broken copy)")
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prebuilt", required=True, help="folder with PREBUILT.json and the library")
    args = parser.parse_args(argv)
    import torch

    import ds_odc.ops_builder as builder

    spec = builder.CUDA_IPC
    figures = {"ds_odc": os.path.dirname(builder.__file__)}
    if torch.version.cuda is None or not torch.cuda.is_available():
        figures["not_measurable"] = (f"torch {torch.__version__} is a CPU-only build" if torch.version.cuda is None
                                     else "no CUDA device is visible")
        print("CUDA_OP " + json.dumps(figures), flush=True)
        return 0
    library = builder._library_path(spec)
    figures["target"] = str(library)
    meta_path = os.path.join(args.prebuilt, "PREBUILT.json")
    if library.exists():
        figures.update(how="cached", why="already in this work folder's extensions cache (an earlier command)")
    elif not os.path.exists(meta_path):
        figures.update(how="built", why=f"no prebuilt operator carried ({meta_path} absent)")
    else:
        with open(meta_path) as handle:
            prebuilt = json.load(handle)
        major, minor = torch.cuda.get_device_capability()
        actual = {"sources": spec.fingerprint(), "torch_tag": builder._torch_tag(), "arch": f"{major}.{minor}"}
        carried = os.path.join(args.prebuilt, prebuilt.get("library", f"{spec.name}.so"))
        found = mismatch(prebuilt, carried, actual)
        if found:
            figures.update(how="built", why="fingerprint mismatch: " + "; ".join(found))
        else:
            library.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(carried, library)
            figures.update(how="prebuilt", why=f"fingerprint matches ({actual['sources']}, {actual['torch_tag']}, "
                                               f"sm_{major}{minor})")
    start = time.monotonic()
    try:
        module = builder.load_op(spec, verbose=figures["how"] == "built")
    except Exception as err:  # noqa: BLE001 - a prebuilt one that does not load is rebuilt, and said so
        if figures["how"] == "built":
            raise
        library.unlink(missing_ok=True)
        builder._loaded.pop(spec.name, None)
        figures.update(how="built", why=f"the {figures['how']} operator did not load ({type(err).__name__}: {err})")
        module = builder.load_op(spec, verbose=True)
    figures["seconds"] = round(time.monotonic() - start, 1)
    figures["functions"] = sorted(name for name in dir(module) if not name.startswith("_"))
    print("CUDA_OP " + json.dumps(figures), flush=True)
    return 0 if "scatter_add" in figures["functions"] else 1


if __name__ == "__main__":
    sys.exit(main())
