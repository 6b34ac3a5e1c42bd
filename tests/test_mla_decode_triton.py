"""mla_decode_attention (the Triton kernel) against mla_decode_reference (its PyTorch path), and the
reference against the definition written out per sequence in float64.

Without CUDA the kernel runs in Triton's CPU interpreter over small latents (R=64, Dr=32), its
products in fp32 there; with CUDA the same cases run compiled, plus DeepSeek's shape (R=512, Dr=64,
16 and 128 heads) at contexts up to 8K and a CUDA graph replayed over other lengths and pages.
Every case's pages are shuffled and strided; the slots past each sequence and the pages it does not
own hold NaN (their scales too, where quantized), so a read past seq_len shows up.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before triton is imported: @triton.jit picks the interpreter at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from shared.kernels import kv_quant
from shared.kernels.mla_decode_triton import (
    MlaTiling,
    auto_num_splits,
    default_tiling,
    mla_decode_attention,
    mla_decode_reference,
)
from shared.kernels.split_merge_triton import MERGE_HERE_SPLITS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RANK, ROPE = 64, 32
KV_DTYPES = [None, torch.int8, torch.float8_e4m3fn]
KV_IDS = ["unquantized", "int8", "fp8"]
# fp32: exact products (ieee on the GPU, fp32 in the interpreter). bf16: the output rounded to 8
# significant bits, and on the GPU the probabilities too.
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2},
       torch.float16: {"atol": 2e-3, "rtol": 2e-3}}


def make_case(seq_lens, heads, page_size=16, dtype=torch.float32, kv_dtype=None, rank=RANK, rope=ROPE,
              device=DEVICE, seed=0):
    """Queries, a latent cache and its scales (None unquantized), page table and lengths, made on
    `device`. The cache is every other page of a larger buffer, so its page stride is not its page's
    size; the pages are shuffled across sequences, and each row's padding names an unowned page."""
    gen = torch.Generator(device).manual_seed(seed)
    pages_per_seq = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_per_seq) + 3
    buffer = torch.full((num_pages, 2, page_size, 1, rank + rope), float("nan"), device=device)
    page_table = torch.full((len(seq_lens), max(pages_per_seq) + 2), num_pages - 1, dtype=torch.int32, device=device)
    order = torch.randperm(num_pages - 3, generator=gen, device=device)
    for b, (n, count) in enumerate(zip(seq_lens, pages_per_seq)):
        pages, order = order[:count], order[count:]
        page_table[b, :count] = pages
        latent = torch.randn(count * page_size, 1, rank + rope, generator=gen, device=device)
        latent[n:] = float("nan")
        buffer[pages, 0] = latent.view(count, page_size, 1, rank + rope)
    if kv_dtype is None:
        cache, scales = buffer.to(dtype)[:, 0], None
    else:
        values, scales = kv_quant.quantize(buffer.nan_to_num(), kv_dtype)
        scales[buffer.isnan().any(-1)] = float("nan")
        cache, scales = values[:, 0], scales[:, 0]
    q_latent = torch.randn(len(seq_lens), heads, rank, generator=gen, device=device).to(dtype)
    q_rope = torch.randn(len(seq_lens), heads, rope, generator=gen, device=device).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return q_latent, q_rope, cache, scales, page_table, lens


def definition(q_latent, q_rope, cache, scales, page_table, seq_lens, scale, window=0):
    """The attention of each sequence over its own tokens, in float64: its pages concatenated,
    dequantized, cut to its length and window."""
    rank, page_size = q_latent.shape[-1], cache.shape[1]
    outs = []
    for b, n in enumerate(seq_lens.tolist()):
        pages = page_table[b, : -(-n // page_size)].tolist()
        rows = torch.cat([cache[p, :, 0] for p in pages]).double()
        if scales is not None:
            rows *= torch.cat([scales[p, :, 0] for p in pages]).double()[:, None]
        rows = rows[max(n - window, 0) if window else 0: n]
        c, k_rope = rows[:, :rank], rows[:, rank:]
        scores = scale * (q_latent[b].double() @ c.T + q_rope[b].double() @ k_rope.T)
        outs.append(torch.softmax(scores, dim=-1) @ c)
    return torch.stack(outs)


def check(seq_lens, heads, page_size=16, dtype=torch.float32, kv_dtype=None, num_splits=None, window=0,
          tiling=None, rank=RANK, rope=ROPE):
    """The kernel against the reference over one case; returns the kernel's output."""
    case = make_case(seq_lens, heads, page_size, dtype, kv_dtype, rank, rope)
    scale = (rank + rope) ** -0.5
    out = mla_decode_attention(*case, scale, window=window, num_splits=num_splits, tiling=tiling)
    assert out.shape == case[0].shape and out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), mla_decode_reference(*case, scale, window).float(), **TOL[dtype])
    return out


# Lengths: 1, within a page, past several pages and not a multiple of the page, and one full page.
LENGTHS = {16: [1, 37, 100, 48], 64: [1, 70, 200, 128]}


