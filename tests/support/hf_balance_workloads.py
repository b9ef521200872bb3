"""What the ranks run in the Trainer-balance tests: a tiny Llama trained by an unmodified ``Trainer`` on
long-tailed lengths, with and without ``zero_optimization.odc.balance``.

Runs inside spawned ranks (harness.py), or in one plain process for the reference. No downloads: the
model comes from a ``LlamaConfig``, the data is synthetic and the same on every run.
"""
from __future__ import annotations

import math
import os

import torch

from tests.support import tiny_models

VOCAB = 96
MAX_LEN = 48


def llama_config():
    return tiny_models.tiny_llama_config(VOCAB, tie_word_embeddings=False)


def long_tailed_lengths(size: int, seed: int) -> list[int]:
    """Mostly short samples and a few long ones (lognormal, clipped to [4, MAX_LEN])."""
    gen = torch.Generator().manual_seed(seed)
    draws = torch.randn(size, generator=gen)
    return [max(4, min(MAX_LEN, int(math.exp(2.3 + 1.0 * float(d))))) for d in draws]


class LongTailedDataset(torch.utils.data.Dataset):
    """Counting sequences (learnable in context) of long-tailed lengths; items are lists, as tokenised
    datasets give them, so the collator pads."""

    def __init__(self, size: int, seed: int):
        gen = torch.Generator().manual_seed(seed + 1)
        self.rows = []
        for length in long_tailed_lengths(size, seed):
            start = int(torch.randint(0, VOCAB, (1,), generator=gen))
            stride = int(torch.randint(1, 4, (1,), generator=gen))
            self.rows.append([(start + stride * i) % VOCAB for i in range(length)])

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


def pad_collator(samples):
    """Right padding to the longest sample; padded labels -100 (what DataCollatorWithPadding + labels does)."""
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    labels = torch.full((len(samples), longest), -100, dtype=torch.long)
    mask = torch.zeros(len(samples), longest, dtype=torch.long)
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        ids[row, :n] = torch.tensor(sample["input_ids"])
        labels[row, :n] = torch.tensor(sample["labels"])
        mask[row, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def balance_ds_config(stage, balance: dict | None, activation_offload: dict | None = None) -> dict:
    """ds_config for ``stage``; the balance block goes under "odc" (on stage 3 it is applied through
    ``hf_balance.balanced_loader`` instead, as the benchmark's baseline does)."""
    zero = {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True}
    if stage == "odc":
        zero["odc"] = {"accumulator_dtype": "fp64"}
        if balance is not None:
            zero["odc"]["balance"] = balance
        if activation_offload is not None:
            zero["odc"]["activation_offload"] = activation_offload
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "steps_per_print": 10_000,
            "zero_optimization": zero}


def _full_parameters(model, distributed: bool) -> dict:
    if not distributed:
        return {name: p.detach().clone() for name, p in model.named_parameters()}
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {name: p.detach().clone() for name, p in model.named_parameters()}


def balanced_trainer_run(stage, output_dir: str, balance: dict | None = None, steps: int = 5,
                         per_device: int = 4, accumulation: int = 2, world: int | None = None,
                         collator=None, resume_from: str | None = None, save_steps: int = 0,
                         workers: int = 0, activation_offload: dict | None = None) -> dict:
    """Train ``steps`` optimizer steps; record the full weights and the loss after every step and how many
    micro-batches this rank ran in each. ``stage=None``: one plain process without DeepSpeed whose
    accumulation covers ``world`` ranks' batches (the same samples per step)."""
    from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    distributed = stage is not None
    counts, weights, losses, logs = [], {}, {}, []

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            weights[state.global_step] = _full_parameters(trainer.model, distributed)
            counts.append(forwards[0])
            forwards[0] = 0

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses[state.global_step] = logs["loss"]
                record.append(dict(logs))

    record = logs
    forwards = [0]
    args = TrainingArguments(
        output_dir=output_dir, deepspeed=balance_ds_config(stage, balance, activation_offload) if distributed else None,
        use_cpu=True,
        max_steps=steps, per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation if distributed else accumulation * world,
        learning_rate=3e-3, lr_scheduler_type="linear", warmup_steps=1, weight_decay=0.0,
        max_grad_norm=0.3,  # below the gradient norms here: every step is clipped
        per_device_eval_batch_size=4, logging_steps=1, save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        report_to="none", seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=workers,
        remove_unused_columns=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config())  # not under zero.Init: the same initial weights in every run
    model.register_forward_pre_hook(lambda module, inputs: forwards.__setitem__(0, forwards[0] + 1))
    trainer_class = Trainer
    if stage == 3 and balance is not None:
        from ds_odc.config import BalanceConfig
        from ds_odc.integration.hf_balance import balanced_loader

        class BalancedZero3Trainer(Trainer):
            def get_train_dataloader(self):
                return balanced_loader(self, super().get_train_dataloader(), BalanceConfig(**balance))

        trainer_class = BalancedZero3Trainer
    # 104 samples: 26 batches of 4, 13 per rank: 6 steps of 2 batches per rank and a last one of 1 (7 an epoch)
    trainer = trainer_class(model=model, args=args, train_dataset=LongTailedDataset(104, seed=3),
                      eval_dataset=LongTailedDataset(16, seed=5), data_collator=collator or pad_collator,
                      callbacks=[Record()])
    trainer.train(resume_from_checkpoint=resume_from)
    eval_loss = trainer.evaluate()["eval_loss"]
    trainer.save_model(os.path.join(output_dir, "final"))
    trainer.accelerator.wait_for_everyone()
    from safetensors.torch import load_file

    saved = load_file(os.path.join(output_dir, "final", "model.safetensors"))
    offload = getattr(trainer.model_wrapped, "odc_activation_offload", None)
    offloaded = None if offload is None else [(s.tokens, s.moved_bytes, s.planned_bytes) for s in offload.history]
    return {"offloaded": offloaded, "counts": counts, "weights": weights, "losses": losses, "logs": logs,
            "eval_loss": eval_loss, "saved": saved, "engine": type(trainer.model_wrapped).__name__}


