"""Samples packed into one sequence attend each within itself, with each layer's own attention form.

Under the split policy (:mod:`ds_odc.integration.split_attention`) a packed micro-batch, whole or split (its
sequence gathered by Ulysses, which drops the mask the model built for a slice), runs its attention per sample:
a sample starts where ``position_ids`` restart at 0. A sample's attention then costs its own length squared
(transformers' sdpa would mask a packed micro-batch densely and compute its total length squared: 3.5x the time
for four ~1K samples on a CPU).

[Note: per-sample attention forms]
The per-sample attention runs without the mask the model built, so whatever the mask carried must be put back
per sample, or the form refused at ``deepspeed.initialize`` (:func:`check_attention_forms`):

* causal attention: sdpa's ``is_causal`` path, no mask (a full-attention layer, ``sliding_window`` None);
* a sliding window (the ``sliding_window`` keyword the model passes per layer: Mistral's ``config.sliding_window``,
  Qwen2's and Gemma 3's per-layer window, None on their full-attention layers): transformers' sdpa carries windows
  only in the mask, so each sample gets transformers' causal window, key ``k`` seen by query ``q`` when
  ``q - window < k <= q`` (:func:`window_mask`), blockwise for long samples (:func:`windowed_sdpa`); a flash
  attention takes the keyword itself;
* the varlen keywords of a packed sequence (``cu_seq_lens_q/k``, ``max_length_q/k``, from
  ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``) are cut to each sample: ``[0, n]`` and ``n``.

Chunked attention, layer types other than full and sliding, a window with an implementation that is neither sdpa
nor a flash attention, a bidirectional window, and attention-logit softcapping without a flash attention are
refused by layer and field.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from ds_odc.errors import ODCConfigError

#: Query tokens per block of a windowed sample's sdpa (:func:`windowed_sdpa`): a sample up to this long runs in one
#: masked call (a ``length x length`` boolean mask), a longer one block by block, each block's keys from
#: ``block_start - window + 1`` (masks of at most ``block x (block + window - 1)`` booleans: 48 MiB for 4096 query
#: tokens and a window of 8192, where a dense 64K-token sample would need 4 GiB).
BLOCK_TOKENS = 4096

#: Keywords of transformers' flash attentions that describe the whole packed sequence: cut to each sample.
VARLEN_OFFSETS = ("cu_seq_lens_q", "cu_seq_lens_k")
VARLEN_MAXIMA = ("max_length_q", "max_length_k")

#: The ``layer_types`` the per-sample attention honours.
LAYER_TYPES = ("full_attention", "sliding_attention")

POLICY = "balance policy 'lb-mini-split'"


def per_sample(core: Callable, block_tokens: int = BLOCK_TOKENS) -> Callable:
    """``core`` attention run on each sample of a packed sequence separately (a sample starts where
    ``position_ids`` restart at 0), so that packed samples do not attend to each other once the split
    micro-batch's sequence is gathered (Ulysses drops the mask the model built for a slice). Each sample keeps its
    layer's form ([Note: per-sample attention forms]): with transformers' sdpa as ``core``, a ``sliding_window``
    becomes a window mask (blockwise past ``block_tokens``); other cores get the keyword. A sequence of one sample
    with no mask gets its window too; one with the model's mask runs with that mask, as the model built it."""
    masks_windows = is_sdpa(core)

    def one(module, query, key, value, args, kwargs):
        window = kwargs.get("sliding_window")
        if window is None or not masks_windows:
            return core(module, query, key, value, None, *args, **kwargs)
        return windowed_sdpa(core, module, query, key, value, int(window), block_tokens, args, kwargs)

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        bounds = sample_bounds(kwargs.get("position_ids"))
        if bounds is None or len(bounds) == 2:
            if attention_mask is not None:
                return core(module, query, key, value, attention_mask, *args, **kwargs)
            return one(module, query, key, value, args,
                       kwargs if bounds is None else own_lengths(kwargs, query.shape[2]))
        positions = kwargs["position_ids"]
        outputs = []
        for a, b in zip(bounds, bounds[1:]):
            out, _ = one(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], args,
                         own_lengths(dict(kwargs, position_ids=positions[:, a:b]), b - a))
            outputs.append(out)
        return torch.cat(outputs, dim=1), None

    return attention


