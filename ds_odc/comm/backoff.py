"""Waiting for something that is usually quick, without spinning a core: sleeps that start at a few
microseconds and double up to a millisecond. Rounds, cross-node collectives and a closing rank's wait
for its peers all wait this way (a rank's neighbours on a 2-core node feel a spinning waiter)."""
from __future__ import annotations

import time
from typing import Callable

FIRST_S = 5e-6
LONGEST_S = 1e-3


class Backoff:
    """``sleep()`` once per poll: ``FIRST_S``, doubling, at most ``LONGEST_S``."""

    def __init__(self, first_s: float = FIRST_S, longest_s: float = LONGEST_S):
        self.pause, self.longest = first_s, longest_s

    def sleep(self) -> None:
        time.sleep(self.pause)
        self.pause = min(self.pause * 2, self.longest)


def wait_until(done: Callable[[], bool], within_s: float, first_s: float = FIRST_S,
               longest_s: float = LONGEST_S) -> bool:
    """Poll ``done`` with :class:`Backoff` sleeps for at most ``within_s``; whether it became true."""
    until, backoff = time.monotonic() + within_s, Backoff(first_s, longest_s)
    while not done():
        if time.monotonic() >= until:
            return False
        backoff.sleep()
    return True
