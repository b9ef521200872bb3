"""What the ranks run in tests/distributed/test_documented_refusals.py: the refusals and the one-time warning that
the docs promise, each driven the way a user meets it (``deepspeed.initialize``, ``engine.offload_states``,
``model.generate``, training steps)."""
from __future__ import annotations

import logging

import deepspeed
import torch
import torch.distributed as tdist

from tests.support.frozen_workloads import frozen_config
from tests.support.workloads import ds_config, make_model, micro_batch, mse_mean


# -- item 11: the data-parallel group must span every rank -------------------------------------------------
class ModelParallelMpu:
    """Megatron's ``mpu`` interface as DeepSpeed reads it, for plain model parallelism over the whole world:
    every rank is one model-parallel rank of a single model-parallel group, so each data-parallel group is
    one rank alone (a data-parallel group smaller than the world, which the odc stage refuses)."""

    def __init__(self):
        world, rank = tdist.get_world_size(), tdist.get_rank()
        self.rank = rank
        # new_group is collective: every rank makes every group, in the same order
        self.own_groups = [tdist.new_group([r]) for r in range(world)]
        self.world_group = tdist.new_group(list(range(world)))

    def get_model_parallel_rank(self):
        return self.rank

    def get_model_parallel_group(self):
        return self.world_group

    def get_model_parallel_world_size(self):
        return tdist.get_world_size()

    def get_data_parallel_rank(self):
        return 0

    def get_data_parallel_group(self):
        return self.own_groups[self.rank]

    def get_data_parallel_world_size(self):
        return 1


def initialize_with_model_parallelism() -> dict:
    """``deepspeed.initialize`` on the odc stage with :class:`ModelParallelMpu`. Returns the error's type and
    message (or None if it was accepted)."""
    from ds_odc.errors import ODCConfigError

    model = make_model()
    try:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config("odc"), mpu=ModelParallelMpu())
    except ODCConfigError as err:
        return {"error": type(err).__name__, "message": str(err)}
    engine.destroy()
    return {"error": None, "message": None}




def initialize_a_pipeline(stages: int) -> dict:
    """``deepspeed.initialize`` on the odc stage with DeepSpeed's ``PipelineModule`` of two layers in ``stages``
    stages over the ranks. Returns the error's type and message (or None if it was accepted)."""
    from deepspeed.pipe import PipelineModule

    torch.manual_seed(0)
    model = PipelineModule(layers=[torch.nn.Linear(7, 7), torch.nn.Linear(7, 7)], num_stages=stages,
                           loss_fn=torch.nn.MSELoss())
    try:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                          config=ds_config("odc"))
    except Exception as err:  # noqa: BLE001 - the type is the result
        return {"error": type(err).__name__, "message": str(err)}
    engine.destroy()
    return {"error": None, "message": None}

# -- item 12a: a frozen engine's offload_states refusals ----------------------------------------------------
def frozen_offload_refusals() -> dict:
    """A frozen engine (no optimizer) asked to move what it cannot: a state besides its parameters, to NVMe,
    and (a second engine) with its parameters offloaded already. Each call's error type and message, by case,
    and each engine's forward after its refusals (a refusal must move nothing: a window moved away would make
    the forward raise)."""
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

    def attempt(call):
        try:
            call()
        except Exception as err:  # noqa: BLE001 - the type is the result
            return {"error": type(err).__name__, "message": str(err)}
        return {"error": None, "message": None}

    results = {}
    reference, *_ = deepspeed.initialize(model=make_model(), config=frozen_config("odc"))
    results["other_state"] = attempt(lambda: reference.offload_states(
        include=[OffloadStateTypeEnum.lp_params, OffloadStateTypeEnum.optim_states]))
    results["nvme"] = attempt(lambda: reference.offload_states(device=OffloadDeviceEnum.nvme))
    x = micro_batch(0, 0, 0)[0]
    with torch.no_grad():
        results["forward_after_refusals"] = reference(x).clone()
    reference.destroy()

    config = frozen_config("odc")
    config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    offloaded, *_ = deepspeed.initialize(model=make_model(), config=config)
    results["offload_param"] = attempt(lambda: offloaded.offload_states())
    with torch.no_grad():
        results["offloaded_forward_after_refusal"] = offloaded(x).clone()
    offloaded.destroy()
    return results


# -- item 12b: generate() under Ulysses SP, refused unless the caller passes synced_gpus ----------------------
def generate_under_sp_with_and_without_synced_gpus(new_tokens: int = 2) -> dict:
    """One SP group of 2 (ALST's mpu) on the odc stage, the same prompt on both ranks. ``generate()`` without
    ``synced_gpus``: ds_odc's refusal (its type and message). With ``synced_gpus=True`` ds_odc steps aside and the
    call is transformers' and ALST's: without the KV cache it runs (the generated length), with it ALST's own
    attention fails at the first decoded token (the error's type). Each case's outcome, by name."""
    from tests.support import sp_workloads

    def attempt(**extra):
        try:
            tokens = engine.module.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                            do_sample=False, **extra)
        except Exception as err:  # noqa: BLE001 - the type is the result
            return {"error": type(err).__name__, "message": str(err)}
        return {"error": None, "length": tokens.shape[1]}

    engine, _ = sp_workloads.sp_engine("odc")
    prompt = torch.tensor([[1, 2, 3, 4]])
    result = {"unsaid": attempt(), "synced_without_cache": attempt(synced_gpus=True, use_cache=False),
              "synced_with_cache": attempt(synced_gpus=True)}
    engine.destroy()
    return result


# -- item 12c: deterministic accumulation beyond its exact range: a warning says so once ----------------------
INEXACT_WARNING = "beyond the range summed exactly"


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def inexact_sum_warnings(loss_scale: float, steps: int = 3, gas: int = 2) -> int:
    """``odc.deterministic`` training, ``steps`` steps of ``gas`` micro-batches, each loss times ``loss_scale``
    (1e12 drives every gradient far beyond the exact range, in every push). Returns how many times the
    ``ds_odc`` logger said the sums are no longer exact on this rank."""
    records = _Records()
    log = logging.getLogger("ds_odc")
    log.addHandler(records)
    try:
        model = make_model(frozen=False)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config("odc", gas=gas, odc={"deterministic": True}))
        rank = tdist.get_rank()
        for step in range(steps):
            for index in range(gas):
                x, y, _ = micro_batch(step, rank, index)
                engine.backward(mse_mean(engine(x), y) * loss_scale)
                engine.step()
        engine.destroy()
    finally:
        log.removeHandler(records)
    return sum(INEXACT_WARNING in message for message in records.messages)
