"""The per-sample attention of packed (or gathered) samples: each sample's sliding window, as transformers defines
it, on the dense and the blockwise path; the varlen keywords cut per sample; the attention forms the split
policy cannot honour, refused by name."""
import types
from unittest import mock

import pytest
import torch

from ds_odc.errors import ODCConfigError
from ds_odc.integration.packed_attention import check_attention_forms, per_sample


def _sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def _module(kv_groups: int):
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, kv_groups
    return module


def _own_window_mask(length: int, window: int) -> torch.Tensor:
    """transformers' own sliding-window causal mask of one sample (True: attends), from its mask function."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    index = torch.arange(length)
    allowed = sliding_window_causal_mask_function(window)(0, 0, index[:, None], index[None, :])
    return allowed[None, None]


def _qkv(length: int, heads: int, kv_heads: int, seed: int = 0, grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(1, h, length, 8, generator=g) for h in (heads, kv_heads, kv_heads)]
    return [t.requires_grad_(grad) for t in tensors]


# (length, window, block_tokens, query heads, key/value heads): dense (the sample fits a block), blockwise (the
# window smaller and larger than a block, a last block of one token), the window reaching past the sample
CASES = [(11, 3, 64, 4, 2), (11, 3, 4, 4, 2), (13, 6, 4, 4, 4), (9, 5, 2, 4, 1), (11, 20, 4, 4, 2),
         (11, 11, 4, 4, 2), (12, 1, 5, 2, 2)]


@pytest.mark.parametrize("length, window, block, heads, kv_heads", CASES)
def test_a_sample_alone_gets_transformers_own_sliding_window(length, window, block, heads, kv_heads):
    """One unpacked sample with no mask (what a split micro-batch's gathered sequence passes): its attention, and
    its gradients, equal transformers' sdpa under transformers' own sliding-window causal mask."""
    sdpa, module = _sdpa(), _module(heads // kv_heads)
    q, k, v = _qkv(length, heads, kv_heads, grad=True)
    masks = []
    torch_sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(*args, attn_mask=None, **kwargs):
        masks.append(None if attn_mask is None else tuple(attn_mask.shape[-2:]))
        return torch_sdpa(*args, attn_mask=attn_mask, **kwargs)

    with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", recording):
        ours, _ = per_sample(sdpa, block_tokens=block)(module, q, k, v, None,
                                                       position_ids=torch.arange(length)[None], sliding_window=window)
    if window >= length:  # the window holds the sample: causal attention, sdpa's is_causal path
        assert masks == [None]
    elif length <= block:  # one dense masked call
        assert masks == [(length, length)]
    else:  # blockwise: each block's keys from block_start - window + 1, never a length x length mask
        starts = range(0, length, block)
        assert masks == [(min(s + block, length) - s, min(s + block, length) - max(0, s - window + 1)) for s in starts]
        assert max(a * b for a, b in masks) <= block * (block + window - 1) < length * length
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    theirs, _ = sdpa(module, q2, k2, v2, _own_window_mask(length, window))
    torch.testing.assert_close(ours, theirs)
    weights = torch.randn(theirs.shape, generator=torch.Generator().manual_seed(1))
    (ours * weights).sum().backward()
    (theirs * weights).sum().backward()
    for mine, own in ((q, q2), (k, k2), (v, v2)):
        torch.testing.assert_close(mine.grad, own.grad)
    if window < length:  # the window matters here: full causal attention differs
        full, _ = sdpa(module, q2, k2, v2, None)
        assert not torch.allclose(full, theirs, atol=1e-3)


@pytest.mark.parametrize("block", [64, 3])
def test_packed_samples_each_get_their_own_window(block):
    """Three samples packed (position_ids restart at 0): each equals itself alone under its own window mask, on
    the dense path (block 64) and the blockwise one (block 3)."""
    sdpa, module = _sdpa(), _module(2)
    lengths, window = (7, 3, 12), 4
    q, k, v = _qkv(sum(lengths), 4, 2, seed=3)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    ours, _ = per_sample(sdpa, block_tokens=block)(module, q, k, v, None, position_ids=positions,
                                                   sliding_window=window)
    start, pieces = 0, []
    for n in lengths:
        piece = slice(start, start + n)
        pieces.append(sdpa(module, q[:, :, piece], k[:, :, piece], v[:, :, piece], _own_window_mask(n, window))[0])
        start += n
    torch.testing.assert_close(ours, torch.cat(pieces, dim=1))


class _Spy:
    """A core attention that records what each call received."""

    def __init__(self):
        self.calls = []

    def __call__(self, module, query, key, value, attention_mask, *args, **kwargs):
        self.calls.append({"length": query.shape[2], "mask": attention_mask, **kwargs})
        return query.transpose(1, 2), None


def test_without_a_window_the_core_runs_as_before_causal_and_without_a_mask():
    """sliding_window None (a full-attention layer) or absent: each sample's core call has no mask (sdpa's
    is_causal path), as before windows were honoured; a sample alone with the model's mask keeps that mask."""
    q = torch.zeros(1, 4, 9, 8)
    for extra in ({}, {"sliding_window": None}):
        spy = _Spy()
        per_sample(spy, block_tokens=2)(None, q, q, q, None, position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]]),
                                        **extra)
        assert [(c["length"], c["mask"]) for c in spy.calls] == [(4, None), (5, None)]
    spy = _Spy()
    per_sample(spy)(None, q, q, q, "the model's mask", position_ids=torch.arange(9)[None], sliding_window=3)
    assert [(c["length"], c["mask"]) for c in spy.calls] == [(9, "the model's mask")]


