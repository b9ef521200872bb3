"""How a refused odc option reads: one line per problem, naming the option by its dotted path in the ds_config
and saying what to do (:func:`problems`, used by :func:`ds_odc.config.parse_options`).

Pydantic's own wording is kept where it says what a value must be ("Input should be 'auto', 'shm' or
'cuda_ipc'"), with the value given and what to do added; where it says nothing useful it is replaced: an unknown
key ("Extra inputs are not permitted") names the closest valid keys and lists them all, and a check written in
:mod:`ds_odc.config` or :mod:`ds_odc.config_options` reads as its own sentence, without pydantic's
"Value error, " and without a dump of the whole block.
"""
from __future__ import annotations

import difflib
import json
import types
import typing
from typing import Any, List, Mapping, Optional, Tuple, Type

from pydantic import BaseModel, ValidationError

__all__ = ["problems", "unknown_key"]


def unknown_key(path: str, key: str, valid: List[str]) -> str:
    """``path: not an option; did you mean 'x'? (valid: ...)``: the closest valid keys to a misspelt one."""
    spelt = key.lower().replace("-", "_")
    close = difflib.get_close_matches(spelt, valid, n=3, cutoff=0.6) or \
        [name for name in valid if len(spelt) > 3 and spelt in name][:3]  # "dtype": accumulator_dtype
    hint = f"did you mean {' or '.join(repr(name) for name in close)}?" if close else "remove it"
    return f"{path}: not an option; {hint} (valid: {', '.join(valid)})"


def _members(annotation: Any) -> List[Any]:
    """The members of a field's type: several for a union (its tags then appear in an error's location), one
    otherwise (``Optional[X]`` is X: pydantic tags no branch for it)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return members if len(members) > 1 else _members(members[0])
    return [annotation]


def _is_block(member: Any) -> bool:
    return isinstance(member, type) and issubclass(member, BaseModel)


def _where(model: Type[BaseModel], loc: Tuple[Any, ...]) -> Tuple[List[str], Optional[Type[BaseModel]], str]:
    """The keys of an error's location (a union's branch tags left out, list indices as ``[i]``), the option
    block the last key was looked up in (None past a non-block value), and which branch of a union the error
    came from ("block", "other", or "" outside a union)."""
    parts: List[str] = []
    owner: Optional[Type[BaseModel]] = model
    current: Optional[Type[BaseModel]] = model
    members: List[Any] = []
    branch = ""
    for item in loc:
        if isinstance(item, int):
            parts[-1] += f"[{item}]"
        elif members:  # a union's branch tag: the block's class name, or "literal[...]" and the like
            current = next((m for m in members if _is_block(m) and m.__name__ == item), None)
            branch, members = ("block" if current else "other"), []
        else:
            parts.append(str(item))
            owner = current
            field = current.model_fields.get(str(item)) if current is not None else None
            if field is None:
                current = None
                continue
            found = _members(field.annotation)
            members = found if len(found) > 1 else []
            current = found[0] if len(found) == 1 and _is_block(found[0]) else None
    return parts, owner, branch


def _leave_out(owner: Optional[Type[BaseModel]], key: str) -> str:
    field = owner.model_fields.get(key) if owner is not None else None
    if field is None or field.is_required():
        return ""
    default = field.get_default()
    try:
        shown = json.dumps(default)
    except TypeError:
        shown = repr(default)
    return f", or leave {key} out (default {shown})"


def _problem(error: Mapping[str, Any], model: Type[BaseModel], path_of: Mapping[str, str], block: str) -> Optional[str]:
    parts, owner, branch = _where(model, tuple(error["loc"]))
    kind, value = error["type"], error.get("input")
    if (branch == "other" and isinstance(value, dict)) or (branch == "block" and kind == "model_type"):
        return None  # the union's other branch fits the value's kind better: its error says more
    path = ".".join([path_of.get(parts[0], block), *parts]) if parts else block
    key = parts[-1].split("[")[0] if parts else ""
    if kind == "extra_forbidden":
        return unknown_key(path, key, list(owner.model_fields) if owner is not None else [])
    if kind in ("value_error", "assertion_error"):  # a check of ours: its message is the sentence
        return f"{path}: {error['ctx']['error']}"
    if kind == "missing":
        return f"{path}: Field required; set it"
    if kind in ("model_type", "dict_type"):
        fields = ", ".join(_members_of(owner, key))
        return f"{path}: {error['msg']} (got {value!r}); give its options as a dict (valid: {fields})"
    return f"{path}: {error['msg']} (got {value!r}); give a value that fits{_leave_out(owner, key)}"


def _members_of(owner: Optional[Type[BaseModel]], key: str) -> List[str]:
    field = owner.model_fields.get(key) if owner is not None else None
    blocks = [m for m in _members(field.annotation) if _is_block(m)] if field is not None else []
    return list(blocks[0].model_fields) if blocks else []


def problems(err: ValidationError, model: Type[BaseModel], path_of: Mapping[str, str], block: str) -> List[str]:
    """Each problem of a failed ``model(**options)``, once, as a line naming the option's dotted path (the block
    it was written in, ``path_of[top-level key]``, else ``block``) and what to do."""
    found: List[str] = []
    for error in err.errors():
        line = _problem(error, model, path_of, block)
        if line is not None and line not in found:
            found.append(line)
    return found
