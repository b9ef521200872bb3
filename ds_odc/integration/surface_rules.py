"""The rules both checkers apply, stated once: the import-time check (:mod:`ds_odc.integration.surface`, on the
imported release) and the source check (:mod:`ds_odc.integration.surface_source`, on a release's files) read an
entry's source text, name-mangled names and call signatures the same way, so a release passes one exactly when it
passes the other. What each rule proves is listed by :class:`~ds_odc.integration.surface_types.Kind` in
:mod:`ds_odc.integration.surface`."""
from __future__ import annotations

import inspect
import re

from ds_odc.integration.surface_types import Kind, PrivateName


def assigned_attributes(source: str, receiver: str) -> set[str]:
    """Names in ``<receiver>.<name> =`` or ``<receiver>.<name>: T =`` (not ``==``, not ``.<name>.x =``)."""
    return set(re.findall(rf"\b{receiver}\.(\w+)\s*(?::[^=\n]*)?=(?!=)", source))


def as_written_in(cls: str | None, name: str) -> str:
    """``_Cls__x`` is written ``__x`` inside class ``Cls`` (Python mangles it when compiling)."""
    if cls:
        prefix = f"_{cls.split('.')[-1].lstrip('_')}__"
        if name.startswith(prefix):
            return "__" + name[len(prefix):]
    return name


def in_source(entry: PrivateName, source: str, cache: dict) -> bool:
    """The rules of the kinds checked on a function's or a file's text."""
    kind = entry.kind
    if kind in (Kind.INSTANCE_ATTRIBUTE, Kind.PARAMETER_ATTRIBUTE):
        receiver = "self" if kind is Kind.INSTANCE_ATTRIBUTE else "param"
        key = (entry.owner, entry.found_in, receiver)
        if key not in cache:
            cache[key] = assigned_attributes(source, receiver)
        return as_written_in(entry.cls, entry.name) in cache[key]
    if kind is Kind.CHECKPOINT_KEY:
        escaped = re.escape(entry.name)
        return re.search(rf"\b{escaped}=|['\"]{escaped}['\"]", source) is not None
    return entry.name in source  # Kind.FILE_NAME, Kind.SOURCE_TEXT


#: A parameter as the signature rule sees it: (name, inspect.Parameter kind, has a default).
Parameter = tuple[str, "inspect._ParameterKind", bool]


def accepts(entry: PrivateName, parameters: list[Parameter]) -> bool:
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


def found_in_of(entry: PrivateName) -> str:
    """``entry.found_in``, which the source-reading kinds need (a table error without it)."""
    if entry.found_in is None:
        raise ValueError(f"{entry.owner}.{entry.name}: a {entry.kind} check reads found_in, which is not set")
    return entry.found_in