def test_a_flash_attention_core_takes_the_window_itself():
    """A core that is not transformers' sdpa (a flash attention) gets each sample with no mask and the
    sliding_window keyword, which it applies itself."""
    spy = _Spy()
    q = torch.zeros(1, 4, 9, 8)
    per_sample(spy, block_tokens=2)(None, q, q, q, None, position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]]),
                                    sliding_window=3)
    assert [(c["length"], c["mask"], c["sliding_window"]) for c in spy.calls] == [(4, None, 3), (5, None, 3)]


def test_varlen_keywords_are_cut_to_each_sample():
    """cu_seq_lens_q/k and max_length_q/k (DataCollatorWithFlattening(return_flash_attn_kwargs=True)) describe the
    whole packed sequence: each sample's call gets its own, [0, n] and n; keywords not given are not added."""
    spy = _Spy()
    q = torch.zeros(1, 4, 11, 8)
    whole = torch.tensor([0, 5, 11], dtype=torch.int32)
    per_sample(spy)(None, q, q, q, None, position_ids=torch.cat([torch.arange(5), torch.arange(6)])[None],
                    cu_seq_lens_q=whole, cu_seq_lens_k=whole, max_length_q=6, max_length_k=6)
    assert [(c["cu_seq_lens_q"].tolist(), c["cu_seq_lens_k"].tolist(), c["max_length_q"], c["max_length_k"])
            for c in spy.calls] == [([0, 5], [0, 5], 5, 5), ([0, 6], [0, 6], 6, 6)]
    assert all(c["cu_seq_lens_q"].dtype == torch.int32 for c in spy.calls)
    spy = _Spy()
    per_sample(spy)(None, q, q, q, None, position_ids=torch.cat([torch.arange(5), torch.arange(6)])[None],
                    cu_seq_lens_q=whole, max_length_q=6)
    assert [sorted(k for k in c if k.startswith(("cu_", "max_"))) for c in spy.calls] == \
        [["cu_seq_lens_q", "max_length_q"]] * 2
    assert [c["max_length_q"] for c in spy.calls] == [5, 6]


# -- whole models: packed through the per-sample attention, against each sample alone ---------------------------
def _tiny(kind: str, window):
    import transformers

    common = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, attn_implementation="sdpa",
                  tie_word_embeddings=False)
    sliding = "full_attention" if window is None else "sliding_attention"
    torch.manual_seed(5)
    if kind == "mistral":  # every layer slides
        return transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=window, **common)).eval()
    if kind == "phi3":  # every layer slides
        config = transformers.Phi3Config(sliding_window=window, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                         **common)
        return transformers.Phi3ForCausalLM(config).eval()
    if kind == "gemma3":  # layer 0 slides, layer 1 full
        config = transformers.Gemma3TextConfig(sliding_window=window or 4096, head_dim=8, query_pre_attn_scalar=8,
                                               layer_types=[sliding, "full_attention"], pad_token_id=0,
                                               bos_token_id=1, eos_token_id=2, **common)
        return transformers.Gemma3ForCausalLM(config).eval()
    config = transformers.Qwen2Config(use_sliding_window=window is not None, sliding_window=window,
                                      max_window_layers=1, layer_types=["full_attention", sliding], **common)
    return transformers.Qwen2ForCausalLM(config).eval()  # layer 0 full, layer 1 slides


