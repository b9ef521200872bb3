"""The one place where the Trainer balance talks to every rank outside ODC's step rounds.

ODC's own communication happens in the step protocol's rounds (fence, norm, update, publish), which
watch the failure board: a dead rank is named within ``timeout_s``. The Trainer adds three small
collectives of its own, all through :func:`gather_rows`:

* ``"loss-token count"``: the step's global number of loss tokens (``get_batch_samples``, once per
  optimizer step, every rank, one with no micro-batch too; :mod:`ds_odc.integration.hf_balance`);
* ``"the ODC figures"``: each rank's row of figures, at each training log of every ODC Trainer (``log``;
  :mod:`ds_odc.integration.hf_metrics`; a row wider than one round takes two);
* ``"cost-model times"``: the forward+backward seconds of the ``"measure"`` cost model, once when
  training starts (:mod:`ds_odc.integration.hf_cost`).

On an ODC training engine each is one of the engine's rounds (:meth:`ODCEngine.odc_exchange`, a round
outside a step that watches its peers like every other), so a dead or stuck rank is named within
``timeout_s``. Without one (the ZeRO-3 + LB-Micro baseline, an engine not built yet) it is accelerate's
``gather`` (what ``Accelerator.gather`` runs) on the process group, bounded by the group's timeout.
"""
from __future__ import annotations

import torch


def gather_rows(trainer, values: torch.Tensor, what: str) -> torch.Tensor:
    """Every rank's ``values`` (a 1-D tensor of the same length everywhere) as float64 rows, row r from rank
    r: shape ``(world_size, len(values))``. A collective: every rank of the Trainer's job must call it, in
    the same order, with the same ``what`` (a short name of the quantity, for profiles and errors).

    >>> gather_rows(trainer, torch.tensor([3.0, 1.0]), "loss-token count")   # on rank 0 of 2  # doctest: +SKIP
    tensor([[3., 1.], [5., 1.]], dtype=torch.float64)
    """
    row = values.detach().to(device=trainer.args.device, dtype=torch.float64).reshape(1, -1)
    world = trainer.args.world_size
    if world == 1:
        return row
    exchange = getattr(_training_engine(trainer), "odc_exchange", None)
    if exchange is not None:
        with torch.profiler.record_function(f"ds_odc::gather_rows({what})"):
            return exchange(row.reshape(-1).cpu(), f"the Trainer's {what}").to(row.device)
    from accelerate.utils import gather

    # accelerate's function, not ``trainer.accelerator.gather``: inside a balanced micro-batch that method
    # answers locally (hf_balance.answered_locally), and these rows must always come from every rank
    with torch.profiler.record_function(f"ds_odc::gather_rows({what})"):
        rows = gather(row)
    if tuple(rows.shape) != (world, row.shape[1]):
        raise RuntimeError(f"ds_odc: gathering the {what} gave shape {tuple(rows.shape)}, expected "
                           f"{(world, row.shape[1])}: ranks disagree about this collective")
    return rows


def _training_engine(trainer):
    """The Trainer's DeepSpeed engine once it trains (None before, or without DeepSpeed)."""
    wrapped = getattr(getattr(trainer, "accelerator", None), "deepspeed_engine_wrapped", None)
    engine = getattr(wrapped, "engine", None)
    return engine if getattr(engine, "odc_trains", False) else None
