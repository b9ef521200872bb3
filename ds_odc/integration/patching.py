"""The one way ds_odc replaces a name in another library: named, reversible, idempotent.

Two shapes, both used by every patch under ``ds_odc/integration``:

* :class:`PatchSet`: replacements that stay in place while ds_odc is registered (``deepspeed.initialize``,
  accelerate's ``HfDeepSpeedConfig.set_stage_and_offload``). Each is built from the original
  (``make(original) -> replacement``), applied once however often registration runs, and undone in
  reverse order by :meth:`PatchSet.undo`, which restores exactly the object that was there before.
* :func:`swapped`: a replacement for the duration of one call (``deepspeed.DeepSpeedEngine`` while
  ``deepspeed.initialize`` builds an ODC engine, ZeRO-3's optimizer class while the engine configures
  it, ``deepspeed.comm.barrier`` while a checkpoint is saved), restored on every exit path.
* :func:`bind`: methods of one *instance* (a Hugging Face ``Trainer`` that asked for ODC), each
  delegating to its class's own method; the class and every other instance are left alone.

Each name patched here is listed, with the reason, in :mod:`ds_odc.integration.surface`.
"""
from __future__ import annotations

import contextlib
import functools
import types
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
    """``owner.name = value`` inside the block, the original restored on every exit; yields the original.

    A name ``owner`` did not hold itself (an instance's method, found on its class) is deleted again on
    exit rather than copied onto ``owner``: afterwards the lookup is exactly what it was before."""
    own = getattr(owner, "__dict__", None)
    held = own is None or name in own
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield original
    finally:
        if held:
            setattr(owner, name, original)
        else:
            delattr(owner, name)


def bind(instance: Any, behaviours: dict[str, Callable], *, needed_for: str, release: str,
         also_needs: tuple[str, ...] = ()) -> None:
    """``instance.<name> = behaviour`` bound to ``instance``, for each name; ``behaviour(original, instance,
    *args, **kwargs)`` receives the class's own method (:func:`delegating`). Only this instance changes.

    All or nothing: if the class lacks any of the names, or of ``also_needs`` (methods the behaviours call),
    nothing is bound and :class:`~ds_odc.errors.ODCConfigError` names every missing method, ``release``
    (e.g. ``"transformers 5.23.0"``) and ``needed_for`` (what asked for the behaviours)."""
    from ds_odc.errors import ODCConfigError

    cls = type(instance)
    missing = [name for name in (*behaviours, *also_needs) if not callable(getattr(cls, name, None))]
    if missing:
        raise ODCConfigError(f"{needed_for} needs {', '.join(f'{cls.__name__}.{name}' for name in missing)}, which "
                             f"{release} does not have ({cls.__module__}.{cls.__qualname__}); install a release "
                             "ds_odc was verified with (ds_odc/integration/versions.py), or leave that option out")
    for name, behaviour in behaviours.items():
        original = getattr(cls, name)
        method = functools.wraps(original)(delegating(behaviour, original))
        setattr(instance, name, types.MethodType(method, instance))
