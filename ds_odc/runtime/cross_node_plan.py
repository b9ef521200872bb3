"""What each ``zero_optimization.odc.cross_node`` mode costs per rank, and which mode (and which layers) a job runs:
pure arithmetic, no processes, no DeepSpeed.

Notation: ``P`` parameters (``P_t`` trainable), ``R`` ranks per node, ``N`` nodes, ``W = R·N``, ``c`` bytes of the
compute dtype, ``a`` bytes of an accumulator element (4 fp32, 2 bf16, 8 fp64), ``o`` optimizer bytes per trainable
parameter (12 for Adam: fp32 master, ``exp_avg``, ``exp_avg_sq``). Model states only: no activations, no gathered
layers, no ZeRO-3 padding. Per rank:

- ``replicate`` (today, docs/multinode.md): every node holds every shard; window ``c·P/R``, accumulator
  ``a·P_t/R``, optimizer ``o·P_t/W``. Pulls and pushes stay inside the node; one exchange per step between nodes.
- ``global``: every rank holds only its own ``1/W``: window ``c·P/W``, accumulator ``a·P_t/W``, optimizer
  ``o·P_t/W``. Pulls and pushes of remote owners cross nodes.
- ``budget``: a set of whole layers is replicated as in ``replicate`` (their window and accumulator blocks, ``N``
  of each), the rest is global. A replicated layer of ``p_t`` trainable and ``p_f`` frozen parameters costs
  ``(N-1)/W · ((c + a)·p_t + c·p_f)`` bytes per rank beyond global; that extra is what ``node_replica_budget_gb``
  (GiB per rank) pays for.
- ZeRO-3 for comparison: ``c·P/W`` parameter partition, gradient partition ``2·P_t/W`` (bf16, its default: 16P/W
  in all with Adam) or ``4·P_t/W`` (``grad_accum_dtype`` fp32: 18P/W).

The 70B rows of the design study (Llama-3-70B's ``P`` = 70,553,706,496, 8 ranks per node, 2 nodes), in GiB per
rank:

>>> p, gib = 70_553_706_496, 2 ** 30
>>> states = ModelStates(p, p, ranks_per_node=8, nodes=2)
>>> round(states.zero3().total / gib, 1), round(states.replicate().total / gib, 1)
(65.7, 98.6)
>>> round(states.global_sharded().total / gib, 1), round(states.zero3(gradient_bytes=4).total / gib, 1)
(73.9, 73.9)

Choosing: 80 layers of the same size, a 20 GiB budget; the first 64 layers fit it:

>>> layers = [(f"layers.{i}", int(p / 80), 0) for i in range(80)]
>>> choice = resolve_cross_node("auto", 20, layers, nodes=2, ranks_per_node=8)
>>> choice.mode, len(choice.replicated_layers), choice.replicated_layers[0], round(choice.bytes_per_rank / gib, 1)
('budget', 64, 'layers.0', 93.6)
>>> resolve_cross_node("global", None, layers, nodes=1, ranks_per_node=8).mode  # nothing crosses nodes
'replicate'
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple

from ds_odc.arguments import is_finite_number, is_whole_number, require_finite_number, require_whole_number
from ds_odc.errors import ODCConfigError

CROSS_NODE_MODES = ("replicate", "global", "budget", "auto")
"""What ``zero_optimization.odc.cross_node`` accepts; a job runs one of the first three."""
GIB = 2 ** 30

Layer = Tuple[str, int, int]
"""(name, trainable numel, frozen numel) of one layer, a unit that is replicated whole or not at all."""


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """Bytes of model states one rank holds: its parameter window (or ZeRO-3's parameter partition), its
    gradient accumulator (ZeRO-3's gradient partition) and its optimizer state."""

    window: float
    accumulator: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.window + self.accumulator + self.optimizer

    @property
    def gib(self) -> float:
        return self.total / GIB


@dataclasses.dataclass(frozen=True)
class ModelStates:
    """A model on a job: ``params`` parameters of which ``trainable_params`` train, on ``nodes`` nodes of
    ``ranks_per_node`` ranks; per element ``compute_bytes`` in the window, ``accumulator_bytes`` in the
    accumulator, ``optimizer_bytes_per_param`` of optimizer state per trainable parameter. Each method gives one
    mode's :class:`StateBytes` per rank."""

    params: float
    trainable_params: float
    ranks_per_node: int
    nodes: int
    compute_bytes: int = 2
    accumulator_bytes: int = 4
    optimizer_bytes_per_param: int = 12

    def __post_init__(self):
        _count("params", self.params)
        _count("trainable_params", self.trainable_params)
        if self.trainable_params > self.params:
            raise ODCConfigError(f"trainable_params ({self.trainable_params}) exceeds params ({self.params})")
        _positive_int("ranks_per_node", self.ranks_per_node)
        _positive_int("nodes", self.nodes)
        _positive_int("compute_bytes", self.compute_bytes)
        _positive_int("accumulator_bytes", self.accumulator_bytes)
        _count("optimizer_bytes_per_param", self.optimizer_bytes_per_param)

    @property
    def world(self) -> int:
        return self.ranks_per_node * self.nodes

    @property
    def frozen_params(self) -> float:
        return self.params - self.trainable_params

    def _optimizer(self) -> float:
        return self.optimizer_bytes_per_param * self.trainable_params / self.world

    def replicate(self) -> StateBytes:
        """Today's layout: every node holds every shard (window ``c·P/R``, accumulator ``a·P_t/R``)."""
        r = self.ranks_per_node
        return StateBytes(self.compute_bytes * self.params / r, self.accumulator_bytes * self.trainable_params / r,
                          self._optimizer())

    def global_sharded(self) -> StateBytes:
        """Every rank holds only its own ``1/W`` (window ``c·P/W``, accumulator ``a·P_t/W``)."""
        w = self.world
        return StateBytes(self.compute_bytes * self.params / w, self.accumulator_bytes * self.trainable_params / w,
                          self._optimizer())

    def budget(self, replicated_trainable: float, replicated_frozen: float = 0.0) -> StateBytes:
        """Global, except ``replicated_trainable`` trainable and ``replicated_frozen`` frozen parameters held as in
        :meth:`replicate`: each costs ``(N-1)/W`` of its window (and accumulator) bytes more per rank."""
        _count("replicated_trainable", replicated_trainable)
        _count("replicated_frozen", replicated_frozen)
        if replicated_trainable > self.trainable_params or replicated_frozen > self.frozen_params:
            raise ODCConfigError(f"replicated parameters ({replicated_trainable} trainable, {replicated_frozen} "
                                 f"frozen) exceed the model's ({self.trainable_params}, {self.frozen_params})")
        base, scale = self.global_sharded(), (self.nodes - 1) / self.world
        return StateBytes(base.window + scale * self.compute_bytes * (replicated_trainable + replicated_frozen),
                          base.accumulator + scale * self.accumulator_bytes * replicated_trainable, base.optimizer)

    def zero3(self, gradient_bytes: int = 2) -> StateBytes:
        """ZeRO-3 on the same ``W`` ranks: parameter partition ``c·P/W``, gradient partition
        ``gradient_bytes·P_t/W`` (2: its bf16 default, 16P/W with Adam; 4: ``grad_accum_dtype`` fp32, 18P/W)."""
        _positive_int("gradient_bytes", gradient_bytes)
        w = self.world
        return StateBytes(self.compute_bytes * self.params / w, gradient_bytes * self.trainable_params / w,
                          self._optimizer())


def replicate_bytes(params: float, trainable_params: float, ranks_per_node: int, nodes: int, compute_bytes: int = 2,
                    accumulator_bytes: int = 4, optimizer_bytes_per_param: int = 12) -> float:
    """Bytes per rank of model states under ``replicate``: ``(c·P + a·P_t)/R + o·P_t/W``."""
    return ModelStates(params, trainable_params, ranks_per_node, nodes, compute_bytes, accumulator_bytes,
                       optimizer_bytes_per_param).replicate().total


def global_bytes(params: float, trainable_params: float, ranks_per_node: int, nodes: int, compute_bytes: int = 2,
                 accumulator_bytes: int = 4, optimizer_bytes_per_param: int = 12) -> float:
    """Bytes per rank of model states under ``global``: ``(c·P + a·P_t + o·P_t)/W``."""
    return ModelStates(params, trainable_params, ranks_per_node, nodes, compute_bytes, accumulator_bytes,
                       optimizer_bytes_per_param).global_sharded().total


def zero3_bytes(params: float, trainable_params: float, world: int, compute_bytes: int = 2, gradient_bytes: int = 2,
                optimizer_bytes_per_param: int = 12) -> float:
    """Bytes per rank of ZeRO-3's model states on ``world`` ranks: ``(c·P + g·P_t + o·P_t)/W``."""
    return ModelStates(params, trainable_params, world, 1, compute_bytes,
                       optimizer_bytes_per_param=optimizer_bytes_per_param).zero3(gradient_bytes).total


def replicated_extra_bytes(trainable_numel: float, frozen_numel: float, nodes: int, ranks_per_node: int,
                           compute_bytes: int = 2, accumulator_bytes: int = 4) -> float:
    """Bytes per rank that replicating one layer costs beyond holding it globally:
    ``(N-1)/W · ((c + a)·p_t + c·p_f)`` (0 on one node)."""
    world = ranks_per_node * nodes
    return (nodes - 1) / world * ((compute_bytes + accumulator_bytes) * trainable_numel
                                  + compute_bytes * frozen_numel)


def choose_replicated_layers(layers: Sequence[Layer], budget_bytes: float, nodes: int, ranks_per_node: int,
                             compute_bytes: int = 2, accumulator_bytes: int = 4) -> Tuple[str, ...]:
    """The names of the layers to replicate: the longest prefix of ``layers`` whose extra bytes per rank
    (:func:`replicated_extra_bytes`, summed) fit ``budget_bytes``.

    Why a prefix in the order given: the caller passes the layers in forward order, and the first layers' pulls
    are the ones no compute hides (a micro-batch's forward starts with them, with nothing before them to prefetch
    behind), so they are the ones worth replicating first. A prefix is also monotone: a larger budget never
    drops a layer a smaller one kept (skipping a layer that does not fit for smaller ones after it would not be).
    It depends on nothing but its arguments (no dict or set order, no floating sum that differs by rank), so
    every rank, given the same module order, picks the same layers."""
    _check_layers(layers)
    _positive_int("nodes", nodes)
    _positive_int("ranks_per_node", ranks_per_node)
    _positive_int("compute_bytes", compute_bytes)
    _positive_int("accumulator_bytes", accumulator_bytes)
    require_finite_number("budget_bytes", budget_bytes, 0, ODCConfigError)
    chosen, used = [], 0.0
    for name, trainable, frozen in layers:
        used += replicated_extra_bytes(trainable, frozen, nodes, ranks_per_node, compute_bytes, accumulator_bytes)
        if used > budget_bytes:
            break
        chosen.append(name)
    return tuple(chosen)


@dataclasses.dataclass(frozen=True)
class CrossNodeChoice:
    """What ``cross_node`` resolved to: the mode the job runs (``"replicate"``, ``"global"`` or ``"budget"``),
    the layers replicated node-locally (every layer for replicate, none for global), the model states per rank
    (bytes, padding not counted) and one line for the log saying why."""

    requested: str
    mode: str
    replicated_layers: Tuple[str, ...]
    bytes_per_rank: float
    reason: str


def sharding_on_gpus(mode: str) -> ODCConfigError:
    """The refusal of ``cross_node`` "global" or "budget" across nodes with shards on GPUs."""
    return ODCConfigError(f"zero_optimization.odc.cross_node={mode!r} runs on CPU hosts for now: on GPUs pulls "
                          "and pushes across nodes need the NVSHMEM transport, which is validated only as an item of "
                          "the GPU kit (docs/gpu.md); use 'replicate' (the default) or 'auto'")


def offloads_with_global_sharding(used: Sequence[str], mode: str) -> ODCConfigError:
    """The refusal of ZeRO offloads when owners live on other nodes."""
    return ODCConfigError(f"zero_optimization.{' and '.join(used)} is not supported with "
                          f"zero_optimization.odc.cross_node={mode!r} on several nodes yet (not tested with owners on "
                          "other nodes); use cross_node 'replicate' (the default) for it")


def with_global_sharding(what: str, mode: str) -> ODCConfigError:
    """The refusal of what is not yet tested with owners on other nodes (SP, the split policy, offload_states)."""
    return ODCConfigError(f"{what} is not supported with zero_optimization.odc.cross_node={mode!r} on several nodes "
                          "yet; use cross_node 'replicate' (the default) for it")


def resolve_cross_node(mode: str, budget_gb: Optional[float], layers: Sequence[Layer], nodes: int,
                       ranks_per_node: int, compute_bytes: int = 2, accumulator_bytes: int = 4,
                       optimizer_bytes_per_param: int = 12, sharding: bool = True) -> CrossNodeChoice:
    """Resolve ``zero_optimization.odc.cross_node`` (``mode``) and ``node_replica_budget_gb`` (``budget_gb``, GiB
    per rank for the replicated part beyond global sharding, or None) for a model of ``layers`` (forward order:
    see :func:`choose_replicated_layers`) on ``nodes`` × ``ranks_per_node`` ranks.

    - one node: every mode runs ``replicate`` (nothing crosses nodes; global would be the same layout);
    - ``replicate`` / ``global``: as asked (a budget with them is refused: it would be ignored);
    - ``budget`` (needs a budget): the layers that fit; all of them is ``replicate``, none is ``global``;
    - ``auto``: ``replicate`` without a budget or when its extra fits the budget, otherwise as ``budget``.

    ``sharding`` False (shards on GPUs: owners on other nodes are not reachable one-sided yet): ``auto`` is
    ``replicate``, and ``global`` or ``budget`` on several nodes are refused by name.
    """
    if mode not in CROSS_NODE_MODES:
        raise ODCConfigError(f"cross_node must be one of {', '.join(map(repr, CROSS_NODE_MODES))}, got {mode!r}")
    if budget_gb is not None and not is_finite_number(budget_gb, 0):
        raise ODCConfigError(f"node_replica_budget_gb must be a finite number of GiB >= 0 or unset, got {budget_gb!r}")
    if mode == "budget" and budget_gb is None:
        raise ODCConfigError("cross_node 'budget' needs node_replica_budget_gb (GiB per rank for replicated layers)")
    if mode in ("replicate", "global") and budget_gb is not None:
        raise ODCConfigError(f"node_replica_budget_gb applies to cross_node 'budget' and 'auto', not {mode!r}: "
                             "unset it, or choose 'budget' or 'auto'")
    _check_layers(layers)
    trainable = sum(t for _, t, _ in layers)
    frozen = sum(f for _, _, f in layers)
    states = ModelStates(trainable + frozen, trainable, ranks_per_node, nodes, compute_bytes, accumulator_bytes,
                         optimizer_bytes_per_param)
    names = tuple(name for name, _, _ in layers)
    full, shared = states.replicate().total, states.global_sharded().total
    if nodes == 1:
        return CrossNodeChoice(mode, "replicate", names, full,
                               f"{mode}: one node, nothing crosses nodes: replicate, {_gib(full)} per rank of "
                               "model states")
    if not sharding and mode != "replicate":
        if mode != "auto":
            raise sharding_on_gpus(mode)
        return CrossNodeChoice(mode, "replicate", names, full,
                               f"auto on GPUs: replicate (global and budget run on CPU hosts for now), {_gib(full)} "
                               "per rank of model states")
    if mode == "replicate":
        return CrossNodeChoice(mode, "replicate", names, full,
                               f"replicate: as configured, {_gib(full)} per rank of model states "
                               f"(global would hold {_gib(shared)})")
    if mode == "global":
        return CrossNodeChoice(mode, "global", (), shared,
                               f"global: as configured, {_gib(shared)} per rank of model states "
                               f"(replicate would hold {_gib(full)})")
    extra = full - shared
    if budget_gb is None:  # auto without a budget
        return CrossNodeChoice(mode, "replicate", names, full,
                               f"auto without node_replica_budget_gb: replicate, {_gib(full)} per rank of model "
                               f"states ({_gib(extra)} beyond global's {_gib(shared)})")
    budget = budget_gb * GIB
    head = (f"{mode}: replicate needs {_gib(full)} per rank of model states, {_gib(extra)} beyond global's "
            f"{_gib(shared)}")
    if extra <= budget:
        return CrossNodeChoice(mode, "replicate", names, full,
                               f"{head}, within the {budget_gb:g} GiB budget: replicate, all {len(names)} layers")
    chosen = choose_replicated_layers(layers, budget, nodes, ranks_per_node, compute_bytes, accumulator_bytes)
    if not chosen:
        first = replicated_extra_bytes(layers[0][1], layers[0][2], nodes, ranks_per_node, compute_bytes,
                                       accumulator_bytes) if layers else 0.0
        return CrossNodeChoice(mode, "global", (), shared,
                               f"{head}; budget {budget_gb:g} GiB: the first layer alone needs {_gib(first, 2)}: "
                               f"global, {_gib(shared)} per rank")
    kept = layers[:len(chosen)]
    held = states.budget(sum(t for _, t, _ in kept), sum(f for _, _, f in kept)).total
    return CrossNodeChoice(mode, "budget", chosen, held,
                           f"{head}; budget {budget_gb:g} GiB: {len(chosen)} of {len(names)} layers replicated "
                           f"({_gib(held - shared)}), {_gib(held)} per rank")


def _gib(value: float, digits: int = 1) -> str:
    return f"{value / GIB:.{digits}f} GiB"


def _count(name: str, value) -> None:
    require_finite_number(name, value, 0, ODCConfigError)


def _positive_int(name: str, value) -> None:
    require_whole_number(name, value, 1, ODCConfigError)


def _check_layers(layers: Sequence[Layer]) -> None:
    seen = set()
    for index, layer in enumerate(layers):
        if not isinstance(layer, (tuple, list)) or len(layer) != 3:
            raise ODCConfigError(f"layers[{index}] must be (name, trainable_numel, frozen_numel), got {layer!r}")
        name, trainable, frozen = layer
        if not isinstance(name, str) or not name:
            raise ODCConfigError(f"layers[{index}]: the name must be a non-empty str, got {name!r}")
        if name in seen:
            raise ODCConfigError(f"layers[{index}]: {name!r} appears twice (a layer is replicated whole, once)")
        seen.add(name)
        for what, value in (("trainable_numel", trainable), ("frozen_numel", frozen)):
            if not is_whole_number(value, 0):
                raise ODCConfigError(f"layers[{index}] ({name!r}): {what} must be an int >= 0, got {value!r}")
