"""Fault injection into real ODC engines: an exception (retried or not) or a signal, at one phase,
on one rank. Runs inside spawned ranks (see harness.py); the test checks what every rank saw.

Every rank runs the same program (:data:`STEPS` steps of :data:`MICRO_BATCHES` micro-batches, a
checkpoint save after step :data:`FAULT_STEP` when the phase is "save"). The target rank fires the
fault the first time its phase is reached at step :data:`FAULT_STEP` (at start-up for "allocate"),
after writing the wall-clock time to ``marker`` so the test can measure how long the others took
to raise.

The same program runs on every transport: batches go to ``engine.device``, and "allocate" fires where
every transport passes, right after a rank has created its files of the start-up protocol
(:meth:`~ds_odc.comm.allocation.NodeAllocation.create_own_files`; ``cuda_ipc`` then allocates its windows
in GPU memory, ``shm`` already has them in ``/dev/shm``). :data:`OWNER_DIES_MID_PULL` is a GPU case:
the owner is killed in its forward while a peer's pulls from its window are in flight.

A rank that survives a fault reports whether its device still works (``device_ok``): a peer's death
must reach it as an ODC error, never as a fault of its own device.
"""
from __future__ import annotations

import os
import signal
import time

import deepspeed
import torch
import torch.distributed as tdist

from ds_odc.comm.allocation import NodeAllocation
from ds_odc.runtime.round_kinds import RoundKind
from tests.support.workloads import ds_config, full_params, make_model, micro_batch, mse_mean

PHASES = ("allocate", "forward", "pull", "push", "fence", "norm", "publish", "save")
#: The target (an owner) is SIGKILLed in its forward while the other ranks keep pulling from its window.
OWNER_DIES_MID_PULL = "owner-dies-mid-pull"
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
    allocation = NodeAllocation
    original = allocation.create_own_files

    def create_own_files(self, timeout_s):
        block = original(self, timeout_s)  # this rank's lock file and control block exist (and shm's windows)
        injector.maybe_fire()
        return block

    allocation.create_own_files = create_own_files
    try:
        return deepspeed.initialize(model=make_model(), config=config)[0]
    finally:
        allocation.create_own_files = original


def _wait_for(path: str, bound_s: float = 30.0) -> None:
    deadline = time.monotonic() + bound_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {bound_s:.0f} s")
        time.sleep(0.01)


def _arm_owner_dies_mid_pull(injector, engine, target: int, marker: str) -> None:
    """The owner ``target`` dies (SIGKILL) in its forward at :data:`FAULT_STEP`, once a peer has queued
    pulls of its whole window; the peer keeps queueing pulls for a second after that, so some are in
    flight while the owner dies and some start after its death."""
    pulling = marker + ".pulling"
    if injector is not None:  # the owner
        def die(*unused):
            if injector.armed and not injector.fired:
                _wait_for(pulling)
                injector.maybe_fire()
        engine.module.blocks[0].register_forward_pre_hook(die)
        return
    transport = engine.optimizer.odc.transport
    window = transport.local_param_window()
    scratch = torch.empty(window.numel(), dtype=window.dtype, device=window.device)
    state = {"done": False}

    def pull_while_it_dies(*unused):
        if state["done"] or engine.global_steps != FAULT_STEP:
            return
        state["done"] = True
        for _ in range(8):
            transport.read(target, 0, scratch)
        with open(pulling, "w"):
            pass
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            transport.read(target, 0, scratch)
            time.sleep(0.005)
    engine.module.blocks[0].register_forward_pre_hook(pull_while_it_dies)


def device_works(device) -> tuple:
    """(True, "") if ``device`` still computes correctly, else (False, the error)."""
    try:
        a = torch.arange(16, dtype=torch.float32, device=device).view(4, 4)
        value = (a @ a).sum().item()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        expected = float((torch.arange(16.0).view(4, 4) @ torch.arange(16.0).view(4, 4)).sum())
        return (value == expected, "" if value == expected else f"computed {value}, expected {expected}")
    except Exception as err:  # noqa: BLE001 - reported to the test
        return False, f"{type(err).__name__}: {err}"


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
    if phase == OWNER_DIES_MID_PULL and action != "sigkill":
        raise ValueError(f"{OWNER_DIES_MID_PULL} kills the owner (action 'sigkill'), got {action!r}")
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
        if phase == OWNER_DIES_MID_PULL:
            _arm_owner_dies_mid_pull(injector, engine, target, marker)
        elif injector is not None and phase != "allocate":
            _arm_in_engine(injector, engine)
        for step in range(STEPS):
            if injector is not None and step == FAULT_STEP:
                injector.armed = True
            for index in range(MICRO_BATCHES):
                x, y, _ = (t.to(engine.device) for t in micro_batch(step, rank, index))
                attempt(lambda x=x, y=y: engine.backward(mse_mean(engine(x), y)))
            attempt(engine.step)
            if phase == "save" and step == FAULT_STEP:
                attempt(lambda step=step: engine.save_checkpoint(ckpt_dir, tag=f"step{step}"))
    except InjectedFault:
        raise  # the target's uncaught fault: the process ends with it
    except Exception as err:  # noqa: BLE001 - what this rank saw is the result
        errors.append((type(err).__name__, str(err), time.time()))
        device = engine.device if engine is not None else None
        ok, why = device_works(device) if device is not None else (None, "no engine")
        return {"errors": errors, "completed": False, "params": None, "device_ok": ok, "device_error": why}
    params = full_params(engine)
    engine.destroy()
    return {"errors": errors, "completed": True, "params": params, "device_ok": True, "device_error": ""}
