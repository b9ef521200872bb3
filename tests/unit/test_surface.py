"""``ds_odc.integration.surface``: every private name ds_odc relies on is listed, found, and missed loudly."""
import dataclasses
import os
import re
import subprocess
import sys
from typing import TypedDict

import deepspeed
import deepspeed.runtime.engine as ds_engine
import deepspeed.runtime.zero.partitioned_param_coordinator as ds_coordinator
import deepspeed.runtime.zero.stage3 as ds_stage3
import pytest
from packaging.version import Version

from ds_odc.errors import ODCConfigError
from ds_odc.integration import register, split_attention, surface, surface_table
from ds_odc.integration.surface import (
    SURFACE,
    Kind,
    PrivateName,
    applies,
    assert_surface,
    check_source,
    check_surface,
    has,
    require_feature,
)
from ds_odc.integration.surface_table import CHANGES, FEATURES, SPLIT_POLICY, Change, Feature
from ds_odc.integration.versions import DEEPSPEED_RANGE, TESTED_HF, check_deepspeed_version, supported_deepspeed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = "tests/unit/test_surface.py"  # the user named by the entries these tests make up


def _entry(name: str) -> PrivateName:
    (entry,) = [e for e in SURFACE if e.name == name and e.kind in (Kind.METHOD, Kind.MODULE_ATTRIBUTE)]
    return entry


# -- on the pinned releases, everything is where ds_odc expects it ---------------------------------------
def test_every_deepspeed_and_torch_entry_is_found_on_the_pinned_release():
    missing = check_surface()
    assert missing == [], surface.format_missing(missing)


def test_every_accelerate_and_transformers_entry_is_found_on_the_pinned_releases():
    pytest.importorskip("transformers")
    missing = check_surface(include_hf=True)
    assert missing == [], surface.format_missing(missing)


@pytest.mark.parametrize("feature", FEATURES, ids=[f.key for f in FEATURES])
def test_every_entry_of_each_feature_is_found_on_the_pinned_releases(feature):
    pytest.importorskip("transformers")
    assert [e for e in SURFACE if e.feature is feature], "a feature no entry names"
    if surface.refused(feature):  # a release before the feature's since (in the version matrix): refused by name
        with pytest.raises(ODCConfigError, match=re.escape(f"{feature.name} needs {feature.since.package}>=")):
            require_feature(feature)
        return
    missing = check_surface(feature=feature)
    assert missing == [], surface.format_missing(missing)
    require_feature(feature)


def test_importing_ds_odc_checks_no_hf_name_and_imports_neither_hf_library():
    # DeepSpeed before 0.19.8 imports transformers itself (deepspeed.linear, when it is installed): not ds_odc's
    code = ("import sys, deepspeed\n"
            "hf = {'transformers', 'accelerate'}; by_deepspeed = hf & set(sys.modules)\n"
            "import ds_odc\n"
            "assert hf & set(sys.modules) <= by_deepspeed, sorted(sys.modules)\n")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "DS_ODC_AUTOLOAD": "0"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_hf_entries_are_checked_only_when_asked_and_installed(monkeypatch):
    pytest.importorskip("accelerate")
    gone = PrivateName("accelerate.utils.deepspeed", None, "no_such_function", Kind.MODULE_ATTRIBUTE, HERE, "test")
    assert check_surface(entries=(gone,)) == []
    assert check_surface(include_hf=True, entries=(gone,)) == [gone]
    monkeypatch.setattr(surface.importlib.util, "find_spec", lambda name: None)  # as if not installed
    assert check_surface(include_hf=True, entries=(gone,)) == []


# -- each kind of check reports a name that is gone ---------------------------------------------------------
@pytest.mark.parametrize("owner, name", [
    (ds_stage3.DeepSpeedZeroOptimizer_Stage3, "_get_norm_groups"),
    (ds_stage3.DeepSpeedZeroOptimizer_Stage3, "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads"),
    (ds_engine.DeepSpeedEngine, "_take_model_step"),
    (ds_coordinator, "assert_ints_same_as_other_ranks"),
])
def test_a_removed_method_or_module_attribute_is_reported_by_name(monkeypatch, owner, name):
    monkeypatch.delattr(owner, name)
    assert check_surface() == [_entry(name)]
    with pytest.raises(ImportError) as raised:
        assert_surface()
    message = str(raised.value)
    assert f"{_entry(name).owner}.{name}: needed by {_entry(name).used_by}" in message
    assert f"deepspeed{supported_deepspeed()}" in message and "ds_odc/integration/surface_table.py" in message


