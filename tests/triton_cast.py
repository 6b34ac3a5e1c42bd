"""A reference value cast as a Triton kernel's store casts it, for tests of kernels that write FP8."""

import os

import torch
import triton
import triton.language as tl

COMPILED_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


@triton.jit
def _cast_kernel(src, dst, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(dst + i, tl.load(src + i, mask=i < n).to(dst.dtype.element_ty), mask=i < n)


def cast_like_a_triton_store(y, dtype):
    """y cast to dtype as the kernel's store casts it. Compiled, that is PyTorch's cast (to nearest,
    ties to even). Triton 3.9's interpreter loses the carry where an fp8 mantissa rounds up into
    the next power of two (125.6 becomes 64, not 128), so interpreted, the reference is cast by
    the interpreter too, and the test checks everything else the kernel does."""
    if COMPILED_CUDA or dtype == torch.int8:  # int8: y is integral, any cast is exact
        return y.to(dtype)
    flat = y.contiguous().view(-1)
    out = torch.empty(flat.shape, dtype=dtype, device=y.device)
    _cast_kernel[(1,)](flat, out, flat.numel(), BLOCK=triton.next_power_of_2(flat.numel()))
    return out.view(y.shape)
