"""Checking a release from its source, imported nowhere: :func:`check_source` holds a release of DeepSpeed,
transformers or accelerate to the surface table without installing or importing it, from its unpacked files
(``tests/unit/test_release_surfaces.py`` does so for every release of the declared ranges). Re-exported by
:mod:`ds_odc.integration.surface`, whose docstring says what each kind of check proves.

Each kind is checked on the syntax tree (``ast``) of the module that defines the owner: a module attribute is a
top-level definition, assignment or import of the name in the module file (``if``/``try`` blocks included;
``from x import *`` and re-exports followed into the package); a method or class attribute is defined in the class
body, a dataclass field is annotated there (in a ``@dataclass`` class), a typed dict key is annotated there (as a
TypedDict declares its keys), and ``found_in`` is a function of the class body; each but a dataclass field is looked
up in the class's bases too when the class body lacks it (bases the package defines; ``getattr`` does the same on
the imported class, and a TypedDict holds its bases' keys). The rules that read source text (instance and parameter
attributes, checkpoint keys, text, file names) and the call signature rule are the ones the import-time check
applies, stated once in :mod:`ds_odc.integration.surface_rules`. A call-time lookup is a name the function itself
reads as a global, an attribute or an import (not its parameters and locals, not nested functions): what
``co_names`` holds. torch's entries are not checked from source (its C++ classes have none).
"""
from __future__ import annotations

import ast
import inspect
from typing import Callable, Optional

from ds_odc.integration.surface_rules import Parameter, accepts, as_written_in, found_in_of, in_source
from ds_odc.integration.surface_table import SURFACE
from ds_odc.integration.surface_types import Kind, PrivateName

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


def _annotated(node) -> list[str]:
    """The name a statement of a class body annotates (``x: int``, with a value or without): a TypedDict's key."""
    return [node.target.id] if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) else []


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

    def member(self, module: str, classdef: ast.ClassDef, name: str, seen: int = 0,
               binds: Callable[[ast.AST], list[str]] = _bound):
        """``(module, statement)``: the statement of ``classdef``'s body that binds ``name``, or of the body of a
        base the release defines (as ``getattr`` finds it on the imported class), or None. ``binds``: the names a
        statement binds (:func:`_annotated`: the keys a TypedDict's body declares)."""
        node = next((n for n in reversed(_body(classdef.body)) if name in binds(n)), None)
        if node is not None:
            return module, node
        for base in classdef.bases if seen < 8 else ():
            path = ast.unparse(base).split(".")
            imported = self.resolve(module, path[0]) if len(path) > 1 else None  # module.Class, as this file has it
            hit = self.cls(module, path[0]) if len(path) == 1 else \
                self.cls(imported[0], path[-1]) if imported else None
            found = self.member(hit[0], hit[1], name, seen + 1, binds) if hit else None
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
        return text is not None and in_source(entry, text, cache)
    if entry.cls:
        owner = tree.cls(entry.module, entry.cls)
        if owner is None:
            return False
        where, classdef = owner
        if kind in (Kind.METHOD, Kind.CLASS_ATTRIBUTE):
            return tree.member(where, classdef, as_written_in(entry.cls, entry.name)) is not None
        if kind is Kind.TYPED_DICT_KEY:
            return tree.member(where, classdef, entry.name, binds=_annotated) is not None
        if kind is Kind.DATACLASS_FIELD:
            return _is_dataclass(classdef) and any(
                isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id == entry.name and
                "ClassVar" not in ast.unparse(n.annotation) for n in classdef.body)
        hit = tree.member(where, classdef, found_in_of(entry))
    else:
        hit = tree.resolve(entry.module, found_in_of(entry))
    where, function = hit or (entry.module, None)
    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    if kind is Kind.CALL_TIME_LOOKUP:
        return as_written_in(entry.cls, entry.name) in _looked_up(function)
    if kind is Kind.SIGNATURE:
        return accepts(entry, _parameters(function))
    return in_source(entry, tree.text(where, function), cache)


def check_source(read: Callable[[str], Optional[str]], package: str, version: str,
                 entries: tuple[PrivateName, ...] = SURFACE) -> list[PrivateName]:
    """The entries of ``package`` that hold on its release ``version`` (:func:`~ds_odc.integration.surface.applies`)
    and are not in that release's source, read with ``read(path)`` (a path from the directory holding the package,
    e.g. ``deepspeed/runtime/engine.py``; None where the release has no such file). Nothing is imported or built.
    The entries of a feature refused on that release (:func:`~ds_odc.integration.surface.refused`) are not required
    of it."""
    # surface re-exports this function, so it is imported from there when called, not when this module loads
    from ds_odc.integration.surface import applies, refused

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
