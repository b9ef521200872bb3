"""``python -m ds_odc check DS_CONFIG``: validate a ds_config for the odc stage offline, before a job is launched.

No process group, window or model: the config is read as ``deepspeed.initialize`` reads it, a deep copy goes
through the public parse path (:func:`ds_odc.config.canonicalize`), then through the refusals initialize raises
from the config and the machine alone (:mod:`ds_odc.check_rules`). It prints the canonical form (stage 3 and the
resolved "odc" block, every option with its default), the loss rule the engine will apply, and warnings.

The machine facts a config does not hold come from flags: ``--device`` (default: ``DS_ACCELERATOR``, else "cuda"
when torch sees a GPU, else "cpu", as DeepSpeed picks), ``--nodes`` (1), ``--ranks-per-node`` (the GPUs torch
sees on "cuda", else 1), ``--gradient-accumulation-steps`` (for a config that says "auto").

Exit codes: 0 valid (warnings allowed), 1 refused (or not an odc config), 2 usage (a missing or unreadable file).
``--json`` prints one object: ``{"ok", "stage", "odc", "loss_rule", "warnings", "error"}``.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, List, Optional

from ds_odc.arguments import is_whole_number
from ds_odc.check_rules import Machine, loss_rule, refuse_at_initialize, warnings
from ds_odc.config import ENV_SWITCH, MARKER_KEY, canonicalize
from ds_odc.errors import ODCConfigError
from ds_odc_import_hooks import is_odc_stage

OK, REFUSED, USAGE = 0, 1, 2
PROG = "python -m ds_odc check"
JSON_KEYS = ("ok", "stage", "odc", "loss_rule", "warnings", "error")


class UsageError(Exception):
    """The file cannot be read as a ds_config (exit 2); the message names the file and why."""


@dataclass
class Verdict:
    """What ``check`` found. ``as_json`` is the ``--json`` object; ``route`` and ``steps`` (how the config asks for
    the stage, the accumulation steps and where they came from) are for the text form."""

    ok: bool
    stage: Any = None
    odc: Optional[dict] = None
    loss_rule: Optional[str] = None
    warnings: List[str] = field(default_factory=list)
    error: Optional[str] = None
    route: str = ""
    steps: str = ""

    def as_json(self) -> dict:
        return {key: getattr(self, key) for key in JSON_KEYS}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``check`` sub-command's arguments."""
    parser.add_argument("config", metavar="DS_CONFIG",
                        help="the ds_config file (JSON, as deepspeed.initialize reads it)")
    parser.add_argument("--json", action="store_true",
                        help="one JSON object: ok, stage, odc, loss_rule, warnings, error")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="where the model runs (default: DS_ACCELERATOR, else cuda when torch sees a GPU, "
                             "else cpu)")
    parser.add_argument("--nodes", type=_positive, default=1, metavar="N", help="hosts in the job (default 1)")
    parser.add_argument("--ranks-per-node", type=_positive, default=None, metavar="M",
                        help="ranks on each host (default: the GPUs torch sees with --device cuda, else 1)")
    parser.add_argument("--gradient-accumulation-steps", type=_positive, default=None, metavar="N",
                        help='the value a framework fills in where the config says "auto" (default 1)')


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def machine_from(args: argparse.Namespace) -> Machine:
    """The machine facts: the flags, else the defaults the module docstring gives."""
    import torch

    device = args.device or os.environ.get("DS_ACCELERATOR") or ("cuda" if torch.cuda.is_available() else "cpu")
    ranks = args.ranks_per_node
    if ranks is None:
        ranks = max(torch.cuda.device_count(), 1) if device == "cuda" else 1
    return Machine(device, args.nodes, ranks, args.gradient_accumulation_steps)


def read_config(path: str) -> dict:
    """The ds_config at ``path``, read as ``deepspeed.initialize`` reads it (hjson, duplicate keys refused);
    :class:`UsageError` naming the file when it is missing, unreadable, not JSON or not an object."""
    if not os.path.exists(path):
        raise UsageError(f"{path}: no such file")
    if os.path.isdir(path):
        raise UsageError(f"{path}: is a directory, not a ds_config file")
    try:
        with open(path, "rb"):
            pass
        from ds_odc.integration.initialize import load_ds_config

        config = load_ds_config(path)
    except OSError as err:
        raise UsageError(f"{path}: cannot be read ({err.strerror or err})") from None
    except ValueError as err:  # hjson's decode error, DeepSpeed's duplicate keys
        raise UsageError(f"{path}: not JSON ({err})") from None
    if not isinstance(config, dict):
        raise UsageError(f"{path}: not a ds_config (a JSON object), but a {type(config).__name__}")
    return config


