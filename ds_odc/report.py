"""``python -m ds_odc report``: what this environment can run, in the spirit of ``ds_report``.

Sections: the versions of ds_odc and of what it integrates with; the transports (which are
usable on this machine and, for the others, why not); the control plane's memory ordering
(release/acquire through the ``ds_odc_atomics`` operator, the x86-64 fallback, or why neither);
the compiled operators (built, buildable, or why not). It only inspects: nothing is compiled, no process group
or window is created, and optional packages (transformers, accelerate) are looked up by their installed
metadata rather than imported, so the report takes about as long as ``import ds_odc``.

Exit status (:func:`out_of_range`): 1 when a row says this environment is outside what ds_odc supports or
would be refused: a release of DeepSpeed, transformers or accelerate outside its tested range; the control
plane's memory ordering ``[NO]`` (no rank can run here); the environment switch refused; a launcher layout
refused at initialize; a section that could not be inspected (its probe failed). Otherwise 0. A ``[NO]`` that is
a fact of the machine is not an error: a transport this machine cannot serve (``cuda_ipc`` without CUDA, ``shm``
without a writable ``/dev/shm``: ``shm_dir`` may point elsewhere) and a compiled operator that cannot be built
here (none is needed on CPU); a job that needs one is refused at initialize, naming it. An optional package
that is not installed is not an error either.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
from typing import Callable, Dict, List, Tuple

GOOD, BAD = "[OKAY]", "[NO]"


def _installed_version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def versions() -> Dict[str, str]:
    """ds_odc and what it runs on; for DeepSpeed, transformers and accelerate, whether the release found is in
    the range ds_odc was tested with (DeepSpeed outside it is refused at import; the other two get a warning).
    torch and DeepSpeed are already imported by ``import ds_odc``."""
    import deepspeed
    import torch

    import ds_odc

    found = {
        "ds_odc": f"{ds_odc.__version__} ({os.path.dirname(os.path.abspath(ds_odc.__file__))})",
        "python": f"{platform.python_version()} ({sys.executable})",
        "torch": f"{torch.__version__} (cuda {torch.version.cuda or 'none'})",
        "deepspeed": f"{deepspeed.__version__} ({range_note('deepspeed', deepspeed.__version__)})",
        "pydantic": _installed_version("pydantic"),
    }
    for package in ("transformers", "accelerate"):
        version = _installed_version(package)
        found[package] = version if version == "not installed" else f"{version} ({range_note(package, version)})"
    return found


def range_note(package: str, version: str) -> str:
    """``in the tested range (...)`` or ``OUTSIDE the tested range (...): what follows``."""
    from ds_odc.integration.versions import DEEPSPEED_RANGE, deepspeed_in_range, hf_in_range, tested_hf

    if package == "deepspeed":
        tested, inside = f"{DEEPSPEED_RANGE[0]} to {DEEPSPEED_RANGE[1]}", deepspeed_in_range(version)
        outside = "refused at import"
    else:
        tested, inside = tested_hf(package), hf_in_range(package, version)
        outside = "the 'odc' stage warns when it patches it"
    return f"in the tested range, {tested}" if inside else f"OUTSIDE the tested range, {tested}: {outside}"


def environment() -> Dict[str, str]:
    """Devices and the autoload switch."""
    import torch

    cuda = f"{torch.cuda.device_count()} device(s)" if torch.cuda.is_available() else "not available"
    autoload_spec = importlib.util.find_spec("ds_odc_autoload")
    if autoload_spec is None:
        autoload = "not installed (scripts need `import ds_odc`)"
    else:
        import ds_odc_autoload

        autoload = "on" if ds_odc_autoload.enabled() else "off (DS_ODC_AUTOLOAD turns it off)"
    return {
        "cuda devices": cuda,
        "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "(unset: DeepSpeed detects)"),
        "cpu cores": str(os.cpu_count()),
        "autoload on `import deepspeed`": autoload,
        "stage-3 engines on odc": _switch(),
    }


def _switch() -> str:
    """What ``DS_ODC_STAGE3`` (and ``DS_ODC_OPTIONS``) ask for, or why they cannot."""
    from ds_odc.config import ENV_OPTIONS, ENV_SWITCH, env_switch
    from ds_odc.errors import ODCConfigError

    try:
        options = env_switch()
    except ODCConfigError as err:
        return f"refused: {err}"
    if options is None:
        return f"no ({ENV_SWITCH} unset: only configs that ask for the odc stage)"
    return f"yes, every one ({ENV_SWITCH}=odc; {ENV_OPTIONS} {json.dumps(options) if options else 'unset'})"


def _shm_fallback() -> Tuple[bool, str]:
    shm_dir = "/dev/shm"
    if not os.path.isdir(shm_dir):
        return False, f"{shm_dir} does not exist (set zero_optimization.odc.shm_dir to a tmpfs directory)"
    if not os.access(shm_dir, os.W_OK | os.X_OK):
        return False, f"{shm_dir} is not writable by this user"
    stats = os.statvfs(shm_dir)
    return True, f"{shm_dir}, {stats.f_bavail * stats.f_frsize / 2**30:.1f} GiB free; CPU ranks on one host"


def transports() -> Dict[str, Tuple[bool, str]]:
    """name -> (usable here, why / why not). Asks ``ds_odc.comm.available_transports`` when the
    installed ds_odc has it; otherwise checks what the shm transport needs."""
    try:
        from ds_odc.comm import available_transports
    except ImportError:
        found = {"shm": _shm_fallback()}
    else:
        found = {name: (bool(ok), str(reason) or ("available" if ok else "unavailable, no reason given"))
                 for name, (ok, reason) in available_transports().items()}
        if found.get("shm", (False,))[0] and found["shm"][1] == "available":
            found["shm"] = _shm_fallback()
    found.setdefault("multi-node", (True, "a transport inside each node, one exchange per step between nodes on "
                                          "torch.distributed (gloo or NCCL)"))
    return found


def topology() -> Dict[str, str]:
    """The layout this process's launcher announces (WORLD_SIZE, LOCAL_WORLD_SIZE), and what ODC makes of it."""
    from ds_odc.comm.topology import launcher_topology

    found = launcher_topology(os.environ)
    if found is None:
        return {"launcher": "none (WORLD_SIZE unset): one process; under a launcher this shows the job's nodes"}
    rows = {"launcher": found.describe()}
    if found.node_count == 1:
        rows["odc"] = "one node: windows and accumulators over every rank, one-sided within the node"
    else:
        try:
            found.check_multi_node_layout()
        except ValueError as err:
            return {**rows, "odc": f"several nodes, refused at initialize: {err}"}
        rows["odc"] = (f"several nodes: windows and accumulators over the {found.local_world_size} ranks of a node "
                       f"(one-sided within it), optimizer state over all {found.world_size}, one exchange per step "
                       f"between nodes on torch.distributed (docs/multinode.md)")
    return rows


