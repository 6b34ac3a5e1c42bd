"""The Triton FP8 prefill attention against the same algorithm in PyTorch, and against bf16 attention.

Without CUDA the kernel runs in Triton's interpreter on small shapes; with a GPU of FP8 tensor cores
(`-m gpu`) it runs compiled at the 8B's heads.
"""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from shared.kernels import fp8_prefill_attention_triton as fp8_attention  # noqa: E402
from shared.kernels.fp8_prefill_attention_triton import FP8, P_WEIGHT  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LOG2E = 1.4426950408889634
# (BLOCK_M, BLOCK_N, warps, stages): small tiles for the interpreter, the kernel's own on a GPU (its
# FP8 MMAs take 64 rows).
SMALL, OTHERS = ((32, 32, 4, 1), ((16, 64, 4, 1), (64, 32, 4, 1))) if DEVICE == "cpu" else (
    fp8_attention.CONFIGS[0], fp8_attention.CONFIGS[1:])
# (queries, keys): a whole prompt, chunks after earlier keys, lengths that fill no tile.
CASES = [(64, 64), (40, 200), (33, 33), (48, 97)]


def inputs(queries: int, keys: int, heads: int = 4, kv_heads: int = 2, head_dim: int = 64, device=DEVICE, seed=0):
    generator = torch.Generator(device=device).manual_seed(seed)
    return tuple(torch.randn(rows, n, head_dim, generator=generator, device=device).to(torch.bfloat16)
                 for rows, n in ((queries, heads), (keys, kv_heads), (keys, kv_heads)))


def emulated(quantized, scales, scale: float, block_n: int) -> torch.Tensor:
    """The kernel's online softmax in PyTorch, tile by tile of block_n keys: each tile's
    probabilities weighed by P_WEIGHT and rounded to e4m3 before the PV product, the row sums of
    them unrounded. On the CPU."""
    (q8, k8, v_t), (q_scale, k_scale, v_scale) = ((x.cpu() for x in group) for group in (quantized, scales))
    queries, heads, _ = q8.shape
    keys, kv_heads, _ = k8.shape
    group = heads // kv_heads
    k = k8.float().repeat_interleave(group, 1)
    v = v_t[:, :, :keys].float().permute(2, 0, 1).repeat_interleave(group, 1)
    multiplier = q_scale * k_scale.repeat_interleave(group) * scale * LOG2E
    scores = torch.einsum("thd,shd->hts", q8.float(), k) * multiplier[:, None, None]
    seen = torch.arange(keys)[None, :] <= torch.arange(queries)[:, None] + (keys - queries)
    scores = scores.masked_fill(~seen, float("-inf"))
    running_max = torch.full((heads, queries), float("-inf"))
    row_sum = torch.zeros(heads, queries)
    acc = torch.zeros(heads, queries, v.shape[-1])
    for start in range(0, keys, block_n):
        tile = scores[:, :, start: start + block_n]
        new_max = torch.maximum(running_max, tile.amax(-1))
        alpha = torch.exp2(running_max - new_max)
        p = torch.exp2(tile - new_max[..., None])
        row_sum = row_sum * alpha + p.sum(-1)
        p8 = (p * P_WEIGHT).to(FP8).float()
        acc = acc * alpha[..., None] + torch.einsum("hts,shd->htd", p8, v[start: start + block_n])
        running_max = new_max
    out = acc / (row_sum * P_WEIGHT)[..., None] * v_scale.repeat_interleave(group)[:, None, None]
    return out.transpose(0, 1)


