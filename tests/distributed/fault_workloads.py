"""Fault injection into real ODC engines: an exception (retried or not) or a signal, at one phase,
on one rank. Runs inside spawned ranks (see harness.py); the test checks what every rank saw.

Every rank runs the same program (:data:`STEPS` steps of :data:`MICRO_BATCHES` micro-batches, a
checkpoint save after step :data:`FAULT_STEP` when the phase is "save"). The target rank fires the
fault the first time its phase is reached at step :data:`FAULT_STEP` (at start-up for "allocate"),
after writing the wall-clock time to ``marker`` so the test can measure how long the others took
to raise.
"""
from __future__ import annotations

import os
import signal
import time

import deepspeed
import torch
import torch.distributed as tdist

import ds_odc.comm.allocation as session_module
from ds_odc.runtime.vocabulary import RoundKind
from tests.distributed.workloads import ds_config, full_params, make_model, micro_batch, mse_mean

PHASES = ("allocate", "forward", "pull", "push", "fence", "norm", "publish", "save")
ACTIONS = ("retry", "uncaught", "sigkill", "sigterm", "sigstop")
STEPS, MICRO_BATCHES, FAULT_STEP = 3, 2, 1
_ROUNDS = {"fence": RoundKind.FENCE, "norm": RoundKind.NORM, "publish": RoundKind.PUBLISH}
_SIGNALS = {"sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM, "sigstop": signal.SIGSTOP}


class InjectedFault(RuntimeError):
    pass


class Injector:
    """Fires ``action`` once, when armed and its phase is reached."""

    def __init__(self, phase: str, action: str, marker: str):
        self.phase, self.action, self.marker = phase, action, marker
        self.armed = phase == "allocate"
        self.fired = False

    def maybe_fire(self) -> None:
        if not self.armed or self.fired:
            return
        self.fired = True
        with open(self.marker, "w") as out:
            out.write(repr(time.time()))
        if self.action in ("retry", "uncaught"):
            raise InjectedFault(f"injected {self.action} fault at {self.phase} on rank {tdist.get_rank()}")
        os.kill(os.getpid(), _SIGNALS[self.action])
        time.sleep(120)  # a stopped rank stays here until the test kills it

    def wrap(self, owner, name: str, when=lambda *a, **k: True) -> None:
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            if when(*args, **kwargs):
                self.maybe_fire()
            return original(*args, **kwargs)

        setattr(owner, name, wrapped)


def _initialize(injector, config):
    if injector is None or injector.phase != "allocate":
        return deepspeed.initialize(model=make_model(), config=config)[0]
    original = session_module.create_reserved

    def create_reserved(path, nbytes):
        if path.endswith("_params"):
            injector.maybe_fire()
        return original(path, nbytes)

    session_module.create_reserved = create_reserved
    try:
        return deepspeed.initialize(model=make_model(), config=config)[0]
    finally:
        session_module.create_reserved = original


def _arm_in_engine(injector, engine) -> None:
    transport = engine.optimizer.odc.transport
    phase = injector.phase
    if phase == "forward":
        engine.module.blocks[0].register_forward_pre_hook(lambda *unused: injector.maybe_fire())
    elif phase == "pull":
        injector.wrap(transport, "read")
        injector.wrap(transport, "read_many")  # ZeRO-3's gathers pull a module's parameters in one batch
    elif phase == "push":
        injector.wrap(transport, "accumulate")
        injector.wrap(transport, "accumulate_many")
    elif phase in _ROUNDS:
        injector.wrap(transport, "exchange", lambda kind, *a, **k: kind == _ROUNDS[phase])
    elif phase == "save":
        injector.wrap(engine.checkpoint_engine, "save")


def faulty_training(phase: str, action: str, target: int, marker: str, ckpt_dir: str, timeout_s: float):
    """See the module docstring. Returns ``{"errors": [(type, message, time)], "completed", "params"}``
    (the full fp32 parameters when every step completed); a target with ``action="uncaught"`` lets
    the injected exception escape."""
    rank = tdist.get_rank()
    injector = Injector(phase, action, marker) if rank == target and phase != "none" else None
    retry = injector is not None and action == "retry"
    errors = []
    config = ds_config("odc", odc={"timeout_s": timeout_s, "accumulator_dtype": "fp64"},
                       stage3_param_persistence_threshold=0, managed=False)

    def attempt(operation):
        """Run ``operation``; on the target's retried fault, record it and run it once more."""
        try:
            return operation()
        except InjectedFault as fault:
            if not retry:
                raise
            errors.append((type(fault).__name__, str(fault), time.time()))
            return operation()

    engine = None
    try:
        engine = attempt(lambda: _initialize(injector, config))
        if injector is not None and phase != "allocate":
            _arm_in_engine(injector, engine)
        for step in range(STEPS):
            if injector is not None and step == FAULT_STEP:
                injector.armed = True
            for index in range(MICRO_BATCHES):
                x, y, _ = micro_batch(step, rank, index)
                attempt(lambda: engine.backward(mse_mean(engine(x), y)))
            attempt(engine.step)
            if phase == "save" and step == FAULT_STEP:
                attempt(lambda: engine.save_checkpoint(ckpt_dir, tag=f"step{step}"))
    except InjectedFault:
        raise  # the target's uncaught fault: the process ends with it
    except Exception as err:  # noqa: BLE001 - what this rank saw is the result
        errors.append((type(err).__name__, str(err), time.time()))
        return {"errors": errors, "completed": False, "params": None}
    params = full_params(engine)
    engine.destroy()
    return {"errors": errors, "completed": True, "params": params}