def control_plane() -> Dict[str, Tuple[bool, str]]:
    """How ranks order their shared control words (release/acquire), without building anything."""
    from ds_odc.comm.ordering import describe

    return {"memory ordering": describe()}


def ops() -> List[dict]:
    """One dict per compiled operator (name, built, buildable, reason, sources); empty when there are none."""
    try:
        from ds_odc.ops_builder import op_status
    except ImportError:
        return []
    return op_status()


def collect() -> dict:
    """Everything the report shows, as plain data (``--json``)."""
    sections: Dict[str, Callable] = {"versions": versions, "environment": environment, "topology": topology,
                                     "transports": transports, "control plane": control_plane, "ops": ops}
    data = {}
    for name, probe in sections.items():
        try:
            data[name] = probe()
        except Exception as err:  # noqa: BLE001 - one broken probe must not hide the others
            data[name] = {"error": f"{type(err).__name__}: {err}"}
    return data


def _rows(title: str, rows: List[Tuple[str, str]]) -> List[str]:
    width = max([len(key) for key, _ in rows] + [20]) + 2
    return ["-" * 70, title, "-" * 70] + [f"{key} {'.' * (width - len(key))} {value}" for key, value in rows]


def render(data: dict) -> str:
    lines = _rows("ds_odc report: versions", list(data["versions"].items()))
    lines += _rows("environment", list(data["environment"].items()))
    lines += _rows("topology (ranks per host)", list(data["topology"].items()))
    transport_rows = data["transports"]
    if "error" in transport_rows:
        rows = [("transports", transport_rows["error"])]
    else:
        rows = [(name, f"{GOOD if ok else BAD} {reason}") for name, (ok, reason) in transport_rows.items()]
    lines += _rows("transports (zero_optimization.odc.transport)", rows)
    plane = data["control plane"]
    rows = [("control plane", plane["error"])] if "error" in plane else \
        [(name, f"{GOOD if ok else BAD} {text}") for name, (ok, text) in plane.items()]
    lines += _rows("control plane (step rendezvous, liveness, failures)", rows)
    op_rows = data["ops"]
    if isinstance(op_rows, dict):
        rows = [("ops", op_rows["error"])]
    elif not op_rows:
        rows = [("ops", "no ops (none are needed on CPU)")]
    else:
        rows = []
        for op in op_rows:
            state = "built" if op["built"] else ("buildable (JIT-built with ninja on first use)"
                                                 if op["buildable"] else f"not buildable: {op['reason']}")
            rows.append((op["name"], f"{GOOD if op['built'] or op['buildable'] else BAD} {state}"))
        if "sources" in op_rows[0]:
            rows.append(("operator sources", op_rows[0]["sources"]))
    lines += _rows("compiled operators (nothing is built by this report)", rows)
    return "\n".join(lines)


def out_of_range(data: dict) -> List[str]:
    """The rows that make the report exit 1 (the module docstring's rule), each as ``section: row: value``."""
    found = []
    for name, rows in data.items():
        if isinstance(rows, dict) and set(rows) == {"error"}:
            found.append(f"{name}: not inspected: {rows['error']}")
    versions = data.get("versions", {})
    found += [f"versions: {package}: {versions[package]}" for package in ("deepspeed", "transformers", "accelerate")
              if "OUTSIDE the tested range" in str(versions.get(package, ""))]
    switch = str(data.get("environment", {}).get("stage-3 engines on odc", ""))
    if switch.startswith("refused"):
        found.append(f"environment: stage-3 engines on odc: {switch}")
    layout = str(data.get("topology", {}).get("odc", ""))
    if "refused at initialize" in layout:
        found.append(f"topology: odc: {layout}")
    ordering = data.get("control plane", {}).get("memory ordering")
    if isinstance(ordering, (list, tuple)) and not ordering[0]:
        found.append(f"control plane: memory ordering: {BAD} {ordering[1]}")
    return found


def main(argv: List[str]) -> int:
    """Print the report (``--json``: as JSON, with the ``out_of_range`` rows); 1 when a row is out of range."""
    data = collect()
    problems = out_of_range(data)
    if "--json" in argv:
        print(json.dumps({**data, "out_of_range": problems}, indent=2, default=str))
    else:
        verdict = "out of range (exit 1):" if problems else "everything checked is in range"
        print("\n".join([render(data), "-" * 70, verdict] + [f"  {row}" for row in problems]))
    return 1 if problems else 0
