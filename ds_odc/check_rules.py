"""What ``python -m ds_odc check`` derives from a canonical "odc" ds_config and the machine facts it is given:
the refusals ``deepspeed.initialize`` would raise, the loss rule the engine applies, and the warnings.

Initialize's refusals are called or built by the same functions initialize uses (``select_transport``,
``accumulator_dtype``, ``deterministic_sums``, the loss rule's ``decide``, and the cross-node refusals of
:mod:`ds_odc.runtime.cross_node_plan`), so their words are written once; a unit test triggers both sides
(tests/unit/test_check_command.py).

The device the refusals see is where the model's shards live, as ``session_plan`` reads it: host memory under
``offload_param`` (windows in host shared memory, pulls copied to the GPU), the accelerator otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from ds_odc.config import ODCConfig
from ds_odc.errors import ODCConfigError
from ds_odc.runtime.cross_node_plan import offloads_with_global_sharding, sharding_on_gpus, with_global_sharding

#: The ZeRO offloads ODC runs with (NVMe is refused by the config parse), in ``session_plan``'s order.
OFFLOADS = ("offload_param", "offload_optimizer")
#: Bytes of one accumulator element per ``accumulator_dtype``; ``deterministic`` holds two fp64 regions.
ACCUMULATOR_BYTES = {"fp32": 4, "fp64": 8, "bf16": 2}
EXACT_ACCUMULATOR_BYTES = 16


@dataclass(frozen=True)
class Machine:
    """The facts a ds_config does not hold: where the model lives (``"cpu"`` or ``"cuda"``), how many nodes and
    ranks per node, and ``gradient_accumulation_steps`` where the config says "auto" (None: not given)."""

    device: str = "cpu"
    nodes: int = 1
    ranks_per_node: int = 1
    gradient_accumulation_steps: Optional[int] = None

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


def offloads(config: dict) -> tuple:
    """The ZeRO offloads in use (``"device": "cpu"``), as ``session_plan`` lists them."""
    zero = config.get("zero_optimization") or {}
    return tuple(name for name in OFFLOADS if isinstance(zero.get(name), dict) and zero[name].get("device") == "cpu")


def shard_device(config: dict, machine: Machine) -> str:
    """Where the shards live: host memory under ``offload_param``, else the machine's device."""
    return "cpu" if "offload_param" in offloads(config) else machine.device


def compute_dtype(config: dict) -> Optional[torch.dtype]:
    """The model's compute dtype from the ds_config (bf16 or fp16 enabled, else fp32); None where
    ``enabled`` is "auto" (a framework fills it in later)."""
    for keys, dtype in ((("bf16", "bfloat16"), torch.bfloat16), (("fp16",), torch.float16)):
        for key in keys:
            block = config.get(key)
            enabled = block.get("enabled") if isinstance(block, dict) else None
            if enabled == "auto":
                return None
            if enabled:
                return dtype
    return torch.float32


def refuse_at_initialize(config: dict, options: ODCConfig, machine: Machine) -> None:
    """Raise the first :class:`ODCConfigError` initialize would raise for this canonical config on ``machine``,
    in initialize's order (session plan, session, transport, split policy); the config parse has run already."""
    from ds_odc.comm import TRANSPORT_DEVICES, select_transport
    from ds_odc.integration.zero3_windows import accumulator_dtype, deterministic_sums

    device = shard_device(config, machine)
    dtype = compute_dtype(config)
    accumulator_dtype(options, torch.bfloat16 if dtype is None else dtype, device)  # "auto": the device check only
    deterministic_sums(options, device)
    if options.cross_node in ("global", "budget") and device != "cpu" and machine.nodes > 1:
        raise sharding_on_gpus(options.cross_node)
    used = offloads(config)
    if machine.nodes > 1 and used and options.cross_node == "global":
        raise offloads_with_global_sharding(used, "global")
    if TRANSPORT_DEVICES.get(options.transport, device) != device or device not in TRANSPORT_DEVICES.values():
        try:
            torch.device(device)
        except RuntimeError:
            raise ODCConfigError(f"accelerator {device!r}: the odc stage's transports serve "
                                 f"{' and '.join(sorted(set(TRANSPORT_DEVICES.values())))} tensors only") from None
        select_transport(options.transport, device)  # raises its own words, before probing this machine
    if machine.nodes > 1 and options.cross_node == "global" and options.balance is not None \
            and options.balance.policy == "lb-mini-split":
        raise with_global_sharding('the balance policy "lb-mini-split"', "global")


