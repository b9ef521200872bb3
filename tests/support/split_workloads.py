"""Rank-side workloads for long samples split over aligned groups (policy "lb-mini-split") on 4 CPU ranks.

A tiny Llama (sdpa, 4 query heads, 2 key/value heads: groups of 2 allowed) on the odc stage with the balance
block's split policy, so the engine creates the groups {0, 1}, {2, 3} at initialize and hooks the attention.
Each step runs a hand-written plan (the runtime must run any plan ``SplitPlan.validate`` accepts): one long
sample split over one group, the rest whole, packed, with uneven counts per rank (zero included), and in the
last step a split micro-batch of two packed samples. Every rank runs ``plan.for_rank(rank)`` in order, each
entry inside ``engine.odc_micro_batch(entry)`` on its slice (``split_batch``), per-token loss.

The one-process reference runs every sample of the step whole, unpacked: the per-token mean over the step.
"""
from __future__ import annotations

import os
from typing import Sequence

import torch
import torch.nn.functional as F

from tests.support.sp_workloads import full_parameters, tiny_llama

VOCAB, IGNORE, CAP, LR = 61, -100, 40, 0.05

#: (lengths, splits as (samples, group size, group index), whole micro-batches per rank)
STEPS = (
    # sample 0 (31 tokens: padded to 32) over ranks 0-1; whole micro-batches per rank: 1, 0, 2, 1
    ((31, 9, 7, 6, 10, 5, 8), (((0,), 2, 0),), (((1,),), (), ((2,), (3, 4)), ((5, 6),))),
    # sample 0 over ranks 2-3; whole: 2, 1, 0, 1
    ((28, 12, 6, 6, 9), (((0,), 2, 1),), (((1,), (2,)), ((3,),), (), ((4,),))),
    # samples 0 and 1 packed over ranks 0-1, then sample 2 over ranks 2-3; whole: 1, 1, 0, 0
    ((20, 14, 26, 8, 8, 7), (((0, 1), 2, 0), ((2,), 2, 1)), (((3,),), ((4, 5),), (), ())),
)


def plan(step: int):
    from ds_odc.balance import AllToAllCost, CostModel, SplitCostModel, SplitMicroBatch, SplitPlan

    lengths, splits, whole = STEPS[step % len(STEPS)]
    result = SplitPlan(lengths, CAP, SplitCostModel(CostModel.tokens(), AllToAllCost.free()), 4,
                       tuple(SplitMicroBatch(*s) for s in splits), whole)
    result.validate()
    return result


def sample(step: int, index: int, length: int):
    """Input ids and labels (HF's convention: unshifted; the first tokens, a prompt, without loss)."""
    g = torch.Generator().manual_seed(1000 * step + index)
    ids = torch.randint(0, VOCAB, (length,), generator=g)
    labels = ids.clone()
    labels[: 1 + index % 3] = IGNORE  # the first token never has a label (as DataCollatorWithFlattening)
    return ids, labels


def packed(step: int, samples: Sequence[int], lengths: Sequence[int]) -> dict:
    """The samples of one micro-batch packed into one sequence (position_ids restart per sample)."""
    pieces = [sample(step, i, lengths[i]) for i in samples]
    return {"input_ids": torch.cat([ids for ids, _ in pieces]).unsqueeze(0),
            "labels": torch.cat([labels for _, labels in pieces]).unsqueeze(0),
            "position_ids": torch.cat([torch.arange(lengths[i]) for i in samples]).unsqueeze(0)}


def ds_config(timeout_s: float = 60.0) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "managed_gradient_accumulation": False, "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "gradient_clipping": 0.0, "steps_per_print": 10 ** 9, "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": "odc", "stage3_param_persistence_threshold": 0,
                                  "stage3_max_live_parameters": 0, "stage3_prefetch_bucket_size": 0,
                                  "odc": {"timeout_s": timeout_s,
                                          "balance": {"policy": "lb-mini-split", "token_cap": CAP, "max_group": 2,
                                                      "min_chunk_tokens": 4}}}}


def token_sum(logits: torch.Tensor, shift_labels: torch.Tensor):
    loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), shift_labels.reshape(-1), ignore_index=IGNORE,
                           reduction="sum")
    return loss, int((shift_labels != IGNORE).sum())


def frozen_reference():
    """A frozen copy of the model on the odc stage, built before the policy (as TRL builds a DPO reference)."""
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": "odc",
              "stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 0}}
    engine, *_ = deepspeed.initialize(model=tiny_llama(), config=config)
    return engine