def test_every_missing_name_is_listed_in_one_error(monkeypatch):
    monkeypatch.delattr(ds_stage3.DeepSpeedZeroOptimizer_Stage3, "_post_step")
    monkeypatch.delattr(ds_engine.DeepSpeedEngine, "_backward_epilogue")  # names every supported release has
    monkeypatch.delattr(ds_coordinator, "assert_ints_same_as_other_ranks")
    with pytest.raises(ImportError) as raised:
        assert_surface()
    message = str(raised.value)
    assert "3 private name(s)" in message
    for name in ("_post_step", "_backward_epilogue", "assert_ints_same_as_other_ranks"):
        assert name in message


def test_registering_ds_odc_fails_on_a_missing_name(monkeypatch):
    monkeypatch.delattr(ds_engine.DeepSpeedEngine, "_configure_zero_optimizer")
    expected = r"DeepSpeedEngine\._configure_zero_optimizer: needed by ds_odc/integration/engine\.py"
    with pytest.raises(ImportError, match=expected):
        register()


def _helper():
    return None


@dataclasses.dataclass
class _Bucket:
    params: list = dataclasses.field(default_factory=list)


class _ZeroLike:
    """Stands in for a DeepSpeed class; ``_ZeroLikeRenamed`` is the same after an upstream rename."""
    STATUS = 1

    def __init__(self):
        self.lp_buffer = None
        self.__grads: dict = {}  # name-mangled: _ZeroLike__grads

    def reduce_ipg_grads(self):
        return None

    def step(self):
        return _helper()

    def convert(self, param):
        param.ds_id = 0

    def state(self):
        return dict(frozen_shapes=None)

    def file_name(self):
        return "zero_pp_rank_0_model_states.pt"

    def build(self, attn, batch_size, process_group=None, **_):
        return attn, batch_size, process_group


class _Offsets(TypedDict, total=False):
    cu_seq_lens: list


class _Kwargs(_Offsets, total=False):
    """Stands in for transformers' FlashAttentionKwargs (a TypedDict: ``hasattr`` sees none of its keys)."""
    max_length: int


class _KwargsRenamed(TypedDict, total=False):
    cu_seq_lengths: list
    max_len: int


@dataclasses.dataclass
class _BucketRenamed:
    tensors: list = dataclasses.field(default_factory=list)


class _ZeroLikeRenamed:
    STATUS_V2 = 1

    def __init__(self):
        self.lp_buffer_v2 = None
        self.__grads_v2: dict = {}

    def reduce_and_partition_ipg_grads(self):
        return None

    def step(self):
        return None

    def convert(self, param):
        param.ds_index = 0

    def state(self):
        return dict(frozen_sizes=None)

    def file_name(self):
        return "rank_0_model_states.pt"

    def build(self, attn, batch_size, local_seq_length, process_group=None):
        return attn, batch_size, local_seq_length, process_group


_RENAMED_ENTRIES = [
    (Kind.MODULE_ATTRIBUTE, None, "_helper", None),
    (Kind.METHOD, "_ZeroLike", "reduce_ipg_grads", None),
    (Kind.CLASS_ATTRIBUTE, "_ZeroLike", "STATUS", None),
    (Kind.DATACLASS_FIELD, "_Bucket", "params", None),
    (Kind.TYPED_DICT_KEY, "_Kwargs", "max_length", None),
    (Kind.TYPED_DICT_KEY, "_Kwargs", "cu_seq_lens", None),  # a base's key
    (Kind.INSTANCE_ATTRIBUTE, "_ZeroLike", "lp_buffer", "__init__"),
    (Kind.INSTANCE_ATTRIBUTE, "_ZeroLike", "_ZeroLike__grads", "__init__"),
    (Kind.PARAMETER_ATTRIBUTE, "_ZeroLike", "ds_id", "convert"),
    (Kind.CALL_TIME_LOOKUP, "_ZeroLike", "_helper", "step"),
    (Kind.CHECKPOINT_KEY, "_ZeroLike", "frozen_shapes", "state"),
    (Kind.FILE_NAME, "_ZeroLike", "zero_pp_rank_", "file_name"),
    (Kind.SIGNATURE, "_ZeroLike", "attn, batch_size, process_group", "build"),
]