def sample_bounds(positions) -> Optional[list[int]]:
    """Where the samples of one sequence start, and its end (``position_ids`` restart at 0); None for a batch of
    several sequences or no ``position_ids``.

    >>> sample_bounds(torch.tensor([[0, 1, 2, 0, 1, 0]])), sample_bounds(torch.arange(4)[None])
    ([0, 3, 5, 6], [0, 4])
    """
    if positions is None or positions.shape[0] != 1:
        return None
    starts = sorted({0, *(int(i) for i in torch.nonzero(positions[0] == 0).flatten().tolist())})
    return [*starts, int(positions.shape[1])]


def is_packed(positions) -> bool:
    """Whether one sequence's ``position_ids`` restart after its first token (several samples packed)."""
    return positions is not None and positions.shape[0] == 1 and bool((positions[0, 1:] == 0).any())


def own_lengths(kwargs: dict, length: int) -> dict:
    """``kwargs`` with the varlen keywords that were given (:data:`VARLEN_OFFSETS`, :data:`VARLEN_MAXIMA`) cut to
    one sample of ``length`` tokens: offsets ``[0, length]``, maxima ``length``."""
    out = dict(kwargs)
    for name in VARLEN_OFFSETS:
        given = kwargs.get(name)
        if given is not None:
            given = torch.as_tensor(given)
            out[name] = torch.tensor([0, length], dtype=given.dtype, device=given.device)
    for name in VARLEN_MAXIMA:
        if kwargs.get(name) is not None:
            out[name] = length
    return out


def is_sdpa(core: Callable) -> bool:
    """Whether ``core`` is transformers' sdpa attention, which carries sliding windows only in the mask."""
    try:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
    except ImportError:  # pragma: no cover - transformers is optional; without it no core is its sdpa
        return False
    return core is sdpa_attention_forward


def window_mask(q_start: int, q_end: int, k_start: int, window: int, device: Any = None) -> torch.Tensor:
    """transformers' causal sliding window (``masking_utils.sliding_window_causal_mask_function``: key ``k`` seen
    by query ``q`` when ``q - window < k <= q``) for queries ``[q_start, q_end)`` and keys ``[k_start, q_end)`` of
    one sample, as sdpa's boolean mask ``[1, 1, queries, keys]`` (True: attends). Queries 2-3 of a window of 2:

    >>> window_mask(2, 4, 1, 2)[0, 0].int()
    tensor([[1, 1, 0],
            [0, 1, 1]], dtype=torch.int32)
    """
    q = torch.arange(q_start, q_end, device=device)[:, None]
    k = torch.arange(k_start, q_end, device=device)[None, :]
    return ((k <= q) & (k > q - window))[None, None]


def windowed_sdpa(core: Callable, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, window: int,
                  block_tokens: int, args: tuple, kwargs: dict) -> tuple[torch.Tensor, None]:
    """One sample's causal attention under a sliding ``window`` through transformers' sdpa ``core`` (called with
    ``args`` and ``kwargs`` besides the tensors and the mask, as the model called the attention). A window that
    holds the whole sample is plain causal attention (sdpa's ``is_causal`` path, no mask); a sample of at most
    ``block_tokens`` runs in one masked call; a longer one block by block, each block of queries over its keys
    from ``block_start - window + 1`` (never a ``length x length`` mask)."""
    length = query.shape[2]
    if window >= length:
        return core(module, query, key, value, None, *args, **kwargs)
    causal = kwargs.get("is_causal")
    if not (getattr(module, "is_causal", True) if causal is None else causal):
        raise ODCConfigError(f"{POLICY}: a bidirectional attention with sliding_window={window} cannot run per "
                             "sample (the per-sample window is causal): use another balance policy")
    if window < 1:
        raise ODCConfigError(f"{POLICY}: sliding_window={window}: a window holds at least one token")
    if length <= block_tokens:
        return core(module, query, key, value, window_mask(0, length, 0, window, query.device), *args, **kwargs)
    outputs = []
    for start in range(0, length, block_tokens):
        end, first = min(start + block_tokens, length), max(0, start - window + 1)
        out, _ = core(module, query[:, :, start:end], key[:, :, first:end], value[:, :, first:end],
                      window_mask(start, end, first, window, query.device), *args, **kwargs)
        outputs.append(out)
    return torch.cat(outputs, dim=1), None


# -- what the split policy refuses ------------------------------------------------------------------------------
def text_config_of(module: torch.nn.Module) -> Any:
    """The text config of the first Hugging Face model in ``module`` (itself or a submodule with a ``config``),
    found as :func:`ds_odc.integration.split_attention.attention_shape` finds it; None without one."""
    for sub in module.modules():
        config = getattr(sub, "config", None)
        text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
        if text is not None and getattr(text, "num_attention_heads", None):
            return text
    return None


