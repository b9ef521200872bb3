"""What the ranks run in the generation tests (test_generation.py): a small Hugging Face Llama under the odc
stage (and under ZeRO-3, beside it), parameters released after every use as for any model of real size,
``model.generate(...)`` called as TRL's GRPO trainer calls it (no ``synced_gpus``), each rank with its own
prompt and its own number of new tokens (rank 0 stops early: DeepSpeed issue 8262's rollout shape)."""
from __future__ import annotations

import contextlib

import deepspeed
import torch
import torch.distributed as tdist

from tests.support import tiny_models
from tests.support.frozen_workloads import RELEASED
from tests.support.workloads import ds_config

VOCAB = 128
#: new tokens per rank: rank 0 ends after 3, rank 1 after 24
NEW_TOKENS = (3, 24)


def llama(seed: int = 11):
    return tiny_models.tiny_llama(VOCAB, seed, kv_heads=4).eval()


def prompt(rank: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, 5 + rank), generator=torch.Generator().manual_seed(100 + rank))


def greedy(model, rank: int, **kwargs) -> list:
    """Greedy decoding of exactly ``NEW_TOKENS[rank]`` tokens (no end-of-sequence token to stop earlier)."""
    with torch.no_grad():
        out = model.generate(prompt(rank), max_new_tokens=NEW_TOKENS[rank], min_new_tokens=NEW_TOKENS[rank],
                             do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs)
    return out[0].tolist()


def single_process_tokens() -> list:
    """The reference: one process, the plain model, each rank's prompt."""
    model = llama()
    return [greedy(model, rank) for rank in range(len(NEW_TOKENS))]


class _Counted:
    """Forwards of the model and collectives of torch.distributed while it is active."""

    def __init__(self, model):
        from tests.support.sync_workloads import COLLECTIVES

        self.forwards = 0
        self.collectives = 0
        self._model = model
        self._handle = model.register_forward_pre_hook(lambda *unused: self._forward())
        self._restore = []
        for name in COLLECTIVES:
            original = getattr(tdist, name, None)
            if original is None:
                continue

            def counted(*args, __original=original, **kwargs):
                self.collectives += 1
                return __original(*args, **kwargs)

            setattr(tdist, name, counted)
            self._restore.append((name, original))

    def _forward(self):
        self.forwards += 1

    def close(self):
        self._handle.remove()
        for name, original in self._restore:
            setattr(tdist, name, original)


def _engine(stage, frozen: bool):
    """An engine over a fresh Llama, with transformers told of the DeepSpeed config as the Trainer tells it
    (``HfDeepSpeedConfig``, kept alive on the engine): ``is_deepspeed_zero3_enabled()`` is then True, which is
    what turns ``synced_gpus`` on for every model by default."""
    from transformers.integrations import HfDeepSpeedConfig

    model = llama()
    if frozen:  # a reference model as TRL's prepare_deepspeed builds it: no optimizer
        config = ds_config(stage, optimizer="client", **RELEASED)
        config.pop("gradient_clipping", None)
    else:
        config = ds_config(stage, optimizer="sgd", clip=0.0, **RELEASED)
    told = HfDeepSpeedConfig(config)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.hf_deepspeed_config_kept_alive = told  # transformers holds it by a weak reference only
    return engine


def generate_unsynced(kind: str):
    """``kind``: "training" (a policy under the odc stage), "frozen" (an engine without an optimizer),
    "gathered" (TRL's ``ds3_gather_for_generation=True``: every parameter gathered once around generate),
    "explicit" (``synced_gpus=True`` passed by the caller), "zero3" (a ZeRO-3 policy built after an ODC one in
    the same process: transformers' lockstep must stay). Returns this rank's tokens, the model's forwards
    and the collectives issued inside generate."""
    rank = tdist.get_rank()
    engines = []
    if kind == "zero3":
        engines.append(_engine("odc", frozen=False))  # an ODC engine alive in the process
    engine = _engine(3 if kind == "zero3" else "odc", frozen=kind == "frozen")
    engines.append(engine)
    model = engine.module
    gathered = deepspeed.zero.GatheredParameters(list(model.parameters())) if kind == "gathered" \
        else contextlib.nullcontext()
    from transformers.integrations import is_deepspeed_zero3_enabled

    zero3_enabled = is_deepspeed_zero3_enabled()
    counted = _Counted(model)
    try:
        with gathered:
            tokens = greedy(model, rank, **({"synced_gpus": True} if kind == "explicit" else {}))
    finally:
        counted.close()
    for built in engines:
        built.destroy()
    result = {"tokens": tokens, "forwards": counted.forwards, "collectives": counted.collectives,
              "zero3_enabled": zero3_enabled,
              "generate_is_the_class_s": type(model).generate is getattr(model.generate, "__func__", None)}
    return result


def rollout_then_score(steps: int = 2):
    """DeepSpeed issue 8262's loop on the odc stage: each step a policy generates its own rollout (ranks stop at
    different tokens, no padding to the longest), a frozen reference scores it (a different number of tokens
    per rank), and the policy trains on it (uneven work, one step). Returns the tokens of every rollout."""
    rank = tdist.get_rank()
    policy = _engine("odc", frozen=False)
    policy.module.train()
    reference = _engine("odc", frozen=True)
    rollouts = []
    for _ in range(steps):
        tokens = greedy(policy.module, rank)
        rollouts.append(tokens)
        ids = torch.tensor([tokens])
        with torch.no_grad():
            reference_logits = reference(ids).logits
        logits = policy(ids).logits
        loss = torch.nn.functional.mse_loss(logits.float(), reference_logits.float())
        policy.backward(loss)
        policy.step()
    policy.destroy()
    reference.destroy()
    return rollouts


def generate_under_sequence_parallelism():
    """Ulysses SP (4 ranks, 2 groups of 2) on the odc stage: generate() on the policy, and on a frozen reference
    built beside it (ALST's attention is process-wide), is refused by name; with an explicit ``synced_gpus``
    the caller takes it over. Returns the error each raised."""
    from ds_odc.errors import ODCConfigError
    from tests.support import sp_workloads

    reference = sp_workloads.reference_engine()
    policy, _ = sp_workloads.sp_engine("odc")
    errors = []
    for engine in (policy, reference):
        try:
            engine.module.generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=2, do_sample=False)
            errors.append(None)
        except ODCConfigError as err:
            errors.append(str(err))
    policy.destroy()
    reference.destroy()
    return errors