@pytest.mark.parametrize("kind, cls, name, found_in", _RENAMED_ENTRIES,
                         ids=[f"{kind.value}: {name}" for kind, _, name, _ in _RENAMED_ENTRIES])
def test_every_kind_of_check_finds_the_name_and_reports_it_once_renamed(monkeypatch, kind, cls, name, found_in):
    entry = PrivateName(__name__, cls, name, kind, HERE, "test", found_in=found_in)
    assert check_surface(entries=(entry,)) == []
    module = sys.modules[__name__]
    if cls is None:
        monkeypatch.delattr(module, name)
    else:
        monkeypatch.setattr(module, cls, {"_ZeroLike": _ZeroLikeRenamed, "_Bucket": _BucketRenamed,
                                          "_Kwargs": _KwargsRenamed}[cls])
    assert check_surface(entries=(entry,)) == [entry]
    assert name in surface.format_missing([entry])


def test_a_renamed_assignment_is_reported_with_the_method_that_should_make_it(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "_ZeroLike", _ZeroLikeRenamed)
    entry = PrivateName(__name__, "_ZeroLike", "lp_buffer", Kind.INSTANCE_ATTRIBUTE, HERE, "test", found_in="__init__")
    message = surface.format_missing(check_surface(entries=(entry,)))
    assert f"self.lp_buffer assigned in {__name__}._ZeroLike.__init__: needed by {HERE}" in message


# -- the list stays complete and current ---------------------------------------------------------------------
def _sources(folder: str):
    """``{path from the repository root: text}`` of the Python files under ``folder``."""
    found = {}
    for directory, _, files in os.walk(os.path.join(ROOT, folder)):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(directory, file)
                with open(path) as source:
                    found[os.path.relpath(path, ROOT)] = source.read()
    return found


def test_every_name_mangled_deepspeed_name_used_under_ds_odc_is_listed():
    listed = {entry.name for entry in SURFACE}
    used = {(path, name) for path, text in _sources("ds_odc").items()
            for name in re.findall(r"\b_DeepSpeed\w*?__[A-Za-z]\w*", text)}
    assert used, "the pattern no longer finds the mangled names ds_odc is known to use"
    unlisted = sorted(f"{name} ({path})" for path, name in used if name not in listed)
    assert not unlisted, f"add these to SURFACE (ds_odc/integration/surface_deepspeed.py): {unlisted}"


def test_every_entry_names_the_ds_odc_files_that_use_it():
    """A name a rewrite stopped using must leave the list (and a renamed file be followed)."""
    sources = {**_sources("ds_odc"), **{name: open(os.path.join(ROOT, name)).read()
                                        for name in ("ds_odc_autoload.py", "ds_odc_import_hooks.py")}}
    stale = []
    for entry in SURFACE:
        for path in entry.used_by.split(", "):
            text = sources.get(path, "")
            if entry.kind is Kind.SIGNATURE:  # the call the file makes: each keyword passed by name
                word = "".join(rf"(?=[\s\S]*\b{re.escape(k.strip())}=)" for k in entry.name.split(","))
            elif entry.kind is Kind.SOURCE_TEXT and (entry.before or entry.since):  # a release's code, not a name:
                word = rf"\b{(entry.before or entry.since).key}\b"  # the file acts on the change
            elif entry.kind is Kind.SOURCE_TEXT:  # code every release has (a keyword it passes): each name in it
                word = "".join(rf"(?=[\s\S]*\b{name}\b)" for name in re.findall(r"\w+", entry.name))
            else:
                word = re.escape(entry.name) if entry.kind is Kind.FILE_NAME else \
                    rf"(?<!\w){re.escape(entry.name)}(?!\w)"
            if not re.search(word, text):
                stale.append(f"{entry.describe()} not in {path}")
    assert not stale, "update SURFACE (ds_odc/integration/surface_deepspeed.py, surface_hf.py):\n" + "\n".join(stale)


