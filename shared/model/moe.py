"""The mixture-of-experts MLP (Mixtral, Qwen3-MoE, DeepSeek-V2/V3): a router picks top_k of E experts
for each token, each expert a SiLU-gated MLP, and the token's output is its experts' outputs weighted
by the router, plus, in DeepSeek's layers, the shared experts' (a dense MLP every token goes through).

Routing, as transformers 5 routes:
- Mixtral, Qwen3-MoE (MixtralTopKRouter, Qwen3MoeTopKRouter): logits in the activations' dtype;
  softmax over them in fp32; top_k; the k probabilities renormalized to sum to one in fp32 (Mixtral
  always, Qwen3-MoE with norm_topk_prob); Qwen3-MoE then rounds them to the activations' dtype where
  Mixtral keeps them in fp32.
- DeepSeek-V2 (DeepseekV2TopkRouter): logits in fp32 (the router's weight is kept in fp32), softmax;
  top_k over all experts ("greedy") or over the topk_group of n_group groups with the highest
  maximum ("group_limited_greedy"); times routed_scaling_factor.
- DeepSeek-V3 (DeepseekV3TopkRouter): sigmoid scores in fp32; the choice made on the scores plus
  e_score_correction_bias, within the topk_group groups of the highest sum of their two best; the
  weights are the chosen scores (without the bias), renormalized with norm_topk_prob, times
  routed_scaling_factor.
Each expert's output times its weight, the k products summed, then rounded to the activations'
dtype (the kernels' contract, shared/kernels/fused_moe_triton.py).

Under tensor parallelism (shared/model/tensor_parallel.py) each rank holds every expert's share of
the intermediate columns (and of the shared experts'), so its output is a partial sum that the
MLP's all-reduce completes; the router is replicated.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from shared.kernels import fused_moe_triton, moe_routing_triton
from shared.model.layer_kernels import PYTORCH, Kernels
from shared.model.loader import UnsupportedModel

MOE_MODEL_TYPES = {"mixtral", "qwen3_moe", "deepseek_v2", "deepseek_v3"}


@dataclass
class MoeWeights:
    router: torch.Tensor   # [E, H]
    gate_up: torch.Tensor  # [E, 2I, H]: each expert's gate rows, then its up rows
    down: torch.Tensor     # [E, H, I]
    correction_bias: torch.Tensor | None = None  # [E] fp32, DeepSeek-V3's e_score_correction_bias
    shared_gate_up: torch.Tensor | None = None   # [2S, H]: DeepSeek's shared experts, one dense MLP
    shared_down: torch.Tensor | None = None      # [H, S]

    @classmethod
    def from_hf(cls, block) -> "MoeWeights":
        """From transformers' sparse MoE block, whose experts are stored fused as 3D parameters."""
        experts, shared = block.experts, getattr(block, "shared_experts", None)
        bias = getattr(block.gate, "e_score_correction_bias", None)
        return cls(router=block.gate.weight.detach(), gate_up=experts.gate_up_proj.detach().contiguous(),
                   down=experts.down_proj.detach().contiguous(),
                   correction_bias=None if bias is None else bias.detach(),
                   shared_gate_up=None if shared is None else torch.cat([shared.gate_proj.weight,
                                                                         shared.up_proj.weight]).detach(),
                   shared_down=None if shared is None else shared.down_proj.weight.detach())

    def named(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_named(cls, tensors: dict[str, torch.Tensor]) -> "MoeWeights | None":
        """None where the names are absent: a dense layer."""
        if "router" not in tensors:
            return None
        return cls(**{f.name: tensors.get(f.name) for f in fields(cls)})


@dataclass(frozen=True)
class Routing:
    """How a model's router weighs the experts it picks."""
    top_k: int
    renormalize: bool
    weights_dtype: torch.dtype  # what the weights are rounded to before the expert product
    scoring: str = "softmax"    # or "sigmoid" (DeepSeek-V3)
    fp32_logits: bool = False   # the router's product in fp32 (DeepSeek's)
    groups: int = 1             # n_group: the experts in that many equal groups ...
    top_groups: int = 1         # ... of which the topk_group best are chosen from
    group_score: str = "max"    # a group's score: its best expert's ("max") or its best two's sum ("top2")
    scaling: float = 1.0        # routed_scaling_factor
    renormalize_epsilon: float = 0.0  # DeepSeek-V3 adds 1e-20 to the sum it divides by

    @classmethod
    def of(cls, config, dtype: torch.dtype) -> "Routing | None":
        """None for a model without experts."""
        kind = config.model_type
        if kind not in MOE_MODEL_TYPES:
            return None
        if kind == "mixtral":
            return cls(config.num_experts_per_tok, True, torch.float32)
        if kind == "qwen3_moe":
            return cls(config.num_experts_per_tok, bool(config.norm_topk_prob), dtype)
        common = dict(top_k=config.num_experts_per_tok, weights_dtype=torch.float32, fp32_logits=True,
                      scaling=float(config.routed_scaling_factor))
        if kind == "deepseek_v2":
            grouped = config.topk_method == "group_limited_greedy"
            return cls(renormalize=False, groups=config.n_group if grouped else 1,
                       top_groups=config.topk_group if grouped else 1, **common)
        return cls(renormalize=bool(config.norm_topk_prob), scoring="sigmoid", groups=config.n_group,
                   top_groups=config.topk_group, group_score="top2", renormalize_epsilon=1e-20, **common)


def route(router_logits: torch.Tensor, routing: Routing, correction_bias: torch.Tensor | None = None,
          in_one_kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> the top_k experts' weights (float32, rounded through weights_dtype) and ids, [T, k]:
    in PyTorch ops, or with in_one_kernel (the GPU's) in one Triton launch that computes the same."""
    if in_one_kernel and moe_routing_triton.supports(router_logits.shape[1], routing.groups):
        return moe_routing_triton.route(
            router_logits, routing.top_k, scoring=routing.scoring, correction_bias=correction_bias,
            groups=routing.groups, top_groups=routing.top_groups, group_score=routing.group_score,
            renormalize=routing.renormalize, renormalize_epsilon=routing.renormalize_epsilon,
            scaling=routing.scaling, weights_dtype=routing.weights_dtype)
    if routing.scoring == "sigmoid":
        scores = router_logits.float().sigmoid()
    else:
        scores = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    choice = scores if correction_bias is None else scores + correction_bias
    if routing.top_groups < routing.groups:
        choice = _within_best_groups(choice, routing)
    if routing.scoring == "softmax" and correction_bias is None:
        weights, ids = torch.topk(choice, routing.top_k, dim=-1)
    else:
        ids = torch.topk(choice, routing.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
    if routing.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + routing.renormalize_epsilon)
    if routing.scaling != 1.0:
        weights = weights * routing.scaling
    return weights.to(routing.weights_dtype).float(), ids


def _within_best_groups(choice: torch.Tensor, routing: Routing) -> torch.Tensor:
    """The choice scores with every expert outside the top_groups best groups masked out (-inf for
    sigmoid scores, as DeepSeek-V3 masks them; 0 for softmax's, as V2's group_limited_greedy does)."""
    grouped = choice.view(len(choice), routing.groups, -1)
    if routing.group_score == "top2":
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    else:
        group_scores = grouped.max(dim=-1).values
    best = torch.topk(group_scores, routing.top_groups, dim=-1)[1]
    kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    masked = float("-inf") if routing.scoring == "sigmoid" else 0.0
    return grouped.masked_fill(~kept[:, :, None], masked).view_as(choice)


def moe_forward(x: torch.Tensor, moe: MoeWeights, routing: Routing, kernels: Kernels = PYTORCH) -> torch.Tensor:
    """[T, H] (the post-attention RMSNorm's output) -> the experts' weighted sum [T, H] in x's dtype,
    plus the shared experts' output where the layer has them: the fused Triton kernel on a GPU, its
    plain PyTorch reference on the CPU. kernels: the routing, the shared experts' products and SiLU."""
    logits = F.linear(x.float(), moe.router.float()) if routing.fp32_logits else F.linear(x, moe.router)
    weights, ids = route(logits, routing, moe.correction_bias, kernels.moe_routing_kernel)
    experts = fused_moe_triton.fused_moe if x.is_cuda else fused_moe_triton.moe_reference
    out = experts(x, moe.gate_up, moe.down, weights, ids)
    if moe.shared_gate_up is None:
        return out
    return out + kernels.linear(kernels.silu_and_mul(kernels.linear(x, moe.shared_gate_up)), moe.shared_down)


def check_supported(block) -> None:
    """Refuses what this module does not compute: a gated shared expert (Qwen2-MoE's), biased experts."""
    if hasattr(block, "shared_expert"):
        raise UnsupportedModel("MoE blocks with a shared expert (Qwen2-MoE's) are not implemented")
    if getattr(block.experts, "has_bias", False):
        raise UnsupportedModel("MoE experts with biases are not implemented")
