"""What a layer's products and elementwise steps run through, chosen once per path: PyTorch's own ops
(the CPU; the reference every fused kernel is tested against), or on a GPU the fused Triton kernels
and, for a decode step, the matmuls LinearChooser picked per shape."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shared.kernels import fused_triton, latent_write_triton
from shared.model.elementwise import apply_rope, rms_norm, silu_and_mul


@dataclass(frozen=True)
class Kernels:
    linear: Callable[..., torch.Tensor] = F.linear          # (x, weight, bias=None)
    rms_norm: Callable[..., torch.Tensor] = rms_norm        # (x, weight, eps)
    rope: Callable[..., torch.Tensor] = apply_rope          # (x, cos, sin, positions): rotated, x's own memory or new
    silu_and_mul: Callable[..., torch.Tensor] = silu_and_mul  # (gate_up) -> silu(gate) * up
    moe_routing_kernel: bool = False  # a MoE router's choice in one Triton launch (moe_routing_triton)
    # MLA's latent from kv_a's output into its page slot in one launch; None: PyTorch's ops, then pool.write_latent
    write_latent: Callable[..., None] | None = None


PYTORCH = Kernels()


def fused(linear: Callable[..., torch.Tensor] = F.linear) -> Kernels:
    """The GPU's: Triton's fused RMSNorm, in-place RoPE, SiLU, MoE routing and latent write, with `linear`
    for the products."""
    return Kernels(linear, fused_triton.rms_norm, fused_triton.rope_in_place, fused_triton.silu_and_mul,
                   moe_routing_kernel=True, write_latent=latent_write_triton.norm_rope_write_latent)