def word_tokenizer():
    """A tokenizer built in memory (no download): one word per token id."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                   pad_token="t0", eos_token="t1")


def sft_run(stage, output_dir: str, balance: dict | None = None, padding_free: bool = False, steps: int = 5,
            per_device: int = 4, accumulation: int = 2, world: int | None = None) -> dict:
    """``trl.SFTTrainer`` on pre-tokenised long-tailed samples, padded or padding-free; records as
    :func:`balanced_trainer_run` does. ``stage=None``: one plain process covering ``world`` ranks' batches."""
    from datasets import Dataset
    from transformers import LlamaForCausalLM, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    distributed = stage is not None
    counts, weights, logs, forwards = [], {}, [], [0]

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            weights[state.global_step] = _full_parameters(trainer.model, distributed)
            counts.append(forwards[0])
            forwards[0] = 0

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                record.append(dict(logs))

    record = logs
    args = SFTConfig(
        output_dir=output_dir, deepspeed=balance_ds_config(stage, balance) if distributed else None, use_cpu=True,
        max_steps=steps, per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation if distributed else accumulation * world,
        padding_free=padding_free, max_length=None, bf16=False, learning_rate=3e-3, lr_scheduler_type="constant",
        weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to="none", seed=0,
        data_seed=0, disable_tqdm=True, dataloader_num_workers=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config())
    model.register_forward_pre_hook(lambda module, inputs: forwards.__setitem__(0, forwards[0] + 1))
    dataset = Dataset.from_dict({"input_ids": LongTailedDataset(96, seed=3).rows})
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=word_tokenizer(),
                         callbacks=[Record()])
    trainer.train()
    return {"counts": counts, "weights": weights, "logs": logs, "engine": type(trainer.model_wrapped).__name__}


def stalled_peer_during_the_step_exchanges(stop_rank: int, output_dir: str, timeout_s: float) -> dict:
    """A balanced ODC Trainer whose rank ``stop_rank`` stops (SIGSTOP) at the end of step 2, so that its
    peers next meet it in the balance's exchange of step 3's loss-token count (no training log in between:
    the Trainer's own loss gather there is a collective of transformers', not ds_odc's). Returns, on a
    peer, the error ``train()`` raised and how long after the stop."""
    import signal
    import time

    import torch.distributed as tdist
    from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    marker = os.path.join(output_dir, "stopped_at")

    class StopAtStep2(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2 and tdist.get_rank() == stop_rank:
                with open(marker, "w") as out:
                    out.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP)

    config = balance_ds_config("odc", {"token_cap": 96})
    config["zero_optimization"]["odc"]["timeout_s"] = timeout_s
    args = TrainingArguments(output_dir=output_dir, deepspeed=config, use_cpu=True, max_steps=6,
                             per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=3e-3,
                             logging_steps=100, average_tokens_across_devices=True, save_strategy="no",
                             report_to="none", seed=0, disable_tqdm=True, remove_unused_columns=False)
    torch.manual_seed(0)
    trainer = Trainer(model=LlamaForCausalLM(llama_config()), args=args, train_dataset=LongTailedDataset(104, seed=3),
                      data_collator=pad_collator, callbacks=[StopAtStep2()])
    try:
        trainer.train()
    except Exception as err:  # noqa: BLE001 - the error is the result
        raised_at = time.time()
        with open(marker) as stopped:
            return {"error": type(err).__name__, "message": str(err), "after_s": raised_at - float(stopped.read())}
    return {"error": None}
