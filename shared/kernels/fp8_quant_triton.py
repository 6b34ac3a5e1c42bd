"""Per-token FP8 quantization of activations in one pass, in Triton: each row's absolute maximum,
its scale (that maximum over 448) and the row in float8_e4m3, for torch._scaled_mm.

The same steps in PyTorch take five passes over the activations (abs, amax, divide, clamp, cast):
at a prompt's 8K rows that is most of what FP8 saves on a small matmul.
"""

from __future__ import annotations

import torch

from shared.kernels.triton_support import pdl_options, require_triton, tl, triton, wait_for_previous_kernel

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
MIN_SCALE = 1e-12  # an all-zero row quantizes to zeros, not NaNs

if triton is not None:

    # The steps of a row's quantization, for every kernel that writes FP8 rows (also the GPU
    # prefill's norms and SiLU, shared/kernels/fused_triton.py): one formula, so the rows they
    # write are those quantize_rows would write from their unquantized output.
    @triton.jit
    def row_scale(amax, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
        """A row's scale from its largest magnitude (fp32)."""
        return tl.maximum(amax / FP8_MAX, MIN_SCALE)

    @triton.jit
    def in_fp8_range(x, scale, FP8_MAX: tl.constexpr):
        """x (fp32) over its row's scale, clamped to e4m3's range: what the store casts to FP8."""
        return tl.clamp(x / scale, -FP8_MAX, FP8_MAX)

    @triton.jit
    def store_fp8_row(out_ptrs, scale_ptr, y, mask, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
        """A whole row y (fp32, zeros where masked) in FP8 at out_ptrs, its scale at scale_ptr."""
        scale = row_scale(tl.max(tl.abs(y), axis=0), FP8_MAX, MIN_SCALE)
        tl.store(out_ptrs, in_fp8_range(y, scale, FP8_MAX).to(out_ptrs.dtype.element_ty), mask=mask)
        tl.store(scale_ptr, scale)

    @triton.jit
    def _quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, K, stride_x, stride_out, FP8_MAX: tl.constexpr,
                              MIN_SCALE: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
        # In a decode step it sits between the attention and o_proj's GEMV, which launch early (PDL):
        # without it, both would wait for full drains.
        wait_for_previous_kernel(USE_PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_K)
        mask = cols < K
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        store_fp8_row(out_ptr + row * stride_out + cols, scale_ptr + row, x, mask, FP8_MAX, MIN_SCALE)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3 [M, K], float32 scale [M, 1]) of x [M, K] with a contiguous last dim."""
    require_triton("quantize_rows")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [M, K] with a contiguous last dim, got shape {tuple(x.shape)} strides {x.stride()}")
    rows, k = x.shape
    out = torch.empty((rows, k), dtype=FP8, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(k)
        _quantize_rows_kernel[(rows,)](x, out, scale, k, x.stride(0), out.stride(0), FP8_MAX=FP8_MAX,
                                       MIN_SCALE=MIN_SCALE, BLOCK_K=block, num_warps=8 if block >= 4096 else 4,
                                       **pdl_options(x.device))
    return out, scale