def train(steps: int = 3, checkpointing: bool = False, reference: bool = False) -> dict:
    """Every rank runs its list of each step's plan. Returns the parameters and ``engine.global_samples`` after
    every step, and with ``reference`` the frozen model's logits on this rank's slice of every split
    micro-batch."""
    import deepspeed
    import torch.distributed as dist

    from ds_odc.balance import split_batch

    rank = dist.get_rank()
    ref = frozen_reference() if reference else None
    model = tiny_llama()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config())
    history, reference_logits, counts, samples = [], [], [], []
    for step in range(steps):
        step_plan = plan(step)
        mine = step_plan.for_rank(rank)
        counts.append([len(mb.ranks) for mb in mine])
        for entry in mine:
            part = split_batch(packed(step, entry.samples, step_plan.lengths), entry, rank)
            with engine.odc_micro_batch(entry):
                extra = 0.0
                if ref is not None:
                    with torch.no_grad():
                        logits = ref(input_ids=part["input_ids"], position_ids=part["position_ids"],
                                     use_cache=False).logits
                    if entry.split:
                        reference_logits.append((step, entry.sequence, entry.part(rank), logits.clone()))
                    extra = 0.0 * logits.float().sum()
                logits = engine(input_ids=part["input_ids"], position_ids=part["position_ids"], use_cache=False).logits
                loss, tokens = token_sum(logits, part["shift_labels"])
                engine.backward(loss + extra, loss_tokens=tokens)
        engine.step()
        history.append(full_parameters(engine))
        samples.append(engine.global_samples)
    engine.destroy()
    if ref is not None:
        ref.destroy()
    return {"params": history, "reference_logits": reference_logits, "counts": counts, "global_samples": samples}


def one_process(steps: int = 3) -> dict:
    """One process, every sample whole and alone: the token mean over the step, SGD. Also the untrained
    model's logits of every split micro-batch's packed sequence (what the frozen reference must give)."""
    model = tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    history, split_logits = [], {}
    initial = tiny_llama()
    for step in range(steps):
        step_plan = plan(step)
        with torch.no_grad():
            for k, split in enumerate(step_plan.splits):
                logits = [initial(input_ids=sample(step, i, step_plan.lengths[i])[0].unsqueeze(0)).logits
                          for i in split.samples]
                split_logits[(step, k)] = torch.cat(logits, dim=1)
        optimizer.zero_grad()
        total, tokens = 0.0, 0
        for index, length in enumerate(step_plan.lengths):
            ids, labels = sample(step, index, length)
            shift = F.pad(labels, (0, 1), value=IGNORE)[1:]
            loss, count = token_sum(model(input_ids=ids.unsqueeze(0)).logits, shift)
            total, tokens = total + loss, tokens + count
        (total / tokens).backward()
        optimizer.step()
        history.append({name: p.detach().clone() for name, p in model.named_parameters()})
    return {"params": history, "split_logits": split_logits}


def run_entries(engine, rank: int, step: int, step_plan, entries) -> None:
    """``entries`` of ``step_plan`` on this rank, each on its slice, per-token loss."""
    from ds_odc.balance import split_batch

    for entry in entries:
        part = split_batch(packed(step, entry.samples, step_plan.lengths), entry, rank)
        with engine.odc_micro_batch(entry):
            logits = engine(input_ids=part["input_ids"], position_ids=part["position_ids"], use_cache=False).logits
            loss, tokens = token_sum(logits, part["shift_labels"])
            engine.backward(loss, loss_tokens=tokens)


def mismatch(kind: str, timeout_s: float = 30.0) -> str:
    """A good step, then one with a member out of step. "skip": rank 1 skips split micro-batch 0 (ranks 0-1)
    and, having no micro-batch of its own, goes to the step fence. "extra": after split micro-batch 0 (ranks
    2-3) rank 2 runs one more over ranks 2-3, which its plan does not give it, while rank 3 goes on to its own
    micro-batch. Returns the error each rank raised."""
    import dataclasses

    import deepspeed
    import torch.distributed as dist

    rank = dist.get_rank()
    model = tiny_llama()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(timeout_s))
    step_plan = plan(0) if kind == "skip" else plan(1)
    mine = step_plan.for_rank(rank)
    if kind == "skip" and rank == 1:
        mine = [mb for mb in mine if not mb.split]
    if kind == "extra" and rank == 2:
        mine = [mine[0], dataclasses.replace(mine[0], sequence=1)] + mine[1:]
    try:
        run_entries(engine, rank, 2, plan(2), plan(2).for_rank(rank))
        engine.step()
        run_entries(engine, rank, 0, step_plan, mine)
        engine.step()
    except Exception as err:  # noqa: BLE001 - the test reads the message
        return f"{type(err).__name__}: {err}"
    return "no error"


