"""Every private name of DeepSpeed, torch, accelerate and transformers that ds_odc relies on, checked.

ds_odc subclasses ZeRO-3 and patches DeepSpeed where no public hook exists, so it depends on names a
release may rename without notice: private and name-mangled methods it overrides or calls, attributes
ZeRO-3 creates that it reads or replaces, closures DeepSpeed attaches to every parameter, module
attributes it swaps. :data:`SURFACE` (in :mod:`ds_odc.integration.surface_table`) lists them, one
:class:`PrivateName` each, grouped by owner.
:func:`assert_surface` checks the DeepSpeed and torch entries no feature claims at ``import ds_odc`` (before the
version check), so that another release fails there, naming every missing name and the ds_odc file
that needs it, instead of deep inside a training step. A private name newly used under ``ds_odc/``
belongs in that table (``tests/unit/test_surface.py`` enforces it for name-mangled ones, and that every entry
is still used by the files it names).

What each check proves, by :class:`Kind` (nothing is called, no instance is built):

* module attribute, method, class attribute: ``getattr`` on the imported module or class finds it
  (a method: and it is callable). Not its signature, nor what it does.
* dataclass field: ``name`` is one of ``dataclasses.fields(cls)``.
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
(``releases`` says which); likewise for transformers within its tested range. :func:`has` tells adapter code which
side of a change the installed release is on.

Per feature: an entry with ``feature=`` a :class:`Feature` is needed by that feature only (the split policy's
Ulysses attention, say). :func:`assert_surface` skips it; the feature calls :func:`require_feature` when a job asks
for it (at ``initialize``), which refuses the feature by name, with the release and the missing names, on a release
that lacks one, or on a release before the feature's ``since``. Every other feature works there.

Per release, from source: :func:`check_source` holds a release of DeepSpeed, transformers or accelerate to the same
table without installing or importing it, from its unpacked files (``tests/unit/test_release_surfaces.py`` does
so for every release of the declared ranges). Each kind is checked on the syntax tree (``ast``) of the module that
defines the owner: a module attribute is a top-level definition, assignment or import of the name in the module
file (``if``/``try`` blocks included; ``from x import *`` and re-exports followed into the package); a method or
class attribute is defined in the class body, a dataclass field is annotated there (in a ``@dataclass`` class),
and ``found_in`` is a function of the class body; each is looked up in the class's bases too when the class body
lacks it (bases the package defines; ``getattr`` does the same on the imported class). The rules that read source
text (instance and parameter attributes, checkpoint keys, text, file names) and the call signature rule are the
ones the import-time check applies, stated once below. A call-time lookup is a name the function itself reads as a
global, an attribute or an import (not its parameters and locals, not nested functions): what ``co_names`` holds.
torch's entries are not checked from source (its C++ classes have none).

A function's source is cut from its file by the line numbers of its code object (``linecache``);
``inspect.getsource`` tokenises each block and costs ~35 ms for these functions. A text match can be
fooled by a comment; a release installed without ``.py`` sources reports every source check missing.

Cost at import: 12-26 ms, median 19 ms, over 9 fresh interpreters (``time.perf_counter`` around the
call inside ``import ds_odc``, which took 4-6 s; a shared 2-core CPU machine at load 5); ~5 ms when
called again. It imports DeepSpeed's SuperOffload stage 3, which ``ds_odc.engine`` imports next anyway.

accelerate / transformers entries are checked only by ``check_surface(include_hf=True)``, and only for
the packages installed (found with ``importlib.util.find_spec``, which imports nothing): ``import
ds_odc`` must not import transformers (seconds). The names the two patches replace are checked again
when each patch is installed (``ds_odc.integration.hf`` / ``hf_trainer``), and the unit tests check
every entry against the pinned releases.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.metadata
import importlib.util
import inspect
import linecache
import os
import re
import types
from typing import Callable, Optional

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
def installed_version(package: str) -> str:
    """DeepSpeed's ``__version__`` (imported by ``import ds_odc`` anyway); the metadata's for the others (no
    import: transformers takes seconds)."""
    if package == "deepspeed":
        import deepspeed

        return deepspeed.__version__
    return importlib.metadata.version(package)


def has(change: Change, version: str | None = None) -> bool:
    """Whether the installed ``change.package`` (or ``version`` of it) has the newer form of ``change``."""
    from packaging.version import Version

    from ds_odc.integration.versions import release

    return release(installed_version(change.package) if version is None else version) >= Version(change.release)


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


# -- the rules, stated once (the import-time check and the source check both apply them) -------------------
def _assigned_attributes(source: str, receiver: str) -> set[str]:
    """Names in ``<receiver>.<name> =`` or ``<receiver>.<name>: T =`` (not ``==``, not ``.<name>.x =``)."""
    return set(re.findall(rf"\b{receiver}\.(\w+)\s*(?::[^=\n]*)?=(?!=)", source))


def _as_written_in(cls: str | None, name: str) -> str:
    """``_Cls__x`` is written ``__x`` inside class ``Cls`` (Python mangles it when compiling)."""
    if cls:
        prefix = f"_{cls.split('.')[-1].lstrip('_')}__"
        if name.startswith(prefix):
            return "__" + name[len(prefix):]
    return name


def _in_source(entry: PrivateName, source: str, cache: dict) -> bool:
    """The rules of the kinds checked on a function's or a file's text."""
    kind = entry.kind
    if kind in (Kind.INSTANCE_ATTRIBUTE, Kind.PARAMETER_ATTRIBUTE):
        receiver = "self" if kind is Kind.INSTANCE_ATTRIBUTE else "param"
        key = (entry.owner, entry.found_in, receiver)
        if key not in cache:
            cache[key] = _assigned_attributes(source, receiver)
        return _as_written_in(entry.cls, entry.name) in cache[key]
    if kind is Kind.CHECKPOINT_KEY:
        escaped = re.escape(entry.name)
        return re.search(rf"\b{escaped}=|['\"]{escaped}['\"]", source) is not None
    return entry.name in source  # Kind.FILE_NAME, Kind.SOURCE_TEXT


#: A parameter as the signature rule sees it: (name, inspect.Parameter kind, has a default).
Parameter = tuple[str, "inspect._ParameterKind", bool]


def _accepts(entry: PrivateName, parameters: list[Parameter]) -> bool:
    """The call-signature rule: the function takes each keyword of ``entry.name`` by keyword (or takes
    ``**kwargs``), and needs no other argument (every parameter without a default is among them; a method's
    first parameter aside)."""
    keywords = {word.strip() for word in entry.name.split(",")}
    if entry.cls:
        parameters = parameters[1:]
    by_keyword = {name for name, kind, _ in parameters
                  if kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    takes_any = any(kind is inspect.Parameter.VAR_KEYWORD for _, kind, _ in parameters)
    required = {name for name, kind, default in parameters
                if not default and kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)}
    return (takes_any or keywords <= by_keyword) and required <= keywords


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


def _found_in(entry: PrivateName) -> str:
    if entry.found_in is None:
        raise ValueError(f"{entry.owner}.{entry.name}: a {entry.kind} check reads found_in, which is not set")
    return entry.found_in


def _source(entry: PrivateName, owner, cache: dict) -> str:
    """The text of ``entry.found_in``: a function's definition (the lines its code spans), or a file."""
    found_in = _found_in(entry)
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
        if kind is Kind.CALL_TIME_LOOKUP:
            return entry.name in _code(getattr(owner, _found_in(entry)), _found_in(entry)).co_names
        if kind is Kind.SIGNATURE:
            function = inspect.unwrap(getattr(getattr(owner, _found_in(entry)), "__func__",
                                              getattr(owner, _found_in(entry))))
            parameters = [(p.name, p.kind, p.default is not p.empty)
                          for p in inspect.signature(function, follow_wrapped=False).parameters.values()]
            return _accepts(entry, parameters)
        source = _source(entry, owner, cache)
    except Exception:  # noqa: BLE001 - a module that fails to import, a class or function gone: not there
        return False
    return _in_source(entry, source, cache)


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


