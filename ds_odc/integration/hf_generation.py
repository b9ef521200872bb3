"""``generate()`` on a model an ODC engine manages: every rank decodes at its own pace, no per-token lockstep.

transformers turns ``synced_gpus`` on for any model while a DeepSpeed ZeRO-3 config is active
(``is_deepspeed_zero3_enabled()``, read in ``GenerationMixin._extract_generation_mode_kwargs``): a rank whose
sequences have ended keeps running dummy forwards until the last rank's have, and every token ends with an
all-reduce of a "finished" flag over the world. ZeRO-3 needs that: its forward gathers are collectives, and
ranks that stop at different tokens deadlock without it. On ODC a forward is one-sided pulls, so each rank
can stop at its own end; the dummy forwards and the per-token collective are pure waste, and the rank whose
rollouts ended first can go on to score them.

So an ODC engine (training or frozen) gives *its* model instance a ``generate`` that passes
``synced_gpus=False`` when the caller did not say (an explicit ``synced_gpus=True`` is honoured: a forward
on ODC is no collective, so the lockstep still works, it only costs its all-reduce per token). Nothing else
changes: transformers' functions, the model's class and every other model (a ZeRO-3 reference beside an ODC
policy keeps transformers' lockstep) are left alone; ``engine.destroy()`` takes the binding back.

Under Ulysses sequence parallelism ``generate()`` is refused, naming why, unless the caller says
``synced_gpus``: ALST's attention shards the *sequence* over the SP group and all-to-alls it at every layer,
which decoding cannot do (a decoded token sits on one rank, and each rank's cache holds its own slice of the
prompt, so the group's attention over their concatenation is not the model's). An explicit ``synced_gpus``
hands the call to transformers and ALST as on ZeRO-3 + SP: with the KV cache (the default) ALST's attention
fails at the first decoded token; with ``use_cache=False`` the group runs in step, but its tokens are not the
model's. Generate on a model without SP (a rollout engine, or the weights gathered into a plain copy).
"""
from __future__ import annotations

from typing import Any, Callable

from ds_odc.errors import ODCConfigError
from ds_odc.integration.patching import PatchSet

_PATCHES = PatchSet("ODC models' generate")

SP_REFUSAL = ("generate() on a model trained with Ulysses sequence parallelism (the odc stage's SP lockstep is "
              "on): ALST's attention splits the sequence over the SP group at every layer, which decoding cannot "
              "do, so the tokens would not be the model's. Generate with a model without SP (a rollout engine, or "
              "a copy of the gathered weights). An explicit synced_gpus leaves the call to transformers and ALST, "
              "as on ZeRO-3 + SP: with the KV cache it fails at the first decoded token, and without it the tokens are "
              "still not the model's")


def bind(module: Any, under_sequence_parallelism: Callable[[], bool]) -> None:
    """Give ``module`` (an ODC engine's model) the unsynced ``generate`` of the module docstring, if it has one."""
    if not callable(getattr(type(module), "generate", None)):
        return

    def make(original):
        def generate(*args, **kwargs):
            if kwargs.get("synced_gpus") is None:
                if under_sequence_parallelism():
                    raise ODCConfigError(SP_REFUSAL)
                kwargs["synced_gpus"] = False
            return original(*args, **kwargs)

        return generate

    _PATCHES.replace(module, "generate", make)


def unbind(module: Any) -> None:
    """``engine.destroy()``: the model's ``generate`` is its class's again."""
    if module is not None:
        _PATCHES.undo(module)


def bound(module: Any) -> bool:
    return _PATCHES.patched(module, "generate")