def killed_inside(victim: int = 1, timeout_s: float = 30.0) -> str:
    """``victim`` dies (SIGKILL) entering the second decoder layer of its split micro-batch in step 2: its
    partner is inside that layer's all-to-all with it, the other ranks at their own micro-batches or the
    fence. Returns the error each survivor raised."""
    import signal

    import deepspeed
    import torch.distributed as dist

    rank = dist.get_rank()
    model = tiny_llama()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(timeout_s))
    doomed = {"now": False}
    if rank == victim:
        model.model.layers[1].register_forward_pre_hook(
            lambda *_: os.kill(os.getpid(), signal.SIGKILL) if doomed["now"] else None)
    try:
        for step in range(2):
            step_plan = plan(2 * step)  # ranks 0-1 share a split micro-batch in both
            doomed["now"] = step == 1
            run_entries(engine, rank, step, step_plan, step_plan.for_rank(rank))
            engine.step()
    except Exception as err:  # noqa: BLE001 - the test reads the message
        return f"{type(err).__name__}: {err}"
    return "no error"


# -- the Hugging Face Trainer with the split policy in its balance block ----------------------------------------
SPLIT_BALANCE = {"policy": "lb-mini-split", "token_cap": 48, "max_group": 2, "min_chunk_tokens": 4,
                 "cost_model": {"a": 1.0, "b": 1.0}}


def split_trainer_run(stage, output_dir: str, steps: int = 3, world: int = 2, variant: str | None = None) -> dict:
    """An unmodified Trainer, packed micro-batches (``DataCollatorWithFlattening``), a tiny Llama with sdpa, on
    long-tailed lengths. ``stage="odc"``: the balance block with the split policy (every step the same samples as
    the Trainer without it); ``stage=None``: one plain process whose accumulation covers ``world`` ranks' batches.
    Returns the weights and logged loss after every step, and this rank's micro-batches per step (split ones
    among them). ``variant`` "no loss kwargs" (a model class that declares ``accepts_loss_kwargs = False``) or
    "local tokens" (``average_tokens_across_devices=False``): the error ``train()`` raised, if any, under "error"."""
    from transformers import DataCollatorWithFlattening, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from tests.support.hf_balance_workloads import (
        LongTailedDataset,
        _full_parameters,
        balance_ds_config,
        llama_config,
    )

    distributed = stage is not None
    weights, losses, grad_norms, counts, current = {}, {}, {}, [], {"whole": 0, "split": 0}

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            weights[state.global_step] = _full_parameters(trainer.model, distributed)
            counts.append(dict(current))
            current.update(whole=0, split=0)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses[state.global_step] = logs["loss"]
            if logs and "grad_norm" in logs:  # before clipping: a gradient off by a factor shows here, not in AdamW
                grad_norms[state.global_step] = float(logs["grad_norm"])

    args = TrainingArguments(
        output_dir=output_dir, deepspeed=balance_ds_config(stage, SPLIT_BALANCE) if distributed else None,
        use_cpu=True, max_steps=steps, per_device_train_batch_size=2,
        gradient_accumulation_steps=2 if distributed else 2 * world, learning_rate=3e-3,
        lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, save_strategy="no",
        report_to="none", seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0,
        remove_unused_columns=False, average_tokens_across_devices=variant != "local tokens")
    torch.manual_seed(0)
    config = llama_config()
    config.use_cache = False  # packed samples attend each within itself (transformers' packed mask needs no cache)
    config._attn_implementation = "sdpa"

    class MeanLossLlama(LlamaForCausalLM):
        accepts_loss_kwargs = False  # its loss is the mean over the batch's tokens, whatever the Trainer counts

    model_class = MeanLossLlama if variant == "no loss kwargs" else LlamaForCausalLM
    model = model_class(config)  # not under zero.Init: the same initial weights in every run

    def count(module, inputs, kwargs):
        engine = trainer.model_wrapped
        split = getattr(getattr(engine, "_odc", None), "split", None)
        current["split" if split is not None and split.active is not None else "whole"] += 1

    model.register_forward_pre_hook(count, with_kwargs=True)
    trainer = Trainer(model=model, args=args, train_dataset=LongTailedDataset(64, seed=3),
                      data_collator=DataCollatorWithFlattening(return_position_ids=True), callbacks=[Record()])
    error = None
    try:
        trainer.train()
    except Exception as err:  # noqa: BLE001 - a variant's test reads the message
        if variant is None:
            raise
        error = f"{type(err).__name__}: {err}"
    return {"weights": weights, "losses": losses, "grad_norms": grad_norms, "counts": counts,
            "engine": type(trainer.model_wrapped).__name__, "error": error}