# -- checking a release from its source, imported nowhere --------------------------------------------------
_Function = ast.FunctionDef | ast.AsyncFunctionDef


def _body(statements: list) -> list:
    """The statements run when the module or class body runs: into ``if``/``try``/``with`` blocks, not into
    functions."""
    found = []
    for node in statements:
        found.append(node)
        for block in ("body", "orelse", "finalbody", "handlers"):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and \
                    isinstance(getattr(node, block, None), list):
                found += _body(getattr(node, block))
    return found


def _bound(node) -> list[str]:
    """The names a statement of a module or class body binds."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and getattr(node, "value", None) is not None:
        targets = list(node.targets) if isinstance(node, ast.Assign) else [node.target]  # ``x: int`` binds nothing
        names = []
        while targets:  # ``a = ...``, ``a, (b, *c) = ...``; not ``a.x = ...`` nor ``a[0] = ...``
            target = targets.pop()
            if isinstance(target, ast.Name):
                names.append(target.id)
            elif isinstance(target, (ast.Tuple, ast.List, ast.Starred)):
                targets += target.elts if not isinstance(target, ast.Starred) else [target.value]
        return names
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [(alias.asname or alias.name).split(".")[0] for alias in node.names if alias.name != "*"]
    return []


class _SourceTree:
    """One release's files (``read(path)``: a path from the directory holding the package, None where the release
    has no such file), parsed on demand."""

    def __init__(self, read: Callable[[str], Optional[str]]):
        self.read = read
        self.parsed: dict[str, Optional[tuple[str, ast.Module, bool]]] = {}
        self.lines: dict[str, list[str]] = {}

    def module(self, module: str) -> Optional[tuple[str, ast.Module, bool]]:
        """``(text, tree, is_package)`` of a dotted module, or None."""
        if module not in self.parsed:
            self.parsed[module] = None
            for path, is_package in ((module.replace(".", "/") + "/__init__.py", True),
                                     (module.replace(".", "/") + ".py", False)):
                text = self.read(path)
                if text is not None:
                    self.parsed[module] = (text, ast.parse(text), is_package)
                    break
        return self.parsed[module]

    def package_dir(self, module: str) -> str:
        found = self.module(module)
        return module.replace(".", "/") if found and found[2] else module.rpartition(".")[0].replace(".", "/")

    def resolve(self, module: str, name: str, depth: int = 0):
        """``(module, node)``: where ``name`` of ``module`` is defined, following imports and ``*`` into the files
        of the release; ``(module, import node)`` where it comes from elsewhere; None if the module lacks it."""
        found = self.module(module)
        if found is None or depth > 8:
            return None
        _, tree, is_package = found
        stars = []
        for node in reversed(_body(tree.body)):  # the last binding wins
            if isinstance(node, ast.ImportFrom):
                source = self._absolute(module, node, is_package)
                for alias in node.names:
                    if alias.name == "*":
                        stars.append(source)
                    elif (alias.asname or alias.name) == name:
                        return self.resolve(source, alias.name, depth + 1) or \
                            (self.module(f"{source}.{alias.name}") and (f"{source}.{alias.name}", None)) or \
                            (module, node)
            elif name in _bound(node):
                return module, node
        for source in stars:
            hit = self.resolve(source, name, depth + 1)
            if hit is not None and not name.startswith("_"):
                return hit
        return None

    @staticmethod
    def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
        if not node.level:
            return node.module or ""
        parts = module.split(".")
        base = parts[:len(parts) - node.level + (1 if is_package else 0)]
        return ".".join(base + ([node.module] if node.module else []))

    def cls(self, module: str, dotted: str):
        """``(module, ClassDef)`` of ``Outer.Inner`` in ``module``, or None."""
        first, *rest = dotted.split(".")
        hit = self.resolve(module, first)
        for _ in range(8):  # an alias of a class (``PretrainedConfig = PreTrainedConfig``): the class
            value = getattr(hit[1], "value", None) if hit else None
            if not isinstance(value, ast.Name):
                break
            hit = self.resolve(hit[0], value.id)
        if hit is None or not isinstance(hit[1], ast.ClassDef):
            return None
        where, node = hit
        for part in rest:
            node = next((n for n in _body(node.body) if isinstance(n, ast.ClassDef) and n.name == part), None)
            if node is None:
                return None
        return where, node

    def member(self, module: str, classdef: ast.ClassDef, name: str, seen: int = 0):
        """``(module, statement)``: the statement of ``classdef``'s body that binds ``name``, or of the body of a
        base the release defines (as ``getattr`` finds it on the imported class), or None."""
        node = next((n for n in reversed(_body(classdef.body)) if name in _bound(n)), None)
        if node is not None:
            return module, node
        for base in classdef.bases if seen < 8 else ():
            path = ast.unparse(base).split(".")
            imported = self.resolve(module, path[0]) if len(path) > 1 else None  # module.Class, as this file has it
            hit = self.cls(module, path[0]) if len(path) == 1 else \
                self.cls(imported[0], path[-1]) if imported else None
            found = self.member(hit[0], hit[1], name, seen + 1) if hit else None
            if found is not None:
                return found
        return None

    def text(self, module: str, node) -> str:
        """A function's definition, decorators included (the lines its code spans when imported)."""
        if module not in self.lines:
            parsed = self.module(module)
            self.lines[module] = parsed[0].splitlines(keepends=True) if parsed else []
        lines = self.lines[module]
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        return "".join(lines[first - 1:node.end_lineno])


