"""Fused elementwise kernels for the Llama decode step, in Triton.

A decode step is launch-bound: per layer the PyTorch forward in shared/model/llama.py spends ~35
small kernels on RMSNorm, the residual add, RoPE, the KV write and SiLU*up. Each function here
replaces one such chain with one launch:

    rms_norm(x, w, eps)              the final / first norm                 (~6 kernels -> 1)
    add_rms_norm(x, res, w, eps)     residual add + the next layer's norm   (~7 kernels -> 1)
    rope_write_kv(qkv, ...)          split, RoPE on q and k, KV page write  (~20 kernels -> 1)
    rope_in_place(x, ...)            RoPE on heads where they lie (MLA's)   (~7 kernels -> 1)
                                     (quantized pages: with the quantization and the scales' write)
    silu_and_mul(gate_up)            chunk, SiLU, multiply                  (~3 kernels -> 1)

The norms and SiLU also come in an _fp8 form for a product with FP8 weights (the GPU prefill's):
the output quantized per token in the same kernel, as fp8_quant_triton.quantize_rows would quantize
it, so the activations are not written in the model's dtype and read back to be quantized.

Numerics follow the PyTorch expressions they replace (transformers' LlamaModel): the math runs in
fp32 and is rounded to the activation dtype at the same points where PyTorch rounds (after the
normalisation and before the weight, after each RoPE product, after SiLU), so in bf16 the fused
path gives the same tokens as the unfused one.

Every function allocates its output with torch.empty, decides everything from shapes and dtypes,
and never reads device memory on the host, so all of them can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from shared.kernels import kv_quant
from shared.kernels.fp8_quant_triton import FP8, FP8_MAX, MIN_SCALE, in_fp8_range, row_scale, store_fp8_row
from shared.kernels.triton_support import pdl_options, require_triton, tl, triton, wait_for_previous_kernel

# Columns per program of silu_and_mul: a 14336-wide Llama-8B row becomes 14 programs. silu_and_mul_fp8
# takes a row per program: up to _SILU_FP8_ONE_PASS columns it holds the whole row in registers and
# reads gate_up once; a wider row goes in blocks of _SILU_FP8_BLOCK columns, twice: for its scale,
# then to write it. Two passes over the 8B's rows ran at 0.65 of the copy rate in an 8K prefill
# (9.4 ms of its 148, H100, docs/BENCHMARKS.md). Compiled for sm_90, a 16384-column row takes 64
# registers a thread over 16 warps; a 32768-column one uses stack, even over 32 warps.
_SILU_BLOCK = 1024
_SILU_FP8_BLOCK, _SILU_FP8_WARPS, _SILU_FP8_ONE_PASS = 4096, 16, 16384
# RMSNorm holds a whole row in registers: one warp per 256 columns, 4 to 16 warps.
_NORM_COLS_PER_WARP = 256
# rope_write_kv's rows per program from this many rows on: a prefill chunk's one-row programs (a
# 1-warp program per row and head, 330K of them for 8K rows of the 8B) took ten times their bytes'
# worth (docs/BENCHMARKS.md, Prefill); a decode step's few rows keep one row a program.
ROPE_BLOCKED_FROM_ROWS, _ROPE_ROWS_PER_PROGRAM = 512, 16


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, scale_ptr,
        eps, hidden,
        stride_x, stride_res, stride_out, stride_sum,
        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, QUANTIZE: tl.constexpr,
        FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, USE_PDL: tl.constexpr,
    ):
        wait_for_previous_kernel(USE_PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < hidden
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
            # Rounded to the activation dtype, as `x + residual` is in PyTorch.
            x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)
            tl.store(sum_ptr + row * stride_sum + cols, x, mask=mask)
        h = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / hidden + eps)
        # LlamaRMSNorm casts back to the input dtype before the weight multiply.
        normed = (h * rstd).to(x.dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if QUANTIZE:  # from the output rounded to the model's dtype, as quantize_rows reads it
            y = (normed * w).to(x.dtype).to(tl.float32)
            store_fp8_row(out_ptr + row * stride_out + cols, scale_ptr + row, y, mask, FP8_MAX, MIN_SCALE)
        else:
            tl.store(out_ptr + row * stride_out + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _store_quantized(values_ptr, scale_ptr, x, mask, scale_mask, QMAX: tl.constexpr, ROUND: tl.constexpr):
        """Rows x [R, D], each one (token, kv head), as x / s in the cache's format and s = max|x| / QMAX
        beside it ([R] scales), as shared/kernels/kv_quant.py's quantize does."""
        x = x.to(tl.float32)
        amax = tl.max(tl.where(mask, tl.abs(x), 0.0), axis=1)
        inverse = QMAX / tl.where(amax > 0, amax, 1.0)  # a row of zeros stays zeros, with scale 0
        y = tl.minimum(tl.maximum(x * inverse[:, None], -QMAX), QMAX)
        if ROUND:  # int8: half up, then exact in the conversion
            y = tl.floor(y + 0.5)
        tl.store(values_ptr, y.to(values_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr, amax / QMAX, mask=scale_mask)

    @triton.jit
    def _rotated(x, x_pair, cos, sin, first_half):
        """x * cos + rotate_half(x) * sin, x_pair holding each element's partner (d +- half) in fp32
        and first_half where d < half: each product rounded to x's dtype before the sum, as
        PyTorch's `x * cos + rotated * sin` rounds them."""
        x_rot = tl.where(first_half, -x_pair, x_pair)
        x_cos = (x.to(tl.float32) * cos).to(x.dtype).to(tl.float32)
        rot_sin = (x_rot * sin).to(x.dtype).to(tl.float32)
        return (x_cos + rot_sin).to(x.dtype)

    # `rows` is a prefill chunk's length: specialized, a length that is not a multiple of 16 (or is 1)
    # would compile the kernel again during a request, holding the GIL (services/prefill/warmup.py).
    @triton.jit(do_not_specialize=["rows"])
    def _rope_write_kv_kernel(
        qkv_ptr, cos_ptr, sin_ptr, pos_ptr, page_ptr, offset_ptr,
        q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, k_out_ptr,
        rows, stride_qkv, stride_cos, stride_sin, stride_qn, stride_qh,
        stride_kp, stride_kt, stride_kh,
        stride_vp, stride_vt, stride_vh,
        stride_sp, stride_st, stride_kon, stride_koh,
        num_heads, num_kv_heads,
        ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, QUANTIZED: tl.constexpr,
        QMAX: tl.constexpr, ROUND: tl.constexpr, K_OUT: tl.constexpr, USE_PDL: tl.constexpr,
    ):
        wait_for_previous_kernel(USE_PDL)
        # Program (b, h): rows b * ROWS onwards; h < num_heads rotates q head h into q; otherwise kv
        # head h - num_heads rotates k and copies v into each row's cache slot. The k heads follow
        # the q heads in a qkv row, so head h starts at column h * HEAD_DIM either way.
        n = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        h = tl.program_id(1)
        half = HEAD_DIM // 2
        d = tl.arange(0, BLOCK_D)
        n_mask = n < rows
        mask = n_mask[:, None] & (d < HEAD_DIM)[None, :]
        # Per-element head index: a scalar-by-vector mask is rejected by the interpreter.
        is_q = (h + 0 * d) < num_heads
        kvh = h - num_heads

        row = qkv_ptr + n[:, None] * stride_qkv
        x = tl.load(row + h * HEAD_DIM + d[None, :], mask=mask, other=0.0)
        # rotate_half(x) = cat(-x[half:], x[:half]): element d pairs with d +- half.
        partner = tl.where(d < half, d + half, d - half)
        x_pair = tl.load(row + h * HEAD_DIM + partner[None, :], mask=mask, other=0.0).to(tl.float32)
        pos = tl.load(pos_ptr + n, mask=n_mask, other=0).to(tl.int64)[:, None]
        cos = tl.load(cos_ptr + pos * stride_cos + d[None, :], mask=mask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + pos * stride_sin + d[None, :], mask=mask, other=0.0).to(tl.float32)
        out = _rotated(x, x_pair, cos, sin, (d < half)[None, :])

        tl.store(q_ptr + n[:, None] * stride_qn + h * stride_qh + d[None, :], out, mask=mask & is_q[None, :])

        kv_mask = mask & ~is_q[None, :]
        if K_OUT:
            tl.store(k_out_ptr + n[:, None] * stride_kon + kvh * stride_koh + d[None, :], out, mask=kv_mask)
        # int64: page * stride_kp overflows int32 for pools above 2**31 elements.
        page = tl.load(page_ptr + n, mask=n_mask, other=0).to(tl.int64)
        slot = tl.load(offset_ptr + n, mask=n_mask, other=0).to(tl.int64)
        k_at = k_ptr + (page * stride_kp + slot * stride_kt + kvh * stride_kh)[:, None] + d[None, :]
        v = tl.load(row + (num_heads + num_kv_heads + kvh) * HEAD_DIM + d[None, :], mask=kv_mask, other=0.0)
        v_at = v_ptr + (page * stride_vp + slot * stride_vt + kvh * stride_vh)[:, None] + d[None, :]
        if QUANTIZED:
            # A q program's kvh is negative: its scale address is out of range, and masked.
            scale_at = page * stride_sp + slot * stride_st + kvh
            scale_mask = n_mask & (h + 0 * n >= num_heads)
            _store_quantized(k_at, k_scale_ptr + scale_at, out, kv_mask, scale_mask, QMAX, ROUND)
            _store_quantized(v_at, v_scale_ptr + scale_at, v, kv_mask, scale_mask, QMAX, ROUND)
        else:
            tl.store(k_at, out.to(k_ptr.dtype.element_ty), mask=kv_mask)
            tl.store(v_at, v.to(v_ptr.dtype.element_ty), mask=kv_mask)

    @triton.jit
    def _rope_in_place_kernel(
        x_ptr, cos_ptr, sin_ptr, pos_ptr, stride_xn, stride_xh, stride_cos, stride_sin,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
    ):
        wait_for_previous_kernel(USE_PDL)
        # Program (n, h) rotates head h of row n where it lies; no other program reads it.
        n = tl.program_id(0).to(tl.int64)
        half = HEAD_DIM // 2
        d = tl.arange(0, BLOCK_D)
        mask = d < HEAD_DIM
        head = x_ptr + n * stride_xn + tl.program_id(1) * stride_xh
        x = tl.load(head + d, mask=mask, other=0.0)
        partner = tl.where(d < half, d + half, d - half)
        x_pair = tl.load(head + partner, mask=mask, other=0.0).to(tl.float32)
        pos = tl.load(pos_ptr + n).to(tl.int64)
        cos = tl.load(cos_ptr + pos * stride_cos + d, mask=mask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + pos * stride_sin + d, mask=mask, other=0.0).to(tl.float32)
        tl.store(head + d, _rotated(x, x_pair, cos, sin, d < half), mask=mask)

    @triton.jit
    def _silu_times_up(row_ptr, cols, mask, inter):
        """F.silu(gate) * up over one block of a gate_up row, in its dtype: SiLU rounded to it before
        the multiply, as F.silu returns it."""
        gate = tl.load(row_ptr + cols, mask=mask, other=0.0)
        up = tl.load(row_ptr + inter + cols, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
        return (silu * up.to(tl.float32)).to(gate.dtype)

    @triton.jit
    def _silu_and_mul_kernel(
        gate_up_ptr, out_ptr, inter, stride_in, stride_out,
        BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
    ):
        wait_for_previous_kernel(USE_PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        tl.store(out_ptr + row * stride_out + cols, _silu_times_up(gate_up_ptr + row * stride_in, cols, mask, inter),
                 mask=mask)

    @triton.jit
    def _silu_and_mul_fp8_kernel(
        gate_up_ptr, out_ptr, scale_ptr, inter, stride_in, stride_out,
        BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        """ONE_PASS: BLOCK covers the row, which stays in registers between its scale and its store."""
        wait_for_previous_kernel(USE_PDL)
        row = tl.program_id(0).to(tl.int64)
        row_ptr = gate_up_ptr + row * stride_in
        out_row_ptr = out_ptr + row * stride_out
        if ONE_PASS:
            cols = tl.arange(0, BLOCK)
            y = _silu_times_up(row_ptr, cols, cols < inter, inter).to(tl.float32)
            store_fp8_row(out_row_ptr + cols, scale_ptr + row, y, cols < inter, FP8_MAX, MIN_SCALE)
        else:
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, inter, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                amax = tl.maximum(amax, tl.abs(_silu_times_up(row_ptr, cols, cols < inter, inter).to(tl.float32)))
            scale = row_scale(tl.max(amax, axis=0), FP8_MAX, MIN_SCALE)
            for start in range(0, inter, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                y = _silu_times_up(row_ptr, cols, cols < inter, inter).to(tl.float32)
                tl.store(out_row_ptr + cols, in_fp8_range(y, scale, FP8_MAX).to(out_ptr.dtype.element_ty),
                         mask=cols < inter)
            tl.store(scale_ptr + row, scale)


def _check_rows(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2 or t.stride(-1) != 1:
        raise ValueError(f"{name} must be 2-D with a contiguous last dim, got shape {tuple(t.shape)} "
                         f"strides {t.stride()}")


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, quantize: bool = False):
    """(normed, summed, scale): scale None unless quantize, summed normed's tensor without a residual."""
    _check_rows("x", x)
    rows, hidden = x.shape
    if weight.shape != (hidden,) or weight.stride(0) != 1:
        raise ValueError(f"weight {tuple(weight.shape)} does not match hidden size {hidden}")
    if quantize and weight.dtype != x.dtype:  # quantized from the output rounded to x's dtype
        raise ValueError(f"an FP8 output needs weight in x's dtype {x.dtype}, got {weight.dtype}")
    out_dtype = FP8 if quantize else torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty((rows, hidden), dtype=out_dtype, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device) if quantize else None
    summed = out
    if residual is not None:
        _check_rows("residual", residual)
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} vs x {tuple(x.shape)} {x.dtype}")
        summed = torch.empty_like(x, memory_format=torch.contiguous_format)
    if rows == 0:
        return out, summed, scale
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, summed, scale if quantize else out,
        eps, hidden,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), summed.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK=block, QUANTIZE=quantize, FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE,
        num_warps=min(16, max(4, block // _NORM_COLS_PER_WARP)), **pdl_options(x.device),
    )
    return out, summed, scale


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm of x [N, H]: weight * (x * rsqrt(mean(x**2) + eps)).to(x.dtype), the statistics
    in fp32. Returns a new [N, H] tensor in x's dtype (promoted with weight's if they differ)."""
    require_triton("rms_norm")
    return _norm(x, None, weight, eps)[0]


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows(rms_norm(x, weight, eps)) in one kernel: (float8_e4m3 [N, H], float32 scale [N, 1])."""
    require_triton("rms_norm_fp8")
    normed, _, scale = _norm(x, None, weight, eps, quantize=True)
    return normed, scale


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """summed = x + residual (rounded to x's dtype), normed = rms_norm(summed, weight, eps), in one
    kernel; returns (normed, summed), both new [N, H] tensors."""
    require_triton("add_rms_norm")
    return _norm(x, residual, weight, eps)[:2]


def add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """add_rms_norm with normed quantized per token as rms_norm_fp8 quantizes it:
    ((float8_e4m3 [N, H], float32 scale [N, 1]), summed)."""
    require_triton("add_rms_norm_fp8")
    normed, summed, scale = _norm(x, residual, weight, eps, quantize=True)
    return (normed, scale), summed


def rope_in_place(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [N, heads, D] (a contiguous last dim, other strides free: a slice of a
    projection's output) at positions [N], written over x, which it returns; cos/sin [max_positions,
    D] in x's dtype. shared/model/elementwise.apply_rope's numbers, in one launch."""
    require_triton("rope_in_place")
    rows, heads, head_dim = x.shape
    if x.stride(-1) != 1 or head_dim % 2:
        raise ValueError(f"x {tuple(x.shape)} strides {x.stride()} needs an even, contiguous last dim")
    for name, table in (("cos", cos), ("sin", sin)):
        _check_rows(name, table)
        if table.shape[1] != head_dim or table.dtype != x.dtype:
            raise ValueError(f"{name} {tuple(table.shape)} {table.dtype} vs head dim {head_dim} {x.dtype}")
    if positions.shape != (rows,):
        raise ValueError(f"positions {tuple(positions.shape)} must be ({rows},)")
    if rows:
        _rope_in_place_kernel[(rows, heads)](
            x, cos, sin, positions, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
            HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), num_warps=1,
            enable_fp_fusion=False, **pdl_options(x.device),
        )
    return x


def rope_rows_per_program(rows: int) -> int:
    return _ROPE_ROWS_PER_PROGRAM if rows >= ROPE_BLOCKED_FROM_ROWS else 1


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor,
                  num_heads: int, num_kv_heads: int, head_dim: int,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                  k_out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate-half RoPE on the q and k of a fused projection, writing k and v to the paged cache.

    qkv [N, (H + 2*KVH) * D] holds each row's q heads, then k heads, then v heads; cos/sin
    [max_positions, D] in qkv's dtype; positions [N] int64; k_cache/v_cache [num_pages, page_size,
    KVH, D] with a contiguous last dim (other strides free); pages/offsets [N] int32 or int64 name
    each row's slot. Writes rotated k and plain v to k_cache[pages[n], offsets[n]] /
    v_cache[...] and returns rotated q as a new [N, H, D] tensor. One launch.
    int8 or float8_e4m3fn caches are written quantized, each (token, kv head) with its float32
    scale in k_scale/v_scale [num_pages, page_size, KVH] (shared/kernels/kv_quant.py). k_out [N, KVH, D] in
    qkv's dtype, if given, also receives the rotated k as computed (a quantizing prefill attends to it).
    """
    require_triton("rope_write_kv")
    _check_rows("qkv", qkv)
    rows = qkv.shape[0]
    if head_dim % 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not hold {num_heads} q and 2x{num_kv_heads} kv heads "
                         f"of even dim {head_dim}")
    for name, table in (("cos", cos), ("sin", sin)):
        _check_rows(name, table)
        if table.shape[1] != head_dim or table.dtype != qkv.dtype:
            raise ValueError(f"{name} {tuple(table.shape)} {table.dtype} vs head_dim {head_dim} {qkv.dtype}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4 or cache.shape[2:] != (num_kv_heads, head_dim) or cache.stride(-1) != 1:
            raise ValueError(f"{name} {tuple(cache.shape)} strides {cache.stride()} is not "
                             f"[pages, page_size, {num_kv_heads}, {head_dim}] with a contiguous last dim")
    for name, index in (("positions", positions), ("pages", pages), ("offsets", offsets)):
        if index.shape != (rows,) or index.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32/int64 of shape ({rows},), got {tuple(index.shape)} {index.dtype}")
    quantized = kv_quant.is_quantized(k_cache.dtype)
    _check_scales(k_cache, v_cache, k_scale, v_scale, quantized)
    if k_out is not None and (k_out.shape != (rows, num_kv_heads, head_dim) or k_out.dtype != qkv.dtype
                              or k_out.stride(-1) != 1):
        raise ValueError(f"k_out must be ({rows}, {num_kv_heads}, {head_dim}) {qkv.dtype} with a contiguous last dim")

    q = torch.empty((rows, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if rows == 0:
        return q
    block = rope_rows_per_program(rows)
    _rope_write_kv_kernel[(triton.cdiv(rows, block), num_heads + num_kv_heads)](
        qkv, cos, sin, positions, pages, offsets,
        q, k_cache, v_cache, k_scale if quantized else k_cache, v_scale if quantized else v_cache,
        k_out if k_out is not None else q,
        rows, qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_scale.stride(0) if quantized else 0, k_scale.stride(1) if quantized else 0,
        k_out.stride(0) if k_out is not None else 0, k_out.stride(1) if k_out is not None else 0,
        num_heads, num_kv_heads,
        ROWS=block, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), QUANTIZED=quantized,
        QMAX=kv_quant.QMAX.get(k_cache.dtype, 0.0), ROUND=k_cache.dtype == torch.int8, K_OUT=k_out is not None,
        num_warps=max(1 if head_dim <= 128 else 2, block * head_dim // 512),
        # Otherwise x * cos + rot * sin contracts to one fma, skipping PyTorch's rounding of x * cos
        # (1 ulp off on ~25% of bf16 elements); without it the result is bitwise PyTorch's.
        enable_fp_fusion=False, **pdl_options(qkv.device),
    )
    return q


def _check_scales(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                  v_scale: torch.Tensor | None, quantized: bool) -> None:
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache {k_cache.dtype} and v_cache {v_cache.dtype} differ")
    if not quantized:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"scales given for an unquantized {k_cache.dtype} cache")
        return
    for name, scales in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scales is None or scales.dtype != torch.float32 or scales.shape != k_cache.shape[:3] or scales.stride(-1) != 1:
            raise ValueError(f"a {k_cache.dtype} cache needs {name} float32 {tuple(k_cache.shape[:3])} "
                             "with a contiguous last dim")
    if v_scale.stride() != k_scale.stride():
        raise ValueError("k_scale and v_scale need the same strides")


def _gate_up_rows(gate_up: torch.Tensor) -> tuple[int, int]:
    _check_rows("gate_up", gate_up)
    rows, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up width {width} is odd")
    return rows, width // 2


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2*I] (gate columns first) -> F.silu(gate) * up [N, I] in gate_up's dtype."""
    require_triton("silu_and_mul")
    rows, inter = _gate_up_rows(gate_up)
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    _silu_and_mul_kernel[(rows, triton.cdiv(inter, _SILU_BLOCK))](
        gate_up, out, inter, gate_up.stride(0), out.stride(0),
        BLOCK=_SILU_BLOCK, num_warps=4, **pdl_options(gate_up.device),
    )
    return out


def silu_and_mul_fp8(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows(silu_and_mul(gate_up)) in one kernel: (float8_e4m3 [N, I], float32 scale [N, 1])."""
    require_triton("silu_and_mul_fp8")
    rows, inter = _gate_up_rows(gate_up)
    out = torch.empty((rows, inter), dtype=FP8, device=gate_up.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=gate_up.device)
    if rows:
        one_pass = inter <= _SILU_FP8_ONE_PASS
        _silu_and_mul_fp8_kernel[(rows,)](
            gate_up, out, scale, inter, gate_up.stride(0), out.stride(0),
            BLOCK=triton.next_power_of_2(inter) if one_pass else _SILU_FP8_BLOCK, ONE_PASS=one_pass,
            FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, num_warps=_SILU_FP8_WARPS, **pdl_options(gate_up.device),
        )
    return out, scale
