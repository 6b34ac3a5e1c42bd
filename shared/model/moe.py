"""The mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks top_k of E experts for each token,
each expert a SiLU-gated MLP, and the token's output is its experts' outputs weighted by the router.

Numerics follow transformers 5 (MixtralTopKRouter, Qwen3MoeTopKRouter and its default grouped_mm
experts forward): router logits in the activations' dtype; softmax over them in fp32; top_k; the k
probabilities renormalized to sum to one in fp32 (Mixtral always, Qwen3-MoE with norm_topk_prob);
Qwen3-MoE then rounds them to the activations' dtype where Mixtral keeps them in fp32. Each expert's
output times its weight, the k products summed, then rounded to the activations' dtype (the
kernels' contract, shared/kernels/fused_moe_triton.py).

Under tensor parallelism (shared/model/tensor_parallel.py) each rank holds every expert's share of
the intermediate columns, so its output is a partial sum that the MLP's all-reduce completes; the
router is replicated.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from shared.kernels import fused_moe_triton
from shared.model.loader import UnsupportedModel

MOE_MODEL_TYPES = {"mixtral", "qwen3_moe"}


@dataclass
class MoeWeights:
    router: torch.Tensor   # [E, H]
    gate_up: torch.Tensor  # [E, 2I, H]: each expert's gate rows, then its up rows
    down: torch.Tensor     # [E, H, I]

    @classmethod
    def from_hf(cls, block) -> "MoeWeights":
        """From transformers' sparse MoE block, whose experts are stored fused as 3D parameters."""
        experts = block.experts
        return cls(router=block.gate.weight.detach(), gate_up=experts.gate_up_proj.detach().contiguous(),
                   down=experts.down_proj.detach().contiguous())

    def named(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_named(cls, tensors: dict[str, torch.Tensor]) -> "MoeWeights | None":
        """None where the names are absent: a dense layer."""
        if "router" not in tensors:
            return None
        return cls(**{f.name: tensors[f.name] for f in fields(cls)})


@dataclass(frozen=True)
class Routing:
    """How a model's router weighs the experts it picks."""
    top_k: int
    renormalize: bool
    weights_dtype: torch.dtype  # what the weights are rounded to before the expert product

    @classmethod
    def of(cls, config, dtype: torch.dtype) -> "Routing | None":
        """None for a model without experts."""
        if config.model_type not in MOE_MODEL_TYPES:
            return None
        if config.model_type == "mixtral":
            return cls(config.num_experts_per_tok, True, torch.float32)
        return cls(config.num_experts_per_tok, bool(config.norm_topk_prob), dtype)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          weights_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> the top_k experts' weights (float32, rounded through weights_dtype) and ids, [T, k]."""
    probabilities = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probabilities, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(weights_dtype).float(), ids


def moe_forward(x: torch.Tensor, moe: MoeWeights, top_k: int, renormalize: bool,
                weights_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[T, H] (the post-attention RMSNorm's output) -> the experts' weighted sum [T, H] in x's dtype:
    the fused Triton kernel on a GPU, its plain PyTorch reference on the CPU."""
    weights, ids = route(F.linear(x, moe.router), top_k, renormalize, weights_dtype)
    experts = fused_moe_triton.fused_moe if x.is_cuda else fused_moe_triton.moe_reference
    return experts(x, moe.gate_up, moe.down, weights, ids)


def check_supported(block) -> None:
    """Refuses what this module does not compute: a shared expert (Qwen2-MoE's), biased experts."""
    if hasattr(block, "shared_expert"):
        raise UnsupportedModel("MoE blocks with a shared expert (Qwen2-MoE's) are not implemented")
    if getattr(block.experts, "has_bias", False):
        raise UnsupportedModel("MoE experts with biases are not implemented")
