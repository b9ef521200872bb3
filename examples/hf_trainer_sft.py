"""Supervised fine-tuning with the Hugging Face Trainer on the ODC stage: a plain Trainer script.

Nothing in this file is specific to ds_odc. The ds_config (``examples/ds_config_hf_odc.json``) says
``"stage": "odc"``; the autoload hook installed with ds_odc does the rest (with ``DS_ODC_AUTOLOAD=0``
add ``import ds_odc`` before ``TrainingArguments``). A tiny Llama built from a ``LlamaConfig`` (no
download) learns synthetic instructions: ``<op> <start> <sep>`` -> count from start up, up by two or
down; long-tailed lengths, loss on the response tokens only, normalised per token over all ranks
(the Trainer's ``average_tokens_across_devices``).

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 examples/hf_trainer_sft.py --steps 40
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/hf_trainer_sft.py --steps 40

The Trainer runs ``gradient_accumulation_steps`` micro-batches on every rank per step. To give ranks
*different* numbers of micro-batches balanced by compute (LB-Mini, ``ds_odc.balance``), drive the
engine from your own loop, as ``examples/train_causal_lm.py`` does.
"""
import argparse
import os

import deepspeed
import torch
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
    """One plain line per logged step (rank 0), next to the Trainer's progress bar: the loss, and the gradient
    norm the Trainer logs before clipping (the first number that shows a wrongly scaled gradient)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            norm = f" | grad norm {logs['grad_norm']:.4f}" if logs.get("grad_norm") is not None else ""
            print(f"step {state.global_step}/{state.max_steps} | loss {logs['loss']:.4f}{norm}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--lr", type=float, default=1e-2, help="peak learning rate")
    parser.add_argument("--ds_config", default=os.path.join(HERE, "ds_config_hf_odc.json"))
    parser.add_argument("--output_dir", default=os.path.join("runs", "hf_trainer_sft"))
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args = parser.parse_args()

    training_args = TrainingArguments(
        output_dir=args.output_dir, deepspeed=args.ds_config, use_cpu=True, max_steps=args.steps,
        per_device_train_batch_size=4, per_device_eval_batch_size=8, gradient_accumulation_steps=2,
        learning_rate=args.lr, warmup_steps=min(5, args.steps // 4), lr_scheduler_type="cosine", weight_decay=0.0,
        logging_steps=max(1, args.steps // 10), save_strategy="no", report_to="none", seed=0,
        average_tokens_across_devices=True, dataloader_num_workers=0)
    # CPU ranks only: accelerate starts torch.distributed but not deepspeed.comm, and zero.Init would then
    # size the partitions for one rank (on GPUs accelerate does this itself).
    deepspeed.init_distributed(dist_backend="gloo")
    set_seed(training_args.seed)  # every rank builds the same initial weights (zero.Init keeps each rank's part)
    model = LlamaForCausalLM._from_config(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS))
    trainer = Trainer(model=model, args=training_args, data_collator=pad_collate,
                      train_dataset=InstructionDataset(2048, seed=1), eval_dataset=InstructionDataset(64, seed=2),
                      callbacks=[PrintLoss()])
    trainer.train()
    engine = trainer.model_wrapped
    eval_loss = trainer.evaluate()["eval_loss"]
    trainer.save_model()  # full 16-bit weights (stage3_gather_16bit_weights_on_model_save)
    if trainer.is_world_process_zero():
        print(f"engine: {type(engine).__name__}, zero stage {engine.zero_optimization_stage()}, "
              f"{training_args.world_size} ranks | eval loss {eval_loss:.4f} | saved to {args.output_dir}", flush=True)


if __name__ == "__main__":
    main()