def test_entries_are_unique_and_source_checks_say_where_to_look():
    keys = [(e.owner, e.name, e.kind, e.found_in) for e in SURFACE]
    assert len(keys) == len(set(keys))
    needs_source = {Kind.INSTANCE_ATTRIBUTE, Kind.PARAMETER_ATTRIBUTE, Kind.CALL_TIME_LOOKUP, Kind.CHECKPOINT_KEY,
                    Kind.FILE_NAME, Kind.SOURCE_TEXT, Kind.SIGNATURE}
    assert all((e.found_in is not None) == (e.kind in needs_source) for e in SURFACE)


# -- per release: each supported DeepSpeed release is held to its own form ------------------------------------
def test_every_change_is_inside_the_range_named_by_its_constant_and_has_entries():
    ranges = {"deepspeed": DEEPSPEED_RANGE, **TESTED_HF}
    for change in CHANGES:
        assert getattr(surface_table, change.key) is change
        low, high = (Version(v) for v in ranges[change.package])
        assert low < Version(change.release) <= high, change
        assert [e for e in SURFACE if change in (e.since, e.before)] or [f for f in FEATURES if f.since is change], \
            f"{change.key}: no entry or feature says what changed"
    assert all(e.since in CHANGES + (None,) and e.before in CHANGES + (None,) for e in SURFACE)
    for feature in FEATURES:
        assert getattr(surface_table, feature.key) is feature and feature.since in CHANGES + (None,)
    assert all(e.feature in FEATURES + (None,) for e in SURFACE)


@pytest.fixture
def pretend_deepspeed(monkeypatch):
    """``pretend_deepspeed(version)``: the installed DeepSpeed reads as ``version`` for the rest of the test
    (``installed_version`` reads a release once per process: its cache is forgotten then, and after the test)."""

    def pretend(version: str) -> None:
        monkeypatch.setattr(deepspeed, "__version__", version)
        surface.installed_version.cache_clear()

    yield pretend
    surface.installed_version.cache_clear()


def test_has_reads_the_installed_release_once_and_compares_each_release_once(monkeypatch):
    """has() is asked per gradient and per bucket: the installed release of each package is read once, and each
    (release, change) comparison made once, however often it is asked; an explicit version is answered as asked,
    reading nothing installed."""
    import importlib.util

    from ds_odc.integration import versions

    norm, run_epoch = surface_table.NORM_DTYPE, surface_table.TRAINER_RUN_EPOCH
    reads, parsed = [], []
    read, release = surface._read_version, versions.release
    monkeypatch.setattr(surface, "_read_version", lambda package: reads.append(package) or read(package))
    monkeypatch.setattr(versions, "release", lambda version: parsed.append(version) or release(version))
    surface.installed_version.cache_clear()
    surface._at_least.cache_clear()
    try:
        assert {has(norm) for _ in range(1000)} == {release(deepspeed.__version__) >= Version(norm.release)}
        assert reads == ["deepspeed"] and parsed == [deepspeed.__version__]
        compared = {(deepspeed.__version__, norm.release)}
        if importlib.util.find_spec("transformers"):
            installed = read("transformers")
            assert {has(run_epoch) for _ in range(1000)} == {release(installed) >= Version(run_epoch.release)}
            assert reads == ["deepspeed", "transformers"]
            compared.add((installed, run_epoch.release))
        read_before = list(reads)
        asked = ((norm, "0.19.5", False), (norm, "0.19.6", True), (norm, "0.19.6+cu130", True),
                 (run_epoch, "5.2.0", False), (run_epoch, "5.3.0.dev0", True))
        for change, version, newer in asked:
            assert [has(change, version) for _ in range(100)] == [newer] * 100, (change.key, version)
        compared |= {(version, change.release) for change, version, _ in asked}
        assert reads == read_before and len(parsed) == len(compared)
    finally:
        surface.installed_version.cache_clear()
        surface._at_least.cache_clear()


