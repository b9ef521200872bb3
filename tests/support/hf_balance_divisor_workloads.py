"""What the ranks run in the tests of the Trainer balance block's other divisors (docs/balancing.md,
"Normalisation, as the Trainer means it"): ``average_tokens_across_devices=False`` (each rank's micro-batches
divided by that rank's own loss-token count, the ranks averaged), and a model that reports no token count
(its forward takes no ``num_items_in_batch``: each micro-batch's mean loss divided by the step's global
micro-batch count over the world size).

The model, data and collator are :mod:`tests.support.hf_balance_workloads`'. Each rank records, per step, the
micro-batches it ran (the tensors its model was given), the ``num_items_in_batch`` its model was given, the
weights after the step and the Trainer's log; :func:`documented_reference` replays the same assignment of samples
to ranks in one plain PyTorch process, applying the documented divisor.
"""
from __future__ import annotations

import torch

from tests.support.hf_balance_workloads import LongTailedDataset, _full_parameters, llama_config, pad_collator

LR = 3e-3
MAX_GRAD_NORM = 0.3  # below the gradient norms here: every step is clipped, as in the other balance tests
BALANCE = {"policy": "lb-mini", "token_cap": 48, "cost_model": {"a": 0.02, "b": 1.0}}


def mean_loss_llama_class():
    """A tiny Llama whose forward names its arguments (no ``**kwargs``): the Trainer sees a model that takes no
    ``num_items_in_batch`` (``model_accepts_loss_kwargs`` False) and divides each micro-batch's mean loss itself."""
    from transformers import LlamaForCausalLM

    class MeanLossLlama(LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, labels=None):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels)

    return MeanLossLlama


def tiny_model(counted: bool):
    """The same initial weights either way (the subclass adds no module)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return (LlamaForCausalLM if counted else mean_loss_llama_class())(llama_config())


def divisor_run(output_dir: str, counted: bool, average_tokens: bool, steps: int = 3) -> dict:
    """The Trainer with the lb-mini balance block on the odc stage for ``steps`` steps (per rank: 4 samples,
    2 accumulation steps). Returns per step: the micro-batches this rank ran (``input_ids``, ``attention_mask``,
    ``labels``), the ``num_items_in_batch`` its model was given in each (None: not given), the full weights
    after the step, and the Trainer's logs."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from tests.support.hf_balance_workloads import balance_ds_config

    ran, given, weights, logs = [], [], {}, []
    pending = {"batches": [], "given": []}

    def record_forward(module, args, kwargs):
        if module.training and torch.is_grad_enabled():
            pending["batches"].append({k: kwargs[k].detach().clone() for k in ("input_ids", "attention_mask",
                                                                                  "labels")})
            count = kwargs.get("num_items_in_batch")
            pending["given"].append(None if count is None else float(count))

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            weights[state.global_step] = _full_parameters(trainer.model, True)
            ran.append(pending["batches"])
            given.append(pending["given"])
            pending["batches"], pending["given"] = [], []

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "grad_norm" in logs:
                record.append(dict(logs))

    record = logs
    args = TrainingArguments(
        output_dir=output_dir, deepspeed=balance_ds_config("odc", BALANCE), use_cpu=True, max_steps=steps,
        per_device_train_batch_size=4, gradient_accumulation_steps=2, average_tokens_across_devices=average_tokens,
        optim="adamw_torch", learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=MAX_GRAD_NORM, logging_steps=1, save_strategy="no", report_to="none", seed=0, data_seed=0,
        disable_tqdm=True, dataloader_num_workers=0, remove_unused_columns=False)
    model = tiny_model(counted)
    model.register_forward_pre_hook(record_forward, with_kwargs=True)
    trainer = Trainer(model=model, args=args, train_dataset=LongTailedDataset(104, seed=3),
                      data_collator=pad_collator, callbacks=[Record()])
    trainer.train()
    return {"ran": ran, "given": given, "weights": weights, "logs": logs,
            "accepts_loss_kwargs": trainer.model_accepts_loss_kwargs, "engine": type(trainer.model_wrapped).__name__}


def loss_tokens(batch: dict) -> int:
    """A micro-batch's loss tokens as the Trainer counts them for a causal LM (labels shifted by one)."""
    return int(batch["labels"][..., 1:].ne(-100).sum())


def _token_sum_loss(model, batch: dict) -> tuple[torch.Tensor, int]:
    """The micro-batch's summed next-token cross entropy and its loss-token count."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    labels = batch["labels"][..., 1:]
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels.reshape(-1),
                                             ignore_index=-100, reduction="sum")
    return loss, loss_tokens(batch)


def documented_reference(per_rank_steps: list[list[list[dict]]], divisor: str) -> dict:
    """One plain PyTorch process replaying ``per_rank_steps[rank][step]`` (the micro-batches each rank ran) with
    the documented divisor: ``"per-rank"``: the gradient is the mean over ranks of each rank's per-token mean
    (its micro-batches' summed loss over its own token count; a rank without micro-batches adds nothing);
    ``"micro-batches"``: the mean over all micro-batches of the step of each one's per-token mean loss.
    Then clipping at ``MAX_GRAD_NORM`` and AdamW, as the Trainer does. Returns the pre-clip gradient norm and
    the weights after each step."""
    world = len(per_rank_steps)
    model = tiny_model(True)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    norms, weights = [], {}
    for step in range(len(per_rank_steps[0])):
        step_batches = [per_rank_steps[rank][step] for rank in range(world)]
        micro_batches = sum(len(batches) for batches in step_batches)
        for batches in step_batches:
            rank_tokens = sum(loss_tokens(batch) for batch in batches)
            for batch in batches:
                loss, tokens = _token_sum_loss(model, batch)
                if divisor == "per-rank":
                    loss = loss / rank_tokens / world
                elif divisor == "micro-batches":
                    loss = loss / tokens / micro_batches
                else:
                    raise ValueError(divisor)
                loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        weights[step + 1] = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"grad_norms": norms, "weights": weights}
