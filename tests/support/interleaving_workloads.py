"""Gradients read, written or dropped between backward and step while a faster peer runs its next micro-batch.

Every scenario is the same script on ZeRO-3 and on ODC: micro-batch 0, then the call under test on every rank,
then micro-batch 1 and the step (SGD without clipping: a lost or doubled push shows in the update). On ODC the
order ZeRO-3's collectives impose is broken on purpose (``forced``): rank 0 is the faster peer, and runs its
micro-batch 1 while rank 1 (the reader) is still inside or right after the call, through the protocol points of
:mod:`ds_odc.comm.schedule` or through the test's own waits; ZeRO-3 runs it unforced (its reduce-scatter needs both
ranks, so the same order cannot happen there). Several scenarios run in one launch, an engine each.

What each returns: ``handed`` (what the call handed rank 1, cloned as it returned), ``still`` (the same tensors
after rank 0's push landed: must equal ``handed``), ``params`` after the step, ``held`` (how each hold or pause
on this rank ended: a pause whose signal came says the peer went on where it must not have).
"""
from __future__ import annotations

import os

import deepspeed
import torch
import torch.distributed as tdist
from deepspeed.utils import (
    safe_get_full_grad,
    safe_get_local_grad,
    safe_set_full_grad,
    safe_set_local_grad,
    safe_update_full_grad_vectorized,
)

from ds_odc.comm import schedule
from tests.support.contract_workloads import _backward
from tests.support.workloads import ds_config, full_params, make_model, odc_runtime_facts, summed_grads, train_uneven

READER, FASTER = 1, 0  # on one node; on two hosts the faster rank may be on the other node
#: Calls whose result is what rank 1 reads (handed back, then compared after the peer's push).
READS = ("get_fp32_grad_partitions", "safe_get_local_grad", "safe_get_full_grad", "norm_outside_step")
#: Calls that write gradients between backward and step.
WRITES = ("safe_set_full_grad", "safe_set_local_grad", "safe_update_full_grad_vectorized")
#: Collective calls a peer must not overtake (each pauses rank 1 inside it).
DROPS = ("zero_grad", "save_checkpoint", "offload_states")
SCENARIOS = READS + WRITES + DROPS
PAUSE_S = 1.5  # how long rank 1 waits inside a call for a peer that must not get past it


def _trainable(engine) -> list:
    return [p for p in engine.module.parameters() if p.requires_grad]


def _read(engine, call: str):
    """Run ``call`` and return what it handed back (not cloned: the test sees whether it moves)."""
    params = _trainable(engine)
    if call == "get_fp32_grad_partitions":
        return [t for group in engine.optimizer.get_fp32_grad_partitions().values() for t in group.values()]
    if call == "safe_get_local_grad":
        return [safe_get_local_grad(p) for p in params]
    if call == "safe_get_full_grad":
        return [safe_get_full_grad(p) for p in params]
    if call == "norm_outside_step":
        engine.allreduce_gradients()
        return list(engine.optimizer._get_norm_groups())
    raise ValueError(call)


def _write(engine, call: str, hold) -> None:
    """Every trainable gradient written through ``call``; ``hold(last)`` runs right before each write's own
    fence (the last parameter's is where the test holds rank 1)."""
    params = _trainable(engine)
    last = params[-1]
    if call == "safe_set_full_grad":
        for param in params:
            hold(param is last)
            safe_set_full_grad(param, torch.linspace(-0.3, 0.3, param.ds_numel).view(param.ds_shape))
    elif call == "safe_set_local_grad":
        for param in params:
            local = safe_get_local_grad(param).clone()
            hold(param is last)
            safe_set_local_grad(param, local * 3.0 - 0.01)
    elif call == "safe_update_full_grad_vectorized":
        def update(full, param):
            hold(param is last)  # after the last parameter's all-gather, before its partition is written
            return full * 2.0 + 0.05
        safe_update_full_grad_vectorized(params, update)
    else:
        raise ValueError(call)


def _build(stage, call: str, odc):
    """SGD without clipping (a lost or doubled push shows in the update); offload_states needs DeepSpeed's
    FusedAdam (ZeRO-3 offloads its states only for it). Even sizes: ZeRO-3's safe_set_full_grad cuts the last
    rank's slice past an odd parameter's end."""
    config = ds_config(stage, gas=1, managed=False, optimizer="sgd", clip=0.0, lr=0.1, **({"odc": odc} if odc else {}))
    if call == "offload_states":
        config["optimizer"] = {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.0}}
    engine, *_ = deepspeed.initialize(model=make_model(hidden=8), config=config)
    return engine