def test_an_entry_holds_from_or_before_the_release_of_its_change():
    change = Change("X", "0.19.4", "newer", "older")
    newer = PrivateName("deepspeed", None, "x", Kind.MODULE_ATTRIBUTE, HERE, "test", since=change)
    older = PrivateName("deepspeed", None, "x", Kind.MODULE_ATTRIBUTE, HERE, "test", before=change)
    for version, is_newer in (("0.19.3", False), ("0.19.4", True), ("0.19.4+cu130", True), ("0.19.8", True),
                              ("0.18.0", False)):
        assert has(change, version) is is_newer
        assert applies(newer, version) is is_newer and applies(older, version) is not is_newer
    assert newer.releases == "deepspeed>=0.19.4" and older.releases == "deepspeed<0.19.4"


def test_each_release_is_held_to_its_own_form(pretend_deepspeed):
    """The installed DeepSpeed as if it were a release on the other side of NORM_DTYPE: the other side's forms
    are looked for, and those it does not have are reported (named with the releases they hold for); the
    installed side's forms are not looked for."""
    newer = has(surface_table.NORM_DTYPE)
    pretend_deepspeed("0.18.0" if newer else DEEPSPEED_RANGE[1])
    missing = check_surface()
    assert missing and all((e.before if newer else e.since) is not None for e in missing), \
        [e.describe() for e in missing]
    names = {e.name for e in missing}
    if newer:  # 0.19.6+: sums in get_norm_dtype(); 0.19.3+: the checkpoint keys moved
        assert ".double().norm(2)" in names
        assert "as deepspeed<0.19.6 has it" in surface.format_missing(missing)
    else:
        assert "get_norm_dtype" in names
        assert "as deepspeed>=0.19.6 has it" in surface.format_missing(missing)


@pytest.mark.parametrize("version", ["0.18.0", "0.18.9", "0.19.0", "0.19.6", "0.19.8", "0.19.8+cu130"])
def test_releases_in_the_range_pass_the_version_check(version):
    check_deepspeed_version(version)


@pytest.mark.parametrize("version", ["0.17.6", "0.16.9", "0.19.9", "0.20.0"])
def test_a_release_outside_the_range_is_refused_by_name(version):
    with pytest.raises(ImportError, match=rf"needs deepspeed>=0\.18\.0,<=0\.19\.8 .*found {re.escape(version)}"):
        check_deepspeed_version(version)


def test_registering_ds_odc_refuses_a_release_outside_the_range(monkeypatch, pretend_deepspeed):
    pretend_deepspeed("0.20.0")
    monkeypatch.setattr(surface, "check_surface", lambda include_hf=False: [])  # as if every name were there
    with pytest.raises(ImportError, match="found 0.20.0"):
        register()


# -- per feature: a name only one feature needs is checked for that feature, at initialize ---------------------
_GATED = Feature("_GATED", "the test's feature")


def test_a_missing_feature_name_leaves_import_alone_and_refuses_that_feature_by_name(monkeypatch):
    gone = PrivateName(__name__, "_ZeroLike", "no_such_method", Kind.METHOD, HERE, "test", feature=_GATED)
    there = PrivateName(__name__, "_ZeroLike", "step", Kind.METHOD, HERE, "test", feature=_GATED)
    monkeypatch.setattr(surface, "SURFACE", SURFACE + (gone, there))
    assert check_surface(entries=(gone, there)) == []  # what import ds_odc checks: not the feature's names
    assert check_surface(entries=(gone, there), feature=_GATED) == [gone]
    assert check_surface(entries=(gone, there), feature=SPLIT_POLICY) == []  # another feature's names only
    with pytest.raises(ODCConfigError) as raised:
        require_feature(_GATED, entries=(gone, there))
    message = str(raised.value)
    assert "the test's feature needs 1 private name(s)" in message and f"deepspeed {deepspeed.__version__}" in message
    assert f"method {__name__}._ZeroLike.no_such_method: needed by {HERE}" in message and "step" not in message


