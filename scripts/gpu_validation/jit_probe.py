"""JIT-build item of the validation kit: build ds_odc's operators from the *installed* wheel, then check
that ``python -m ds_odc report`` shows them built and reads their sources from the installed package.

    cd <a directory outside the checkout> && PYTHONPATH=<site> TORCH_EXTENSIONS_DIR=<fresh> \
        python jit_probe.py --site <site> --fresh <fresh> OP [OP...]

``--fresh`` is emptied first and must be the extensions folder (``TORCH_EXTENSIONS_DIR``): the build then
really compiles, whatever earlier items built into the kit's shared folder (an earlier kit's item passed
without building anything). ``cached_before`` and ``compiled`` say so for each operator.

Run as a file from outside the checkout, so that ``import ds_odc`` cannot find the repository's copy.
``OP`` names the operators that must build here (``ds_odc_atomics``, ``ds_odc_cuda_ipc``); any other one
is reported with the reason it cannot be built here. Prints ``JIT_PROBE {json}``; exits 1 if a required
operator did not build or the report disagrees.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--site", required=True)
    parser.add_argument("--fresh", help="the extensions folder, emptied first")
    parser.add_argument("required", nargs="+")
    args = parser.parse_args(argv)
    if args.fresh:
        if os.path.realpath(os.environ.get("TORCH_EXTENSIONS_DIR", "")) != os.path.realpath(args.fresh):
            where = os.environ.get("TORCH_EXTENSIONS_DIR")
            raise SystemExit(f"--fresh {args.fresh} is not TORCH_EXTENSIONS_DIR ({where})")
        shutil.rmtree(args.fresh, ignore_errors=True)
    import ds_odc.ops_builder as builder

    site = os.path.realpath(args.site)
    figures = {"ds_odc": os.path.dirname(builder.__file__), "sources": str(builder.OPS_DIR), "ops": {}}
    problems = []
    if not os.path.realpath(builder.__file__).startswith(site):
        problems.append(f"ds_odc was imported from {builder.__file__}, not from the installed wheel in {site}")
    for spec in builder.OPS:
        entry = {"required": spec.name in args.required, "cached_before": builder._library_path(spec).exists()}
        reason = builder.why_not_buildable(spec)
        if spec.name not in args.required:
            entry["not_built"] = reason or "not required here"
        else:
            start = time.monotonic()
            try:
                builder.load_op(spec, verbose=True)
                entry["build_s"] = round(time.monotonic() - start, 1)
                entry["directory"] = str(builder.build_directory(spec))
                entry["compiled"] = not entry["cached_before"] and builder._library_path(spec).exists()
            except Exception as err:  # noqa: BLE001 - reported
                problems.append(f"{spec.name} did not build: {type(err).__name__}: {err}")
        figures["ops"][spec.name] = entry
    report = subprocess.run([sys.executable, "-m", "ds_odc", "report"], capture_output=True, text=True, timeout=300)
    print(report.stdout + report.stderr)
    lines = report.stdout.splitlines()
    for name in args.required:
        line = next((x for x in lines if x.startswith(name + " ")), "")
        figures["ops"][name]["report"] = line
        if "[OKAY] built" not in line:
            problems.append(f"python -m ds_odc report does not show {name} built: {line!r}")
    sources = next((x for x in lines if x.startswith("operator sources")), "")
    figures["report_sources"] = sources
    source_dir = os.path.realpath(sources.split()[-1]) if sources else ""
    if not source_dir.startswith(site):
        problems.append(f"python -m ds_odc report reads operator sources elsewhere than {site}: {sources!r}")
    figures["problems"] = problems
    print("JIT_PROBE " + json.dumps(figures), flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