def refused_heads() -> str:
    """A model whose 6 query heads do not divide by the balance block's max_group 4: refused at initialize."""
    import deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=48, num_hidden_layers=1,
                                         num_attention_heads=6, num_key_value_heads=6, attn_implementation="sdpa"))
    config = ds_config()
    config["zero_optimization"]["odc"]["balance"]["max_group"] = 4
    try:
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    except Exception as err:  # noqa: BLE001 - the test reads the message
        return f"{type(err).__name__}: {err}"
    return "no error"


# -- the backward routes inside a split micro-batch (2 ranks) ------------------------------------------------------
#: One step on 2 ranks: sample 0 split over ranks 0-1, then one whole micro-batch each.
ROUTE_STEP = ((30, 9, 11), (((0,), 2, 0),), (((1,),), ((2,),)))


def route_plan():
    from ds_odc.balance import AllToAllCost, CostModel, SplitCostModel, SplitMicroBatch, SplitPlan

    lengths, splits, whole = ROUTE_STEP
    result = SplitPlan(lengths, CAP, SplitCostModel(CostModel.tokens(), AllToAllCost.free()), 2,
                       tuple(SplitMicroBatch(*s) for s in splits), whole)
    result.validate()
    return result


#: Routes refused inside a split micro-batch (a loss that may be a mean over the slice).
REFUSED_ROUTES = ("mean", "torch mean", "mean rule")


def _route_backward(engine, route: str, logits, shift_labels, global_tokens: int, world: int) -> None:
    """One micro-batch's backward by ``route``: "token" (engine.backward with loss_tokens), "scaled" (the caller's
    token sum over the global count, times the world: the HF Trainer's loss), "torch token" / "torch scaled" (the
    same by loss.backward()), "mean" (the slice's mean through engine.backward), "torch mean", "mean rule"
    (engine.backward(mean) under managed accumulation with gradient_accumulation_steps 2: the mean rule)."""
    loss, tokens = token_sum(logits, shift_labels)
    if route in ("token", "torch token"):
        if route == "token":
            engine.backward(loss, loss_tokens=tokens)
        else:
            engine.set_loss_tokens(tokens)
            loss.backward()
    elif route in ("scaled", "torch scaled"):
        scaled = loss / global_tokens * world
        engine.backward(scaled) if route == "scaled" else scaled.backward()
    else:
        mean = loss / max(tokens, 1)
        mean.backward() if route == "torch mean" else engine.backward(mean)


def routes(route: str) -> dict:
    """2 ranks, one step of :data:`ROUTE_STEP` with each micro-batch's backward by ``route`` (the split one declared
    a scaled token sum for the "scaled" routes), then a second step by engine.backward(loss_tokens). A refused
    backward is recorded with the gradients pushed so far (none may be), then the micro-batch runs again by the
    per-token rule, so the parameters must still equal one process's. Returns the error, the pushes counted
    before and after it, and the parameters after each step."""
    import deepspeed
    import torch.distributed as dist

    from ds_odc.balance import split_batch

    rank, world = dist.get_rank(), dist.get_world_size()
    config = ds_config()
    if route == "mean rule":
        config.update(gradient_accumulation_steps=2, managed_gradient_accumulation=True)
    model = tiny_llama()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    step_plan = route_plan()
    global_tokens = sum(int((sample(0, i, n)[1][1:] != IGNORE).sum()) for i, n in enumerate(step_plan.lengths))
    error, pushes, history = None, None, []
    for step in range(2):
        mine = step_plan.for_rank(rank)
        for m, entry in enumerate(mine):
            if route == "mean rule" and m == len(mine) - 1:
                engine.set_gradient_accumulation_boundary(True)
            # one rule per step: a refused route's whole micro-batches (and every one of step 1) go per-token
            how = route if step == 0 and (entry.split or route not in REFUSED_ROUTES) else "token"
            part = split_batch(packed(0, entry.samples, step_plan.lengths), entry, rank)
            with engine.odc_micro_batch(entry, scaled_token_sum=how.endswith("scaled")):
                logits = engine(input_ids=part["input_ids"], position_ids=part["position_ids"], use_cache=False).logits
                seen = engine.optimizer.odc_gradients_seen
                try:
                    _route_backward(engine, how, logits, part["shift_labels"], global_tokens, world)
                except Exception as err:  # noqa: BLE001 - the test reads the message
                    error, pushes = f"{type(err).__name__}: {err}", (seen, engine.optimizer.odc_gradients_seen)
                    logits = engine(input_ids=part["input_ids"], position_ids=part["position_ids"],
                                    use_cache=False).logits
                    loss, tokens = token_sum(logits, part["shift_labels"])
                    engine.backward(loss, loss_tokens=tokens)
        engine.step()
        history.append(full_parameters(engine))
    engine.destroy()
    return {"error": error, "pushes": pushes, "params": history}