def _looked_up(function: _Function) -> set[str]:
    """The names ``function`` itself looks up when it runs, as its ``co_names`` holds them: globals it reads (names
    neither parameters nor assigned in it, or declared ``global``), attributes, and what it imports (the modules, by
    their dotted names, and the names taken from them). Not those of functions nested in it."""
    loads: set[str] = set()
    stores = {a.arg for a in ast.walk(function.args) if isinstance(a, ast.arg)}
    declared: set[str] = set()
    found: set[str] = set()  # attributes and imports: looked up whatever the function's locals are
    todo: list[ast.AST] = list(function.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stores.add(getattr(node, "name", ""))  # its body is its own code; what its definition evaluates is ours
            todo += getattr(node, "decorator_list", []) + getattr(node, "bases", []) + getattr(node, "keywords", [])
            arguments = getattr(node, "args", None)
            if arguments is not None:
                todo += [d for d in arguments.defaults + arguments.kw_defaults if d is not None]
                todo += [a.annotation for a in ast.walk(arguments) if isinstance(a, ast.arg) and a.annotation]
            returns = getattr(node, "returns", None)
            todo += [returns] if returns is not None else []
            continue
        if isinstance(node, (ast.Global, ast.Nonlocal)):
            declared.update(node.names)
        elif isinstance(node, ast.Name):
            (loads if isinstance(node.ctx, ast.Load) else stores).add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            found.update([node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            found.update(alias.name for alias in node.names)
            stores.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        todo += list(ast.iter_child_nodes(node))
    return {name for name in loads if name not in stores} | ((loads | stores) & declared) | found


def _parameters(function: _Function) -> list[Parameter]:
    args, kind = function.args, inspect.Parameter
    positional = args.posonlyargs + args.args
    defaults = [False] * (len(positional) - len(args.defaults)) + [True] * len(args.defaults)
    found: list[Parameter] = [(a.arg, kind.POSITIONAL_ONLY if a in args.posonlyargs else kind.POSITIONAL_OR_KEYWORD,
                               d) for a, d in zip(positional, defaults)]
    found += [(args.vararg.arg, kind.VAR_POSITIONAL, False)] if args.vararg else []
    found += [(a.arg, kind.KEYWORD_ONLY, d is not None) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    return found + ([(args.kwarg.arg, kind.VAR_KEYWORD, False)] if args.kwarg else [])


def _is_dataclass(classdef: ast.ClassDef) -> bool:
    return any(ast.unparse(d.func if isinstance(d, ast.Call) else d).split(".")[-1] == "dataclass"
               for d in classdef.decorator_list)


def _present_in_source(entry: PrivateName, tree: _SourceTree, cache: dict) -> bool:
    kind = entry.kind
    if kind is Kind.MODULE_ATTRIBUTE:
        return tree.resolve(entry.module, entry.name) is not None
    if entry.found_in is not None and "/" in entry.found_in:  # a file shipped in the package
        text = tree.read(f"{tree.package_dir(entry.module)}/{entry.found_in}")
        return text is not None and _in_source(entry, text, cache)
    if entry.cls:
        owner = tree.cls(entry.module, entry.cls)
        if owner is None:
            return False
        where, classdef = owner
        if kind in (Kind.METHOD, Kind.CLASS_ATTRIBUTE):
            return tree.member(where, classdef, _as_written_in(entry.cls, entry.name)) is not None
        if kind is Kind.DATACLASS_FIELD:
            return _is_dataclass(classdef) and any(
                isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id == entry.name and
                "ClassVar" not in ast.unparse(n.annotation) for n in classdef.body)
        hit = tree.member(where, classdef, _found_in(entry))
    else:
        hit = tree.resolve(entry.module, _found_in(entry))
    where, function = hit or (entry.module, None)
    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    if kind is Kind.CALL_TIME_LOOKUP:
        return _as_written_in(entry.cls, entry.name) in _looked_up(function)
    if kind is Kind.SIGNATURE:
        return _accepts(entry, _parameters(function))
    return _in_source(entry, tree.text(where, function), cache)


def check_source(read: Callable[[str], Optional[str]], package: str, version: str,
                 entries: tuple[PrivateName, ...] = SURFACE) -> list[PrivateName]:
    """The entries of ``package`` that hold on its release ``version`` (:func:`applies`) and are not in that
    release's source, read with ``read(path)`` (a path from the directory holding the package, e.g.
    ``deepspeed/runtime/engine.py``; None where the release has no such file). Nothing is imported or built.
    The entries of a feature refused on that release (:func:`refused`) are not required of it."""
    tree, missing = _SourceTree(read), []
    cache: dict = {}
    for entry in entries:
        if entry.package != package or entry.package == "torch":
            continue
        changes = [c for c in (entry.since, entry.before) if c is not None]
        if any(c.package == package for c in changes) and not applies(entry, version):
            continue
        if entry.feature is not None and refused(entry.feature, package, version):
            continue
        if not _present_in_source(entry, tree, cache):
            missing.append(entry)
    return missing
