"""A prompt's causal attention with both products on FP8 tensor cores, in Triton (issue 22's FP8 row).

On Hopper no library kernel gives it: cuDNN's FP8 attention is for Blackwell only, and FlashInfer's
FA3 FP8 prefill put its output a third of its norm off (docs/BENCHMARKS.md). This one is measured
beside them by loadtest/engine/bench_prefill_attention.py, with its accuracy against the math
backend. The prefill does not choose it: on an H100 it ran 1.07-1.15x FlashInfer's bf16 kernel after
earlier keys and at most 0.97x on a whole 8K prompt, not enough for what e4m3 costs in accuracy.

Inputs in float8_e4m3fn with one float32 scale per head (quantize_for_attention):
    q  [T, H, D]      k  [S, KVH, D]      v_t  [KVH, D, S']   (S' >= S, the tokens contiguous)
V comes transposed because an FP8 warpgroup MMA reads its second operand along the reduced dim:
for P @ V that is the tokens. Query i of T sees keys up to S - T + i (causal from the bottom right:
a whole prompt, or a chunk after earlier keys, in one call); query head h reads KV head h // (H / KVH).

Program (query block, head) runs an online softmax over its keys in fp32, in log2 units, the softmax
scale and both quantization scales folded into one multiplier of the scores; the blocks that see the
most keys launch first. Where the numbers can go wrong in FP8, and what is done:
- The probabilities go to e4m3 weighed up to P_WEIGHT (256), not in [0, 1]: e4m3 keeps 3 bits of
  mantissa at any size, but below 2**-6 it loses them, and at 2**-10 nothing is left.
- Hopper's FP8 MMA adds at about 14 bits. The PV product's sums are promoted to fp32 after each
  tile (max_num_imprecise_acc), not left to accumulate over a whole context at the MMA's precision.
- The row sums add the probabilities before their rounding to e4m3; that rounding is to nearest,
  so its errors have no bias to add up.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from shared.kernels.fp8_quant_triton import FP8, FP8_MAX, MIN_SCALE
from shared.kernels.triton_support import compiled, require_triton, tl, triton

P_WEIGHT = 256.0
_LOG2E = 1.4426950408889634
# V's tokens padded to a multiple of this, so each row of v_t starts 16-byte aligned.
_TOKEN_ALIGN = 16


class Config(NamedTuple):
    """Query rows and keys a tile, warps, pipeline stages, and a cap on registers a thread (None:
    the compiler's choice). 64 x 64 tiles take 217 registers over 4 warps, two programs an SM; at
    168 they spill nothing (sm_90, Triton 3.6) and three fit, one more warpgroup to overlap the
    others' products and softmax: 4-13% faster on an H100, the fastest config on a whole 8K prompt
    (docs/BENCHMARKS.md)."""
    block_m: int
    block_n: int
    warps: int
    stages: int
    max_registers: int | None = None


# The first is the default.
CONFIGS = (Config(128, 128, 8, 3), Config(128, 64, 8, 3), Config(128, 128, 8, 2), Config(64, 64, 4, 3),
           Config(64, 64, 4, 3, 168))


def runs_on(device: torch.device) -> bool:
    """A GPU with FP8 tensor cores (sm_89 and later) and Triton."""
    return triton is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_for_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """q [T, H, D], k and v [S, KVH, D] -> ((q8, k8, v_t8), (q_scale [H], k_scale [KVH], v_scale [KVH])):
    each head scaled so its largest magnitude is e4m3's largest, V transposed to [KVH, D, S']."""
    (q8, q_scale), (k8, k_scale), (v8, v_scale) = (quantize_per_head(x) for x in (q, k, v))
    tokens, kv_heads, head_dim = v.shape
    padded = -(-tokens // _TOKEN_ALIGN) * _TOKEN_ALIGN
    v_t = torch.zeros((kv_heads, head_dim, padded), dtype=FP8, device=v.device)
    v_t[:, :, :tokens] = v8.permute(1, 2, 0)
    return (q8, k8, v_t), (q_scale, k_scale, v_scale)


def quantize_per_head(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, H, D] -> (float8_e4m3 [S, H, D], float32 [H]): each head scaled so its largest magnitude is
    e4m3's largest (also the FP8 inputs of FlashInfer's kernel in the benchmark)."""
    scale = (x.abs().amax(dim=(0, 2)).float() / FP8_MAX).clamp(min=MIN_SCALE)
    # In x's dtype: bf16 keeps more bits than e4m3, and a float32 copy of a long context is large.
    return (x * (1 / scale).to(x.dtype)[None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


if triton is not None:

    @triton.jit
    def _round_to_e4m3(x):
        """Positive normal fp32 x rounded to e4m3's 3 mantissa bits, to nearest even, as the GPU's
        conversion rounds. Triton 3.9's interpreter rounds wrongly where the rounding carries into the
        exponent (127.2 becomes 64, not 128); the value rounded first converts exactly."""
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _tile(q, acc, m_i, l_i, k_base, stride_kt, v_base, stride_vd, start_n, offs_m, qk_scale, S, offset,
              BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, LOG2_P_WEIGHT: tl.constexpr,
              ROUND_FIRST: tl.constexpr):
        """One tile of BLOCK_N keys into the query block's running (acc, max, sum); MASKED: the tile
        holds keys some of the block's queries may not see (past their diagonal, or past S). The sum
        adds the probabilities weighed by P_WEIGHT, as the PV product takes them."""
        offs_n = start_n + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        if MASKED:
            in_range = offs_n < S
            k = tl.load(k_base + offs_n[:, None] * stride_kt + offs_d[None, :], mask=in_range[:, None], other=0.0)
            v_t = tl.load(v_base + offs_d[:, None] * stride_vd + offs_n[None, :], mask=in_range[None, :], other=0.0)
        else:
            k = tl.load(k_base + offs_n[:, None] * stride_kt + offs_d[None, :])
            v_t = tl.load(v_base + offs_d[:, None] * stride_vd + offs_n[None, :])
        # Scores stay the product's own numbers: the max takes the multiplier after (qk_scale > 0),
        # and each probability's exponent takes it in one fused multiply-add with the running max and
        # P_WEIGHT's log2, where a multiply of every score and one of every probability came before
        # (with the MMAs in FP8, the softmax's per-score instructions are the loop's cost).
        scores = tl.dot(q, tl.trans(k))
        if MASKED:
            seen = (offs_n[None, :] <= offs_m[:, None] + offset) & in_range[None, :]
            scores = tl.where(seen, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1) * qk_scale)
        alpha = tl.math.exp2(m_i - m_new)
        weighted = tl.math.exp2(scores * qk_scale - (m_new - LOG2_P_WEIGHT)[:, None])
        l_i = l_i * alpha + tl.sum(weighted, axis=1)
        if ROUND_FIRST:
            weighted = _round_to_e4m3(weighted)
        p8 = weighted.to(v_t.dtype)
        acc = tl.dot(p8, tl.trans(v_t), acc=acc * alpha[:, None], max_num_imprecise_acc=BLOCK_N)
        return acc, m_new, l_i

    @triton.jit
    def _fp8_prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, qk_scale_ptr, v_scale_ptr, T, S,
                            stride_qt, stride_qh, stride_kt, stride_kh, stride_vh, stride_vd, stride_ot, stride_oh,
                            GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, LOG2_P_WEIGHT: tl.constexpr, ROUND_FIRST: tl.constexpr):
        # The last query blocks, which see the most keys, first: the short ones fill in behind them.
        block = tl.num_programs(0) - 1 - tl.program_id(0)
        head = tl.program_id(1).to(tl.int64)
        kv_head = head // GROUP
        offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + offs_m[:, None].to(tl.int64) * stride_qt + head * stride_qh + offs_d[None, :],
                    mask=offs_m[:, None] < T, other=0.0)
        qk_scale = tl.load(qk_scale_ptr + head)
        k_base = k_ptr + kv_head * stride_kh
        v_base = v_ptr + kv_head * stride_vh
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
        offset = S - T  # query i sees keys up to offset + i
        # Keys before the block's first diagonal, whole tiles of them, every query of the block sees.
        unmasked_end = (offset + block * BLOCK_M) // BLOCK_N * BLOCK_N
        end = tl.minimum(S, offset + (block + 1) * BLOCK_M)
        for start_n in range(0, unmasked_end, BLOCK_N):
            acc, m_i, l_i = _tile(q, acc, m_i, l_i, k_base, stride_kt, v_base, stride_vd, start_n, offs_m, qk_scale,
                                  S, offset, BLOCK_N, HEAD_DIM, False, LOG2_P_WEIGHT, ROUND_FIRST)
        for start_n in range(unmasked_end, end, BLOCK_N):
            acc, m_i, l_i = _tile(q, acc, m_i, l_i, k_base, stride_kt, v_base, stride_vd, start_n, offs_m, qk_scale,
                                  S, offset, BLOCK_N, HEAD_DIM, True, LOG2_P_WEIGHT, ROUND_FIRST)
        v_scale = tl.load(v_scale_ptr + kv_head)
        out = acc * (v_scale / l_i)[:, None]
        tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_ot + head * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=offs_m[:, None] < T)