def loss_rule(options: ODCConfig, managed: bool, gradient_accumulation_steps: int) -> str:
    """One line: how ``engine.step()`` normalises ``engine.backward(loss)`` under these settings, decided by the
    engine's own rule (``ds_odc.integration.backward_rules.decide``; docs/normalisation.md)."""
    from ds_odc.integration.backward_rules import decide
    from ds_odc.runtime import LossNormalization

    gas = gradient_accumulation_steps
    try:
        rule = decide(None, options.loss_normalization, managed=managed, scale_wrt_gas=True,
                      gradient_accumulation_steps=gas).rule
    except ODCConfigError:
        return ("per token: each loss is a sum over its micro-batch's loss tokens, divided at the step by the global "
                "token count (loss_normalization 'token': every engine.backward(loss_sum, loss_tokens=n) must give n, "
                "one without is refused at that backward)")
    per_token = "; per token instead for backwards given loss_tokens=n"
    if rule is LossNormalization.MEAN:
        return (f"mean over the global micro-batches (engine.backward(loss), managed accumulation, "
                f"gradient_accumulation_steps {gas}; with uneven counts each rank calls "
                f"engine.set_gradient_accumulation_boundary(True) before its own last micro-batch){per_token}")
    if not managed:
        divided = f"; engine.backward(loss) still divides each loss by {gas}" if gas > 1 else ""
        return (f"the caller's scaling, summed over micro-batches and divided by the world size "
                f"(managed_gradient_accumulation false: each engine.step() ends the step{divided}){per_token}")
    return ("the caller's scaling, summed over micro-batches and divided by the world size "
            "(gradient_accumulation_steps 1: every backward is a boundary, several before one engine.step() are "
            f"summed, as ZeRO-3 sums them){per_token}")


def warnings(config: dict, options: ODCConfig, machine: Machine) -> List[str]:
    """What initialize lets through but the user should know: paths never run on GPUs, several nodes, the
    replicated memory of "replicate", and what a config predicts will be refused later (at a call, or at
    initialize depending on the model or the script)."""
    found = []
    device, nodes, mode = shard_device(config, machine), machine.nodes, options.cross_node
    if machine.device != "cpu":
        found.append(_gpu_warning(options, device, nodes))
    if nodes > 1:
        found.append(f"{nodes} nodes: ODC across hosts has run only as two hosts simulated on one machine "
                     "(docs/multinode.md), never over a real network")
    on_gpus = device != "cpu"
    if nodes > 1 and mode == "auto" and on_gpus:
        found.append("cross_node 'auto' on GPUs: replicate (global and budget run on CPU hosts for now)")
    if nodes > 1 and (mode == "replicate" or (mode == "auto" and (on_gpus or options.node_replica_budget_gb is None))):
        found.append(_replicate_memory(config, options, machine, device))
    if nodes > 1 and mode == "global":
        found.append("cross_node 'global' on several nodes: engine.offload_states() is refused at the call, and "
                     "sequence parallelism (an SP mpu passed to deepspeed.initialize) at initialize")
    if nodes > 1 and mode in ("budget", "auto") and options.node_replica_budget_gb is not None and not on_gpus:
        later = ["engine.offload_states() at the call", "sequence parallelism at initialize"]
        if offloads(config):
            later.insert(0, f"zero_optimization.{' and '.join(offloads(config))} at initialize")
        if options.balance is not None and options.balance.policy == "lb-mini-split":
            later.insert(0, "the balance policy 'lb-mini-split' at initialize")
        found.append(f"cross_node {mode!r} is resolved at initialize from the model's size against "
                     "node_replica_budget_gb; where it shards layers over nodes, these are refused: "
                     f"{', '.join(later)}")
    if options.accumulator_dtype == "bf16" and compute_dtype(config) is None:
        found.append("accumulator_dtype 'bf16' with bf16.enabled \"auto\": refused at initialize unless the framework "
                     "turns bf16 on")
    return found


def _gpu_warning(options: ODCConfig, device: str, nodes: int) -> str:
    parts = ["the cuda_ipc transport and its CUDA push kernel" if device != "cpu" else
             "shm windows in host memory (offload_param) with pulls to the GPU"]
    if nodes > 1:
        parts.append("NCCL's exchange between nodes")
    if options.activation_offload is not None:
        parts.append("activation_offload")
    if options.balance is not None and options.balance.policy == "lb-mini-split":
        parts.append("split micro-batches (Ulysses attention)")
    if options.accumulator_dtype == "fp64":
        parts.append("fp64 accumulators")
    return (f"device cuda: on GPUs ds_odc is compiled and linked but has never run (docs/gpu.md): "
            f"{', '.join(parts)}; run the GPU kit's validation before relying on it")


def _replicate_memory(config: dict, options: ODCConfig, machine: Machine, device: str) -> str:
    window = (compute_dtype(config) or torch.bfloat16).itemsize  # "auto": bf16, what frameworks mostly turn on
    accumulator = EXACT_ACCUMULATOR_BYTES if options.deterministic else ACCUMULATOR_BYTES[options.accumulator_dtype]
    instead = ("on GPUs only 'replicate' runs for now" if device != "cpu" else
               "cross_node 'global' (sharded over the job) or 'auto' with node_replica_budget_gb bound it")
    return (f"cross_node {options.cross_node!r} on {machine.nodes} nodes: each rank holds {machine.nodes} times "
            f"ZeRO-3's partitions of the parameter window and the gradient accumulator: ({window} + {accumulator})"
            f"·P/{machine.ranks_per_node} bytes for P parameters, against ({window} + {accumulator})·P/"
            f"{machine.world_size} sharded over the job; {instead}")