def _route(config: dict) -> str:
    """How the config asks for the odc stage (before it is canonicalised)."""
    zero = config.get("zero_optimization") or {}
    if is_odc_stage(zero.get("stage")):
        return '"stage": "odc"'
    if MARKER_KEY in zero:
        return 'the marker form ("stage": 3, an "odc" block under zero_optimization)'
    if MARKER_KEY in config:
        return 'the canonical form ("stage": 3, a top-level "odc" block)'
    return f"the environment switch, {ENV_SWITCH}=odc"


def accumulation_steps(config: dict, machine: Machine) -> tuple[int, str]:
    """``gradient_accumulation_steps`` as DeepSpeed resolves it (absent: ``train_batch_size`` /
    (``train_micro_batch_size_per_gpu`` × world size), else 1; "auto": the flag, else 1), and where it came from."""
    value = config.get("gradient_accumulation_steps")
    if value == "auto" or (value is None and machine.gradient_accumulation_steps is not None):
        steps = machine.gradient_accumulation_steps
        return (1, '"auto", taken as 1 (pass --gradient-accumulation-steps)') if steps is None else (steps, "the flag")
    if value is None:
        batch, micro = config.get("train_batch_size"), config.get("train_micro_batch_size_per_gpu")
        if isinstance(batch, int) and isinstance(micro, int) and micro > 0:
            steps = max(batch // micro // machine.world_size, 1)
            return steps, f"train_batch_size {batch} / ({micro} x {machine.world_size} ranks)"
        return 1, "unset, 1 as DeepSpeed takes it"
    if not is_whole_number(value, 1):
        raise ODCConfigError(f"gradient_accumulation_steps={value!r}: a whole number >= 1, or \"auto\"")
    return value, "the config"


def check(ds_config: dict, machine: Machine) -> Verdict:
    """Validate ``ds_config`` (left untouched) for the odc stage on ``machine``, offline."""
    config = copy.deepcopy(ds_config)
    zero = config.get("zero_optimization")
    verdict = Verdict(ok=False, stage=zero.get("stage") if isinstance(zero, dict) else None, route=_route(config))
    try:
        options = canonicalize(config)
    except ODCConfigError as err:
        verdict.error = str(err)
        return verdict
    if options is None:
        verdict.error = (f"zero_optimization.stage={verdict.stage!r}: this ds_config does not ask for the odc stage; "
                         'set "stage": "odc" (or keep 3 and add "odc": {} under zero_optimization)')
        return verdict
    verdict.stage, verdict.odc = config["zero_optimization"]["stage"], options.model_dump(mode="json")
    try:
        steps, source = accumulation_steps(config, machine)
        refuse_at_initialize(config, options, machine)
    except ODCConfigError as err:
        verdict.error = str(err)
        return verdict
    managed = bool(config.get("managed_gradient_accumulation", True))
    verdict.ok, verdict.loss_rule, verdict.steps = True, loss_rule(options, managed, steps), f"{steps} ({source})"
    verdict.warnings = warnings(config, options, machine)
    if config.get("gradient_accumulation_steps") == "auto" and machine.gradient_accumulation_steps is None:
        verdict.warnings.append('gradient_accumulation_steps "auto": the framework fills it in; the loss rule takes 1 '
                                "(pass --gradient-accumulation-steps N for the value it will use)")
    return verdict


def render(path: str, verdict: Verdict, machine: Machine) -> str:
    """The text form: a refusal in one line, or the canonical form, the loss rule and the warnings."""
    if not verdict.ok:
        return f"{path}: refused: {verdict.error}"
    rows = [("stage", f"{verdict.stage}, with the top-level \"odc\" block below (asked for by {verdict.route})"),
            ("machine", f"{machine.device}, {machine.nodes} node(s) x {machine.ranks_per_node} rank(s) per node"),
            ("accumulation", f"gradient_accumulation_steps {verdict.steps}"),
            ("loss rule", verdict.loss_rule or "")]
    rows += [(f"odc.{key}", json.dumps(value)) for key, value in (verdict.odc or {}).items()]
    width = max(len(key) for key, _ in rows) + 2
    lines = [f"{path}: valid for the odc stage"]
    lines += [f"{key} {'.' * (width - len(key))} {value}" for key, value in rows]
    lines += [f"warning: {text}" for text in verdict.warnings] or ["warnings: none"]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Run ``check`` for parsed ``args``; returns the exit code (module docstring)."""
    try:
        config = read_config(args.config)
    except UsageError as err:
        if args.json:
            print(json.dumps(Verdict(ok=False, error=str(err)).as_json(), indent=2))
        print(f"{PROG}: {err}", file=sys.stderr)
        return USAGE
    machine = machine_from(args)
    verdict = check(config, machine)
    if args.json:
        print(json.dumps(verdict.as_json(), indent=2))
    else:
        print(render(args.config, verdict, machine), file=sys.stdout if verdict.ok else sys.stderr)
    return OK if verdict.ok else REFUSED