@pytest.mark.parametrize("window", [0, 45], ids=["all", "window45"])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=KV_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_matches_the_definition(dtype, kv_dtype, page_size, window):
    case = make_case(LENGTHS[page_size], 6, page_size, dtype, kv_dtype)
    out = mla_decode_reference(*case, 0.1, window)
    assert out.shape == case[0].shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), definition(*case, 0.1, window), **TOL[dtype], check_dtype=False)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=KV_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_matches_reference(dtype, kv_dtype, page_size, num_splits):
    check(LENGTHS[page_size], 16, page_size, dtype, kv_dtype, num_splits)


@pytest.mark.parametrize("num_splits", [2, 5, 16, None], ids=["2", "5", "16-some-empty", "default"])
def test_num_splits(num_splits):
    """16 splits of 100 tokens leave most splits empty: they must weigh nothing in the merge."""
    check([100, 1, 333], 16, num_splits=num_splits, kv_dtype=torch.int8)


@pytest.mark.parametrize("num_splits", [MERGE_HERE_SPLITS + 1, 40, None],
                         ids=["first-merged-apart", "40-more-than-a-load", "default"])
def test_many_splits_merged_by_a_launch_of_their_own(num_splits):
    """Past MERGE_HERE_SPLITS the partials go to merge_splits: a long sequence beside short ones
    (most of their splits empty), 40 splits two loads of the merge's, and the default for a long
    context at batch 1, which lifts the paged kernel's cap of 64."""
    seq_lens = [5000, 1, 333]
    if num_splits is None:
        assert auto_num_splits(1, 1, 524288, 0, default_tiling(16), torch.device(DEVICE)) > 64
        seq_lens = [5000]
        assert auto_num_splits(1, 1, 5000, 0, default_tiling(16), torch.device(DEVICE)) > MERGE_HERE_SPLITS
    check(seq_lens, 16, num_splits=num_splits, kv_dtype=torch.int8)


@pytest.mark.parametrize("window", [1, 20, 64, 1000])
@pytest.mark.parametrize("kv_dtype", [None, torch.int8], ids=["unquantized", "int8"])
def test_window(kv_dtype, window):
    """Windows that start inside a tile and a page, on a tile's edge, and one longer than every
    sequence; 3 splits of the window, the first starting before it."""
    check([1, 37, 300], 16, kv_dtype=kv_dtype, num_splits=3, window=window)


@pytest.mark.parametrize("heads,tiling", [(1, None), (20, None), (128, None), (40, MlaTiling(16, 32, 4, 2))],
                         ids=["1-head", "20-in-one-block", "128-two-blocks", "40-in-blocks-of-16"])
def test_heads_not_a_multiple_of_the_block(heads, tiling):
    check([1, 77, 150], heads, num_splits=2, tiling=tiling, dtype=torch.bfloat16)


@pytest.mark.parametrize("page_size,block_n", [(16, 64), (64, 16)], ids=["4-pages-a-tile", "4-tiles-a-page"])
def test_tiles_and_pages(page_size, block_n):
    check([1, 70, 200], 16, page_size, kv_dtype=torch.float8_e4m3fn, num_splits=2,
          tiling=MlaTiling(16, block_n, 4, 2))


def test_larger_latent():
    check([3, 130], 16, kv_dtype=torch.int8, num_splits=2, rank=128, rope=64)


def test_a_latent_wider_than_the_merges_columns():
    """The last split's program merges 128 latent columns at a time: 256 take two passes."""
    check([3, 130], 16, num_splits=3, rank=256, rope=64)


def test_float16_queries():
    check([1, 90], 16, dtype=torch.float16, kv_dtype=torch.int8, num_splits=2)


def test_default_tiling():
    assert default_tiling(16).block_h == 16 and default_tiling(128).block_h == 64
    assert default_tiling(16, quantized=True).num_stages == 5 and default_tiling(16).num_stages == 2
    for tiling in (default_tiling(16), default_tiling(16, quantized=True), default_tiling(128)):
        # The [BLOCK_N, 576] bf16 tile per pipeline stage and the queries fit H200's 228 KB of shared memory.
        assert tiling.num_stages * tiling.block_n * 576 * 2 + tiling.block_h * 576 * 2 < 228 * 1024


def test_bad_inputs():
    q_latent, q_rope, cache, scales, page_table, lens = make_case([20], 4, kv_dtype=torch.int8)
    with pytest.raises(ValueError, match="in q's dtype"):
        mla_decode_attention(q_latent, q_rope, cache, None, page_table, lens, 0.1)
    with pytest.raises(ValueError, match="cache_scale"):
        mla_decode_attention(q_latent, q_rope, cache, scales.double(), page_table, lens, 0.1)
    with pytest.raises(ValueError, match="int32"):
        mla_decode_attention(q_latent, q_rope, cache, scales, page_table.long(), lens, 0.1)
    with pytest.raises(ValueError, match="q_rope"):
        mla_decode_attention(q_latent, q_rope[:, :2], cache, scales, page_table, lens, 0.1)
    with pytest.raises(ValueError, match="cache"):
        mla_decode_attention(q_latent, q_rope[:, :, :16], cache, scales, page_table, lens, 0.1)
    with pytest.raises(ValueError, match="power of two"):
        mla_decode_attention(q_latent[:, :, :48], q_rope, cache[..., 16:], scales, page_table, lens, 0.1)
    with pytest.raises(ValueError, match="window"):
        mla_decode_attention(q_latent, q_rope, cache, scales, page_table, lens, 0.1, window=-1)
    with pytest.raises(ValueError, match="products must be one of"):
        mla_decode_attention(q_latent, q_rope, cache, scales, page_table, lens, 0.1, products="bf16")


