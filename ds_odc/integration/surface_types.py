"""What an entry of the surface tables is (:class:`PrivateName`, its :class:`Kind`; a :class:`Change` between
releases; a :class:`Feature`; a :class:`ProcessWide` effect), and the ds_odc files the tables name. Types only:
the tables are assembled in :mod:`ds_odc.integration.surface_table`, and :mod:`ds_odc.integration.surface` checks
the names and explains what each check proves."""
from __future__ import annotations

import dataclasses
import enum


class Kind(enum.Enum):
    """How ds_odc depends on a name, which decides how it is checked (see :mod:`ds_odc.integration.surface`)."""
    MODULE_ATTRIBUTE = "module attribute"
    METHOD = "method"
    CLASS_ATTRIBUTE = "class attribute"
    DATACLASS_FIELD = "dataclass field"
    TYPED_DICT_KEY = "typed dict key"
    INSTANCE_ATTRIBUTE = "instance attribute"
    PARAMETER_ATTRIBUTE = "parameter attribute"
    CALL_TIME_LOOKUP = "looked up at call time"
    CHECKPOINT_KEY = "checkpoint key"
    FILE_NAME = "file name part"
    SOURCE_TEXT = "text in the source"
    SIGNATURE = "call signature"


@dataclasses.dataclass(frozen=True)
class Change:
    """A difference between two supported releases of ``package`` (DeepSpeed, or transformers / accelerate within
    their tested ranges). ``release`` is the first with the newer form.

    Entries of :data:`~ds_odc.integration.surface_table.SURFACE` say which form they belong to (``since=`` the
    change, or ``before=`` it), so the import-time check holds each release to its own form. Adapter code that must
    act differently asks :func:`ds_odc.integration.surface.has` about the change by its constant (in
    :mod:`ds_odc.integration.surface_releases`), never about a version number: that module is the one place that
    knows which release changed what."""
    key: str  # the constant's name, which the adapter files that act on the change refer to
    release: str
    newer: str  # what the releases from ``release`` on have
    older: str  # what the earlier releases have, and what ds_odc does there
    package: str = "deepspeed"


@dataclasses.dataclass(frozen=True)
class Feature:
    """A part of ds_odc a job asks for, whose private names the rest of ds_odc does not need. Its entries
    (``feature=`` it) are not checked at ``import ds_odc``: the feature checks them when a job asks for it
    (:func:`ds_odc.integration.surface.require_feature`, at ``initialize``), and is refused there, by name, on a
    release that lacks one, while every other feature works. ``since``: the feature is refused on the releases
    before that change (its ``older`` says why); on those, its entries are not required of the release."""
    key: str  # the constant's name (in :mod:`ds_odc.integration.surface_releases`)
    name: str  # as a user asks for it, e.g. "balance policy 'lb-mini-split'"
    since: Change | None = None


@dataclasses.dataclass(frozen=True)
class PrivateName:
    """One name ds_odc relies on, where it lives, and which ds_odc file needs it for what."""
    module: str
    cls: str | None  # None: the name belongs to the module; "Outer.Inner" for a nested class
    name: str  # as ds_odc spells it: name-mangled names in their mangled form
    kind: Kind
    used_by: str  # the file(s) that use it, from the repository root
    why: str
    found_in: str | None = None  # source checks: a function of ``cls`` (else of the module), or a file
    since: Change | None = None  # the entry holds from this change's release on (None: every supported release)
    before: Change | None = None  # the entry holds only before this change's release
    feature: Feature | None = None  # checked for this feature only, when a job asks for it (None: at import)

    @property
    def owner(self) -> str:
        return f"{self.module}.{self.cls}" if self.cls else self.module

    @property
    def package(self) -> str:
        return self.module.split(".")[0]

    def describe(self) -> str:
        """Where the name was expected, e.g. ``self.lp_param_buffer assigned in deepspeed...Stage3._create_...``."""
        if self.found_in and "/" in self.found_in:
            where = f"{self.module.replace('.', '/')}/{self.found_in}"
        else:
            where = f"{self.owner}.{self.found_in}"
        return {
            Kind.INSTANCE_ATTRIBUTE: f"self.{self.name} assigned in {where}",
            Kind.PARAMETER_ATTRIBUTE: f"param.{self.name} assigned in {where}",
            Kind.CALL_TIME_LOOKUP: f"{self.name} looked up at call time by {where}",
            Kind.CHECKPOINT_KEY: f"checkpoint key {self.name!r} written by {where}",
            Kind.FILE_NAME: f"file name part {self.name!r} in {where}",
            Kind.SOURCE_TEXT: f"{self.name!r} in the source of {where}",
            Kind.SIGNATURE: f"{where} called with the keywords {self.name} alone",
        }.get(self.kind, f"{self.kind.value} {self.owner}.{self.name}")

    @property
    def releases(self) -> str:
        """The releases the entry holds for, as a specifier of the change's package ("" for every supported one)."""
        change = self.since or self.before
        if change is None:
            return ""
        return change.package + ",".join(([f">={self.since.release}"] if self.since else []) +
                                         ([f"<{self.before.release}"] if self.before else []))


@dataclasses.dataclass(frozen=True)
class ProcessWide:
    """Something ds_odc changes beyond its own objects, for how long, and why it cannot be narrower."""
    what: str
    lifetime: str
    why: str
    where: str


# -- the ds_odc files the tables name (``used_by``, ``where``), spelled once ---------------------------------------
OPT, PARAMS = "ds_odc/integration/zero3_optimizer.py", "ds_odc/integration/zero3_params.py"
WINDOWS, CKPT = "ds_odc/integration/zero3_windows.py", "ds_odc/integration/checkpoints.py"
FROZEN, ACTIVATIONS = "ds_odc/integration/zero3_frozen.py", "ds_odc/integration/activation_offload.py"
INIT, METRICS = "ds_odc/integration/initialize.py", "ds_odc/integration/metrics_hooks.py"
TIMEOUTS, SHM = "ds_odc/integration/timeouts.py", "ds_odc/integration/clean_exit.py"
HF, TRAINER, ENGINE = "ds_odc/integration/hf.py", "ds_odc/integration/hf_trainer.py", "ds_odc/integration/engine.py"
BALANCE, LOADER, COST = ("ds_odc/integration/hf_balance.py", "ds_odc/integration/hf_balance_loader.py",
                         "ds_odc/integration/hf_cost.py")
SPLIT, PACKED = "ds_odc/integration/split_attention.py", "ds_odc/integration/packed_attention.py"
HF_SP = "ds_odc/integration/hf_sequence_parallel.py"
PUBLISH, HF_METRICS = "ds_odc/integration/metrics_publish.py", "ds_odc/integration/hf_metrics.py"
