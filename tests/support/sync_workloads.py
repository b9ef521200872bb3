"""What the ranks run in the synchronisation tests (test_sync.py): every torch.distributed collective
counted, per micro-batch and per step, and a straggler rank. Runs inside spawned ranks (harness.py)."""
from __future__ import annotations

import time

import deepspeed
import torch.distributed as tdist

from tests.support.workloads import ds_config, make_model, micro_batch, mse_mean

# -- op counting -----------------------------------------------------------------------------------
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce_scatter",
               "_all_gather_base", "_reduce_scatter_base", "all_reduce_coalesced", "all_gather_coalesced",
               "broadcast", "barrier", "monitored_barrier", "all_gather_object", "broadcast_object_list", "reduce",
               "gather", "scatter", "all_to_all_single", "all_to_all")
#: point-to-point messages, counted apart (cross_node "global" pulls and pushes across nodes are made of them)
POINT_TO_POINT = ("send", "recv", "isend", "irecv")


class CollectiveCounter:
    """Counts every torch.distributed collective (DeepSpeed's comm layer ends in these). Installed
    by :func:`install_collective_counter` before the process group exists, so that references
    DeepSpeed captures at initialisation are the counting ones too."""

    def __init__(self):
        import torch.distributed.distributed_c10d as c10d

        self.count = 0
        self.messages = 0  # point-to-point
        for name in COLLECTIVES + POINT_TO_POINT:
            original = getattr(tdist, name, None)
            if original is None:
                continue
            field = "messages" if name in POINT_TO_POINT else "count"

            def counted(*args, __original=original, __field=field, **kwargs):
                setattr(self, __field, getattr(self, __field) + 1)
                return __original(*args, **kwargs)

            setattr(tdist, name, counted)
            if getattr(c10d, name, None) is original:
                setattr(c10d, name, counted)

    def take(self) -> int:
        value, self.count = self.count, 0
        return value

    def take_messages(self) -> int:
        value, self.messages = self.messages, 0
        return value


_counter = None


def install_collective_counter():
    global _counter
    _counter = CollectiveCounter()


def count_collectives(stage, layers, micro_batches, steps=3, odc=None):
    """Collectives issued in forward+backward and in each step, for one model size; point-to-point messages
    apart (``messages``: in forward+backward, per step)."""
    counter = _counter
    cfg = ds_config(stage, gas=micro_batches, stage3_param_persistence_threshold=0, **({"odc": odc} if odc else {}))
    engine, *_ = deepspeed.initialize(model=make_model(layers=layers), config=cfg)
    rank = tdist.get_rank()
    counter.take()
    counter.take_messages()
    fwd_bwd, per_step, exchanges, pulls, pushes, messages = [], [], [], [], [], []
    runtime = getattr(engine.optimizer, "odc", None)
    transport = runtime.transport if runtime else None
    for step in range(steps):
        inside = 0
        before_exchanges = transport.exchanges if transport else 0
        before_pulls, before_pushes = (runtime.pulls, runtime.pushes) if runtime else (0, 0)
        for index in range(micro_batches):
            x, y, _ = micro_batch(step, rank, index)
            loss = mse_mean(engine(x), y)
            engine.backward(loss)
            inside += counter.take()
            if index < micro_batches - 1:
                engine.step()  # not a boundary: no optimizer work
                inside += counter.take()
        engine.step()
        per_step.append(counter.take())
        fwd_bwd.append(inside)
        messages.append(counter.take_messages())
        exchanges.append((transport.exchanges - before_exchanges) if transport else None)
        pulls.append((runtime.pulls - before_pulls) if runtime else None)
        pushes.append((runtime.pushes - before_pushes) if runtime else None)
    trainable = sum(1 for p in engine.module.parameters() if p.requires_grad)
    every = sum(1 for p in engine.module.parameters())
    engine.destroy()
    return {"fwd_bwd": fwd_bwd, "step": per_step, "exchanges": exchanges, "pulls": pulls, "pushes": pushes,
            "trainable_params": trainable, "params": every, "messages": messages}


# -- straggler --------------------------------------------------------------------------------------
def straggler(stage, sleep_s=1.0, micro_batches=2, steps=2):
    """Rank 1 sleeps inside each forward. Returns rank 0's time in forward+backward and in step."""
    rank = tdist.get_rank()
    cfg = ds_config(stage, gas=micro_batches)
    engine, *_ = deepspeed.initialize(model=make_model(), config=cfg)
    if rank == 1:
        engine.module.blocks[0].register_forward_pre_hook(lambda *_: time.sleep(sleep_s))
    compute, stepping = 0.0, 0.0
    for step in range(steps):
        for index in range(micro_batches):
            x, y, _ = micro_batch(step, rank, index)
            start = time.perf_counter()
            loss = mse_mean(engine(x), y)
            engine.backward(loss)
            compute += time.perf_counter() - start
            start = time.perf_counter()
            engine.step()
            stepping += time.perf_counter() - start
    engine.destroy()
    return {"compute_s": compute, "step_s": stepping}