@pytest.mark.parametrize("version", ["0.18.0", "0.18.1"])
def test_the_split_policy_is_refused_by_name_at_enable_on_a_release_before_its_since(pretend_deepspeed, version):
    """DeepSpeed 0.18.0/0.18.1's Ulysses requires local_seq_length and global_seq_length, which the split policy
    does not pass: refused by name, with the release, before anything is built (enable's first call)."""
    pretend_deepspeed(version)
    with pytest.raises(ODCConfigError, match=rf"balance policy 'lb-mini-split' needs deepspeed>=0\.18\.2 .*found "
                                             rf"deepspeed {re.escape(version)}.*everything else works"):
        split_attention.enable(engine=None, runtime=None, balance=None, timeout_s=1.0)


def test_the_split_policy_needs_no_core_attn_implementation_before_deepspeed_0_19_0(monkeypatch):
    """0.18.x's Ulysses has no core_attn_implementation and its forward never reads one: setting it is harmless,
    so the entry holds from 0.19.0 on and the policy works on 0.18.2-0.18.9."""
    (entry,) = [e for e in SURFACE if e.name == "core_attn_implementation"]
    assert entry.feature is SPLIT_POLICY and entry.since is surface_table.ULYSSES_CORE_ATTN
    assert not applies(entry, "0.18.9") and applies(entry, "0.19.0")
    assert not surface.refused(SPLIT_POLICY, "deepspeed", "0.18.2") and surface.refused(SPLIT_POLICY, "deepspeed",
                                                                                           "0.18.1")