def bf16_attention(q, k, v, scale):
    queries, keys = q.shape[0], k.shape[0]
    seen = torch.arange(keys, device=q.device)[None, :] <= torch.arange(queries, device=q.device)[:, None] + (
        keys - queries)
    out = F.scaled_dot_product_attention(*(x.float().transpose(0, 1)[None] for x in (q, k, v)), attn_mask=seen,
                                         scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def assert_close_to_bf16(out, reference, v):
    """e4m3 keeps 3 bits of mantissa: each of q, k, v and the probabilities is within 1/16 of itself.
    The difference is bounded by V's largest value, not the output's: over thousands of keys the
    output averages V down to a tenth of it, and the rounding of each V with it (on an H100, at 1000
    queries after 3096 keys, the largest difference was 14% of the output's largest value)."""
    assert F.cosine_similarity(out.flatten(), reference.flatten(), dim=0) > 0.998
    assert (out - reference).abs().max() < 0.05 * v.float().abs().max()


@pytest.mark.parametrize("queries,keys", CASES)
def test_matches_the_algorithm_in_pytorch(queries, keys):
    q, k, v = inputs(queries, keys)
    scale = q.shape[-1] ** -0.5
    quantized, scales = fp8_attention.quantize_for_attention(q, k, v)
    out = fp8_attention.attention(quantized, scales, scale, torch.float32, SMALL)
    # Interpreted, what is left is fp32's order of additions; compiled, also the FP8 MMA's
    # sums in QK, which Hopper adds at about 14 bits.
    torch.testing.assert_close(out.cpu(), emulated(quantized, scales, scale, SMALL[1]), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("queries,keys", CASES)
def test_close_to_bf16_attention(queries, keys):
    q, k, v = inputs(queries, keys, seed=1)
    scale = q.shape[-1] ** -0.5
    out = fp8_attention.attention(*fp8_attention.quantize_for_attention(q, k, v), scale, torch.float32, SMALL)
    reference = bf16_attention(q, k, v, scale)
    assert_close_to_bf16(out.float(), reference, v)


def test_tiles_of_other_shapes_agree():
    q, k, v = inputs(48, 97)
    scale = q.shape[-1] ** -0.5
    quantized, scales = fp8_attention.quantize_for_attention(q, k, v)
    for config in OTHERS:
        out = fp8_attention.attention(quantized, scales, scale, torch.float32, config)
        torch.testing.assert_close(out.cpu(), emulated(quantized, scales, scale, config[1]), rtol=2e-3, atol=2e-3)


def test_v_transposed_and_padded():
    q, k, v = inputs(20, 37)
    (q8, k8, v_t), _ = fp8_attention.quantize_for_attention(q, k, v)
    assert q8.dtype == k8.dtype == v_t.dtype == FP8
    assert v_t.shape == (2, 64, 48) and not v_t[:, :, 37:].float().any()  # tokens padded to 16
    assert torch.equal(v_t[:, :, :37].permute(2, 0, 1).float(), fp8_attention.quantize_per_head(v)[0].float())


def test_per_head_fp8_keeps_each_head_within_e4m3_rounding():
    """q, k and v are quantized with one scale a head (for this kernel, and for FlashInfer's in the
    benchmark): a head of tiny values keeps its precision beside a head of large ones, and nothing
    saturates (so what the benchmark's FP8 rows measure of accuracy is the kernel's)."""
    generator = torch.Generator().manual_seed(0)
    magnitudes = torch.tensor([1e-3, 1.0, 300.0])[None, :, None]
    x = (torch.randn(50, 3, 16, generator=generator) * magnitudes).to(torch.bfloat16)
    quantized, scale = fp8_attention.quantize_per_head(x)
    assert quantized.dtype == torch.float8_e4m3fn and scale.shape == (3,)
    assert quantized.float().abs().amax(dim=(0, 2)).tolist() == [fp8_attention.FP8_MAX] * 3
    restored = quantized.float() * scale[None, :, None]
    # e4m3 keeps 3 bits of mantissa: half an ulp is 2^-4 of a value (below its normal range, 2^-9 of
    # the scale), and the scaling in bf16 rounds twice by at most 2^-9 of it before
    error = (restored - x.float()).abs()
    assert (error <= x.float().abs() * (2 ** -4 + 2 ** -8) + scale[None, :, None] * 2 ** -9).all()


def test_bad_layout_raises():
    q, k, v = inputs(16, 32)
    (q8, k8, v_t), scales = fp8_attention.quantize_for_attention(q, k, v)
    with pytest.raises(ValueError):
        fp8_attention.attention((q8, k8, v_t[:, :, :16]), scales, 0.125)  # fewer tokens than keys
    with pytest.raises(ValueError):
        fp8_attention.attention((q8.float(), k8, v_t), scales, 0.125)
    with pytest.raises(ValueError):
        fp8_attention.attention((k8, q8, v_t), scales, 0.125)  # more queries than keys


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not fp8_attention.runs_on(torch.device("cuda")),
                    reason="needs a GPU with FP8 tensor cores")
@pytest.mark.parametrize("config", fp8_attention.CONFIGS)
@pytest.mark.parametrize("queries,keys", [(1024, 1024), (1000, 4096)])
def test_8b_heads_on_the_gpu(config, queries, keys):
    q, k, v = inputs(queries, keys, heads=32, kv_heads=8, head_dim=128)
    scale = 128 ** -0.5
    out = fp8_attention.attention(*fp8_attention.quantize_for_attention(q, k, v), scale, torch.bfloat16, config)
    assert_close_to_bf16(out.float(), bf16_attention(q, k, v, scale), v)
