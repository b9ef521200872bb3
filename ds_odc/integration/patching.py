"""The one way ds_odc replaces a name in another library: named, reversible, idempotent.

Two shapes, both used by every patch under ``ds_odc/integration``:

* :class:`PatchSet`: replacements that stay in place while ds_odc is registered (``deepspeed.initialize``,
  accelerate's ``HfDeepSpeedConfig.set_stage_and_offload``). Each is built from the original
  (``make(original) -> replacement``), applied once however often registration runs, and undone in
  reverse order by :meth:`PatchSet.undo`, which restores exactly the object that was there before.
* :func:`swapped`: a replacement for the duration of one call (``deepspeed.DeepSpeedEngine`` while
  ``deepspeed.initialize`` builds an ODC engine, ZeRO-3's optimizer class while the engine configures
  it, ``deepspeed.comm.barrier`` while a checkpoint is saved), restored on every exit path.

Each name patched here is listed, with the reason, in :mod:`ds_odc.integration.surface`.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator


@dataclass
class _Applied:
    owner: Any
    name: str
    original: Any
    replacement: Any


class PatchSet:
    """Replacements installed together and undone together (see the module docstring)."""

    def __init__(self, label: str):
        self.label = label
        self._applied: list[_Applied] = []

    @property
    def active(self) -> bool:
        return bool(self._applied)

    def original(self, owner: Any, name: str) -> Any:
        """What ``owner.name`` was before this set replaced it."""
        for applied in self._applied:
            if applied.owner is owner and applied.name == name:
                return applied.original
        raise KeyError(f"{self.label}: {name} of {owner!r} is not patched")

    def replace(self, owner: Any, name: str, make: Callable[[Any], Any], *, wraps: bool = True) -> None:
        """Set ``owner.name`` to ``make(original)`` (once: a second call for the same name is a no-op).
        ``wraps``: copy the original's name and docstring onto a function replacement."""
        if any(a.owner is owner and a.name == name for a in self._applied):
            return
        original = getattr(owner, name)
        replacement = make(original)
        if wraps and callable(replacement) and callable(original):
            replacement = functools.wraps(original)(replacement)
        setattr(owner, name, replacement)
        self._applied.append(_Applied(owner, name, original, replacement))

    def undo(self) -> None:
        """Restore every original, last replacement first (a name replaced by someone else after us is
        left as they set it: undoing would drop their replacement)."""
        while self._applied:
            applied = self._applied.pop()
            if getattr(applied.owner, applied.name, None) is applied.replacement:
                setattr(applied.owner, applied.name, applied.original)


def delegating(function: Callable, original: Callable) -> Callable:
    """``function(original, *args, **kwargs)`` as a replacement for ``original``: a plain function, so it
    also binds as a method when ``original`` is one."""

    def replacement(*args, **kwargs):
        return function(original, *args, **kwargs)

    return replacement


@contextlib.contextmanager
def swapped(owner: Any, name: str, value: Any) -> Iterator[Any]:
    """``owner.name = value`` inside the block, the original restored on every exit; yields the original."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield original
    finally:
        setattr(owner, name, original)
