"""FP8 weights (model.quantization = "fp8"): each linear layer's weight in float8_e4m3 with a scale
per output channel, as vLLM's `--quantization fp8` and the compressed-tensors FP8 checkpoints have
them. Embeddings, norms and the lm_head stay in the model's dtype.

A product quantizes its activations per token as they come (a dynamic scale each, the row's
absolute maximum over 448) and runs both operands through the FP8 tensor cores, accumulating in
fp32: torch._scaled_mm, or for a decode step's batch the Triton GEMV if it reads the weight faster
(shared/model/linear_choice.py). The same numbers at every batch size, as vLLM's dynamic FP8 has
them: a request's tokens do not depend on how many others share its step. The GPU's norms and SiLU
quantize their output for the product in the same kernel (Fp8Rows).
The CPU computes the same numbers in plain PyTorch: the operands dequantized, the products in fp32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from shared.kernels.fp8_quant_triton import FP8, FP8_MAX, MIN_SCALE, quantize_rows

# torch._scaled_mm's use_fast_accum: Hopper's FP8 MMA without its periodic promotion of the sums to
# fp32, as vLLM's CUTLASS FP8 kernels for sm90 run. Off: on an H100 it made the 8K prefill 7% faster
# but moved the last position's logits by up to 1.7 of their standard deviations and changed the
# argmax (docs/BENCHMARKS.md). bench_fp8_weights turns it on for its own comparison.
fast_accumulation = False


class Fp8Rows(NamedTuple):
    """Activations quantized per token by the kernel that made them (shared/kernels/fused_triton.py's
    _fp8 forms), as fp8_linear would quantize them: a product takes them as they are."""
    values: torch.Tensor  # float8_e4m3 [M, K]
    scale: torch.Tensor   # float32 [M, 1]
    dtype: torch.dtype    # the model's: the product's


# Rows of a weight quantized at a time, so that its float32 copies stay small: whole, the 70B's
# gate_up takes 1.75 GiB a copy, and building the 70B's FP8 weights on an H100 ran out of memory at
# one (docs/BENCHMARKS.md).
QUANTIZE_ROWS = 4096


def quantize_weight(weight: torch.Tensor, rows_at_a_time: int = QUANTIZE_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3 weight [N, K], float32 scale [N]): each output channel scaled so its largest
    magnitude lands on 448; rows_at_a_time rows at a time (each row's numbers are its own)."""
    quantized = torch.empty(weight.shape, dtype=FP8, device=weight.device)
    scale = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for start in range(0, weight.shape[0], rows_at_a_time):
        block = slice(start, start + rows_at_a_time)
        rows = weight[block]
        scale[block] = (rows.abs().amax(dim=1).float() / FP8_MAX).clamp(min=MIN_SCALE)
        quantized[block] = (rows.float() / scale[block, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return quantized, scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3 x [M, K], float32 scale [M, 1]): a dynamic scale per row (on a GPU in one
    Triton pass, shared/kernels/fp8_quant_triton.py)."""
    if x.is_cuda:
        return quantize_rows(x.contiguous())
    scale = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=MIN_SCALE)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_linear(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for an FP8 weight [N, K] with its per-channel scale [N]; x [M, K] in the model's
    dtype, or already quantized, the result in the model's dtype."""
    rows = x if isinstance(x, Fp8Rows) else Fp8Rows(*quantize_per_token(x), x.dtype)
    out = quantized_product(rows, weight, scale)
    return out if bias is None else out + bias


def quantized_product(x: Fp8Rows, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Both operands in FP8: on the GPU's FP8 tensor cores, on the CPU dequantized in fp32."""
    if x.values.is_cuda:
        return torch._scaled_mm(x.values, weight.t(), scale_a=x.scale, scale_b=scale[None, :],  # noqa: SLF001
                                out_dtype=x.dtype, use_fast_accum=fast_accumulation)
    return (F.linear(x.values.float(), weight.float()) * x.scale * scale).to(x.dtype)

