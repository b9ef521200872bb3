"""Agreeing on a value through the job's key-value store, before any collective.

``deepspeed.initialize`` meets every rank in collectives from its first lines on; a rank that asked for
the odc stage and a peer that did not would meet in different collectives (a hang, or garbage). So ranks
that ask for ODC first say so in the job's store (the ``torch.distributed`` rendezvous store every rank
reaches) and read every peer's answer: a peer that answered differently is named at once, and a peer
that never answers (it did not ask for ODC, so it went straight into DeepSpeed's collectives) is named
when the bound runs out. A rank that does not ask for ODC never touches the store.
"""
from __future__ import annotations

import time
from typing import List

from ds_odc.comm.backoff import Backoff


class AgreementTimeout(TimeoutError):
    """Some ranks never answered; ``missing`` lists them."""

    def __init__(self, missing: List[int], waited_s: float):
        super().__init__(f"ranks {missing} did not answer within {waited_s:.0f}s")
        self.missing = missing


def answers_of_every_rank(store, prefix: str, rank: int, world_size: int, mine: str, timeout_s: float) -> List[str]:
    """Write ``mine`` under ``<prefix>/<rank>`` and return every rank's answer, in rank order. Raises
    :class:`AgreementTimeout` naming the ranks with no answer after ``timeout_s``."""
    store.set(f"{prefix}/{rank}", mine)
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    deadline, backoff = time.monotonic() + timeout_s, Backoff(first_s=1e-3, longest_s=0.1)
    while not store.check(keys):
        if time.monotonic() > deadline:
            raise AgreementTimeout([r for r, key in enumerate(keys) if not store.check([key])], timeout_s)
        backoff.sleep()
    return [store.get(key).decode("utf-8", "replace") for key in keys]