def takes_window_itself(implementation: str) -> bool:
    """Whether the attention implementation applies the ``sliding_window`` (and ``softcap``) keyword itself: the
    flash attentions ("flash_attention_2", "flash_attention_3", a hub kernel of flash attention)."""
    return "flash" in implementation.lower()


def _layers(indices: Sequence[int], layer_types: Sequence[str]) -> str:
    if not layer_types or len(indices) == len(layer_types):
        return "every layer"
    return ("layer " if len(indices) == 1 else "layers ") + ", ".join(str(i) for i in indices)


def sliding_layers(text_config: Any) -> list[int]:
    """The layers whose attention slides: every layer with a ``sliding_window`` (Mistral, Phi-3), or those of
    ``layer_types`` "sliding_attention" (Qwen2, Gemma 2/3); none without a window or with
    ``use_sliding_window=False``."""
    window = getattr(text_config, "sliding_window", None)
    if window is None or getattr(text_config, "use_sliding_window", True) is False:
        return []
    layer_types = list(getattr(text_config, "layer_types", None) or [])
    if layer_types:
        return [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    return list(range(int(getattr(text_config, "num_hidden_layers", 0) or 0)))


def check_attention_forms(text_config: Any, implementation: str) -> None:
    """Refuse, naming the layers and the field, the attention forms the split policy's per-sample attention
    cannot honour ([Note: per-sample attention forms]): chunked attention (``attention_chunk_size``, Llama 4),
    ``layer_types`` other than full and sliding attention, a sliding window with an implementation that is neither
    sdpa nor a flash attention, a bidirectional window (``use_bidirectional_attention``), and attention-logit
    softcapping (``attn_logit_softcapping``, Gemma 2) without a flash attention. ``text_config``: the model's text
    config (:func:`text_config_of`); ``implementation``: its ``attn_implementation``."""
    if text_config is None:
        return
    layer_types = list(getattr(text_config, "layer_types", None) or [])
    chunk = getattr(text_config, "attention_chunk_size", None)
    chunked = [i for i, kind in enumerate(layer_types) if kind == "chunked_attention"]
    if chunk is not None and (chunked or not layer_types):
        raise ODCConfigError(
            f"{POLICY} cannot honour the model's chunked attention at {_layers(chunked, layer_types)}: "
            f"attention_chunk_size={chunk}: packed and split samples run their attention per sample without the "
            "model's mask, and the per-sample attention knows causal and sliding-window layers only; use another "
            "balance policy for this model")
    other = [(i, kind) for i, kind in enumerate(layer_types) if kind not in LAYER_TYPES]
    if other:
        where = "; ".join(f"layer {i}: layer_types[{i}]={kind!r}" for i, kind in other)
        raise ODCConfigError(
            f"{POLICY} cannot honour the model's attention at {where}: packed and split samples run their "
            f"attention per sample without the model's mask, and the per-sample attention knows layer_types "
            f"{' and '.join(map(repr, LAYER_TYPES))} only; use another balance policy for this model")
    sliding = sliding_layers(text_config)
    window = getattr(text_config, "sliding_window", None)
    if sliding and getattr(text_config, "use_bidirectional_attention", False):
        raise ODCConfigError(
            f"{POLICY} cannot honour the model's bidirectional sliding window at {_layers(sliding, layer_types)}: "
            f"use_bidirectional_attention=True with sliding_window={window}: the per-sample window is causal; "
            "use another balance policy for this model")
    if sliding and implementation != "sdpa" and not takes_window_itself(implementation):
        raise ODCConfigError(
            f"{POLICY} cannot honour the model's sliding window at {_layers(sliding, layer_types)}: "
            f"sliding_window={window} with attn_implementation={implementation!r}: packed and split samples run "
            "their attention per sample without the model's mask, so the window comes from sdpa (given a window "
            "mask per sample) or a flash attention (which takes the sliding_window keyword); use attn_implementation"
            " 'sdpa' or a flash attention")
    softcap = getattr(text_config, "attn_logit_softcapping", None)
    if softcap is not None and not takes_window_itself(implementation):
        raise ODCConfigError(
            f"{POLICY} cannot honour the model's attention at every layer: attn_logit_softcapping={softcap} with "
            f"attn_implementation={implementation!r}: sdpa cannot cap attention logits (and the split policy "
            "refuses eager attention); use a flash attention (it takes the softcap keyword) or another balance "
            "policy")
