"""Every rank built the same model: checked once, before anything is partitioned or exchanged.

A ZeRO-3 shard means "elements [r·n, (r+1)·n) of parameter k", on every rank, so ranks that built
different models (another config file, a code version skew, a rank-dependent branch in the model's
constructor) would pull bytes of one tensor into another, or hang in the first collective whose
sizes differ. :func:`check_same_parameters` compares a digest of every rank's parameter list in one
collective and, if they differ, fails on every rank naming the first differing parameter.
"""
from __future__ import annotations

import hashlib
from typing import Any, List, Optional, Sequence

from ds_odc.errors import ODCConfigError

#: One parameter as ranks compare it: (name, shape, trainable).
Entry = tuple


def first_difference(entries_by_rank: Sequence[List[Entry]]) -> Optional[str]:
    """Where the parameter lists of several ranks first differ (None if they agree).

    >>> a = [("w", (2, 3), True), ("b", (2,), True)]
    >>> first_difference([a, a]) is None
    True
    >>> first_difference([a, [("w", (2, 3), True), ("c", (4,), False)]])
    "parameter #1: rank 0 has 'b' of shape (2,) (trainable), rank 1 has 'c' of shape (4,) (frozen)"
    """
    def text(entry) -> str:
        if entry is None:
            return "no such parameter"
        name, shape, trainable = entry
        return f"{name!r} of shape {tuple(shape)} ({'trainable' if trainable else 'frozen'})"

    reference = entries_by_rank[0]
    for rank, entries in enumerate(entries_by_rank[1:], start=1):
        for index in range(max(len(reference), len(entries))):
            mine = reference[index] if index < len(reference) else None
            theirs = entries[index] if index < len(entries) else None
            if mine != theirs:
                return f"parameter #{index}: rank 0 has {text(mine)}, rank {rank} has {text(theirs)}"
    return None


def check_same_parameters(entries: List[Entry], group=None) -> None:
    """Collective: raise ODCConfigError on every rank unless every rank passed the same ``entries``."""
    import torch.distributed as tdist

    world = tdist.get_world_size(group)
    digest = hashlib.sha256(repr([(n, tuple(s), t) for n, s, t in entries]).encode()).hexdigest()
    digests: List[Any] = [None] * world  # every rank's digest, once gathered
    tdist.all_gather_object(digests, digest, group=group)
    if len(set(digests)) == 1:
        return
    everyone: List[Any] = [None] * world  # every rank's entries, once gathered
    tdist.all_gather_object(everyone, [(n, tuple(s), t) for n, s, t in entries], group=group)
    raise ODCConfigError("the ranks built different models (ODC needs the same parameters, in the same order, on "
                         f"every rank): {first_difference(everyone)}")
