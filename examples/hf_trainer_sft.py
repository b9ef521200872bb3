"""Supervised fine-tuning with the Hugging Face Trainer on the ODC stage: a plain Trainer script.

Nothing in this file is specific to ds_odc. The ds_config (``examples/ds_config_hf_odc.json``) says
``"stage": "odc"``; the autoload hook installed with ds_odc does the rest (with ``DS_ODC_AUTOLOAD=0``
add ``import ds_odc`` before ``TrainingArguments``). A tiny Llama built from a ``LlamaConfig`` (no
download) learns synthetic instructions: ``<op> <start> <sep>`` -> count from start up, up by two or
down; long-tailed lengths, loss on the response tokens only, normalised per token over all ranks
(the Trainer's ``average_tokens_across_devices``).

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 examples/hf_trainer_sft.py --steps 40
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/hf_trainer_sft.py --steps 40
    torchrun --nproc_per_node <GPUs> examples/hf_trainer_sft.py --steps 40       # GPUs: the same script

The device is the one DeepSpeed picks (``DS_ACCELERATOR``, else what it detects). With
``--ds_config examples/ds_config_hf_balance_odc.json`` the ds_config's balance block plans each step's
samples with LB-Mini, and ranks run different numbers of micro-batches of equal compute; the Trainer
takes the same samples per step either way (docs/balancing.md). ``examples/lora_sft.py`` and
``examples/moe_sft.py`` train this script's data with a LoRA adapter and with a mixture-of-experts model.
"""
import argparse
import os

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments, set_seed

HERE = os.path.dirname(os.path.abspath(__file__))
PAD, BOS, SEP, EOS, FIRST_OP, STRIDES = 0, 1, 2, 3, 4, (1, 2, -1)  # ops: count up, count by two, count down
FIRST_VALUE, VOCAB = FIRST_OP + len(STRIDES), 64
IGNORE = -100  # the label the loss skips: prompt and padding


def make_example(gen: torch.Generator, max_len: int) -> dict:
    """One prompt/response pair (``<bos> <op> <start> <sep>`` -> ``start, start±stride, ... <eos>``,
    long-tailed lengths); the prompt's tokens carry no loss."""
    length = int(torch.distributions.LogNormal(2.0, 0.6).sample().clamp(3, max_len))
    op = int(torch.randint(0, len(STRIDES), (1,), generator=gen))
    start = int(torch.randint(0, VOCAB - FIRST_VALUE, (1,), generator=gen))
    response = FIRST_VALUE + (start + STRIDES[op] * torch.arange(length)) % (VOCAB - FIRST_VALUE)
    prompt = torch.tensor([BOS, FIRST_OP + op, FIRST_VALUE + start, SEP])
    full = torch.cat([prompt, response, torch.tensor([EOS])])
    labels = full.clone()
    labels[:len(prompt)] = IGNORE
    return {"input_ids": full, "labels": labels}


class InstructionDataset(torch.utils.data.Dataset):

    def __init__(self, size: int, seed: int, max_len: int = 24):
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)  # LogNormal.sample draws from the global generator
        self.rows = [make_example(gen, max_len) for _ in range(size)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return self.rows[index]


def pad_collate(rows: list) -> dict:
    """Right-pad to the longest row of the micro-batch; padding is masked out of attention and loss."""
    longest = max(len(row["input_ids"]) for row in rows)
    batch = {"input_ids": torch.full((len(rows), longest), PAD), "labels": torch.full((len(rows), longest), IGNORE),
             "attention_mask": torch.zeros((len(rows), longest), dtype=torch.long)}
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        batch["input_ids"][i, :n], batch["labels"][i, :n], batch["attention_mask"][i, :n] = \
            row["input_ids"], row["labels"], 1
    return batch


class PrintLoss(TrainerCallback):
    """One plain line per logged step (rank 0), next to the Trainer's progress bar: the loss, the gradient norm the
    Trainer logs before clipping (the first number that shows a wrongly scaled gradient), and on the odc stage each
    rank's micro-batch count and the most gradient bytes a rank pushed in the step."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            norm = f" | grad norm {logs['grad_norm']:.4f}" if logs.get("grad_norm") is not None else ""
            counts = f" | micro-batches {logs['odc_micro_batches']}" if "odc_micro_batches" in logs else ""
            pushed = f" | pushed {logs['ODC/push/max_bytes']:.0f} B" if "ODC/push/max_bytes" in logs else ""
            print(f"step {state.global_step}/{state.max_steps} | loss {logs['loss']:.4f}{norm}{counts}{pushed}",
                  flush=True)


def parse_args(description: str, default_config: str = "ds_config_hf_odc.json", lr: float = 1e-2):
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--lr", type=float, default=lr, help="peak learning rate")
    parser.add_argument("--ds_config", default=os.path.join(HERE, default_config), help="the DeepSpeed config")
    parser.add_argument("--output_dir", default=os.path.join("runs", os.path.splitext(default_config)[0]))
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return parser.parse_args()


def training_arguments(args) -> TrainingArguments:
    """The Trainer's arguments, on the device DeepSpeed picks; then DeepSpeed's process group on CPU ranks.

    On CPU ranks accelerate starts torch.distributed but not deepspeed.comm, and zero.Init would then size the
    partitions for one rank: start it here, after the arguments and before any model is built (on GPUs accelerate
    does this itself)."""
    on_cpu = get_accelerator().device_name() == "cpu"
    training_args = TrainingArguments(
        output_dir=args.output_dir, deepspeed=args.ds_config, use_cpu=on_cpu, max_steps=args.steps,
        per_device_train_batch_size=4, per_device_eval_batch_size=8, gradient_accumulation_steps=2,
        learning_rate=args.lr, warmup_steps=min(5, args.steps // 4), lr_scheduler_type="cosine", weight_decay=0.0,
        logging_steps=max(1, args.steps // 10), save_strategy="no", report_to="none", seed=0,
        average_tokens_across_devices=True, dataloader_num_workers=0)
    if on_cpu:
        deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    set_seed(training_args.seed)  # every rank builds the same initial weights (zero.Init keeps each rank's part)
    return training_args


def tiny_llama_config(**extra) -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD,
                       bos_token_id=BOS, eos_token_id=EOS, **extra)


def train(model, training_args: TrainingArguments, args) -> Trainer:
    """Train, evaluate and print one summary line on rank 0."""
    trainer = Trainer(model=model, args=training_args, data_collator=pad_collate,
                      train_dataset=InstructionDataset(2048, seed=1), eval_dataset=InstructionDataset(64, seed=2),
                      callbacks=[PrintLoss()])
    trainer.train()
    engine = trainer.model_wrapped
    eval_loss = trainer.evaluate()["eval_loss"]
    if trainer.is_world_process_zero():
        print(f"engine: {type(engine).__name__}, zero stage {engine.zero_optimization_stage()}, "
              f"{training_args.world_size} ranks on {get_accelerator().device_name()} | eval loss {eval_loss:.4f}",
              flush=True)
    return trainer


def main():
    args = parse_args(__doc__.split("\n")[0])
    training_args = training_arguments(args)
    trainer = train(LlamaForCausalLM._from_config(tiny_llama_config()), training_args, args)
    trainer.save_model()  # full 16-bit weights (stage3_gather_16bit_weights_on_model_save)
    if trainer.is_world_process_zero():
        print(f"saved to {args.output_dir}", flush=True)


if __name__ == "__main__":
    main()
