"""Rank-side workloads for sliding-window models under the split policy ("lb-mini-split") on 2 CPU ranks.

Two tiny models whose attention slides, with the window shorter than the samples: a Mistral (every layer slides,
window 5) and a Qwen2 with ``use_sliding_window`` and a layer mix (layer 0 full, layer 1 sliding, window 4). Each
trains on the odc stage with the balance block's split policy (groups of 2: ranks 0-1) for two hand-written
steps: a sample split over ranks 0-1 alone, then two packed samples split over them, and whole micro-batches
packed and alone. Every split or packed sample's attention runs per sample with no mask (the split policy's
per-sample attention), so its window comes from the per-sample path; a whole micro-batch of one sample keeps the
model's own mask.

The one-process reference runs every sample whole and alone, unpacked, with the model's own mask: the per-token
mean over the step, SGD.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.support.sp_workloads import full_parameters
from tests.support.split_workloads import CAP, IGNORE, LR, VOCAB, ds_config, packed, sample, token_sum

KINDS = ("mistral", "qwen2")
WINDOWS = {"mistral": 5, "qwen2": 4}

#: (lengths, splits as (samples, group size, group index), whole micro-batches per rank)
STEPS = (
    # sample 0 (22 tokens) alone over ranks 0-1; whole: rank 0 a packed pair, rank 1 one sample alone
    ((22, 9, 8, 12), (((0,), 2, 0),), (((1, 2),), ((3,),))),
    # samples 0 and 1 packed over ranks 0-1 (23 tokens, padded to 24); whole: rank 0 one alone, rank 1 a pair
    ((13, 10, 16, 7, 6), (((0, 1), 2, 0),), (((2,),), ((3, 4),))),
)


def tiny(kind: str, windowed: bool = True, seed: int = 11):
    """A tiny ``kind`` model (sdpa, 4 query and 2 key/value heads); ``windowed=False``: the same weights with full
    attention on every layer (what the split policy computed before it honoured windows)."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, attn_implementation="sdpa",
                  tie_word_embeddings=False)
    window = WINDOWS[kind] if windowed else None
    torch.manual_seed(seed)
    if kind == "mistral":
        return MistralForCausalLM(MistralConfig(sliding_window=window, **common))
    layer_types = ["full_attention", "sliding_attention" if windowed else "full_attention"]
    return Qwen2ForCausalLM(Qwen2Config(use_sliding_window=windowed, sliding_window=window, max_window_layers=1,
                                        layer_types=layer_types, **common))


def plan(step: int):
    from ds_odc.balance import AllToAllCost, CostModel, SplitCostModel, SplitMicroBatch, SplitPlan

    lengths, splits, whole = STEPS[step % len(STEPS)]
    result = SplitPlan(lengths, CAP, SplitCostModel(CostModel.tokens(), AllToAllCost.free()), 2,
                       tuple(SplitMicroBatch(*s) for s in splits), whole)
    result.validate()
    return result


def train(steps: int = 2) -> dict:
    """Every rank runs its list of each step's plan, for each model in turn (one split engine at a time).
    Returns each model's parameters after every step, and this rank's entries (split or whole, samples)."""
    import deepspeed
    import torch.distributed as dist

    from ds_odc.balance import split_batch

    rank = dist.get_rank()
    out: dict = {"entries": []}
    for kind in KINDS:
        model = tiny(kind)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config())
        history = []
        for step in range(steps):
            step_plan = plan(step)
            for entry in step_plan.for_rank(rank):
                if kind == KINDS[0]:
                    out["entries"].append((step, entry.split, tuple(entry.samples)))
                part = split_batch(packed(step, entry.samples, step_plan.lengths), entry, rank)
                with engine.odc_micro_batch(entry):
                    logits = engine(input_ids=part["input_ids"], position_ids=part["position_ids"],
                                    use_cache=False).logits
                    loss, tokens = token_sum(logits, part["shift_labels"])
                    engine.backward(loss, loss_tokens=tokens)
            engine.step()
            history.append(full_parameters(engine))
        engine.destroy()
        out[kind] = history
    return out


def one_process(kind: str, steps: int = 2, windowed: bool = True) -> dict:
    """One process, every sample whole and alone with the model's own mask: the token mean over the step, SGD.
    Returns the parameters after every step and the untrained model's logits of every sample of step 0."""
    model = tiny(kind, windowed)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    history, logits = [], []
    with torch.no_grad():
        for index, length in enumerate(plan(0).lengths):
            logits.append(model(input_ids=sample(0, index, length)[0].unsqueeze(0), use_cache=False).logits)
    for step in range(steps):
        optimizer.zero_grad()
        total, tokens = 0.0, 0
        for index, length in enumerate(plan(step).lengths):
            ids, labels = sample(step, index, length)
            shift = F.pad(labels, (0, 1), value=IGNORE)[1:]
            loss, count = token_sum(model(input_ids=ids.unsqueeze(0), use_cache=False).logits, shift)
            total, tokens = total + loss, tokens + count
        (total / tokens).backward()
        optimizer.step()
        history.append({name: p.detach().clone() for name, p in model.named_parameters()})
    return {"params": history, "logits": logits}
