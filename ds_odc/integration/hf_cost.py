"""``"cost_model": "measure"``: fit ``c + a·s² + b·s`` on this model and machine when training starts.

Every rank times the same forward+backward passes of one synthetic sample at several lengths up to
the token cap (after a warm-up pass each), the ranks average their medians in one gather
(:func:`~ds_odc.integration.hf_gather.gather_rows`) so that the fit, hence every plan, is the same
everywhere, and the gradients of those passes are dropped with a collective ``zero_grad`` before the
first real micro-batch. Runs once, when the training data loader first plans a step (the engine
exists by then); the fit is logged once. Times that do not grow with length (samples too short to
time on a loaded machine) fall back to the token count, with a warning: every rank sees the same
averaged times, so every rank falls back alike.
"""
from __future__ import annotations

import time

import torch
from deepspeed.utils import logger

from ds_odc.balance.cost import CostModel, fit_cost_model
from ds_odc.config import BalanceConfig
from ds_odc.errors import ODCError
from ds_odc.integration.hf_gather import gather_rows

#: Fractions of the token cap timed; five lengths from 1/16 of the cap to the cap.
MEASURED_FRACTIONS = (1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0)
REPEATS = 3


def measured_lengths(token_cap: int) -> list[int]:
    return sorted({max(1, int(token_cap * fraction)) for fraction in MEASURED_FRACTIONS})


def measure_cost_model(trainer, config: BalanceConfig) -> CostModel:
    engine = trainer.accelerator.deepspeed_engine_wrapped.engine
    device = trainer.args.device
    vocab = int(getattr(getattr(trainer.model, "config", None), "vocab_size", 2) or 2)
    generator = torch.Generator().manual_seed(0)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def seconds(length: int) -> float:
        ids = torch.randint(0, vocab, (1, length), generator=generator).to(device)
        engine.set_gradient_accumulation_boundary(False)
        synchronize()
        start = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        synchronize()
        return time.perf_counter() - start

    lengths = measured_lengths(config.token_cap)
    medians = []
    for length in lengths:
        seconds(length)  # warm-up
        runs = sorted(seconds(length) for _ in range(REPEATS))
        medians.append(runs[len(runs) // 2])
    engine.optimizer.zero_grad()  # collective on ODC: every rank drops these gradients
    times = gather_rows(trainer, torch.tensor(medians, dtype=torch.float64), "cost-model times")
    averaged = dict(zip(lengths, times.mean(dim=0).tolist()))
    try:
        model = fit_cost_model(lambda length: averaged[length], lengths, repeats=1, warmup=0)
    except ODCError as error:  # times lost in noise (tiny samples, a loaded machine): the same on every rank
        if trainer.is_world_process_zero():
            logger.warning(f"ds_odc balance: {error}; planning by token count instead")
        return CostModel.tokens()
    if trainer.is_world_process_zero():
        logger.info(f"ds_odc balance: measured forward+backward seconds at lengths {lengths}: "
                    f"{[round(averaged[s], 5) for s in lengths]}; fitted cost {model.per_micro_batch:.3g} + "
                    f"{model.quadratic:.3g}·s² + {model.linear:.3g}·s")
    return model
