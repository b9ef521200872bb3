"""Supervised fine-tuning with TRL's ``SFTTrainer`` on the ODC stage, through the marker form of the ds_config.

TRL (like LLaMA-Factory) checks ``zero_optimization.stage == 3`` itself, so its ds_config keeps ``"stage": 3`` and
asks for the odc stage with an ``"odc"`` block beside it (``examples/ds_config_marker_odc.json``); every ``stage ==
3`` check keeps seeing 3. A tiny Llama and a byte-level tokenizer are built in the script (no download); the data
are short chat-free texts of counting sequences.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 examples/trl_sft.py --steps 40
    torchrun --nproc_per_node <GPUs> examples/trl_sft.py --steps 40
"""
import argparse
import os
import random

import deepspeed
from datasets import Dataset
from deepspeed.accelerator import get_accelerator
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, set_seed
from trl import SFTConfig, SFTTrainer

HERE = os.path.dirname(os.path.abspath(__file__))
SPECIALS = ["<pad>", "<s>", "</s>"]


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per byte (no merges) plus three special tokens: any text encodes, nothing is downloaded."""
    symbols = SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={symbol: i for i, symbol in enumerate(symbols)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def counting_texts(count: int, seed: int) -> list:
    """``count from 17: 17 18 19 ...`` with long-tailed lengths."""
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        start, length = rng.randrange(100), min(40, int(rng.lognormvariate(2.0, 0.6)) + 2)
        texts.append(f"count from {start}: " + " ".join(str(start + i) for i in range(length)))
    return texts


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--lr", type=float, default=3e-3, help="learning rate")
    parser.add_argument("--ds_config", default=os.path.join(HERE, "ds_config_marker_odc.json"))
    parser.add_argument("--output_dir", default=os.path.join("runs", "trl_sft"))
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args = parser.parse_args()

    on_cpu = get_accelerator().device_name() == "cpu"
    sft_args = SFTConfig(output_dir=args.output_dir, deepspeed=args.ds_config, use_cpu=on_cpu, max_steps=args.steps,
                         per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=args.lr,
                         lr_scheduler_type="constant", logging_steps=max(1, args.steps // 10), save_strategy="no",
                         report_to="none", seed=0, max_length=128, dataloader_num_workers=0)
    if on_cpu:  # accelerate starts torch.distributed but not deepspeed.comm on CPU ranks (zero.Init needs it)
        deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    set_seed(0)
    tokenizer = byte_tokenizer()
    model = LlamaForCausalLM._from_config(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id))
    trainer = SFTTrainer(model=model, args=sft_args, processing_class=tokenizer,
                         train_dataset=Dataset.from_dict({"text": counting_texts(1024, seed=1)}))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    engine = trainer.model_wrapped
    if trainer.is_world_process_zero():
        print(f"engine: {type(engine).__name__}, zero stage {engine.zero_optimization_stage()}, "
              f"{sft_args.world_size} ranks on {get_accelerator().device_name()} | losses "
              + " ".join(f"{loss:.4f}" for loss in losses), flush=True)


if __name__ == "__main__":
    main()
