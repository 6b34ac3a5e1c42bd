"""paged_decode_attention against SDPA on the gathered, contiguous K/V; quantized caches against
SDPA on the same caches dequantized by shared/kernels/kv_quant.py, and the CPU path's own dequantization.

Without CUDA the kernels run in Triton's CPU interpreter (fp32 and bf16, small shapes); with CUDA
the same cases run compiled on the GPU, plus bf16 cases at serving size. Quantized pages are
computed with q rounded to fp16 (float8_e4m3 pages) or written as two int8 terms (int8 pages) and the
probabilities in fp16, so they are held to fp16's precision; with fp8_query q and the probabilities
are e4m3, held to a relative error.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before triton is imported: @triton.jit picks the interpreter at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from shared.kernels import kv_quant  # noqa: E402
from shared.kernels.decode_tiling import (  # noqa: E402
    DEFAULT_TILING, LARGE_BATCH, LARGE_BATCH_TILING, LONG_CONTEXT, MANY_SEQUENCES, MANY_SEQUENCES_TILING, Tiling,
    default_tiling,
)
from shared.kernels.paged_attention_triton import (  # noqa: E402
    _choose_num_splits, compute_mode, paged_decode_attention,
)
from shared.model import attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp16 products: q and the probabilities rounded to 11 significant bits.
FP16_TOL = {"atol": 2e-3, "rtol": 2e-3}
# A bf16 output is rounded to 8 significant bits.
BF16_TOL = {"atol": 2e-2, "rtol": 2e-2}


def make_case(seq_lens, num_heads, num_kv_heads, head_dim, page_size, dtype, device, seed=0):
    """Random q and a paged cache whose pages are shuffled across sequences; the unused tail slots
    of each last page and every unowned page hold NaN, so reading past seq_len shows up."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    pages_per_seq = [-(-n // page_size) for n in seq_lens]
    max_pages = max(pages_per_seq) + 1  # one column of padding past the longest sequence
    num_pages = sum(pages_per_seq) + 3
    k_cache = torch.full((num_pages, page_size, num_kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    page_table = torch.zeros((batch, max_pages), dtype=torch.int32)
    perm = torch.randperm(num_pages, generator=gen)
    used = 0
    for b, (n, p) in enumerate(zip(seq_lens, pages_per_seq)):
        pages = perm[used:used + p]
        used += p
        page_table[b, :p] = pages
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        for i, page in enumerate(pages.tolist()):
            chunk = slice(i * page_size, min((i + 1) * page_size, n))
            k_cache[page, : chunk.stop - chunk.start] = k[chunk]
            v_cache[page, : chunk.stop - chunk.start] = v[chunk]
    q = torch.randn(batch, num_heads, head_dim, generator=gen)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    return (q.to(device, dtype), k_cache.to(device, dtype), v_cache.to(device, dtype),
            page_table.to(device), seq_lens_t.to(device))


def reference(q, k_cache, v_cache, page_table, seq_lens, scale):
    """fp32 SDPA per sequence over K/V gathered into contiguous [H, L, D]."""
    num_heads = q.shape[1]
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    outs = []
    for b, n in enumerate(seq_lens.tolist()):
        pages = page_table[b, : -(-n // page_size)].long()
        k = k_cache[pages].flatten(0, 1)[:n].float().transpose(0, 1).repeat_interleave(group, dim=0)
        v = v_cache[pages].flatten(0, 1)[:n].float().transpose(0, 1).repeat_interleave(group, dim=0)
        o = torch.nn.functional.scaled_dot_product_attention(q[b].float().unsqueeze(1), k, v, scale=scale)
        outs.append(o.squeeze(1))
    return torch.stack(outs)


def check(seq_lens, num_heads, num_kv_heads, head_dim, num_splits, page_size=16):
    q, k_cache, v_cache, page_table, seq_lens_t = make_case(
        seq_lens, num_heads, num_kv_heads, head_dim, page_size, torch.float32, DEVICE)
    scale = head_dim ** -0.5
    out = paged_decode_attention(q, k_cache, v_cache, page_table, seq_lens_t, scale, num_splits=num_splits)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = reference(q, k_cache, v_cache, page_table, seq_lens_t, scale)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def quantized(cache, kv_dtype):
    """The cache in kv_dtype with its scales; the slots that hold NaN get a NaN scale, so reading
    past seq_len still shows up."""
    values, scales = kv_quant.quantize(torch.nan_to_num(cache.float()), kv_dtype)
    scales[cache.isnan().any(-1)] = float("nan")
    return values, scales


def check_quantized(seq_lens, num_heads, num_kv_heads, head_dim, num_splits, kv_dtype, dtype=torch.float32,
                    device=DEVICE, tol=None, page_size=16, tiling=None, value_size=1.0):
    """The kernel over quantized pages against SDPA over the same pages dequantized; value_size
    multiplies V before it is quantized (its scales shrink with it)."""
    q, k_cache, v_cache, page_table, seq_lens_t = make_case(
        seq_lens, num_heads, num_kv_heads, head_dim, page_size, dtype, device)
    (k_values, k_scale), (v_values, v_scale) = quantized(k_cache, kv_dtype), quantized(v_cache * value_size, kv_dtype)
    scale = head_dim ** -0.5
    out = paged_decode_attention(q, k_values, v_values, page_table, seq_lens_t, scale, k_scale, v_scale,
                                 num_splits=num_splits, tiling=tiling)
    assert out.shape == q.shape and out.dtype == q.dtype and torch.isfinite(out).all()
    ref = reference(q, kv_quant.dequantize(k_values, k_scale, torch.float32),
                    kv_quant.dequantize(v_values, v_scale, torch.float32), page_table, seq_lens_t, scale)
    torch.testing.assert_close(out.float(), ref, **(tol or FP16_TOL))
    return q, (k_values, k_scale, v_values, v_scale), page_table, seq_lens_t, ref


# seq_lens for batch 1 and 3; none of them fills its last 16-token page except where noted.
@pytest.mark.parametrize("seq_lens", [[1], [17], [100], [100, 1, 17], [33, 100, 64]],
                         ids=["b1-L1", "b1-L17", "b1-L100", "b3-mixed", "b3-full-page"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (6, 2), (4, 1)], ids=["mha", "gqa3", "gqa4"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_matches_sdpa_d64(seq_lens, num_heads, num_kv_heads, num_splits):
    check(seq_lens, num_heads, num_kv_heads, 64, num_splits)


@pytest.mark.parametrize("seq_lens", [[17], [100, 1, 17]], ids=["b1-L17", "b3-mixed"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (3, 1), (8, 2)], ids=["mha", "gqa3", "gqa4"])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_matches_sdpa_d128(seq_lens, num_heads, num_kv_heads, num_splits):
    check(seq_lens, num_heads, num_kv_heads, 128, num_splits)


def test_more_splits_than_blocks():
    # 7 splits over 100 tokens: most splits are empty and must drop out of the reduction.
    check([100, 5], 4, 1, 64, num_splits=7)


def test_page_size_32_gqa8():
    check([45, 70], 8, 1, 64, num_splits=2, page_size=32)


def test_the_last_split_merges_and_leaves_the_counters_at_zero():
    """The splits' merge is done by whichever program of a (sequence, kv head) finishes last, counted
    in a buffer that a CUDA graph replays over: each call must leave it at zero, or the next call
    would merge at the wrong count (or never) and return what its output held before."""
    from shared.kernels.split_merge_triton import split_counters

    q, k_cache, v_cache, page_table, seq_lens = make_case([100, 40, 71], 8, 2, 64, 16, torch.float32, DEVICE)
    expected = reference(q, k_cache, v_cache, page_table, seq_lens, 0.125)
    for _ in range(3):
        out = paged_decode_attention(q, k_cache, v_cache, page_table, seq_lens, 0.125, num_splits=4)
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
        assert not split_counters(q.device, 6).any()


@pytest.mark.parametrize("merge_here", [True, False], ids=["by-the-last-split", "by-a-launch"])
def test_many_splits_merged_either_way(merge_here):
    """Past MERGE_HERE_SPLITS a launch of its own merges the splits: both ways give the same
    output, with splits left empty by the short sequences."""
    q, k_cache, v_cache, page_table, seq_lens = make_case([1000, 40, 333], 8, 2, 64, 16, torch.float32, DEVICE)
    out = paged_decode_attention(q, k_cache, v_cache, page_table, seq_lens, 0.125, num_splits=20,
                                 merge_here=merge_here)
    torch.testing.assert_close(out, reference(q, k_cache, v_cache, page_table, seq_lens, 0.125), atol=1e-4, rtol=1e-4)


def test_default_num_splits():
    check([100, 1, 17], 4, 1, 64, num_splits=None)


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("seq_lens,num_heads,num_kv_heads,head_dim,num_splits",
                         [([1], 2, 2, 64, 1), ([100, 1, 17], 6, 2, 64, 3), ([33, 100], 8, 2, 128, 2)],
                         ids=["b1-L1-mha", "b3-gqa3-split3", "b2-gqa4-d128"])
def test_quantized_matches_sdpa_on_the_dequantized_cache(kv_dtype, seq_lens, num_heads, num_kv_heads, head_dim,
                                                         num_splits):
    check_quantized(seq_lens, num_heads, num_kv_heads, head_dim, num_splits, kv_dtype)


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=str)
def test_the_cpu_path_dequantizes_as_the_kernel(kv_dtype):
    """shared/model/attention.py on the CPU, the decode's path there, over the same quantized pages."""
    q, caches, page_table, seq_lens, ref = check_quantized([100, 1, 17], 6, 2, 64, 2, kv_dtype)
    k_values, k_scale, v_values, v_scale = (t.cpu() for t in caches)
    out = attention.paged_decode_attention(q.cpu(), k_values, v_values, page_table.cpu().long(), seq_lens.cpu().long(),
                                           64 ** -0.5, k_scale.nan_to_num(), v_scale.nan_to_num())
    torch.testing.assert_close(out, ref.cpu(), **FP16_TOL)


# bf16 q as the GPU runs it: odd lengths, many splits, a batch of mixed lengths.
@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("seq_lens,num_splits", [([1, 333, 64, 129], 5), ([517], 9), ([200, 3], None)],
                         ids=["b4-mixed-split5", "b1-L517-split9", "b2-default"])
def test_quantized_bf16_query(kv_dtype, seq_lens, num_splits):
    check_quantized(seq_lens, 8, 2, 64, num_splits, kv_dtype, torch.bfloat16, tol=BF16_TOL)


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=str)
def test_quantized_tiny_values_keep_their_precision(kv_dtype):
    """V of size 1e-4 has scales near 1e-6: probabilities times scales would fall below fp16's
    normal range, so the kernel weighs them by the scales over the largest weight so far."""
    check_quantized([700, 90], 4, 1, 64, 2, kv_dtype, value_size=1e-4, tol={"atol": 2e-7, "rtol": 2e-3})


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=str)
def test_v_scales_of_every_size_and_rows_of_zeros(kv_dtype):
    """Tokens whose V differ by 1e10 in size, and rows of zeros (scale 0), in one sequence and tile:
    the softmax's sum stays the plain one whatever weights the scales give."""
    generator = torch.Generator().manual_seed(3)
    sizes = 10.0 ** (torch.rand((16, 1, 1), generator=generator) * 10 - 8)  # by slot of a page
    sizes[[3, 11]] = 0.0
    check_quantized([300, 517], 4, 1, 64, 3, kv_dtype, value_size=sizes, tol={"atol": 1e-3, "rtol": 2e-3})


@pytest.mark.parametrize("page_size", [24, 128], ids=["page24", "page128"])
@pytest.mark.parametrize("kv_dtype", [None, torch.int8], ids=["unquantized", "int8"])
def test_pages_that_do_not_divide_the_tile(page_size, kv_dtype):
    """Pages of 24 tokens straddle the 64-token tiles, pages of 128 hold two: each row's slot is
    computed per tile then, not once."""
    if kv_dtype is None:
        check([300, 77], 4, 2, 64, num_splits=2, page_size=page_size)
    else:
        check_quantized([300, 77], 4, 2, 64, 2, kv_dtype, page_size=page_size)


def test_default_tiling_by_batch_and_page_table_width():
    """128-token tiles from batch 8 up, and below where the page table spans LONG_CONTEXT tokens;
    quantized ones double-buffered (5 stages) there, but from MANY_SEQUENCES on."""
    for mode in ("native", "fp16", "int8_query"):
        assert default_tiling(mode, 1, 131072) == DEFAULT_TILING[mode] != LARGE_BATCH_TILING[mode]
        assert default_tiling(mode, 1, LONG_CONTEXT) == LARGE_BATCH_TILING[mode]
        assert default_tiling(mode, LARGE_BATCH - 1, LONG_CONTEXT - 16) == DEFAULT_TILING[mode]
        assert default_tiling(mode, LARGE_BATCH, 1024) == LARGE_BATCH_TILING[mode]
        assert default_tiling(mode, MANY_SEQUENCES, 1024) == MANY_SEQUENCES_TILING[mode]
        assert MANY_SEQUENCES_TILING[mode].block_n == 128
    assert LARGE_BATCH_TILING["native"].block_n == 128 and DEFAULT_TILING["fp16"].block_n == 64
    for mode in ("fp16", "int8_query"):
        assert LARGE_BATCH_TILING[mode].num_stages == 5 and MANY_SEQUENCES_TILING[mode].num_stages == 2


@pytest.mark.parametrize("tiling", [Tiling(32, 4, 2), Tiling(128, 8, 3)], ids=["n32", "n128-w8"])
def test_other_tilings(tiling):
    """The tilings loadtest/engine/bench_kv_quant_speed.py sweeps compute the same."""
    check_quantized([300, 1, 65], 8, 2, 64, 3, torch.int8, tiling=tiling)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_query(dtype):
    """q and the probabilities in e4m3 too: three mantissa bits, so a relative error of a few
    percent, against well under one for fp16 products on the same pages."""
    q, k_cache, v_cache, page_table, seq_lens = make_case([100, 1, 37], 8, 2, 64, 16, dtype, DEVICE)
    (k_values, k_scale), (v_values, v_scale) = (quantized(c, torch.float8_e4m3fn) for c in (k_cache, v_cache))
    ref = reference(q, kv_quant.dequantize(k_values, k_scale, torch.float32),
                    kv_quant.dequantize(v_values, v_scale, torch.float32), page_table, seq_lens, 0.125)
    out = paged_decode_attention(q, k_values, v_values, page_table, seq_lens, 0.125, k_scale, v_scale,
                                 num_splits=3, fp8_query=True)
    assert out.shape == q.shape and out.dtype == q.dtype and torch.isfinite(out).all()
    error = (out.float() - ref).norm() / ref.norm()
    assert 1e-3 < error < 0.05
    with pytest.raises(ValueError, match="float8_e4m3fn pages"):
        (int8_k, int8_ks), (int8_v, int8_vs) = (quantized(c, torch.int8) for c in (k_cache, v_cache))
        paged_decode_attention(q, int8_k, int8_v, page_table, seq_lens, 0.125, int8_ks, int8_vs, fp8_query=True)


def test_int8_query_keeps_small_query_components():
    """int8 pages take the int8-query mode, whose q's low term carries what its high term rounds
    off: with one component 200 times the size of the others, one int8 term would round most of
    them to 0 or +-1 step (the output off by about 5e-2); two keep it within fp16's tolerance."""
    q, k_cache, v_cache, page_table, seq_lens = make_case([64], 4, 1, 64, 16, torch.float32, DEVICE)
    q[:, :, 1:] *= 0.05  # their scores spread by about 0.5 across the tokens
    q[:, :, 0] = 10.0
    k_cache[..., 0] = 1.0  # the large component adds about the same score to every token
    (k_values, k_scale), (v_values, v_scale) = (quantized(c, torch.int8) for c in (k_cache, v_cache))
    ref = reference(q, kv_quant.dequantize(k_values, k_scale, torch.float32),
                    kv_quant.dequantize(v_values, v_scale, torch.float32), page_table, seq_lens, 1.0)
    assert compute_mode(q, k_values, fp8_query=False) == "int8_query"
    out = paged_decode_attention(q, k_values, v_values, page_table, seq_lens, 1.0, k_scale, v_scale)
    torch.testing.assert_close(out.float(), ref, **FP16_TOL)


def test_quantized_caches_need_both_scales():
    q, k_cache, v_cache, page_table, seq_lens = make_case([17], 2, 2, 64, 16, torch.float32, DEVICE)
    (k_values, k_scale), (v_values, v_scale) = quantized(k_cache, torch.int8), quantized(v_cache, torch.int8)
    with pytest.raises(ValueError, match="dtype mismatch"):
        paged_decode_attention(q, k_values, v_values, page_table, seq_lens, 0.125)
    with pytest.raises(ValueError, match="v_scale"):
        paged_decode_attention(q, k_values, v_values, page_table, seq_lens, 0.125, k_scale, None)
    with pytest.raises(ValueError, match="int8 or float8_e4m3fn"):
        paged_decode_attention(q, k_cache, v_cache, page_table, seq_lens, 0.125, k_scale, v_scale)


def test_choose_num_splits_fills_gpu():
    # Small batch, long context: enough programs for every one of 132 SMs, in one wave of two per SM.
    for context in (32768, 524288):
        splits = _choose_num_splits(batch=1, num_kv_heads=8, max_context=context, num_sms=132)
        assert 132 <= 8 * splits <= 2 * 132
    assert _choose_num_splits(batch=8, num_kv_heads=8, max_context=131072, num_sms=132) == 4
    # Batch 32 x 8 kv heads already fills the GPU: unsplit, as are larger batches.
    for batch in (32, 64):
        assert _choose_num_splits(batch=batch, num_kv_heads=8, max_context=32768, num_sms=132) == 1
    # Short context: chunks are not cut below a useful size.
    assert _choose_num_splits(batch=1, num_kv_heads=8, max_context=256, num_sms=132) == 1
    assert _choose_num_splits(batch=1, num_kv_heads=8, max_context=1024, num_sms=132) == 4


compiled_gpu = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                  reason="needs CUDA with compiled (not interpreted) Triton")


# Triton's interpreter (3.9) multiplies bf16 tl.dot operands wrongly, so bf16 pages, whose products
# are in bf16, are checked here only; quantized pages' products are fp16 and checked on the CPU too.
@pytest.mark.gpu
@compiled_gpu
@pytest.mark.parametrize("num_splits", [None, 1])
def test_bf16_cuda_large(num_splits):
    seq_lens = [8192, 8000, 4097, 8191, 1, 6000, 8192, 300]
    num_heads, num_kv_heads, head_dim = 32, 8, 128
    q, k_cache, v_cache, page_table, seq_lens_t = make_case(
        seq_lens, num_heads, num_kv_heads, head_dim, 16, torch.bfloat16, "cuda")
    scale = head_dim ** -0.5
    out = paged_decode_attention(q, k_cache, v_cache, page_table, seq_lens_t, scale, num_splits=num_splits)
    ref = reference(q, k_cache, v_cache, page_table, seq_lens_t, scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@compiled_gpu
@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=str)
def test_quantized_bf16_cuda_large(kv_dtype):
    check_quantized([8192, 8000, 4097, 1, 300], 32, 8, 128, None, kv_dtype, torch.bfloat16, "cuda", BF16_TOL)


@pytest.mark.gpu
@compiled_gpu
@pytest.mark.parametrize("tiling", [Tiling(64, 4, 3), Tiling(128, 4, 2), Tiling(128, 8, 2), Tiling(32, 4, 3),
                                    Tiling(128, 4, 3), Tiling(64, 4, 2, True), Tiling(128, 4, 2, True),
                                    Tiling(64, 4, 5), Tiling(64, 4, 7), Tiling(128, 4, 5), Tiling(128, 4, 7)],
                         ids=str)
@pytest.mark.parametrize("kv_dtype", [None, torch.int8, torch.float8_e4m3fn], ids=["bf16", "int8", "e4m3"])
def test_benchmarked_tilings_cuda(tiling, kv_dtype):
    """Every tiling loadtest/engine/bench_decode_attention.py times computes the same, compiled."""
    seq_lens = [4097, 1, 300, 2048]
    if kv_dtype is not None:
        check_quantized(seq_lens, 32, 8, 128, 3, kv_dtype, torch.bfloat16, "cuda", BF16_TOL, tiling=tiling)
        return
    q, k_cache, v_cache, page_table, lens = make_case(seq_lens, 32, 8, 128, 16, torch.bfloat16, "cuda")
    out = paged_decode_attention(q, k_cache, v_cache, page_table, lens, 128 ** -0.5, num_splits=3, tiling=tiling)
    torch.testing.assert_close(out.float(), reference(q, k_cache, v_cache, page_table, lens, 128 ** -0.5), **BF16_TOL)


@pytest.mark.gpu
@compiled_gpu
def test_fp8_query_cuda_large():
    q, k_cache, v_cache, page_table, seq_lens = make_case([8192, 4097, 1, 300], 32, 8, 128, 16, torch.bfloat16,
                                                          "cuda")
    (k_values, k_scale), (v_values, v_scale) = (quantized(c, torch.float8_e4m3fn) for c in (k_cache, v_cache))
    ref = reference(q, kv_quant.dequantize(k_values, k_scale, torch.float32),
                    kv_quant.dequantize(v_values, v_scale, torch.float32), page_table, seq_lens, 128 ** -0.5)
    out = paged_decode_attention(q, k_values, v_values, page_table, seq_lens, 128 ** -0.5, k_scale, v_scale,
                                 fp8_query=True)
    assert torch.isfinite(out).all() and (out.float() - ref).norm() / ref.norm() < 0.05


@pytest.mark.gpu
@compiled_gpu
@pytest.mark.parametrize("kv_dtype", [None, torch.int8, torch.float8_e4m3fn], ids=["bf16", "int8", "fp8"])
def test_cuda_graph_replay_follows_the_inputs(kv_dtype):
    """Captured once with one batch's q, lengths and pages, replayed with another's: the split count
    and the grid are fixed by the shapes, the lengths and pages are read on the device."""
    q, k_cache, v_cache, table, lens = make_case([5000, 4999, 3000], 32, 8, 128, 16, torch.bfloat16, "cuda")
    (k, k_scale), (v, v_scale) = (quantized(c, kv_dtype) if kv_dtype else (c, None) for c in (k_cache, v_cache))
    captured_lens = torch.tensor([5000, 17, 3000], dtype=torch.int32, device="cuda")
    paged_decode_attention(q, k, v, table, captured_lens, 128 ** -0.5, k_scale, v_scale)  # compiles outside
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(q, k, v, table, captured_lens, 128 ** -0.5, k_scale, v_scale)
    # Each row takes the next row's pages, at a length they hold.
    table.copy_(table.roll(-1, 0))
    captured_lens.copy_(torch.tensor([600, 2999, 1], dtype=torch.int32))
    q.copy_(torch.randn_like(q))
    graph.replay()
    caches = [kv_quant.dequantize(c, s, torch.float32) if s is not None else c for c, s in ((k, k_scale), (v, v_scale))]
    torch.testing.assert_close(out.float(), reference(q, *caches, table, captured_lens, 128 ** -0.5), **BF16_TOL)
