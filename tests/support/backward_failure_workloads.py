"""A backward that raises inside autograd, on one rank, on either side of "its gradients reached ZeRO-3's buckets"
(``ODCEngine.backward``: the optimizer's ``odc_gradients_seen``, counted when ZeRO-3's hook hands a parameter's
gradient to its bucketing, which pushes it to the owner). Runs inside the ranks (see harness.py); the test checks
what every rank saw.

Every rank runs :data:`STEPS` steps of :data:`MICRO_BATCHES` micro-batches (``odc.deterministic``: sums that do not
depend on the order pushes land in, so a retried run can be compared bit for bit). At micro-batch
:data:`FAULT_MICRO_BATCH` of step :data:`FAULT_STEP` (the accumulators already hold the step's first micro-batch)
the target's backward raises once, from a tensor hook at one of :data:`WHERE`:

* ``"loss"``: on the loss, the first gradient autograd computes, before any of ZeRO-3's backward hooks;
* ``"model-output"``: on the model's output, after DeepSpeed's backward prologue (its hook on that output runs
  first) and before any parameter's gradient;
* ``"first-layer-output"``: on the output of the first layer (``inp``), the last gradient autograd computes before
  ``inp``'s own: the gradients of every later layer have reached the buckets.

The target catches the fault and retries as a user would: ``engine.backward(loss)`` again where autograd has not
run a node of the graph yet ("loss"), else the whole micro-batch (autograd freed what it ran through).
"""
from __future__ import annotations

import time

import deepspeed
import torch.distributed as tdist

from ds_odc.errors import ODCError
from tests.support.workloads import ds_config, full_params, make_model, micro_batch, mse_mean, summed_grads

WHERE = ("loss", "model-output", "first-layer-output")
STEPS, MICRO_BATCHES, FAULT_STEP, FAULT_MICRO_BATCH = 2, 2, 1, 1


class InjectedFault(RuntimeError):
    pass


class BackwardFault:
    """A tensor hook that raises once when armed, recording when, and how many gradients of this backward had
    reached the buckets by then."""

    def __init__(self, engine):
        self.engine = engine
        self.armed = False
        self.fired_at = None
        self.gradients_before = None  # odc_gradients_seen when the faulty micro-batch began
        self.gradients_reached = None  # gradients of that backward handed to the buckets when the fault fired

    def arm(self) -> None:
        self.armed = True
        self.gradients_before = self.engine.optimizer.odc_gradients_seen

    def hook(self, grad):
        if not self.armed:
            return grad
        self.armed = False
        self.fired_at = time.time()
        self.gradients_reached = self.engine.optimizer.odc_gradients_seen - self.gradients_before
        raise InjectedFault(f"injected backward fault on rank {tdist.get_rank()}")


def _error(err: BaseException) -> tuple:
    return type(err).__name__, str(err), time.time()


def _hook_first_layer_output(engine, fault: BackwardFault) -> None:
    def on_output(module, inputs, out):
        if fault.armed:
            out.register_hook(fault.hook)

    engine.module.inp.register_forward_hook(on_output)


def backward_fault_training(where, target: int, timeout_s: float):
    """See the module docstring (``where=None``: the undisturbed run). Returns this rank's ``errors`` (type, message,
    time: the injected fault, then any ODC error and what the engine said when used once more), ``completed``, and
    when completed the summed gradients of the fault step (read before its step) and the parameters after the last
    step; the target also ``fired_at`` and ``gradients_reached``."""
    if where is not None and where not in WHERE:
        raise ValueError(f"where must be one of {WHERE}, got {where!r}")
    rank = tdist.get_rank()
    engine, *_ = deepspeed.initialize(model=make_model(), config=ds_config(
        "odc", managed=False, stage3_param_persistence_threshold=0,
        odc={"timeout_s": timeout_s, "deterministic": True}))
    fault = BackwardFault(engine) if rank == target and where is not None else None
    if fault is not None and where == "first-layer-output":
        _hook_first_layer_output(engine, fault)
    errors, grads = [], None
    try:
        for step in range(STEPS):
            for index in range(MICRO_BATCHES):
                x, y, _ = micro_batch(step, rank, index)
                if fault is not None and (step, index) == (FAULT_STEP, FAULT_MICRO_BATCH):
                    fault.arm()  # before the forward, which puts the first-layer hook on inp's output
                pred = engine(x)
                if fault is not None and fault.armed and where == "model-output":
                    pred.register_hook(fault.hook)
                loss = mse_mean(pred, y)
                if fault is not None and fault.armed and where == "loss":
                    loss.register_hook(fault.hook)
                try:
                    engine.backward(loss)
                except InjectedFault as err:
                    errors.append(_error(err))
                    if where == "loss":
                        engine.backward(loss)
                    else:
                        engine.backward(mse_mean(engine(x), y))
            if step == FAULT_STEP:
                grads = summed_grads(engine)  # every rank, before the step
            engine.step()
    except ODCError as err:
        errors.append(_error(err))
        try:  # used once more, the engine refuses
            engine(x)
        except ODCError as again:
            errors.append(_error(again))
        found = {"errors": errors, "completed": False}
    else:
        found = {"errors": errors, "completed": True, "grads": grads, "params": full_params(engine)}
    if fault is not None:
        found.update(fired_at=fault.fired_at, gradients_reached=fault.gradients_reached)
    engine.destroy()
    return found
