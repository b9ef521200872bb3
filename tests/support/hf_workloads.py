"""What the ranks run in the Hugging Face tests: a tiny Llama under the Trainer, and a plain accelerate loop.

Runs inside spawned ranks (harness.py). No downloads: the model is built from a ``LlamaConfig``,
the data is synthetic and the same on every run.
"""
from __future__ import annotations

import os

import torch

from tests.support import tiny_models

SEQ = 16
VOCAB = 128


def tiny_llama_config():
    return tiny_models.tiny_llama_config(VOCAB, max_positions=2 * SEQ, tie_word_embeddings=False)


class CountingDataset(torch.utils.data.Dataset):
    """Sequences that count up by a stride of 1, 2 or 3 from a random start (learnable in context)."""

    def __init__(self, size: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, VOCAB, (size,), generator=gen)
        strides = torch.randint(1, 4, (size,), generator=gen)
        self.rows = [(start + stride * torch.arange(SEQ)) % VOCAB for start, stride in zip(starts, strides)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


def trainer_ds_config(stage) -> dict:
    """The ds_config a Trainer user writes ("auto" filled in by the Trainer); only the stage differs."""
    zero = {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True}
    if stage == "odc":
        zero["odc"] = {"accumulator_dtype": "fp64"}  # order-independent sums: resume is bit-exact
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "steps_per_print": 10_000,
            "zero_optimization": zero}  # no "optimizer": the Trainer's own AdamW, as evaluate() deletes it


def _full_state_dict(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def _gathered_state_dict(model) -> dict:
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {name: param.detach().clone() for name, param in model.named_parameters()}


def loss_recorder():
    """A Trainer callback keeping the logged loss of every step (``.losses``: step -> loss) and the gradient norm
    the Trainer logs before clipping (``.grad_norms``): under AdamW and clipping a gradient off by a factor gives
    the same update, so weights and losses alone would not show it; the norm does."""
    from transformers import TrainerCallback

    class RecordLosses(TrainerCallback):
        def __init__(self):
            self.losses, self.grad_norms = {}, {}

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses[state.global_step] = logs["loss"]
            if logs and "grad_norm" in logs:
                self.grad_norms[state.global_step] = float(logs["grad_norm"])

    return RecordLosses()


def trainer_story(stage, output_dir: str, max_steps: int = 4, resume_from: str | None = None,
                  evaluate_first: bool = True, pretrained: str | None = None, train: bool = True) -> dict:
    """One Trainer life: build the model (``from_pretrained(pretrained)`` or ``_from_config``), [evaluate,]
    train (optionally resumed), evaluate, save_model. Returns what happened. ``train=False``: stop after the
    first evaluate (ZeRO-3 cannot train after an evaluate: transformers' own order problem)."""
    import deepspeed
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments
    from transformers.integrations import is_deepspeed_zero3_enabled

    args = TrainingArguments(
        output_dir=output_dir, deepspeed=trainer_ds_config(stage), use_cpu=True, max_steps=max_steps,
        per_device_train_batch_size=2, per_device_eval_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=3e-3, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
        logging_steps=1, save_strategy="steps", save_steps=2, report_to="none", seed=0, data_seed=0,
        disable_tqdm=True, dataloader_num_workers=0)
    zero3 = is_deepspeed_zero3_enabled()
    plugin_stage = args.deepspeed_plugin.zero_stage
    torch.manual_seed(0)
    if pretrained:
        model = LlamaForCausalLM.from_pretrained(pretrained)
    else:
        model = LlamaForCausalLM._from_config(tiny_llama_config())
    partitioned = all(hasattr(p, "ds_id") and p.numel() == 0 for p in model.parameters())
    initial = _gathered_state_dict(model)

    recorder = loss_recorder()
    trainer = Trainer(model=model, args=args, train_dataset=CountingDataset(32, seed=1),
                      eval_dataset=CountingDataset(8, seed=2), callbacks=[recorder])
    eval_before = trainer.evaluate()["eval_loss"] if evaluate_first else None
    if not train:
        return {"eval_before": eval_before, "initial": initial}
    trainer.train(resume_from_checkpoint=resume_from)
    engine = trainer.model_wrapped
    eval_after = trainer.evaluate()["eval_loss"]
    trainer.save_model(os.path.join(output_dir, "final"))
    trainer.accelerator.wait_for_everyone()
    return {"engine": type(engine).__name__, "optimizer": type(engine.optimizer).__name__,
            "stage": engine.zero_optimization_stage(), "zero3_enabled": zero3, "plugin_stage": plugin_stage,
            "partitioned_at_init": partitioned, "world": deepspeed.comm.get_world_size(),
            "losses": recorder.losses, "grad_norms": recorder.grad_norms, "initial": initial,
            "eval_before": eval_before, "eval_after": eval_after,
            "final": _full_state_dict(os.path.join(output_dir, "final"))}


def eval_loss_of(state_dict: dict) -> float:
    """Reference: the evaluation loss of full weights in one plain process (same data as ``trainer_story``)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_llama_config())
    model.load_state_dict(state_dict)
    model.eval()
    rows = CountingDataset(8, seed=2)
    with torch.no_grad():
        batch = torch.stack([rows[i]["input_ids"] for i in range(len(rows))])
        return float(model(input_ids=batch, labels=batch).loss)


def accelerate_accumulate_loop(stage, steps: int = 3, gas: int = 2) -> dict:
    """The canonical accelerate loop (``with accelerator.accumulate(model)``) on a ds_config with ``stage``."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas, "gradient_clipping": 1.0,
              "steps_per_print": 10_000, "zero_optimization": {"stage": stage}}
    accelerator = Accelerator(gradient_accumulation_steps=gas,
                              deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    engine, optimizer = accelerator.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    rank, plugin_stage = accelerator.process_index, accelerator.state.deepspeed_plugin.zero_stage
    losses, norms = [], []  # norms: the pre-clip gradient norm of each step (Adam hides a gradient's scale)
    for index in range(steps * gas):
        gen = torch.Generator().manual_seed(100 * index + rank)
        x, y = torch.randn(4, 5, generator=gen), torch.randn(4, 3, generator=gen)
        with accelerator.accumulate(engine):  # no_sync on the non-boundary micro-batches
            loss = ((engine(x) - y) ** 2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if accelerator.sync_gradients:  # a boundary: the engine stepped
                norms.append(float(engine.get_global_grad_norm()))
        losses.append(float(loss))
    params = list(_gathered_state_dict(engine.module).values())
    engine.destroy()
    return {"engine": type(engine).__name__, "plugin_stage": plugin_stage,
            "losses": losses, "params": params, "norms": norms}


def accelerate_accumulate_both(steps: int = 3, gas: int = 2) -> dict:
    """:func:`accelerate_accumulate_loop` on "odc" then on stage 3, in one process (saves a spawn)."""
    from accelerate.state import AcceleratorState, GradientState

    results = {}
    for stage in ("odc", 3):
        results[stage] = accelerate_accumulate_loop(stage, steps, gas)
        AcceleratorState._reset_state()
        GradientState._reset_state()
    return results
