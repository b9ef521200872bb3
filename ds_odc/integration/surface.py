"""Every private name of DeepSpeed, torch, accelerate and transformers that ds_odc relies on, checked.

ds_odc subclasses ZeRO-3 and patches DeepSpeed where no public hook exists, so it depends on names a
release may rename without notice: private and name-mangled methods it overrides or calls, attributes
ZeRO-3 creates that it reads or replaces, closures DeepSpeed attaches to every parameter, module
attributes it swaps. :data:`SURFACE` (assembled in :mod:`ds_odc.integration.surface_table`) lists them, one
:class:`PrivateName` each, grouped by owner (DeepSpeed and torch: :mod:`~ds_odc.integration.surface_deepspeed`;
accelerate and transformers: :mod:`~ds_odc.integration.surface_hf`).
:func:`assert_surface` checks the DeepSpeed and torch entries no feature claims at ``import ds_odc`` (before the
version check), so that another release fails there, naming every missing name and the ds_odc file
that needs it, instead of deep inside a training step. A private name newly used under ``ds_odc/``
belongs in that table (``tests/unit/test_surface.py`` enforces it for name-mangled ones, and that every entry
is still used by the files it names).

What each check proves, by :class:`Kind` (nothing is called, no instance is built):

* module attribute, method, class attribute: ``getattr`` on the imported module or class finds it
  (a method: and it is callable). Not its signature, nor what it does.
* dataclass field: ``name`` is one of ``dataclasses.fields(cls)``.
* typed dict key: ``cls`` is a ``TypedDict`` and ``name`` one of its keys (required or not, its bases' included):
  a keyword transformers passes through ``**kwargs`` and declares there. Not what a function does with it.
* instance attribute: ``self.<name> =`` (or ``self.<name>: T =``) is in the source of the method
  ``found_in`` of the class, so that method assigns it, at least on some path. ``hasattr`` on the
  class cannot see such attributes. Name-mangled names are searched as the class writes them
  (``self.__x``).
* parameter attribute: ``param.<name> =`` is in the source of ``Init._convert_to_deepspeed_param``,
  which attaches it to every parameter ZeRO-3 partitions (``ds_tensor`` is given its shard later).
* looked up at call time: ``name`` is in the names the code of ``found_in`` itself refers to
  (``co_names``: globals, names imported inside the function, attributes), so it is resolved when the
  function runs and swapping the module attribute around a call reaches it.
* checkpoint key: ``name=`` or ``'name'`` is in the source of the function that builds the dict.
* file name part, text in the source: the text is in the source of ``found_in`` (a function, or a file
  shipped in the package, the path relative to the package directory).
* call signature: the function ``found_in`` can be called with the keywords ``name`` lists and no other
  argument (each is a parameter it takes by keyword, or it takes ``**kwargs``; every parameter without a
  default, ``self`` aside, is among them). Not what it does with them.

Per release: an entry with ``since=`` / ``before=`` a :class:`Change` holds only on the DeepSpeed releases from /
before that change's release, and is checked only there, so each supported release is held to its own form
(``releases`` says which); likewise for transformers and accelerate within their tested ranges. :func:`has` tells
adapter code which side of a change the installed release is on.

Per feature: an entry with ``feature=`` a :class:`Feature` is needed by that feature only (the split policy's
Ulysses attention, say). :func:`assert_surface` skips it; the feature calls :func:`require_feature` when a job asks
for it (at ``initialize``), which refuses the feature by name, with the release and the missing names, on a release
that lacks one, or on a release before the feature's ``since``. Every other feature works there.

Per release, from source: :func:`check_source` (:mod:`ds_odc.integration.surface_source`) holds a release of
DeepSpeed, transformers or accelerate to the same table from its unpacked files, imported nowhere, with the same
rules (:mod:`ds_odc.integration.surface_rules`): ``tests/unit/test_release_surfaces.py`` does so for every release
of the declared ranges.

A function's source is cut from its file by the line numbers of its code object (``linecache``);
``inspect.getsource`` tokenises each block and costs ~35 ms for these functions. A text match can be
fooled by a comment; a release installed without ``.py`` sources reports every source check missing.

Its cost at ``import ds_odc`` (tens of milliseconds) is measured in docs/benchmarks.md ("The private-name check
at import"). It imports DeepSpeed's SuperOffload stage 3, which ``ds_odc.engine`` imports next anyway.

accelerate / transformers entries are checked only by ``check_surface(include_hf=True)``, and only for
the packages installed (found with ``importlib.util.find_spec``, which imports nothing): ``import
ds_odc`` must not import transformers (seconds). The names the two patches replace are checked again
when each patch is installed (``ds_odc.integration.hf`` / ``hf_trainer``), and the unit tests check
every entry against the pinned releases.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import linecache
import os
import types
import typing

from ds_odc.integration.surface_rules import accepts, found_in_of, in_source
from ds_odc.integration.surface_source import check_source
from ds_odc.integration.surface_table import (
    FEATURES,
    OPTIONAL_PACKAGES,
    PROCESS_WIDE,
    SPLIT_POLICY,
    SURFACE,
    Change,
    Feature,
    Kind,
    PrivateName,
)

__all__ = ["SURFACE", "PROCESS_WIDE", "FEATURES", "SPLIT_POLICY", "Change", "Feature", "Kind", "PrivateName",
           "check_surface", "assert_surface", "require_feature", "format_missing", "has", "applies", "refused",
           "check_source"]


# -- which release ----------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def installed_version(package: str) -> str:
    """The installed release of ``package``, read once per process (:func:`_read_version`): :func:`has` asks on hot
    paths (per gradient, per bucket), and transformers' metadata takes ~1 ms to read. A test that pretends another
    release is installed (``deepspeed.__version__`` set) calls ``installed_version.cache_clear()`` around it."""
    return _read_version(package)


def _read_version(package: str) -> str:
    """DeepSpeed's ``__version__`` (imported by ``import ds_odc`` anyway); the metadata's for the others (no
    import: transformers takes seconds)."""
    if package == "deepspeed":
        import deepspeed

        return deepspeed.__version__
    return importlib.metadata.version(package)


def has(change: Change, version: str | None = None) -> bool:
    """Whether the installed ``change.package`` (or ``version`` of it) has the newer form of ``change``. Both the
    installed release and the comparison are cached: ~0.2 us a call, where reading and parsing each time took ~8 us
    (DeepSpeed) and ~1.3 ms (transformers' metadata) (``timeit``, the shared 2-core CPU machine)."""
    return _at_least(installed_version(change.package) if version is None else version, change.release)


@functools.lru_cache(maxsize=256)
def _at_least(version: str, first: str) -> bool:
    """Whether release ``version`` (``0.19.8+cu130`` is ``0.19.8``) is ``first`` or later."""
    from packaging.version import Version

    from ds_odc.integration.versions import release

    return release(version) >= Version(first)


def applies(entry: PrivateName, version: str | None = None) -> bool:
    """Whether ``entry`` holds on the installed release (or ``version``) of its change's package."""
    return (entry.since is None or has(entry.since, version)) and \
        (entry.before is None or not has(entry.before, version))


def refused(feature: Feature, package: str | None = None, version: str | None = None) -> bool:
    """Whether ``feature`` is refused on the installed release (or ``version`` of ``package``) for being older
    than its ``since``. A version of another package than the change's says nothing: False."""
    if feature.since is None or (package is not None and package != feature.since.package):
        return False
    return not has(feature.since, version)


# -- checking the installed releases ----------------------------------------------------------------------
def _owner(entry: PrivateName):
    owner = importlib.import_module(entry.module)
    for part in entry.cls.split(".") if entry.cls else ():
        owner = getattr(owner, part)
    return owner


def _code(function, name: str) -> types.CodeType:
    """The code of ``function`` (named ``name``), through decorators: those that say what they wrap
    (``functools.wraps``), and those that only hold it in their closure (DeepSpeed's ``instrument_w_nvtx``)."""
    function = inspect.unwrap(getattr(function, "__func__", function))
    if function.__name__ != name:
        held = [cell.cell_contents for cell in function.__closure__ or () if inspect.isfunction(cell.cell_contents)]
        function = next((inner for inner in held if inner.__name__ == name), function)
    return function.__code__


def _last_line(code: types.CodeType) -> int:
    nested = [_last_line(const) for const in code.co_consts if isinstance(const, types.CodeType)]
    return max([line for _, _, line in code.co_lines() if line] + nested + [code.co_firstlineno])


def _source(entry: PrivateName, owner, cache: dict) -> str:
    """The text of ``entry.found_in``: a function's definition (the lines its code spans), or a file."""
    found_in = found_in_of(entry)
    key = (entry.owner, found_in)
    if key not in cache:
        if "/" in found_in:
            package_dir = os.path.dirname(inspect.getfile(importlib.import_module(entry.module)))
            with open(os.path.join(package_dir, found_in), encoding="utf-8", errors="replace") as file:
                cache[key] = file.read()
        else:
            code = _code(getattr(owner, found_in), found_in)
            lines = linecache.getlines(code.co_filename)
            cache[key] = "".join(lines[code.co_firstlineno - 1:_last_line(code)])
    return cache[key]


def _present(entry: PrivateName, cache: dict) -> bool:
    kind = entry.kind
    try:
        owner = _owner(entry)
        if kind in (Kind.MODULE_ATTRIBUTE, Kind.CLASS_ATTRIBUTE):
            return hasattr(owner, entry.name)
        if kind is Kind.METHOD:
            return callable(getattr(owner, entry.name, None))
        if kind is Kind.DATACLASS_FIELD:
            return dataclasses.is_dataclass(owner) and entry.name in {f.name for f in dataclasses.fields(owner)}
        if kind is Kind.TYPED_DICT_KEY:
            return typing.is_typeddict(owner) and entry.name in owner.__required_keys__ | owner.__optional_keys__
        if kind is Kind.CALL_TIME_LOOKUP:
            return entry.name in _code(getattr(owner, found_in_of(entry)), found_in_of(entry)).co_names
        if kind is Kind.SIGNATURE:
            function = inspect.unwrap(getattr(getattr(owner, found_in_of(entry)), "__func__",
                                              getattr(owner, found_in_of(entry))))
            parameters = [(p.name, p.kind, p.default is not p.empty)
                          for p in inspect.signature(function, follow_wrapped=False).parameters.values()]
            return accepts(entry, parameters)
        source = _source(entry, owner, cache)
    except Exception:  # noqa: BLE001 - a module that fails to import, a class or function gone: not there
        return False
    return in_source(entry, source, cache)


def check_surface(include_hf: bool = False, entries: tuple[PrivateName, ...] = SURFACE,
                  feature: Feature | None = None) -> list[PrivateName]:
    """The entries not found, of those that hold on the installed DeepSpeed release (:func:`applies`): the
    entries no feature claims, or with ``feature`` those of that feature (accelerate / transformers ones
    included, where installed). Otherwise accelerate / transformers entries only with ``include_hf=True``, and
    only for those of the two that are installed (checking imports them: seconds for transformers)."""
    cache: dict = {}  # (owner, found_in) -> source text; (owner, found_in, receiver) -> names it assigns
    missing = []
    for entry in entries:
        if entry.feature != feature:
            continue
        if entry.package in OPTIONAL_PACKAGES and not \
                ((include_hf or feature is not None) and importlib.util.find_spec(entry.package)):
            continue
        if not applies(entry):
            continue
        if not _present(entry, cache):
            missing.append(entry)
    return missing


def format_missing(missing: list[PrivateName]) -> str:
    """The ImportError text: every missing name, where it was expected, and who needs it."""
    import deepspeed
    import torch

    from ds_odc.integration.versions import supported_deepspeed

    def held_on(entry: PrivateName) -> str:
        return f", as {entry.releases} has it" if entry.releases else ""

    lines = [f"ds_odc {__import__('ds_odc').__version__} supports deepspeed{supported_deepspeed()} (found "
             f"deepspeed {deepspeed.__version__}, torch {torch.__version__}), and {len(missing)} private name(s) "
             "it relies on are missing:"]
    lines += [f"  - {entry.describe()}{held_on(entry)}: needed by {entry.used_by} ({entry.why})" for entry in missing]
    lines.append(f"Install deepspeed{supported_deepspeed()} (and a torch release it supports); the names ds_odc "
                 "relies on, per release where they differ, are listed in ds_odc/integration/surface_table.py.")
    return "\n".join(lines)


def assert_surface(include_hf: bool = False) -> None:
    """Raise ImportError naming every missing entry (see :func:`check_surface`)."""
    missing = check_surface(include_hf=include_hf)
    if missing:
        raise ImportError(format_missing(missing))


def require_feature(feature: Feature, entries: tuple[PrivateName, ...] = SURFACE) -> None:
    """Refuse ``feature`` by name (``ODCConfigError``) on the installed releases when one of its private names is
    missing, or when the release is older than its ``since``; called when a job asks for it, at ``initialize``,
    before anything is built. On such a release ``import ds_odc`` and every other feature work."""
    from ds_odc.errors import ODCConfigError

    found = ", ".join(f"{package} {installed_version(package)}" for package in
                      ["deepspeed", *[p for p in OPTIONAL_PACKAGES if importlib.util.find_spec(p)]])
    change = feature.since
    if change is not None and refused(feature):
        raise ODCConfigError(f"{feature.name} needs {change.package}>={change.release} ({change.newer}); found "
                             f"{found}: {change.older}. Install {change.package}>={change.release}, or ask for "
                             "another feature: everything else works on this release")
    missing = check_surface(entries=entries, feature=feature)
    if missing:
        raise ODCConfigError(
            f"{feature.name} needs {len(missing)} private name(s) that the installed release does not have "
            f"(found {found}):\n" + "\n".join(f"  - {e.describe()}: needed by {e.used_by} ({e.why})" for e in missing)
            + "\nEverything else works on this release; ds_odc/integration/surface_table.py lists the names each "
            "release has.")
