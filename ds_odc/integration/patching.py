"""The one way ds_odc replaces a name in another library: named, reversible, idempotent.

Two shapes, both used by every patch under ``ds_odc/integration``:

* :class:`PatchSet`: replacements that outlast one call: while ds_odc is registered (``deepspeed.initialize``,
  accelerate's ``HfDeepSpeedConfig.set_stage_and_offload``), or for an engine's life (the closures ZeRO-3
  attaches to each parameter, a coordinator's ``reset_step``, the step recorder's hooks, an entry of
  transformers' attention functions), undone by the engine's ``destroy()``. Each is built from the original
  (``make(original) -> replacement``), applied once however often it is asked for, and undone in reverse order
  by :meth:`PatchSet.undo` (all of them, or those of one owner), which restores exactly the lookup there was
  before.
* :func:`swapped`: a replacement for the duration of one call (``deepspeed.DeepSpeedEngine`` while
  ``deepspeed.initialize`` builds an ODC engine, ZeRO-3's optimizer class while the engine configures
  it, ``deepspeed.comm.barrier`` while a checkpoint is saved), restored on every exit path.
* :func:`bind`: methods of one *instance* (a Hugging Face ``Trainer`` that asked for ODC), each
  delegating to its class's own method; the class and every other instance are left alone.

Each private name patched here is listed, with the reason, in :mod:`ds_odc.integration.surface_table`
(``SURFACE``), and every patch that outlives one call has a line in its ``PROCESS_WIDE``.
"""
from __future__ import annotations

import contextlib
import functools
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional


@dataclass
class _Applied:
    owner: Any
    name: str
    original: Any
    replacement: Any
    held: bool  # the owner held the name itself (else it was found on its class, and undo deletes it again)
    item: Optional[str] = None  # replace_item: the key of the mapping entry (``name`` is then its label)


class PatchSet:
    """Replacements installed together and undone together (see the module docstring). Indexed by owner,
    so that a set over every parameter of a model replaces and undoes in time linear in their number."""

    def __init__(self, label: str):
        self.label = label
        # (id(owner), name) -> what was replaced, in the order applied; each entry holds its owner, so an
        # id is not reused while it is here
        self._applied: dict[tuple[int, str], _Applied] = {}
        self._names: dict[int, list[str]] = {}  # id(owner) -> the names replaced on it, in order

    @property
    def active(self) -> bool:
        return bool(self._applied)

    def patched(self, owner: Any, name: Optional[str] = None) -> bool:
        """Whether this set replaced ``owner.name`` (any name of ``owner`` when ``name`` is None)."""
        if name is not None:
            return (id(owner), name) in self._applied
        return id(owner) in self._names

    def original(self, owner: Any, name: str) -> Any:
        """What ``owner.name`` was before this set replaced it."""
        applied = self._applied.get((id(owner), name))
        if applied is None:
            raise KeyError(f"{self.label}: {name} of {owner!r} is not patched")
        return applied.original

    def replace(self, owner: Any, name: str, make: Callable[[Any], Any], *, wraps: bool = True) -> None:
        """Set ``owner.name`` to ``make(original)`` (once: a second call for the same name is a no-op).
        ``wraps``: copy the original's name and docstring onto a function replacement."""
        key = (id(owner), name)
        if key in self._applied:
            return
        own = getattr(owner, "__dict__", None)
        held = own is None or name in own
        original = getattr(owner, name)
        replacement = make(original)
        if wraps and callable(replacement) and callable(original):
            replacement = functools.wraps(original)(replacement)
        setattr(owner, name, replacement)
        self._applied[key] = _Applied(owner, name, original, replacement, held)
        self._names.setdefault(id(owner), []).append(name)

    def replace_item(self, mapping: Any, key: str, make: Callable[[Any], Any]) -> None:
        """Set ``mapping[key]`` to ``make(original)`` (once), for registries that are mappings (transformers'
        ``ALL_ATTENTION_FUNCTIONS``). :meth:`undo` puts the original back under ``key`` (so every lookup finds
        what it found before), unless someone replaced the entry after us."""
        name = f"[{key!r}]"
        if (id(mapping), name) in self._applied:
            return
        original = mapping[key]
        replacement = make(original)
        mapping[key] = replacement
        self._applied[(id(mapping), name)] = _Applied(mapping, name, original, replacement, held=True, item=key)
        self._names.setdefault(id(mapping), []).append(name)

    def undo(self, owner: Any = None) -> None:
        """Restore every original (only ``owner``'s, when given), last replacement first. A name replaced by
        someone else after us is left as they set it: undoing would drop their replacement. A name the
        owner did not hold itself (an instance's method, found on its class) is deleted again rather than
        copied onto the owner."""
        if owner is None:
            keys = list(self._applied)
            self._names.clear()
        else:
            keys = [(id(owner), name) for name in self._names.pop(id(owner), ())]
        for key in reversed(keys):
            applied = self._applied.pop(key)
            if applied.item is not None:  # an entry of a mapping (replace_item)
                if applied.owner.get(applied.item) is applied.replacement:
                    applied.owner[applied.item] = applied.original
                continue
            if getattr(applied.owner, applied.name, None) is not applied.replacement:
                continue
            if applied.held:
                setattr(applied.owner, applied.name, applied.original)
            else:
                delattr(applied.owner, applied.name)


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