def route_reference(steps: int = 2) -> list:
    """One process: every sample of :data:`ROUTE_STEP` whole and alone, the token mean, SGD; ``steps`` times."""
    model = tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    lengths = ROUTE_STEP[0]
    history = []
    for _ in range(steps):
        optimizer.zero_grad()
        total, tokens = 0.0, 0
        for index, length in enumerate(lengths):
            ids, labels = sample(0, index, length)
            loss, count = token_sum(model(input_ids=ids.unsqueeze(0)).logits, F.pad(labels, (0, 1), value=IGNORE)[1:])
            total, tokens = total + loss, tokens + count
        (total / tokens).backward()
        optimizer.step()
        history.append({name: p.detach().clone() for name, p in model.named_parameters()})
    return history


# -- forwards outside every entry (2 ranks, one of them late) ---------------------------------------------------
def outside_forwards(delay_s: float = 0.3, steps: int = 2) -> dict:
    """Each step: a frozen reference model's log-probs of every sample of the rank's entries *before* them (TRL's
    DPO precompute, GRPO's old log-probs), a no_grad forward of the training engine between entries (an
    evaluation) and after them; rank 1 sleeps ``delay_s`` before each entry and before its precompute, so rank 0
    sits in the split micro-batch's lockstep while rank 1 runs forwards outside every entry. Training is
    :data:`ROUTE_STEP` by the per-token rule: the parameters must equal one process's."""
    import time

    import deepspeed
    import torch.distributed as dist

    from ds_odc.balance import split_batch

    rank = dist.get_rank()
    ref = frozen_reference()
    model = tiny_llama()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config())
    step_plan = route_plan()
    history, forwards_outside = [], 0

    def late():
        if rank == 1:
            time.sleep(delay_s)

    for _ in range(steps):
        mine = step_plan.for_rank(rank)
        late()
        with torch.no_grad():
            for entry in mine:  # the whole samples of every entry, on the frozen reference, outside the entries
                for i in entry.samples:
                    ref(input_ids=sample(0, i, step_plan.lengths[i])[0].unsqueeze(0), use_cache=False)
                    forwards_outside += 1
        for entry in mine:
            late()
            part = split_batch(packed(0, entry.samples, step_plan.lengths), entry, rank)
            with engine.odc_micro_batch(entry):
                logits = engine(input_ids=part["input_ids"], position_ids=part["position_ids"], use_cache=False).logits
                loss, tokens = token_sum(logits, part["shift_labels"])
                engine.backward(loss, loss_tokens=tokens)
            with torch.no_grad():  # an evaluation between entries
                engine(input_ids=sample(0, 0, 12)[0].unsqueeze(0), use_cache=False)
                forwards_outside += 1
        engine.step()
        with torch.no_grad():  # and after them
            engine(input_ids=sample(0, 1, 7)[0].unsqueeze(0), use_cache=False)
            forwards_outside += 1
        history.append(full_parameters(engine))
    engine.destroy()
    ref.destroy()
    return {"params": history, "forwards_outside": forwards_outside}


# -- an engine's split groups live and die with it ---------------------------------------------------------------
def _threads_and_descriptors() -> tuple[int, int]:
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def rebuilds(cycles: int = 3) -> dict:
    """Build and destroy a split engine ``cycles`` times, trying a second split engine while the first lives.
    Returns the second's error, and this process's threads and open descriptors after each cycle (gloo groups
    hold worker threads and sockets: they must not grow with the cycles)."""
    import deepspeed

    counts, error = [], None
    for cycle in range(cycles):
        model = tiny_llama()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config())
        if cycle == 0:
            other = tiny_llama()
            try:
                deepspeed.initialize(model=other, model_parameters=other.parameters(), config=ds_config())
            except Exception as err:  # noqa: BLE001 - the test reads the message
                error = f"{type(err).__name__}: {err}"
        engine.destroy()
        del engine
        import gc

        gc.collect()
        counts.append(_threads_and_descriptors())
    return {"error": error, "counts": counts}
