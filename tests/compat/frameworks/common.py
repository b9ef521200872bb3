"""What every framework scenario shares: a tiny model and tokenizer written to disk, small data sets,
the ds_config of each route, and the result file the runner reads.

Why on disk: the frameworks load models by path (``from_pretrained`` under ``zero.Init``, LLaMA-Factory's
``model_name_or_path``, ArcticTraining's ``model.name_or_path``), and nothing may be downloaded. The
tokenizer is byte-level with no merges, so any text a framework's template produces encodes and decodes
back (GRPO's reward function reads the decoded completions). Standard library, torch, transformers and
tokenizers only: every framework venv has those, at different releases.

The runner passes ``DS_ODC_COMPAT_OUT`` (the result file rank 0 writes) and ``DS_ODC_COMPAT_ROUTE``.
"""
from __future__ import annotations

import copy
import json
import os

ROUTES = ("odc", "3", "marker", "env")  # "3" is the ZeRO-3 baseline every other route is compared with
WORDS = ("alpha", "beta", "gamma", "delta", "apple", "banana", "cat", "dog", "red", "blue", "one", "two")


def route() -> str:
    value = os.environ.get("DS_ODC_COMPAT_ROUTE", "3")
    if value not in ROUTES:
        raise SystemExit(f"DS_ODC_COMPAT_ROUTE={value!r}: one of {ROUTES}")
    return value


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


# -- the tiny model -------------------------------------------------------------------------------------
def build_tokenizer():
    """Byte-level BPE without merges: 256 byte symbols plus <pad>, <s>, </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                        model_max_length=512)
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant: {% endif %}")
    return tokenizer


def write_tiny_model(directory: str, layers: int = 2, hidden: int = 32) -> str:
    """A seeded tiny Llama and its tokenizer saved under ``directory`` (once; same bytes for every route)."""
    if os.path.exists(os.path.join(directory, "config.json")):
        return directory
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


# -- data -----------------------------------------------------------------------------------------------
def sentence(i: int, words: int) -> str:
    return " ".join(WORDS[(i * 7 + j * 3 + j * j) % len(WORDS)] for j in range(words))


def sft_texts(n: int = 64) -> list[str]:
    """Long-tailed lengths (2 to 14 words), deterministic."""
    return [sentence(i, 2 + (i * i) % 13) for i in range(n)]


def preference_rows(n: int = 64) -> list[dict]:
    """prompt / chosen / rejected, lengths varying with i (the balance scenario needs uneven costs: one prompt
    in four has 33 bytes, the others 18 to 21; no two fit under a cap of the longest, and with a cost in length
    squared one long prompt balances about three short ones, so LB-Mini plans different counts per rank)."""
    return [{"prompt": f"say {sentence(i, 8)}"[:(32 if i % 4 == 0 else 17 + i % 4)] + ":",
             "chosen": " " + sentence(i + 1, 1 + (i * 5) % 7),
             "rejected": " " + sentence(i + 5, 1 + (i * 3) % 6)} for i in range(n)]


def prompts(n: int = 32) -> list[str]:
    return [f"name {sentence(i, 1 + i % 4)}:" for i in range(n)]


# -- ds_config per route --------------------------------------------------------------------------------
def ds_config(which: str, base: dict, odc_options: dict | None = None) -> dict:
    """``base`` (a stage-3 ds_config) asked for on route ``which``: "3" as is, "odc" as ``"stage": "odc"``,
    "marker" as stage 3 plus an ``"odc"`` block, "env" as is (the environment switch does the asking)."""
    config = copy.deepcopy(base)
    zero = config.setdefault("zero_optimization", {})
    zero["stage"] = 3
    options = {"timeout_s": 120, **(odc_options or {})}
    if which == "odc":
        zero["stage"] = "odc"
        zero["odc"] = options
    elif which == "marker":
        zero["odc"] = options
    return config


HF_BASE = {  # what the Trainer fills in ("auto"), fp32 (DeepSpeed's CPU accelerator refuses fp16)
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
    "gradient_clipping": "auto", "bf16": {"enabled": False},
    "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
}

RELEASED = {  # parameters released after every use, as ZeRO-3 does for a model of real size
    "stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 1000, "stage3_prefetch_bucket_size": 0,
}


# -- results --------------------------------------------------------------------------------------------
def write_result(losses: list, **extra) -> None:
    """Rank 0 writes {"losses": [...], ...} where the runner asked (``DS_ODC_COMPAT_OUT``)."""
    out = os.environ.get("DS_ODC_COMPAT_OUT")
    if out and rank() == 0:
        with open(out, "w") as handle:
            json.dump({"losses": [float(x) for x in losses], **extra}, handle)


def trainer_losses(log_history: list, key: str = "loss") -> list:
    """The per-step training losses from a Trainer's ``state.log_history`` (``logging_steps=1``)."""
    return [row[key] for row in log_history if key in row and "step" in row and "train_runtime" not in row]
