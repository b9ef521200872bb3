"""Protocol points: where a test holds a rank, and where opt-in perturbation delays one.

[Note: timing is an input] On a quiet machine ranks move almost in step; on a cluster a fast rank overtakes
a slow one all the time, and that is why ODC exists. A defect that needs one rank to be overtaken at one
place (a reader still using what it read while a peer pushes its next micro-batch) never shows on a quiet
machine, so the protocol names its dangerous places, and :func:`point` is called at each of them:

* a test *holds* a rank at a point until another rank *posts* a signal (:meth:`Schedule.hold_next`,
  :meth:`Schedule.post_next`): one interleaving, forced, the same on every run;
* ``DS_ODC_PERTURB=<seed>`` (opt-in, for test runs) delays every point by a short random time drawn from a
  generator seeded by the seed and the rank (:class:`Perturbation`): many interleavings, each reproducible
  from its seed, which every ODC error then names.

With neither, :func:`point` is one check of an empty tuple. The installed observers are process-wide on
purpose: the points sit in the transports, the runtime and the adapter, and a test reaches all of them
without threading an object through every call.
"""
from __future__ import annotations

import os
import random
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

#: Every protocol point, and where it is. A hold or a post on another name is refused (a typo must not
#: make a test wait for nothing).
POINTS = {
    "pull": "a parameter pull, after the phase check, before the first read",
    "pull.inside": "inside a pull: the first owner's shard read, the rest not yet",
    "pull.done": "a parameter pull issued (its reads done on a transport that completes eagerly)",
    "push": "a gradient push, after the phase check, before the first add",
    "push.done": "a gradient push complete: every add landed in its owners' accumulators",
    "stripe.locked": "inside a push: an accumulator stripe locked, its add not yet made",
    "remote.pull": "a pull from owners on other nodes, before its requests are sent",
    "remote.push": "a push to owners on other nodes, before its requests are sent",
    "round.write": "a rendezvous round, before this rank writes its values",
    "round.read": "a rendezvous round complete, before this rank reads the peers' values",
    "open": "the open round, after this rank published its rebound shards",
    "fence.exit": "the step's fence round complete, before the accumulator is summed",
    "gradient_fence.exit": "a gradient read's fence round complete, before the accumulator is copied",
    "gradient_read.return": "a gradient read between backward and step, about to hand its result back",
    "accumulator.zero": "an accumulator about to be zeroed (in the step, or a discard)",
    "publish": "the owner's update written, before the publish round",
    "window.rewrite": "this rank's shards rewritten outside a step, before the round that orders them",
    "windows.away": "engine.offload_states(): this rank's windows copied to the host, before the next round",
    "save": "a checkpoint save begun on this rank, before its first barrier",
}

#: The environment variable that turns perturbation on: ``<seed>`` or ``<seed>:<max_ms>[:<probability>]``.
PERTURB_VARIABLE = "DS_ODC_PERTURB"


class ScheduleError(RuntimeError):
    """A forced interleaving could not happen (a hold that waited out its bound, an unknown point)."""


def _check(name: str) -> None:
    if name not in POINTS:
        raise ScheduleError(f"no protocol point {name!r}; the points are {sorted(POINTS)}")


class Observer:
    """Something called at every point this process reaches."""

    def reach(self, name: str) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def describe(self) -> str:
        return ""


_observers: Tuple[Observer, ...] = ()


def point(name: str) -> None:
    """This rank is at protocol point ``name`` (one of :data:`POINTS`). Free unless a test or perturbation
    is installed."""
    if _observers:
        for observer in _observers:
            observer.reach(name)


def install(observer: Observer) -> Observer:
    """Call ``observer`` at every point from now on (until :func:`uninstall`). Returns it."""
    global _observers
    _observers = _observers + (observer,)
    return observer


def uninstall(observer: Observer) -> None:
    global _observers
    _observers = tuple(o for o in _observers if o is not observer)


def installed() -> Tuple[Observer, ...]:
    return _observers


def describe() -> str:
    """What the installed observers do, for error messages (empty when nothing is installed)."""
    return "; ".join(text for text in (o.describe() for o in _observers) if text)


# -- forced interleavings ----------------------------------------------------------------------------------
@dataclass
class _Rule:
    point: str
    signal: str
    hold: bool  # hold until ``signal`` is posted; else post ``signal`` when the point is reached
    timeout_s: float = 60.0
    required: bool = True  # a hold whose signal never comes raises; a pause goes on after timeout_s


