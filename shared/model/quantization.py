"""FP8 weights (model.quantization = "fp8"): each linear layer's weight in float8_e4m3 with a scale
per output channel, as vLLM's `--quantization fp8` and the compressed-tensors FP8 checkpoints have
them. Embeddings, norms and the lm_head stay in the model's dtype.

A product takes one of two forms, by the rows of its input:
  up to WEIGHT_ONLY_ROWS (a decode step's small batches, bound by reading the weights): the
      activations stay in the model's dtype and the weight is widened as it is read, so the step
      reads half the bytes (the Triton GEMV on a GPU);
  more rows (a prompt's chunk, a large batch, bound by the matmuls): the activations are quantized
      per token as they come (a dynamic scale each, the row's absolute maximum over 448), and both
      operands go through the FP8 tensor cores (torch._scaled_mm), accumulating in fp32.
The CPU computes the same numbers in plain PyTorch: the operands dequantized, the products in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shared.kernels.fp8_quant_triton import FP8, FP8_MAX, MIN_SCALE, quantize_rows
from shared.kernels.gemv_triton import WEIGHT_ONLY_ROWS


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3 weight [N, K], float32 scale [N]): each output channel scaled so its largest
    magnitude lands on 448."""
    scale = (weight.abs().amax(dim=1).float() / FP8_MAX).clamp(min=MIN_SCALE)
    return (weight.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3 x [M, K], float32 scale [M, 1]): a dynamic scale per row (on a GPU in one
    Triton pass, shared/kernels/fp8_quant_triton.py)."""
    if x.is_cuda:
        return quantize_rows(x.contiguous())
    scale = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=MIN_SCALE)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for an FP8 weight [N, K] with its per-channel scale [N]; x [M, K] in the model's
    dtype, the result too."""
    if x.shape[0] <= WEIGHT_ONLY_ROWS:
        out = weight_only_linear(x, weight, scale)
    elif x.is_cuda:
        x_fp8, x_scale = quantize_per_token(x)
        out = torch._scaled_mm(x_fp8, weight.t(), scale_a=x_scale, scale_b=scale[None, :],  # noqa: SLF001
                               out_dtype=x.dtype)
    else:
        x_fp8, x_scale = quantize_per_token(x)
        out = (F.linear(x_fp8.float(), weight.float()) * x_scale * scale).to(x.dtype)
    return out if bias is None else out + bias


def weight_only_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The small-batch product without the GEMV (the CPU, or a shape the GEMV does not take)."""
    return (F.linear(x.float(), weight.float()) * scale).to(x.dtype)