def _scenario(stage, call: str, forced: bool, directory: str, ckpt_dir: str, odc=None, reader=READER,
              faster=FASTER) -> dict:
    rank = tdist.get_rank()
    engine = _build(stage, call, odc)
    sched = schedule.install(schedule.Schedule(directory)) if forced else None
    prefix = f"{call}-{(odc or {}).get('cross_node', '')}-"
    seen: dict = {}
    try:
        _backward(engine, 0, 0)
        faster_went_on = False
        if call in READS:
            handed = _read(engine, call)
            seen["handed"] = [t.detach().clone() for t in handed]
            if forced and rank == reader:
                sched.post(prefix + "cloned")
                sched.wait(prefix + "pushed")
            elif forced and rank == faster:
                sched.wait(prefix + "cloned")
                _backward(engine, 0, 1)
                sched.post(prefix + "pushed")
                faster_went_on = True
            seen["still"] = [t.detach().clone() for t in handed]
        elif call in WRITES:
            def hold(last: bool) -> None:
                if forced and rank == reader and last:
                    if call == "safe_update_full_grad_vectorized":
                        sched.wait(prefix + "pushed")  # inside the user's update function
                    else:
                        sched.hold_next("gradient_read.return", until=prefix + "pushed")
            _write(engine, call, hold)
            if forced and rank == faster:
                _backward(engine, 0, 1)
                sched.post(prefix + "pushed")
                faster_went_on = True
        else:
            if forced and rank == reader:
                point = {"zero_grad": "accumulator.zero", "save_checkpoint": "save",
                         "offload_states": "windows.away"}[call]
                sched.pause_next(point, PAUSE_S, unless=prefix + "pushed")
            if forced and rank == faster:
                sched.post_next("push.done", prefix + "pushed")
            if call == "zero_grad":
                engine.optimizer.zero_grad()
            elif call == "save_checkpoint":
                engine.save_checkpoint(ckpt_dir, tag=f"{stage}-{call}")
            elif stage == "odc":
                engine.offload_states()
                engine.reload_states()
        if not faster_went_on:
            _backward(engine, 0, 1)
        seen["grads"] = summed_grads(engine)  # what the step reads (a read itself: every rank, after every push)
        engine.step()
        seen["params"] = full_params(engine)
        seen["cross_node"] = odc_runtime_facts(engine).get("cross_node")
        if sched is not None:
            seen["held"] = list(sched.held)
            seen["pending"] = sched.pending()
    finally:
        if sched is not None:
            schedule.uninstall(sched)
        engine.destroy()
    return seen


def interleavings(stage, calls, forced: bool, directory: str, ckpt_dir: str, odc=None, reader=READER,
                  faster=FASTER) -> dict:
    """Every scenario of ``calls`` in turn, an engine each: ``{call: what it saw}`` (``odc``: the engine's odc
    options, e.g. a cross_node mode; ``reader`` / ``faster``: the ranks whose order is forced)."""
    return {call: _scenario(stage, call, forced, directory, ckpt_dir, odc, reader, faster) for call in calls}


#: On two hosts (2 nodes x 2 ranks): a read, a write and a discard (one of each path through the copy: the other
#: calls of each kind take the same path, one node's tests run them all), with rank 1 the slower reader and the
#: faster rank on its own node (replicate: the node's accumulators are summed over nodes at each read) or on the
#: other node (global and budget: its pushes reach rank 1's accumulator across nodes).
ACROSS_NODES_CALLS = ("get_fp32_grad_partitions", "safe_set_full_grad", "zero_grad")
ACROSS_NODES_MODES = {"replicate": ({"cross_node": "replicate"}, 0), "global": ({"cross_node": "global"}, 2),
                      "budget": ({"cross_node": "budget", "node_replica_budget_gb": 400 / 2 ** 30}, 2)}


def across_nodes(directory: str) -> dict:
    """ZeRO-3 on the same 4 ranks (unforced), then each cross_node mode forced (see the constants above)."""
    signals = os.path.join(directory, "signals")
    os.makedirs(signals, exist_ok=True)
    result = {"zero3": interleavings(3, ACROSS_NODES_CALLS, False, signals, directory)}
    for mode, (options, faster) in ACROSS_NODES_MODES.items():
        result[mode] = interleavings("odc", ACROSS_NODES_CALLS, True, signals, directory, options, READER, faster)
    return result


def uneven_under_perturbation(counts) -> dict:
    """:func:`~tests.support.workloads.train_uneven` (unmanaged), and what the perturbation did on this rank (it is
    installed from ``DS_ODC_PERTURB`` when the engine's session opens)."""
    result = train_uneven("odc", "unmanaged", counts)
    perturbations = [o for o in schedule.installed() if isinstance(o, schedule.Perturbation)]
    result["perturbation"] = (perturbations[0].seed, perturbations[0].delays) if perturbations else None
    return result