# -- from source: a release checked from its files, nothing imported --------------------------------------------
_TREE = {  # a package as a release ships it
    "fakeds/__init__.py": "from .engine import Engine\nfrom .engine import initialize as init\n",
    "fakeds/comm/__init__.py": "from .comm import *\n",
    "fakeds/comm/comm.py": "def barrier():\n    pass\n\ndef _private():\n    pass\n",
    "fakeds/base.py": "class Base:\n    def save(self):\n        return dict(frozen_shapes=1)\n",
    "fakeds/engine.py": """import dataclasses
from dataclasses import dataclass
from typing import TypedDict
from .base import Base
try:
    from fast import helper
except ImportError:
    helper = None
__all__ = ["Engine"]


def initialize(config):
    engine = Engine()
    return engine, helper


class Engine(Base):
    STATUS = 1
    __slots__ = ()

    def __init__(self, attn, batch_size, process_group=None, **_):
        self.lp_buffer = None
        self.__grads: dict = {}

    @staticmethod
    def convert(param):
        param.ds_id = 0

    def __reduce_grads(self):
        return "zero_pp_rank_"

    class Inner:
        KEY = 2


Alias = Engine


@dataclasses.dataclass
class Bucket:
    params: list


class Offsets(TypedDict, total=False):
    offsets: list


class Kwargs(Offsets, total=False):
    max_length: int
""",
    "fakeds/ops/shm.cpp": 'const char* name = "deepspeed_allreduce_buffer";\n',
}
_FROM_SOURCE = [
    ("fakeds", None, "Engine", Kind.MODULE_ATTRIBUTE, None),  # a re-export
    ("fakeds", None, "init", Kind.MODULE_ATTRIBUTE, None),  # an alias of a re-export
    ("fakeds.comm", None, "barrier", Kind.MODULE_ATTRIBUTE, None),  # through import *
    ("fakeds.engine", None, "helper", Kind.MODULE_ATTRIBUTE, None),  # bound in a try block
    ("fakeds.engine", "Engine", "STATUS", Kind.CLASS_ATTRIBUTE, None),
    ("fakeds.engine", "Engine.Inner", "KEY", Kind.CLASS_ATTRIBUTE, None),
    ("fakeds.engine", "Alias", "convert", Kind.METHOD, None),  # a class through its alias
    ("fakeds.engine", "Engine", "_Engine__reduce_grads", Kind.METHOD, None),  # name-mangled
    ("fakeds.engine", "Engine", "save", Kind.METHOD, None),  # a base's, in another file
    ("fakeds.engine", "Bucket", "params", Kind.DATACLASS_FIELD, None),
    ("fakeds.engine", "Kwargs", "max_length", Kind.TYPED_DICT_KEY, None),
    ("fakeds.engine", "Kwargs", "offsets", Kind.TYPED_DICT_KEY, None),  # a base's key
    ("fakeds.engine", "Engine", "lp_buffer", Kind.INSTANCE_ATTRIBUTE, "__init__"),
    ("fakeds.engine", "Engine", "_Engine__grads", Kind.INSTANCE_ATTRIBUTE, "__init__"),
    ("fakeds.engine", "Engine", "ds_id", Kind.PARAMETER_ATTRIBUTE, "convert"),
    ("fakeds.engine", None, "Engine", Kind.CALL_TIME_LOOKUP, "initialize"),
    ("fakeds.engine", "Engine", "frozen_shapes", Kind.CHECKPOINT_KEY, "save"),  # in a base's method
    ("fakeds.engine", "Engine", "zero_pp_rank_", Kind.FILE_NAME, "__reduce_grads"),
    ("fakeds", None, "deepspeed_allreduce_buffer", Kind.FILE_NAME, "ops/shm.cpp"),
    ("fakeds.engine", "Engine", "attn, batch_size, process_group", Kind.SIGNATURE, "__init__"),
]
_RENAMED = {  # each of the names above, gone in a later release
    "fakeds/__init__.py": ("from .engine import Engine", "from .engine import Engine2"),
    "fakeds/comm/comm.py": ("def barrier", "def barrier2"),
    "fakeds/base.py": ("frozen_shapes", "frozen_sizes"),
}
_REWRITTEN_ENGINE = [("import initialize as init", ""), ("helper", "helper2"), ("STATUS", "STATUS2"),
                     ("KEY", "KEY2"), ("convert", "convert2"), ("__reduce_grads", "__reduce"), ("save", "save"),
                     ("params: list", "params = []"), ("max_length: int", "max_len: int"),
                     ("offsets: list", "offset_list: list"), ("self.lp_buffer", "self.lp_buffer.x"),
                     ("self.__grads:", "grads:"), ("param.ds_id", "param.ds_index"),
                     ("engine = Engine()", "engine = object()"), ('"zero_pp_rank_"', '"rank_"'),
                     ("attn, batch_size, process_group=None, **_", "attn, batch_size, seq_length, process_group=None")]


def _reader(files: dict):
    return files.get


def _renamed_tree() -> dict:
    files = dict(_TREE)
    for path, (old, new) in _RENAMED.items():
        files[path] = files[path].replace(old, new)
    files["fakeds/__init__.py"] = files["fakeds/__init__.py"].replace("import initialize as init", "import Base")
    engine = files["fakeds/engine.py"]
    for old, new in _REWRITTEN_ENGINE:
        engine = engine.replace(old, new)
    files["fakeds/engine.py"] = engine.replace("class Engine(Base)", "class Engine")
    files["fakeds/ops/shm.cpp"] = 'const char* name = "allreduce";\n'
    return files


@pytest.mark.parametrize("module, cls, name, kind, found_in", _FROM_SOURCE,
                         ids=[f"{kind.value}: {name}" for _, _, name, kind, _ in _FROM_SOURCE])
def test_the_source_check_finds_every_kind_and_reports_each_once_gone(module, cls, name, kind, found_in):
    entry = PrivateName(module, cls, name, kind, HERE, "test", found_in=found_in)
    assert check_source(_reader(_TREE), "fakeds", "1.0.0", (entry,)) == []
    assert check_source(_reader(_renamed_tree()), "fakeds", "1.1.0", (entry,)) == [entry]


def test_the_source_check_reads_no_module_the_release_lacks_and_checks_only_its_own_package():
    gone = PrivateName("fakeds.missing", None, "x", Kind.MODULE_ATTRIBUTE, HERE, "test")
    private = PrivateName("fakeds.comm", None, "_private", Kind.MODULE_ATTRIBUTE, HERE, "test")  # not through *
    other = PrivateName("otherpkg", None, "x", Kind.MODULE_ATTRIBUTE, HERE, "test")
    assert check_source(_reader(_TREE), "fakeds", "1.0.0", (gone, private, other)) == [gone, private]


