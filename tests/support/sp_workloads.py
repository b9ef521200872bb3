"""Rank-side workloads for Ulysses sequence parallelism (DeepSpeed ALST) on the odc stage.

4 CPU ranks = 2 SP groups x 2 ({0, 1}, {2, 3}); a tiny Llama with sdpa attention whose attention is
ALST's ``UlyssesSPAttentionHF`` (``register_with_transformers`` builds the SP groups and returns the
``mpu`` handed to ``deepspeed.initialize``). Every SP rank takes its contiguous half of each sequence
(``position_ids`` likewise, labels shifted beforehand), as ALST's data adapter does.

Data: step ``s``, SP group ``g``, micro-batch ``i`` has a deterministic sequence (the same on both
ranks of the group, and in the one-process reference, which runs every full sequence of the step).
"""
from __future__ import annotations

import os
from typing import List, Sequence

import torch
import torch.nn.functional as F

from tests.support import tiny_models

SP = 2
VOCAB = 61
IGNORE = -100


def tiny_llama(seed: int = 7):
    return tiny_models.tiny_llama(VOCAB, seed, intermediate=48, max_positions=128, attn_implementation="sdpa",
                                  tie_word_embeddings=False)


def sequence(step: int, group: int, index: int, length: int = 16):
    """Input ids and shifted labels of one full sequence (a few labels ignored, so token counts differ)."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * group + index)
    ids = torch.randint(0, VOCAB, (1, length), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), IGNORE)], dim=1)
    labels[:, : (index + group) % 4] = IGNORE  # a prompt without loss
    return ids, labels


def shard(tensor: torch.Tensor, sp_rank: int) -> torch.Tensor:
    size = tensor.shape[1] // SP
    return tensor[:, sp_rank * size:(sp_rank + 1) * size]


def token_sum_loss(model, ids, labels, sp_rank: int):
    """This SP rank's shard: the loss summed over its own tokens, and how many tokens that is."""
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    local_ids, local_labels = shard(ids, sp_rank), shard(labels, sp_rank)
    logits = model(input_ids=local_ids, position_ids=shard(positions, sp_rank)).logits.float()
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), local_labels.reshape(-1), ignore_index=IGNORE, reduction="sum")
    return loss, int((local_labels != IGNORE).sum())


class _GatherInGroup(torch.autograd.Function):
    """A differentiable all_gather inside the SP group: the backward sums every copy's gradient, as
    ``torch.distributed.nn.functional.all_gather`` does (whose gloo backward cannot take a subgroup without
    global rank 0: it scatters from group ranks as if they were global ones)."""

    @staticmethod
    def forward(ctx, value, group):
        import torch.distributed as dist

        ctx.group = group
        out = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, value.contiguous(), group=group)
        return torch.stack(out)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def gathered_mean_loss(model, ids, labels, sp_rank: int, group):
    """The token mean over the whole sequence, the same on both SP ranks (HF's ``deepspeed_sp_compute_loss``
    shape: a differentiable all_gather of the shards' loss sums)."""
    loss, _ = token_sum_loss(model, ids, labels, sp_rank)
    total_tokens = sum(int((shard(labels, r) != IGNORE).sum()) for r in range(SP))
    return _GatherInGroup.apply(loss, group).sum() / total_tokens


def ds_config(stage, *, gas: int = 1, lr: float = 0.05, managed: bool = True, odc: dict | None = None):
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 0,
            "stage3_prefetch_bucket_size": 0}
    if stage == "odc":
        zero["odc"] = dict(odc or {})
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas,
              "optimizer": {"type": "SGD", "params": {"lr": lr}}, "gradient_clipping": 0.0,
              "zero_optimization": zero, "steps_per_print": 10 ** 9, "zero_allow_untested_optimizer": True}
    if not managed:
        config["managed_gradient_accumulation"] = False
    return config