compiled_gpu = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                  reason="needs CUDA with compiled (not interpreted) Triton")
# DeepSeek's latent: kv_lora_rank 512, qk_rope_head_dim 64, and its softmax scale 1/sqrt(128 + 64).
REAL = {"rank": 512, "rope": 64}
REAL_SCALE = 192 ** -0.5
BATCH_64 = [8192, 1, 4097, 300, 8000, 17, 2048, 6000] * 8


@pytest.mark.gpu
@compiled_gpu
@pytest.mark.parametrize("seq_lens", [[8192], BATCH_64], ids=["b1-8K", "b64-mixed"])
@pytest.mark.parametrize("heads", [16, 128], ids=["V2-Lite-16", "V3-128"])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=KV_IDS)
def test_deepseek_shape_cuda(kv_dtype, heads, seq_lens):
    case = make_case(seq_lens, heads, 64, torch.bfloat16, kv_dtype, **REAL)
    out = mla_decode_attention(*case, REAL_SCALE)
    ref = mla_decode_reference(*case, REAL_SCALE).float()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, **TOL[torch.bfloat16])
    assert (out.float() - ref).norm() / ref.norm() < 5e-3


@pytest.mark.gpu
@compiled_gpu
@pytest.mark.parametrize("tiling", [MlaTiling(16, 64, 4, 2), MlaTiling(16, 32, 4, 3), MlaTiling(16, 32, 4, 5),
                                    MlaTiling(16, 32, 8, 2)], ids=str)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=KV_IDS)
def test_benchmarked_tilings_cuda(kv_dtype, tiling):
    """Every tiling loadtest/engine/bench_latent_decode_attention.py times computes the same, compiled
    (5 stages: Triton 3.6 double-buffers the tiles)."""
    case = make_case(BATCH_64[:8], 16, 64, torch.bfloat16, kv_dtype, **REAL)
    out = mla_decode_attention(*case, REAL_SCALE, num_splits=3, tiling=tiling)
    torch.testing.assert_close(out.float(), mla_decode_reference(*case, REAL_SCALE).float(), **TOL[torch.bfloat16])


@pytest.mark.gpu
@compiled_gpu
@pytest.mark.parametrize("products", ["fp16", "native"], ids=["fp16-default", "bf16-benchmarks-baseline"])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES[1:], ids=KV_IDS[1:])
def test_quantized_pages_either_products(kv_dtype, products):
    """Quantized pages through fp16 products (the default, the values converted as loaded) and
    through bf16 ones (the benchmark's baseline), both against the reference."""
    case = make_case(BATCH_64[:8], 16, 64, torch.bfloat16, kv_dtype, **REAL)
    out = mla_decode_attention(*case, REAL_SCALE, products=products)
    ref = mla_decode_reference(*case, REAL_SCALE).float()
    torch.testing.assert_close(out.float(), ref, **TOL[torch.bfloat16])


@pytest.mark.gpu
@compiled_gpu
@pytest.mark.parametrize("window", [4096, 0], ids=["window-merged-here", "whole-merged-apart"])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=KV_IDS)
def test_cuda_graph_replay_follows_the_inputs(kv_dtype, window):
    """Captured once with one batch's queries, lengths and pages, replayed with another's: the grid
    and the splits are fixed by the shapes, the lengths and pages are read on the device. The
    window's splits are merged by the last split program, the whole context's (19 splits) by
    merge_splits."""
    case = make_case([5000, 4999, 3000, 1], 128, 16, torch.bfloat16, kv_dtype, **REAL)
    q_latent, q_rope, _, _, page_table, lens = case
    lens.copy_(torch.tensor([5000, 17, 3000, 1], dtype=torch.int32))
    mla_decode_attention(*case, REAL_SCALE, window=window)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mla_decode_attention(*case, REAL_SCALE, window=window)
    # Each row takes the next row's pages, at a length they hold.
    page_table.copy_(page_table.roll(-1, 0))
    lens.copy_(torch.tensor([4999, 2999, 1, 4097], dtype=torch.int32))
    q_latent.copy_(torch.randn_like(q_latent))
    q_rope.copy_(torch.randn_like(q_rope))
    graph.replay()
    torch.testing.assert_close(out.float(), mla_decode_reference(*case, REAL_SCALE, window).float(),
                               **TOL[torch.bfloat16])
