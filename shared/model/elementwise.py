"""RMSNorm, RoPE and the gated SiLU as transformers computes them (RMSNorm in fp32, the weight applied in the input's
dtype; RoPE with tables already in the activations' dtype), for the unfused paths of every model."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [T, heads, dim] rotated at its positions by the rotate-half RoPE; cos/sin [max_context, dim]."""
    cos, sin = cos[positions][:, None, :], sin[positions][:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2*I] (gate columns first) -> F.silu(gate) * up [T, I]: a gated MLP's middle."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
