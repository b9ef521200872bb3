"""What the simulator needs to know about a machine and a model: per-layer communication times,
how compute splits across layers, and the fixed costs of a step.

The simulator never sees bytes or FLOPs, only seconds. :class:`Link` turns a payload into seconds
(``latency + bytes / bandwidth``) so presets can be written in the units hardware is sold in, and
:func:`spread_over_peers` applies the ``(D-1)/D`` factor of gathering (or scattering) a layer whose
shards live on ``D`` ranks: a rank already holds its own ``1/D``.

>>> round(spread_over_peers(Link(bandwidth=100e9, latency=0.0), 94e6, world_size=8) * 1e3, 3)  # ms
0.823
>>> spread_over_peers(Link(bandwidth=100e9, latency=1e-5), 94e6, world_size=1)  # nothing to move
0.0
"""
from __future__ import annotations

import dataclasses

from ds_odc.errors import ODCError


@dataclasses.dataclass(frozen=True)
class Link:
    """A transfer path: ``seconds = latency + bytes / bandwidth`` (bandwidth in bytes/s)."""

    bandwidth: float
    latency: float = 0.0

    def __post_init__(self):
        if not self.bandwidth > 0:
            raise ODCError(f"Link.bandwidth must be > 0 bytes/s, got {self.bandwidth}")
        if self.latency < 0:
            raise ODCError(f"Link.latency must be >= 0 s, got {self.latency}")

    def seconds(self, payload_bytes: float) -> float:
        return self.latency + payload_bytes / self.bandwidth


def spread_over_peers(link: Link, layer_bytes: float, world_size: int) -> float:
    """Seconds for one rank to receive (or send) the ``(D-1)/D`` of a layer it does not own.

    A ring collective moves exactly this per rank; a rank pulling point-to-point reads the same
    bytes through its own port. With one rank there is nothing to move, so no latency either."""
    if world_size < 1:
        raise ODCError(f"world_size must be >= 1, got {world_size}")
    if world_size == 1:
        return 0.0
    return link.seconds(layer_bytes * (world_size - 1) / world_size)


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Per-layer, per-micro-batch seconds of every operation the simulator schedules.

    Compute: a micro-batch's cost (from the plan's cost model, times ``seconds_per_cost_unit``) is
    split evenly over ``layers``; each layer's forward gets ``1 - backward_fraction`` of its share
    and its backward ``backward_fraction`` (2/3: backward is about twice forward).

    Communication, once per layer per micro-batch (a padded, empty micro-batch of a collective
    engine pays it too: the collectives must still be matched):
      - collective engine: ``gather_seconds`` before each layer's forward and again before its
        backward, ``reduce_seconds`` after its backward (all-gather, reduce-scatter);
      - ODC: ``pull_seconds`` in the same two places, ``push_seconds`` after the backward.
    Each rank has one communication channel that runs its transfers one at a time in issue order,
    beside compute. ``prefetch_depth`` k issues layer j+k's gather when layer j's compute starts
    (k=0: only when layer j-1's compute has ended, so nothing overlaps compute).

    Fixed costs: ``*_micro_batch_seconds`` run serially on the compute timeline at the start of
    every micro-batch (hooks, launches, bookkeeping). At the end of the step both engines pay
    ``optimizer_seconds``; ODC also pays ``fence_seconds`` (the barrier that waits for every push to
    land, and publishing the updated shards).
    """

    layers: int
    gather_seconds: float = 0.0
    reduce_seconds: float = 0.0
    pull_seconds: float = 0.0
    push_seconds: float = 0.0
    prefetch_depth: int = 1
    backward_fraction: float = 2.0 / 3.0
    seconds_per_cost_unit: float = 1.0
    collective_micro_batch_seconds: float = 0.0
    odc_micro_batch_seconds: float = 0.0
    optimizer_seconds: float = 0.0
    fence_seconds: float = 0.0
    description: str = ""

    def __post_init__(self):
        if not isinstance(self.layers, int) or self.layers < 1:
            raise ODCError(f"Hardware.layers must be an int >= 1, got {self.layers!r}")
        if not isinstance(self.prefetch_depth, int) or self.prefetch_depth < 0:
            raise ODCError(f"Hardware.prefetch_depth must be an int >= 0, got {self.prefetch_depth!r}")
        if not 0.0 <= self.backward_fraction <= 1.0:
            raise ODCError(f"Hardware.backward_fraction must be in [0, 1], got {self.backward_fraction}")
        if not self.seconds_per_cost_unit > 0:
            raise ODCError(f"Hardware.seconds_per_cost_unit must be > 0, got {self.seconds_per_cost_unit}")
        for name in ("gather_seconds", "reduce_seconds", "pull_seconds", "push_seconds",
                     "collective_micro_batch_seconds", "odc_micro_batch_seconds", "optimizer_seconds",
                     "fence_seconds"):
            value = getattr(self, name)
            if not value >= 0:  # also rejects NaN
                raise ODCError(f"Hardware.{name} must be >= 0 seconds, got {value}")

    def without_communication(self) -> "Hardware":
        """Free transfers, no fixed costs, no prefetch: the plan's balance bound, which then equals
        :meth:`Plan.collective_step_cost` / :meth:`Plan.odc_step_cost` (with prefetch a fast rank
        could run one layer ahead of a slow one even for free, beating the paper's bound a little)."""
        return dataclasses.replace(self, prefetch_depth=0, gather_seconds=0.0, reduce_seconds=0.0, pull_seconds=0.0,
                                   push_seconds=0.0, collective_micro_batch_seconds=0.0,
                                   odc_micro_batch_seconds=0.0, optimizer_seconds=0.0, fence_seconds=0.0)