def attention(quantized, scales, scale: float, out_dtype: torch.dtype = torch.bfloat16,
              config: tuple = CONFIGS[0]) -> torch.Tensor:
    """quantize_for_attention's tensors and scales, the softmax scale -> out [T, H, D] in out_dtype,
    causal from the bottom right; config one of CONFIGS, or its fields as a tuple."""
    require_triton("fp8 prefill attention")
    (q, k, v_t), (q_scale, k_scale, v_scale) = quantized, scales
    tokens, heads, head_dim = q.shape
    context, kv_heads = k.shape[:2]
    if not (q.dtype == k.dtype == v_t.dtype == FP8) or heads % kv_heads or context < tokens \
            or v_t.shape[:2] != (kv_heads, head_dim) or v_t.shape[2] < context:
        raise ValueError(f"q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, v_t {tuple(v_t.shape)} "
                         f"{v_t.dtype}: not quantize_for_attention's layout")
    block_m, block_n, warps, stages, max_registers = Config(*config)
    group = heads // kv_heads
    # One multiplier of the scores: the softmax scale, both quantization scales, log2(e).
    qk_scale = (q_scale * k_scale.repeat_interleave(group) * (scale * _LOG2E)).float().contiguous()
    out = torch.empty((tokens, heads, head_dim), dtype=out_dtype, device=q.device)
    grid = (triton.cdiv(tokens, block_m), heads)
    _fp8_prefill_kernel[grid](q, k, v_t, out, qk_scale, v_scale.float().contiguous(), tokens, context,
                              q.stride(0), q.stride(1), k.stride(0), k.stride(1), v_t.stride(0), v_t.stride(1),
                              out.stride(0), out.stride(1), GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m,
                              BLOCK_N=block_n, LOG2_P_WEIGHT=math.log2(P_WEIGHT), ROUND_FIRST=not compiled(q.device),
                              num_warps=warps, num_stages=stages, maxnreg=max_registers)
    return out
