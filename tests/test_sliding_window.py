"""Sliding-window attention (shared/model/attention.py, shared/kernels/paged_attention_triton.py)
against transformers: the query at position p sees the keys at positions j with p - window < j <= p,
transformers' sliding_window_overlay (`kv_idx > q_idx - sliding_window`). The prefill against a
definition that takes its mask from transformers' own mask function, the paged decode (the CPU path
and the Triton kernel; fp32, int8 and float8 pages) against attention over each sequence's last window
tokens with the tokens before them poisoned, and a tiny Mistral's logits with its attention swapped
for ours, a prompt whole and in two chunks."""

from __future__ import annotations

import inspect
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run interpreted

pytest.importorskip("triton")

from transformers import MistralConfig, MistralForCausalLM
from transformers.masking_utils import sliding_window_causal_mask_function
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from shared.kernels import kv_quant
from shared.kernels.decode_tiling import Tiling
from shared.kernels.paged_attention_triton import (
    paged_decode_attention as triton_decode,
)
from shared.model import attention
from tests.test_paged_attention_triton import make_case, quantized

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
WINDOW = 20  # not a multiple of the 16-token pages
# The kernel runs compiled where there is a GPU, interpreted on the CPU otherwise.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def qkv(queries: int, keys: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(queries, HEADS, HEAD_DIM, generator=generator)
    k, v = (torch.randn(keys, KV_HEADS, HEAD_DIM, generator=generator) for _ in range(2))
    return q, k, v


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    """Softmax attention in float64, query t at position S - T + t, masked by transformers' own
    sliding-window causal mask function."""
    length, context = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(group, dim=1) for x in (k, v))
    scores = torch.einsum("thd,shd->hts", q.double(), k) * scale
    positions = torch.arange(context - length, context)[:, None]
    seen = sliding_window_causal_mask_function(window)(0, 0, positions, torch.arange(context)[None, :])
    return torch.einsum("hts,shd->thd", scores.masked_fill(~seen, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("queries, keys", [(40, 40), (8, 40), (1, 40), (16, 17), (5, 12)],
                         ids=["prompt", "later-chunk", "one-query", "chunk-straddling", "inside-window"])
def test_prefill_with_a_window_equals_the_definition(queries, keys):
    q, k, v = qkv(queries, keys)
    out = attention.prefill_attention(q, k, v, 0.3, window=WINDOW)
    torch.testing.assert_close(out.double(), reference(q, k, v, 0.3, WINDOW), atol=1e-5, rtol=1e-5)


def test_a_window_of_one_sees_only_its_own_key():
    q, k, v = qkv(6, 30)
    out = attention.masked_attention(q, k, v, 0.3, window=1)
    torch.testing.assert_close(out, v[-6:].repeat_interleave(HEADS // KV_HEADS, dim=1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("queries, keys", [(256, 256), (64, 1000)], ids=["prompt", "later-chunk"])
def test_prefill_with_a_window_on_the_gpu(queries, keys):
    """bf16 on the GPU, where a prefill inside its window goes through cuDNN and one past it does not."""
    q, k, v = (x.to("cuda", torch.bfloat16) for x in qkv(queries, keys))
    out = attention.prefill_attention(q, k, v, 0.25, window=100)
    exact = reference(q.cpu(), k.cpu(), v.cpu(), 0.25, 100)
    torch.testing.assert_close(out.cpu().double(), exact, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("queries, keys", [(40, 40), (8, 40)])
def test_window_zero_and_a_window_past_the_keys_change_nothing(queries, keys):
    q, k, v = qkv(queries, keys)
    today = attention.prefill_attention(q, k, v, 0.3)
    assert torch.equal(attention.prefill_attention(q, k, v, 0.3, window=0), today)
    assert torch.equal(attention.prefill_attention(q, k, v, 0.3, window=keys), today)
    torch.testing.assert_close(today.double(), reference(q, k, v, 0.3, keys), atol=1e-5, rtol=1e-5)


def poison_before_window(cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
                         window: int) -> torch.Tensor:
    """The cache with each sequence's tokens before its window set to NaN: a kernel that reads them shows it."""
    cache = cache.clone()
    page_size = cache.shape[1]
    for b, n in enumerate(seq_lens.tolist()):
        for t in range(max(0, n - window)):
            cache[page_table[b, t // page_size], t % page_size] = float("nan")
    return cache


def windowed_reference(q, k_cache, v_cache, page_table, seq_lens, scale, window):
    """Attention per sequence over its tokens seq_len - window .. seq_len - 1, gathered from the pages."""
    page_size = k_cache.shape[1]
    outs = []
    for b, n in enumerate(seq_lens.tolist()):
        pages = page_table[b, : -(-n // page_size)].long()
        k, v = (c[pages].flatten(0, 1)[max(0, n - window):n] for c in (k_cache, v_cache))
        outs.append(reference(q[b:b + 1], k, v, scale, window)[0])
    return torch.stack(outs).float()


def decode_case(seq_lens, window, kv_dtype, page_size=16):
    """(q, caches, scales or None, page_table, seq_lens, the reference) with the tokens before each
    window NaN (their scales too for quantized pages)."""
    q, k_cache, v_cache, page_table, lens = make_case(seq_lens, HEADS, KV_HEADS, 64, page_size, torch.float32, "cpu")
    k_cache, v_cache = (poison_before_window(c, page_table, lens, window) for c in (k_cache, v_cache))
    if kv_dtype is None:
        ref = windowed_reference(q, k_cache, v_cache, page_table, lens, 0.125, window)
        return q, (k_cache, v_cache), (None, None), page_table, lens, ref
    (k_values, k_scale), (v_values, v_scale) = quantized(k_cache, kv_dtype), quantized(v_cache, kv_dtype)
    ref = windowed_reference(q, kv_quant.dequantize(k_values, k_scale, torch.float32),
                             kv_quant.dequantize(v_values, v_scale, torch.float32), page_table, lens, 0.125, window)
    return q, (k_values, v_values), (k_scale, v_scale), page_table, lens, ref


def on_device(case):
    """decode_case's tensors (nested one level) on DEVICE."""
    def move(x):
        return x.to(DEVICE) if isinstance(x, torch.Tensor) else x
    return tuple(tuple(map(move, x)) if isinstance(x, tuple) else move(x) for x in case)


# Shorter than the window, the window's length, a token past it, one that starts inside a tile and
# ends in the next, and a long one whose window starts inside a later tile.
SEQ_LENS = [5, 20, 21, 37, 100, 150]
# Quantized pages are computed in fp16 against their dequantized values (tests/test_paged_attention_triton.py).
TOL = {"fp32": {"atol": 1e-4, "rtol": 1e-4}, "quantized": {"atol": 2e-3, "rtol": 2e-3}}


@pytest.mark.parametrize("kv_dtype", [None, torch.int8, torch.float8_e4m3fn], ids=["fp32", "int8", "fp8"])
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_triton_decode_reads_only_the_window(kv_dtype, num_splits):
    q, caches, scales, page_table, lens, ref = on_device(decode_case(SEQ_LENS, WINDOW, kv_dtype))
    out = triton_decode(q, *caches, page_table, lens, 0.125, *scales, num_splits=num_splits, window=WINDOW)
    torch.testing.assert_close(out, ref, **TOL["fp32" if kv_dtype is None else "quantized"])


@pytest.mark.parametrize("page_size, tiling", [(16, Tiling(32, 4, 2)), (24, Tiling(64, 4, 2))],
                         ids=["page16-n32", "page24-n64"])
def test_triton_decode_over_a_window_of_several_tiles(page_size, tiling):
    """A window of 100 over 300 tokens, split in 3: the first tile masked below the window, full
    tiles, a last partial one, an empty split; pages of 24 straddle the tiles."""
    q, caches, scales, page_table, lens, ref = on_device(decode_case([300, 90, 161], 100, torch.int8, page_size))
    out = triton_decode(q, *caches, page_table, lens, 0.125, *scales, num_splits=3, tiling=tiling, window=100)
    torch.testing.assert_close(out, ref, **TOL["quantized"])


@pytest.mark.parametrize("kv_dtype", [None, torch.int8], ids=["fp32", "int8"])
def test_cpu_decode_reads_only_the_window(kv_dtype):
    """The CPU path masks rather than skips: the poisoned tokens are zeroed first (SDPA turns a
    masked NaN into NaN), which a leak would still show as a score of 0 in the softmax."""
    q, caches, scales, page_table, lens, ref = decode_case(SEQ_LENS, WINDOW, kv_dtype)
    caches = tuple(c.nan_to_num() if kv_dtype is None else c for c in caches)
    scales = tuple(s.nan_to_num() if s is not None else None for s in scales)
    out = attention.paged_decode_attention(q, *caches, page_table.long(), lens.long(), 0.125, *scales, window=WINDOW)
    torch.testing.assert_close(out, ref, **TOL["fp32" if kv_dtype is None else "quantized"])


def test_decode_window_zero_changes_nothing():
    case = make_case([5, 37, 100], HEADS, KV_HEADS, 64, 16, torch.float32, DEVICE)
    assert torch.equal(triton_decode(*case, 0.125, num_splits=2, window=0), triton_decode(*case, 0.125, num_splits=2))
    q, k_cache, v_cache, page_table, lens = (x.cpu() for x in case)
    k_cache, v_cache = k_cache.nan_to_num(), v_cache.nan_to_num()
    assert torch.equal(attention.paged_decode_attention(q, k_cache, v_cache, page_table, lens, 0.125, window=0),
                       attention.paged_decode_attention(q, k_cache, v_cache, page_table, lens, 0.125))


def pdserve_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, sliding_window=None, **_):
    """transformers' attention interface over prefill_attention: [1, H, T, D] q, [1, KVH, S, D] k/v,
    the window as Mistral passes it to every layer (`sliding_window=config.sliding_window`)."""
    out = attention.prefill_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                                      scaling, window=sliding_window or 0)
    return out.unsqueeze(0), None


def test_a_mistral_with_our_attention_gives_transformers_logits(monkeypatch):
    """A prompt of 60 tokens with a window of 24: whole, and in chunks of 40 and 20 through the
    cache (the second chunk's queries are the last rows of its keys, as the prefill chunks run)."""
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           sliding_window=24)
    model = MistralForCausalLM(config).eval()
    model.set_attn_implementation("eager")
    ids = torch.randint(0, 1000, (1, 60))
    with torch.no_grad():
        expected = model(ids).logits
        monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "pdserve", pdserve_attention)
        model.set_attn_implementation("pdserve")
        whole = model(ids).logits
        first = model(ids[:, :40], use_cache=True)
        # transformers renamed forward's past_key_values to cache (5.25 has the new name, the H200's 5.17 the old).
        cache = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        second = model(ids[:, 40:], **{cache: first.past_key_values}, use_cache=True).logits
    torch.testing.assert_close(whole, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([first.logits, second], dim=1), expected, atol=1e-5, rtol=1e-5)
    unwindowed = MistralForCausalLM(MistralConfig(**{**config.to_dict(), "sliding_window": None})).eval()
    unwindowed.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert not torch.allclose(unwindowed(ids).logits[:, 30:], expected[:, 30:], atol=1e-3)