@pytest.mark.parametrize("kind", ["mistral", "phi3", "qwen2", "gemma3"])
def test_a_sliding_window_model_packed_through_the_per_sample_attention_equals_each_sample_alone(kind):
    """Tiny Mistral and Phi-3 (every layer slides), Qwen2 (layer 0 full, layer 1 sliding) and Gemma 3 text (layer 0
    sliding, layer 1 full): three samples packed,
    the model's attention entry replaced as the split policy's dispatcher does (per sample, no mask, the blockwise
    path), equal each sample run alone with the model's own mask; the window matters on these lengths."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ds_odc.integration.patching import PatchSet

    lengths, window = (9, 14, 6), 4
    model, full = _tiny(kind, window), _tiny(kind, None)
    ids = torch.randint(0, 61, (1, sum(lengths)), generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    bounds = [0, 9, 23, 29]
    alone = [model(input_ids=ids[:, a:b], use_cache=False).logits for a, b in zip(bounds, bounds[1:])]
    full_alone = [full(input_ids=ids[:, a:b], use_cache=False).logits for a, b in zip(bounds, bounds[1:])]
    assert all(not torch.allclose(x, y, atol=1e-3) for x, y in zip(alone[:2], full_alone[:2]))  # longer than 4
    patches = PatchSet("test")

    def hook(core):
        separate = per_sample(core, block_tokens=4)
        return lambda module, q, k, v, mask, *args, **kwargs: separate(module, q, k, v, None, *args, **kwargs)

    patches.replace_item(ALL_ATTENTION_FUNCTIONS, "sdpa", hook)
    try:
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    finally:
        patches.undo()
    torch.testing.assert_close(packed, torch.cat(alone, dim=1), rtol=1e-5, atol=1e-5)


# -- forms the split policy refuses --------------------------------------------------------------------------------
def _config(**fields):
    base = dict(num_hidden_layers=4, sliding_window=None, layer_types=None)
    return types.SimpleNamespace(**{**base, **fields})


def test_sliding_windows_full_layers_and_their_mix_are_taken():
    """sdpa and flash attentions take windows (per layer too); without a window any implementation is taken."""
    for implementation in ("sdpa", "flash_attention_2", "flash_attention_3", "kernels-community/flash-attn2"):
        check_attention_forms(_config(sliding_window=8), implementation)
        check_attention_forms(_config(sliding_window=8, layer_types=["full_attention", "sliding_attention"] * 2),
                              implementation)
    check_attention_forms(_config(), "my_attention")
    check_attention_forms(_config(sliding_window=8, layer_types=["full_attention"] * 4), "my_attention")
    check_attention_forms(_config(sliding_window=8, use_sliding_window=False), "my_attention")


def test_forms_that_cannot_be_honoured_are_refused_by_layer_and_field():
    with pytest.raises(ODCConfigError, match=r"layer 1: .*layer_types\[1\]='linear_attention'"):
        check_attention_forms(_config(layer_types=["full_attention", "linear_attention"] * 2), "sdpa")
    with pytest.raises(ODCConfigError, match=r"layers 1, 3: .*attention_chunk_size=16"):
        check_attention_forms(_config(attention_chunk_size=16,
                                      layer_types=["full_attention", "chunked_attention"] * 2), "sdpa")
    with pytest.raises(ODCConfigError, match=r"every layer: .*attention_chunk_size=16"):
        check_attention_forms(_config(attention_chunk_size=16), "flash_attention_2")
    with pytest.raises(ODCConfigError, match=r"layers 0, 2: .*sliding_window=8.*attn_implementation='my_attention'"):
        check_attention_forms(_config(sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2),
                              "my_attention")
    with pytest.raises(ODCConfigError, match=r"every layer: .*attn_logit_softcapping=50.0"):
        check_attention_forms(_config(attn_logit_softcapping=50.0), "sdpa")
    check_attention_forms(_config(attn_logit_softcapping=50.0), "flash_attention_2")  # flash takes softcap itself
    with pytest.raises(ODCConfigError, match=r"layers 0, 2: .*use_bidirectional_attention=True"):
        check_attention_forms(_config(sliding_window=8, use_bidirectional_attention=True,
                                      layer_types=["sliding_attention", "full_attention"] * 2), "sdpa")


def test_real_configs_are_refused_by_name():
    """transformers' own configs: Llama 4's chunked layers, Gemma 2's softcapping under sdpa, Qwen2's sliding layers
    (those from max_window_layers on) under an implementation that cannot take a window."""
    from transformers import Gemma2Config, Llama4TextConfig, Qwen2Config

    qwen2 = Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=8, max_window_layers=2)
    check_attention_forms(qwen2, "sdpa")
    with pytest.raises(ODCConfigError, match=r"layers 2, 3: sliding_window=8 with attn_implementation='my_attention'"):
        check_attention_forms(qwen2, "my_attention")

    with pytest.raises(ODCConfigError, match=r"layers 0, 1, 2: .*attention_chunk_size=8192"):
        check_attention_forms(Llama4TextConfig(num_hidden_layers=4), "sdpa")
    with pytest.raises(ODCConfigError, match=r"attn_logit_softcapping"):
        check_attention_forms(Gemma2Config(num_hidden_layers=2), "sdpa")


def test_enable_refuses_a_window_the_implementation_cannot_take_before_any_group():
    """The check runs inside the split runtime's enable() (at deepspeed.initialize), before any process group."""
    from transformers import MistralConfig, MistralForCausalLM

    from ds_odc.integration.split_attention import enable

    model = MistralForCausalLM(MistralConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2, sliding_window=8))
    model.config._attn_implementation = "my_attention"
    with pytest.raises(ODCConfigError, match=r"every layer: .*sliding_window=8.*'my_attention'"):
        enable(types.SimpleNamespace(module=model), None, None, 1.0)


def test_docstring_examples():
    import doctest

    from ds_odc.integration import packed_attention

    failures, tried = doctest.testmod(packed_attention)
    assert tried > 0 and failures == 0