def test_the_source_check_holds_each_release_to_its_own_form_and_skips_a_refused_feature():
    change = Change("X", "1.1.0", "newer", "older", package="fakeds")
    older = PrivateName("fakeds.engine", "Engine", "STATUS", Kind.CLASS_ATTRIBUTE, HERE, "test", before=change)
    newer = PrivateName("fakeds.engine", "Engine", "STATUS2", Kind.CLASS_ATTRIBUTE, HERE, "test", since=change)
    feature = Feature("F", "the test's feature", since=Change("Y", "1.2.0", "newer", "older", package="fakeds"))
    needed = PrivateName("fakeds.engine", "Engine", "KEY3", Kind.CLASS_ATTRIBUTE, HERE, "test", feature=feature)
    for version, tree in (("1.0.0", _TREE), ("1.1.0", _renamed_tree())):
        assert check_source(_reader(tree), "fakeds", version, (older, newer)) == []  # each its own form
        assert check_source(_reader(tree), "fakeds", version, (older, newer, needed)) == []  # F refused there
    both = {**_TREE, "fakeds/engine.py": _TREE["fakeds/engine.py"].replace("STATUS = 1", "STATUS = 1\n    KEY3 = 3")}
    assert check_source(_reader(_TREE), "fakeds", "1.2.0", (older, newer, needed)) == [newer, needed]
    assert check_source(_reader(both), "fakeds", "1.2.0", (older, newer, needed)) == [newer]


def test_the_source_check_agrees_with_the_import_time_check_on_the_installed_deepspeed():
    """The same table, the installed release read as files instead of imported: the same verdicts."""
    root = os.path.dirname(os.path.dirname(deepspeed.__file__))

    def read(path):
        full = os.path.join(root, path)
        return open(full, encoding="utf-8").read() if os.path.isfile(full) else None

    entries = tuple(e for e in SURFACE if e.package == "deepspeed")
    assert check_source(read, "deepspeed", deepspeed.__version__, entries) == []
    gone = tuple(dataclasses.replace(e, name=e.name + "_gone") for e in entries if e.kind is not Kind.SIGNATURE)
    from_source = check_source(read, "deepspeed", deepspeed.__version__, gone)
    assert from_source == [e for e in gone if applies(e) and not (e.feature and surface.refused(e.feature))]
    split = set() if surface.refused(SPLIT_POLICY) else set(check_surface(entries=gone, feature=SPLIT_POLICY))
    assert set(from_source) == set(check_surface(entries=gone)) | split


def test_the_source_rule_for_call_time_lookups_sees_every_name_co_names_holds():
    """Over every method of DeepSpeed's engine and ZeRO-3 optimizer, as installed: each name of its ``co_names`` is
    among those the source rule reads from its definition (name-mangled ones as the class writes them)."""
    import ast
    import inspect

    from ds_odc.integration.surface_rules import as_written_in
    from ds_odc.integration.surface_source import _looked_up

    unseen, checked = [], 0
    for module, cls in ((ds_engine, "DeepSpeedEngine"), (ds_stage3, "DeepSpeedZeroOptimizer_Stage3")):
        tree = ast.parse(open(module.__file__, encoding="utf-8").read())
        (classdef,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
        for node in classdef.body:
            function = getattr(getattr(module, cls), as_written_in(None, node.name), None) \
                if isinstance(node, ast.FunctionDef) else None
            function = inspect.unwrap(getattr(function, "__func__", function)) if function else None
            if function is None or getattr(function, "__name__", None) != node.name:
                continue  # a property, or a decorator that hides what it wraps
            checked += 1
            names = {as_written_in(cls, name) for name in function.__code__.co_names}
            unseen += [f"{cls}.{node.name}: {name}" for name in names - _looked_up(node)]
    assert checked > 100 and not unseen, unseen