class TiledLossLM(torch.nn.Module):
    """ALST's other parts around the tiny Llama: activation checkpointing of every decoder layer, ``TiledMLP``
    (each MLP run in 2 sequence tiles, recomputed in backward) and ``TiledFusedLogitsLoss`` (logits and loss in
    2 tiles, never the whole logits tensor; its backward runs inside the forward). Returns the loss summed
    over this rank's tokens."""

    def __init__(self, llama):
        super().__init__()
        import types

        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

        self.llama = llama
        llama.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

        def mlp(module, x):
            return module.down_proj(module.act_fn(module.gate_proj(x)) * module.up_proj(x))

        def tiled(module, x):
            return TiledMLP.apply(mlp, module, x, 2, [module.down_proj.weight, module.gate_proj.weight,
                                                      module.up_proj.weight])

        for layer in llama.model.layers:
            layer.mlp.forward = types.MethodType(tiled, layer.mlp)

    def forward(self, input_ids, position_ids, shift_labels):
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

        hidden = self.llama.model(input_ids=input_ids, position_ids=position_ids).last_hidden_state
        head = self.llama.lm_head

        def loss_fn(module, x, y):
            return F.cross_entropy(module(x).float().reshape(-1, VOCAB), y.reshape(-1), ignore_index=IGNORE,
                                   reduction="sum")

        return TiledFusedLogitsLoss.apply(loss_fn, head, hidden, shift_labels, None, 2, [head.weight], "sum")


def sp_engine(stage, alst: bool = False, **config_kw):
    """A tiny Llama with Ulysses attention on ``stage`` (``alst``: wrapped in :class:`TiledLossLM`), and the
    ALST mpu."""
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    model = tiny_llama()
    mpu = UlyssesSPAttentionHF.register_with_transformers(model_name_or_path=model, core_attn_implementation="sdpa",
                                                           sequence_parallel_size=SP, micro_batch_size=1)
    if alst:
        model = TiledLossLM(model)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(stage, **config_kw), mpu=mpu)
    return engine, mpu


def reference_engine():
    """A frozen copy of the model on the odc stage, built without the mpu and before the policy, as TRL's
    ``prepare_deepspeed`` builds a DPO reference model: its attention is ALST's too (registered process-wide)."""
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": "odc",
              "stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 0}}
    engine, *_ = deepspeed.initialize(model=tiny_llama(), config=config)
    return engine


def with_reference(counts: Sequence[int], extra_rank: int = -1, steps: int = 2) -> dict:
    """DPO's shape under SP: each micro-batch runs the frozen reference model, then the policy. SP group g runs
    counts[g] micro-batches per step (``extra_rank`` one more). Parameters after every step, or the error."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    policy_model = tiny_llama()
    mpu = UlyssesSPAttentionHF.register_with_transformers(model_name_or_path=policy_model,
                                                           core_attn_implementation="sdpa",
                                                           sequence_parallel_size=SP, micro_batch_size=1)
    reference = reference_engine()
    engine, *_ = deepspeed.initialize(model=policy_model, model_parameters=policy_model.parameters(),
                                      config=ds_config("odc", managed=False, odc={"timeout_s": 60}), mpu=mpu)
    rank, sp_rank = dist.get_rank(), mpu.get_sequence_parallel_rank()
    group, history = rank // SP, []
    try:
        for step in range(steps):
            for index in range(counts[group] + (1 if rank == extra_rank else 0)):
                ids, labels = sequence(step, group, index)
                positions = shard(torch.arange(ids.shape[1]).unsqueeze(0), sp_rank)
                with torch.no_grad():
                    reference_logits = reference(input_ids=shard(ids, sp_rank), position_ids=positions).logits
                loss, tokens = token_sum_loss(engine, ids, labels, sp_rank)
                engine.backward(loss + 0.0 * reference_logits.float().sum(), loss_tokens=tokens)
            engine.step()
            history.append(full_parameters(engine))
    except Exception as err:  # noqa: BLE001 - the test reads the message
        return {"error": f"{type(err).__name__}: {err}"}
    engine.destroy()
    reference.destroy()
    return {"params": history}


def full_parameters(engine) -> dict:
    import deepspeed

    out = {}
    for name, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            out[name.removeprefix("llama.")] = param.detach().clone().float()
    return out


def train_per_token(counts: Sequence[int], steps: int = 3, alst: bool = False) -> dict:
    """SP group g runs counts[g] micro-batches per step (the ranks of a group the same), per-token loss:
    each SP rank reports its own shard's tokens (``alst``: through :class:`TiledLossLM`). Returns parameters
    after every step."""
    import torch.distributed as dist

    engine, mpu = sp_engine("odc", alst=alst, managed=False)
    rank, sp_rank = dist.get_rank(), mpu.get_sequence_parallel_rank()
    group = rank // SP
    history = []
    for step in range(steps):
        for index in range(counts[group]):
            ids, labels = sequence(step, group, index)
            if alst:
                positions = shard(torch.arange(ids.shape[1]).unsqueeze(0), sp_rank)
                local_labels = shard(labels, sp_rank)
                loss = engine(shard(ids, sp_rank), positions, local_labels)
                tokens = int((local_labels != IGNORE).sum())
            else:
                loss, tokens = token_sum_loss(engine, ids, labels, sp_rank)
            engine.backward(loss, loss_tokens=tokens)
        engine.step()
        history.append(full_parameters(engine))
    totals = engine.odc_last_step
    result = {"params": history, "global_samples": engine.global_samples,
              "micro_batches": totals.total_micro_batches if totals else None}
    engine.destroy()
    return result


def reference_per_token(counts: Sequence[int], steps: int = 3, lr: float = 0.05) -> List[dict]:
    """One process, full sequences: the token mean over every sequence of the step, SGD."""
    model = tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    history = []
    for step in range(steps):
        optimizer.zero_grad()
        total, tokens = 0.0, 0
        for group, count in enumerate(counts):
            for index in range(count):
                ids, labels = sequence(step, group, index)
                logits = model(input_ids=ids).logits.float()
                total = total + F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=IGNORE,
                                                reduction="sum")
                tokens += int((labels != IGNORE).sum())
        if tokens:
            (total / tokens).backward()
            optimizer.step()
        history.append({name: p.detach().clone() for name, p in model.named_parameters()})
    return history


def train_gathered_mean(stage, gas: int = 2, steps: int = 3) -> dict:
    """Equal counts (``gas`` per SP rank), HF's gathered mean loss, DeepSpeed's managed accumulation: the
    shape of an HF Trainer run with ``ParallelismConfig(sp_size=2)``. Losses and parameters per step."""
    import torch.distributed as dist

    engine, mpu = sp_engine(stage, gas=gas)
    rank, sp_rank = dist.get_rank(), mpu.get_sequence_parallel_rank()
    group = rank // SP
    losses, history = [], []
    for step in range(steps):
        for index in range(gas):
            ids, labels = sequence(step, group, index)
            loss = gathered_mean_loss(engine, ids, labels, sp_rank, mpu.get_sequence_parallel_group())
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        history.append(full_parameters(engine))
    result = {"losses": losses, "params": history, "global_samples": engine.global_samples}
    engine.destroy()
    return result


def per_token_backward(engine, step: int, group: int, index: int, sp_rank: int) -> None:
    """One micro-batch of SP group ``group``: this rank's slice, its token-sum loss, its token count."""
    ids, labels = sequence(step, group, index)
    loss, tokens = token_sum_loss(engine, ids, labels, sp_rank)
    engine.backward(loss, loss_tokens=tokens)