@dataclass
class Schedule(Observer):
    """One rank's forced interleaving, for tests. Signals are files in ``directory`` (one the test made, seen by
    every rank: two hosts share it too), so a rank on one process can wait for a point another reached.

    >>> import tempfile
    >>> schedule = Schedule(tempfile.mkdtemp())
    >>> schedule.post_next("push.done", "pushed")
    >>> schedule.reach("push.done"); schedule.posted("pushed")
    True
    """

    directory: str
    rules: List[_Rule] = field(default_factory=list)
    reached: Dict[str, int] = field(default_factory=lambda: defaultdict(int))
    #: ``(point, signal, seconds)`` of every hold and pause so far; the signal is "" for a pause that ran out
    held: List[Tuple[str, str, float]] = field(default_factory=list)

    def hold_next(self, name: str, until: str, timeout_s: float = 60.0) -> None:
        """The next time this rank reaches point ``name``, it waits there until signal ``until`` is posted
        (raising :class:`ScheduleError` after ``timeout_s``)."""
        _check(name)
        self.rules.append(_Rule(name, until, True, timeout_s))

    def pause_next(self, name: str, seconds: float, unless: str) -> None:
        """The next time this rank reaches ``name``, it waits there ``seconds``, or until signal ``unless`` is
        posted if that comes first (:attr:`held` says which). For an interleaving the protocol must *prevent*: a
        peer that could go on while this rank waits posts ``unless``; one that cannot leaves the pause to end."""
        _check(name)
        self.rules.append(_Rule(name, unless, True, seconds, required=False))

    def post_next(self, name: str, signal: str) -> None:
        """The next time this rank reaches point ``name`` (and has passed any hold there), post ``signal``."""
        _check(name)
        self.rules.append(_Rule(name, signal, False))

    def reach(self, name: str) -> None:
        self.reached[name] += 1
        for rule in [r for r in self.rules if r.point == name and r.hold]:
            self.rules.remove(rule)
            started = time.monotonic()
            came = self._await(rule.signal, rule.timeout_s)
            if not came and rule.required:
                raise ScheduleError(f"held at {name}: signal {rule.signal!r} was not posted within "
                                    f"{rule.timeout_s:.0f}s (the interleaving the test forces could not happen)")
            self.held.append((name, rule.signal if came else "", time.monotonic() - started))
        for rule in [r for r in self.rules if r.point == name and not r.hold]:
            self.rules.remove(rule)
            self.post(rule.signal)

    def post(self, signal: str) -> None:
        """Post ``signal`` (a rank waiting for it goes on)."""
        with open(self._path(signal), "w"):
            pass

    def posted(self, signal: str) -> bool:
        return os.path.exists(self._path(signal))

    def wait(self, signal: str, timeout_s: float = 60.0, why: str = "waiting") -> None:
        """Wait until ``signal`` is posted; :class:`ScheduleError` after ``timeout_s`` (never without a bound)."""
        if not self._await(signal, timeout_s):
            raise ScheduleError(f"{why}: signal {signal!r} was not posted within {timeout_s:.0f}s (the "
                                "interleaving the test forces could not happen)")

    def _await(self, signal: str, timeout_s: float) -> bool:
        """Whether ``signal`` was posted within ``timeout_s`` (decided once: a post just after it ran out
        does not count)."""
        deadline = time.monotonic() + timeout_s
        while not self.posted(signal):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    def pending(self) -> List[str]:
        """Rules not yet used, as text (a test asserts none is left: the interleaving really happened)."""
        return [f"{'hold at' if r.hold else 'post at'} {r.point} ({r.signal})" for r in self.rules]

    def _path(self, signal: str) -> str:
        return os.path.join(self.directory, "signal-" + "".join(c if c.isalnum() else "_" for c in signal))


# -- perturbation ----------------------------------------------------------------------------------------------
@dataclass
class Perturbation(Observer):
    """Short random delays at every point: at each, with ``probability``, a sleep of up to ``max_ms``, drawn
    from a generator seeded with ``(seed, rank)`` (a failure reruns with the same seed).

    >>> perturbation = Perturbation(seed=7, rank=1, max_ms=0.0)
    >>> perturbation.reach("push"); perturbation.delays
    1
    >>> Perturbation.parse("7:0.5:0.25", rank=0).describe()
    'schedule perturbation DS_ODC_PERTURB=7:0.5:0.25 (rank 0: 0 delays so far)'
    """

    seed: int
    rank: int
    max_ms: float = 2.0
    probability: float = 0.5
    delays: int = 0
    rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(f"ds_odc-perturb:{self.seed}:{self.rank}")

    @classmethod
    def parse(cls, text: str, rank: int) -> "Perturbation":
        parts = text.split(":")
        try:
            seed = int(parts[0])
            max_ms = float(parts[1]) if len(parts) > 1 else 2.0
            probability = float(parts[2]) if len(parts) > 2 else 0.5
        except (ValueError, IndexError):
            raise ScheduleError(f"{PERTURB_VARIABLE}={text!r}: expected <seed>[:<max_ms>[:<probability>]], e.g. "
                                "'7' or '7:2:0.5'") from None
        if len(parts) > 3 or max_ms < 0 or not 0 <= probability <= 1:
            raise ScheduleError(f"{PERTURB_VARIABLE}={text!r}: max_ms must be >= 0 and the probability in [0, 1]")
        return cls(seed, rank, max_ms, probability)

    def reach(self, name: str) -> None:
        if self.rng.random() < self.probability:
            self.delays += 1
            time.sleep(self.rng.random() * self.max_ms / 1000.0)

    def describe(self) -> str:
        text = f"{self.seed}" if (self.max_ms, self.probability) == (2.0, 0.5) else \
            f"{self.seed}:{self.max_ms:g}:{self.probability:g}"
        return f"schedule perturbation {PERTURB_VARIABLE}={text} (rank {self.rank}: {self.delays} delays so far)"


def perturb_from_environment(rank: int) -> Optional[Perturbation]:
    """Install :class:`Perturbation` if ``DS_ODC_PERTURB`` asks for it (once per process: a second engine keeps
    the generator the first one started)."""
    text = os.environ.get(PERTURB_VARIABLE, "").strip()
    if not text:
        return None
    for observer in _observers:
        if isinstance(observer, Perturbation):
            return observer
    perturbation = Perturbation.parse(text, rank)
    install(perturbation)
    return perturbation
