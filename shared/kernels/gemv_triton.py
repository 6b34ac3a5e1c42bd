"""Skinny matmul for the decode step, in Triton: out[M, N] = x[M, K] @ weight[N, K]^T, M <= 64.

It is F.linear without bias for a batch of at most 64 rows. There a decode step is bound by reading
each weight once, so the kernel is built to stream the weight at HBM bandwidth: program (n, s)
reads a contiguous block of BLOCK_N weight rows, 16-byte loads along K, over its share s of K, and
accumulates in fp32. Two inner products, one per kind of config:

    BLOCK_M == 1    multiply-add on the CUDA cores: the [BLOCK_N, BLOCK_K] products accumulate
                    elementwise and are summed over K once, after the loop (M = 1 only)
    BLOCK_M >= 16   tl.dot on the tensor cores, the weight's BLOCK_N rows as the MMA's M side (64
                    rows make one Hopper warpgroup MMA) and x padded to BLOCK_M rows: 16 for
                    M <= 16, 32 and 64 for the wider batches (at 32 rows on an H100 they read four
                    of the 8B's five weights faster than cuBLAS: docs/BENCHMARKS.md)

Split-K: where N / BLOCK_N programs would leave SMs idle (o_proj and down_proj of Llama-8B have
N = 4096 on 132 SMs), the grid's second axis cuts K into SPLIT_K ranges; each writes fp32 partial
sums and a second kernel adds them and rounds once. The caller names the config:
shared/model/linear_choice.py times every usable one per shape, as a decode step runs them, and
keeps the fastest. Nothing is read on the host, so a call can be captured in a CUDA graph once its
config has been compiled.

FP8 weights (W8A8, the numbers of shared/model/quantization.fp8_linear at every batch size): weight
float8_e4m3fn [N, K] with weight_scale float32 [N], one scale per output channel; the rows quantized
to float8_e4m3 with a scale each (fp8_quant_triton.quantize_rows), unless the kernel before quantized
them already (the decode's norms and SiLU: shared/kernels/fused_triton.py's _fp8 forms), and the two
scales on each output after the K loop. The tensor-core configs put both operands into the FP8 MMA
(fp32 accumulators) with the weight's rows as its 64-row side; the multiply-add ones widen both to
fp32 (exactly: e4m3 fits). This is what torch._scaled_mm computes, but reading the weight as a GEMV
does: the decode times both (shared/model/linear_choice.py) and keeps the faster. Weight-only FP8
(bf16 rows, each weight element widened before its product) went: it read the weights at only
0.41-0.72 of the copy rate on an H200 (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import functools

import torch

from shared.kernels.fp8_quant_triton import quantize_rows
from shared.kernels.triton_support import pdl_options, require_triton, tl, triton, wait_for_previous_kernel

MAX_ROWS = 64
# The narrowest tensor-core block of rows; the wider ones (32, 64) take only what this one cannot.
TENSOR_CORE_ROWS = 16
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The weight dtype that comes with a per-output-channel weight_scale.
FP8_DTYPE = torch.float8_e4m3fn
# Split K only while the row blocks alone give fewer programs than this per SM.
_SPLIT_BELOW_PROGRAMS_PER_SM = 2
# Columns per program of the split-K sum.
_SUM_BLOCK = 1024


def _config(block_m: int, block_n: int, block_k: int, split_k: int, warps: int, stages: int):
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split_k},
                         num_warps=warps, num_stages=stages)


if triton is not None:
    CONFIGS = [
        # Multiply-add, one row: blocks of a few rows already make enough programs without a split.
        # Two rows by 1024 and four by 2048 columns were the fastest multiply-add configs for
        # qkv, o_proj and down of Llama-8B on the H200 (loadtest/engine/bench_gemv_configs.py).
        _config(1, 2, 1024, 1, 4, 3),
        _config(1, 4, 2048, 1, 4, 3),
        _config(1, 4, 1024, 1, 4, 3),
        _config(1, 8, 512, 1, 4, 3),
        _config(1, 16, 512, 1, 8, 3),
        # The same bytes per load for one-byte weights: twice the columns.
        _config(1, 2, 2048, 1, 4, 3),
        _config(1, 4, 4096, 1, 4, 3),
        _config(1, 8, 1024, 1, 4, 3),
        # Tensor cores: 64 rows a block is one Hopper warpgroup MMA; split-K for the small N.
        _config(16, 64, 128, 1, 4, 4),
        _config(16, 128, 128, 1, 4, 4),
        _config(16, 32, 256, 1, 4, 4),
        _config(16, 64, 128, 2, 4, 4),
        _config(16, 32, 256, 4, 4, 4),
        # 256 columns a step, as the wide blocks' fastest below, for FP8 weights' rows up to 16.
        _config(16, 64, 256, 1, 4, 4),
        _config(16, 128, 256, 1, 4, 4),
        _config(16, 64, 256, 2, 4, 4),
        # 17 to 64 rows: 32 and 64 rows a block, split-K for the small N.
        _config(32, 64, 128, 1, 4, 4),
        _config(32, 64, 128, 2, 4, 4),
        _config(64, 64, 128, 1, 4, 3),
        _config(64, 64, 128, 2, 4, 3),
        _config(64, 128, 128, 1, 8, 3),
        # 256 columns a step: the fastest of bench_gemv_configs' W8A8 sweep for every Llama-8B weight at
        # 32 and 64 rows on an H100 (8-29% faster than the configs above; docs/BENCHMARKS.md).
        _config(32, 128, 256, 1, 4, 4),
        _config(32, 64, 256, 2, 4, 4),
        _config(64, 64, 256, 1, 4, 4),
        _config(64, 64, 256, 2, 4, 4),
    ]

    @triton.jit
    def _gemv_kernel(
        x_ptr, w_ptr, scale_ptr, x_scale_ptr, out_ptr, partial_ptr,
        M, N, K,
        stride_xm, stride_wn, stride_om,
        DOT_PRECISION: tl.constexpr, FP8: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        wait_for_previous_kernel(USE_PDL)
        split = tl.program_id(1)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        # Each split owns whole K blocks, so only K's own end needs a mask (and with K a multiple
        # of 16, which Triton specialises on, the mask keeps the loads vectorised).
        blocks_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
        k_begin = split * blocks_per_split * BLOCK_K
        k_end = tl.minimum(K, k_begin + blocks_per_split * BLOCK_K)
        # int64 rows: N * K passes 2**31 for large vocabularies.
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
        x_rows = x_ptr + m[:, None] * stride_xm
        row_mask = rows[:, None] < N
        m_mask = m[:, None] < M
        if FP8:
            # Loaded before the loop, so their latency hides under the weight stream.
            scale = tl.load(scale_ptr + rows, mask=rows < N, other=0.0)
            x_scale = tl.load(x_scale_ptr + m, mask=m < M, other=0.0)
        if BLOCK_M == 1:
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k in range(k_begin, k_end, BLOCK_K):
            cols = k + tl.arange(0, BLOCK_K)
            col_mask = cols[None, :] < K
            # The weight is read once per step: keep it from evicting x and other hot lines in L2.
            w = tl.load(w_rows + cols[None, :], mask=row_mask & col_mask, other=0.0, eviction_policy="evict_first")
            x = tl.load(x_rows + cols[None, :], mask=m_mask & col_mask, other=0.0)
            if BLOCK_M == 1:
                acc += w.to(tl.float32) * x.to(tl.float32)
            elif FP8:
                # Hopper's FP8 MMA adds at less than fp32's precision (about 14 bits); Triton 3.6 on
                # sm_90 never promotes the sums by default (fast accumulation), which on an H100 put
                # this product up to 0.015 off at outputs of about 1. Into fp32 every 128 of K, as
                # torch._scaled_mm's default (CUTLASS's two-level accumulation) does.
                acc = tl.dot(w, tl.trans(x), acc=acc, max_num_imprecise_acc=128)
            else:
                acc = tl.dot(w, tl.trans(x), acc=acc, input_precision=DOT_PRECISION)
        if BLOCK_M == 1:
            result = tl.sum(acc, axis=1)[:, None]
        else:
            result = acc
        if FP8:
            # With split-K each partial is scaled here, before the sum: the scales are per output, so
            # the scaled partials add up to the scaled sum (to fp32 rounding), and the sum kernel
            # stays one kernel for both weight formats, with no scale to read.
            result = result * scale[:, None] * x_scale[None, :]
        # result is [BLOCK_N, BLOCK_M]: out transposed.
        out_mask = row_mask & (m[None, :] < M)
        if SPLIT_K == 1:
            tl.store(out_ptr + m[None, :] * stride_om + rows[:, None], result.to(out_ptr.dtype.element_ty),
                     mask=out_mask)
        else:
            tl.store(partial_ptr + (split * M + m[None, :]) * N + rows[:, None], result, mask=out_mask)

    @triton.jit
    def _split_sum_kernel(partial_ptr, out_ptr, M, N, stride_om, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
                          USE_PDL: tl.constexpr):
        wait_for_previous_kernel(USE_PDL)
        m = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < N
        splits = tl.arange(0, SPLIT_K)
        parts = tl.load(partial_ptr + (splits[:, None] * M + m) * N + cols[None, :], mask=mask[None, :], other=0.0)
        tl.store(out_ptr + m * stride_om + cols, tl.sum(parts, axis=0).to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def shared_memory_per_program(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin


def usable_configs(rows: int, n: int, k: int, sms: int, shared_memory: int,
                   weight_bytes: int = 2, x_bytes: int = 2) -> list:
    """The configs worth timing for a shape on a GPU of `sms` SMs: multiply-add only for one row,
    the tensor cores in the narrowest block of rows that holds them; split-K only where the row
    blocks leave SMs idle and every split gets at least one K block; none that does not fit the
    `shared_memory` a program may have (fits_shared_memory)."""
    def usable(config) -> bool:
        meta = config.kwargs
        if meta["BLOCK_M"] < rows or (meta["BLOCK_M"] > TENSOR_CORE_ROWS and meta["BLOCK_M"] // 2 >= rows):
            return False
        if not fits_shared_memory(config, shared_memory, weight_bytes, x_bytes):
            return False
        return meta["SPLIT_K"] == 1 or (triton.cdiv(n, meta["BLOCK_N"]) < _SPLIT_BELOW_PROGRAMS_PER_SM * sms
                                        and k >= meta["SPLIT_K"] * meta["BLOCK_K"])
    return [config for config in CONFIGS if usable(config)]


def fits_shared_memory(config, shared_memory: int, weight_bytes: int, x_bytes: int) -> bool:
    """Whether the config's pipelined tiles (num_stages of them, of weight_bytes and x_bytes elements)
    fit the `shared_memory` a program may have. Triton 3.6 allocates num_stages tiles for the Hopper
    MMA's operands: on an H100 a 64 x 64 x 256 bf16 config of 4 stages asked for 262,144 bytes
    of 232,448, and its first call failed where counting num_stages - 1 had let it through."""
    meta = config.kwargs
    tile = meta["BLOCK_K"] * (meta["BLOCK_N"] * weight_bytes + meta["BLOCK_M"] * x_bytes)
    return config.num_stages * tile <= shared_memory


def tile_element_bytes(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None) -> tuple[int, int]:
    """The bytes of a weight element and of an x element in gemv's kernel tiles: with an FP8 weight the
    rows reach the kernel in FP8, since gemv quantizes rows that come in a float dtype first."""
    return weight.element_size(), 1 if weight_scale is not None else x.element_size()


def _scale_fits(weight: torch.Tensor, weight_scale: torch.Tensor) -> bool:
    return (weight_scale.dtype == torch.float32 and weight_scale.shape == weight.shape[:1]
            and weight_scale.is_contiguous() and weight_scale.device == weight.device)


def supports(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None) -> bool:
    """Whether gemv takes these on the GPU: CUDA, triton present, at most MAX_ROWS rows, contiguous
    last dims, and a weight in x's float dtype, or in FP8_DTYPE with its float32 [N] weight_scale (x
    may then be in FP8_DTYPE too, quantized already)."""
    if weight_scale is None:
        weight_fits = weight.dtype == x.dtype
    else:
        weight_fits = weight.dtype == FP8_DTYPE and _scale_fits(weight, weight_scale)
    x_fits = x.dtype in SUPPORTED_DTYPES or (x.dtype == FP8_DTYPE and weight_scale is not None)
    return (triton is not None and x.is_cuda and x.dim() == 2 and weight.dim() == 2
            and 0 < x.shape[0] <= MAX_ROWS and x.shape[1] == weight.shape[1]
            and weight_fits and x_fits
            and x.stride(1) == 1 and weight.stride(1) == 1 and x.device == weight.device)


def _check(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None, x_scale: torch.Tensor | None,
           out_dtype: torch.dtype | None) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} are not [M, K] and [N, K]")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"gemv takes at most {MAX_ROWS} rows, got {x.shape[0]}")
    if (x.dtype == FP8_DTYPE) != (x_scale is not None) or (x_scale is not None) != (out_dtype is not None):
        raise ValueError(f"quantized rows ({FP8_DTYPE}) come with their x_scale and an out_dtype, and only they")
    if x_scale is not None:
        if weight_scale is None or x_scale.dtype != torch.float32 or x_scale.shape != (x.shape[0], 1):
            raise ValueError(f"quantized rows need an FP8 weight and x_scale float32 [{x.shape[0]}, 1], got "
                             f"{x_scale.dtype} {tuple(x_scale.shape)}")
        if out_dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"out_dtype {out_dtype} must be one of {SUPPORTED_DTYPES}")
    elif x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x {x.dtype} must be one of {SUPPORTED_DTYPES}")
    if weight_scale is None:
        if weight.dtype == FP8_DTYPE:
            raise ValueError(f"a {FP8_DTYPE} weight needs its weight_scale, float32 [N]")
        if weight.dtype != x.dtype:
            raise ValueError(f"weight {weight.dtype} must be x's {x.dtype}, or {FP8_DTYPE} with a weight_scale")
    elif weight.dtype != FP8_DTYPE:
        raise ValueError(f"a weight_scale goes with a {FP8_DTYPE} weight, not {weight.dtype}")
    elif not _scale_fits(weight, weight_scale):
        raise ValueError(f"weight_scale {weight_scale.dtype} {tuple(weight_scale.shape)} on {weight_scale.device} "
                         f"must be float32 [{weight.shape[0]}], contiguous, on {weight.device}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"x strides {x.stride()} and weight strides {weight.stride()} need a contiguous last dim")


def gemv(x: torch.Tensor, weight: torch.Tensor, config, weight_scale: torch.Tensor | None = None,
         x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """F.linear(x, weight) for x [M <= 64, K], weight [N, K] row-major, with one of CONFIGS: a new
    [M, N] in x's dtype. The weight is in x's dtype, or in FP8_DTYPE with weight_scale float32 [N]
    (then fp8_linear's W8A8: x quantized per row first, unless it comes quantized, x in FP8_DTYPE
    with its x_scale float32 [M, 1], the result in out_dtype). A config's first call compiles it, so
    it must not come in a CUDA-graph capture."""
    require_triton("gemv")
    _check(x, weight, weight_scale, x_scale, out_dtype)
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty((rows, n), dtype=out_dtype or x.dtype, device=x.device)
    if rows == 0:
        return out
    if config.kwargs["BLOCK_M"] < rows:
        raise ValueError(f"config {config.kwargs} takes at most {config.kwargs['BLOCK_M']} rows, got {rows}")
    fp8 = weight_scale is not None
    # The rows quantized as shared/model/quantization.fp8_linear quantizes them, unless they came so.
    x_in, x_scale = quantize_rows(x) if fp8 and x_scale is None else (x, x_scale)
    split_k = config.kwargs["SPLIT_K"]
    # Unused unless the config splits K; out stands in for it otherwise.
    partial = torch.empty((split_k, rows, n), dtype=torch.float32, device=x.device) if split_k > 1 else out
    # tf32 would round fp32 inputs to 10 mantissa bits; for 16-bit inputs the precision is moot.
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    grid = (triton.cdiv(n, config.kwargs["BLOCK_N"]), split_k)
    launch = pdl_options(x.device)
    # Without FP8, scale_ptr and x_scale_ptr are None: the kernel compiles as for the plain weight.
    _gemv_kernel[grid](x_in, weight, weight_scale, x_scale, out, partial, rows, n, k, x_in.stride(0),
                       weight.stride(0), out.stride(0), DOT_PRECISION=precision, FP8=fp8, **config.kwargs,
                       num_warps=config.num_warps, num_stages=config.num_stages, **launch)
    if split_k > 1:
        _split_sum_kernel[(rows, triton.cdiv(n, _SUM_BLOCK))](partial, out, rows, n, out.stride(0),
                                                             SPLIT_K=split_k, BLOCK=_SUM_BLOCK, **launch)
    return out