def mismatch_in_group(extra_rank: int, timeout_s: float = 30.0) -> str:
    """Every rank runs 2 micro-batches except ``extra_rank``, which runs 3: its SP partner goes to the step
    while it starts one more. Returns the error each rank raised."""
    import torch.distributed as dist

    engine, mpu = sp_engine("odc", managed=False, odc={"timeout_s": timeout_s})
    rank, sp_rank = dist.get_rank(), mpu.get_sequence_parallel_rank()
    try:
        for index in range(3 if rank == extra_rank else 2):
            per_token_backward(engine, 0, rank // SP, index, sp_rank)
        engine.step()
    except Exception as err:  # noqa: BLE001 - the test reads the message
        return f"{type(err).__name__}: {err}"
    return "no error"


def killed_in_group(victim: int, inside: bool, timeout_s: float = 30.0) -> str:
    """``victim`` dies (SIGKILL) at its second micro-batch of step 2: before the forward (its SP partner then
    waits for it in the lockstep) or ``inside`` it, entering the second decoder layer (the partner is then
    inside that layer's all-to-all with it). Returns the error each survivor raised."""
    import signal

    import torch.distributed as dist

    engine, mpu = sp_engine("odc", managed=False, odc={"timeout_s": timeout_s})
    rank, sp_rank = dist.get_rank(), mpu.get_sequence_parallel_rank()
    doomed = {"now": False}
    if rank == victim and inside:
        engine.module.model.layers[1].register_forward_pre_hook(
            lambda *_: os.kill(os.getpid(), signal.SIGKILL) if doomed["now"] else None)
    try:
        for step in range(2):
            for index in range(2):
                if rank == victim and step == 1 and index == 1:
                    doomed["now"] = True
                    if not inside:
                        os.kill(os.getpid(), signal.SIGKILL)
                per_token_backward(engine, step, rank // SP, index, sp_rank)
            engine.step()
    except Exception as err:  # noqa: BLE001 - the test reads the message
        return f"{type(err).__name__}: {err}"
    return "no error"


# -- collectives, inside and outside the SP groups ---------------------------------------------------------
class GroupedCollectiveCounter:
    """Counts torch.distributed collectives by where they run: inside an SP group (a group of ``SP`` ranks) or
    outside (the world, or any larger group). Installed before the process group exists (harness ``setup``)."""

    def __init__(self):
        import torch.distributed as tdist
        import torch.distributed.distributed_c10d as c10d

        from tests.support.sync_workloads import COLLECTIVES

        self.inside = self.outside = 0
        for name in COLLECTIVES:
            original = getattr(tdist, name, None)
            if original is None:
                continue

            def counted(*args, __original=original, **kwargs):
                group = kwargs.get("group")
                if group is None:
                    group = next((a for a in args if isinstance(a, tdist.ProcessGroup)), None)
                if group is not None and tdist.get_world_size(group) == SP < tdist.get_world_size():
                    self.inside += 1
                else:
                    self.outside += 1
                return __original(*args, **kwargs)

            setattr(tdist, name, counted)
            if getattr(c10d, name, None) is original:
                setattr(c10d, name, counted)

    def take(self) -> tuple[int, int]:
        counts, self.inside, self.outside = (self.inside, self.outside), 0, 0
        return counts


_grouped = None


def install_grouped_counter():
    global _grouped
    _grouped = GroupedCollectiveCounter()


def count_sp_collectives(stage, micro_batches: int = 2, steps: int = 2) -> dict:
    """(inside SP groups, outside) collectives in each step's forwards/backwards and in its engine.step()."""
    import torch.distributed as dist

    engine, mpu = sp_engine(stage, gas=micro_batches)
    rank, sp_rank = dist.get_rank(), mpu.get_sequence_parallel_rank()
    _grouped.take()
    fwd_bwd, stepping = [], []
    for step in range(steps):
        inside = outside = 0
        for index in range(micro_batches):
            ids, labels = sequence(step, rank // SP, index)
            engine.backward(gathered_mean_loss(engine, ids, labels, sp_rank, mpu.get_sequence_parallel_group()))
            if index < micro_batches - 1:
                engine.step()  # not a boundary
            i, o = _grouped.take()
            inside, outside = inside + i, outside + o
        engine.step()
        fwd_bwd.append((inside, outside))
        stepping.append(_grouped.take())
    engine.destroy()
    return {"fwd_bwd": fwd_bwd, "step": stepping}


def attention_forms_alst_drops(timeout_s: float = 30.0) -> dict:
    """Under fixed SP with sdpa (2 ranks, one group): a Mistral-style model with a sliding window, refused at
    initialize; then a Llama fed packed samples: at the boundary between the members' slices (a sample starts at
    rank 1's first token) and inside rank 0's slice. Returns each case's error on this rank."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers import MistralConfig, MistralForCausalLM

    errors = {}
    torch.manual_seed(7)
    mistral = MistralForCausalLM(MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=128, sliding_window=4,
                                               attn_implementation="sdpa"))
    mpu = UlyssesSPAttentionHF.register_with_transformers(model_name_or_path=mistral, core_attn_implementation="sdpa",
                                                           sequence_parallel_size=SP, micro_batch_size=1)
    try:
        deepspeed.initialize(model=mistral, model_parameters=mistral.parameters(), mpu=mpu,
                             config=ds_config("odc", odc={"timeout_s": timeout_s}))
        errors["window"] = "no error"
    except Exception as err:  # noqa: BLE001 - the test reads the message
        errors["window"] = f"{type(err).__name__}: {err}"
    sp_rank = dist.get_rank() % SP
    for case, positions in (("boundary", torch.cat([torch.arange(8), torch.arange(8)])),
                            ("inside", torch.cat([torch.arange(3), torch.arange(13)]))):
        llama = tiny_llama()  # the same attention shape: ALST's groups and wrapper (once per process) serve it too
        engine, *_ = deepspeed.initialize(model=llama, model_parameters=llama.parameters(), mpu=mpu,
                                          config=ds_config("odc", managed=False, odc={"timeout_s": timeout_s}))
        ids, labels = sequence(0, 0, 0)
        try:
            logits = engine(input_ids=shard(ids, sp_rank), position_ids=shard(positions[None], sp_rank)).logits
            engine.backward(logits.float().sum(), loss_tokens=1)
            errors[case] = "no error"
        except Exception as err:  # noqa: BLE001 - the test reads the message
            errors[case] = f"{type(err).__name__}: {err}"
        engine.destroy()
    return errors
