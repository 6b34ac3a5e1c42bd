"""A mixture-of-experts router's choice in one Triton launch: from a token's router logits to its
top_k experts and their weights, one program per token.

The PyTorch expression (shared/model/moe.py `route`) takes two launches for Mixtral's and
DeepSeek-V2's routing (softmax, topk) and a dozen for DeepSeek-V3's grouped sigmoid routing
(sigmoid, the bias, each group's best two, the best groups, the mask, topk, gather, the
renormalization, the scaling), in every MoE layer of every decode step. This kernel computes the
same in fp32: scores (softmax or sigmoid), the choice (scores plus the correction bias), the
experts outside the best groups masked, the top_k by repeated argmax (descending, as torch.topk
returns them), the chosen scores renormalized and scaled, rounded through the model's dtype where
the model rounds them.

Nothing is read on the host and the output shapes come from the input's, so a call can be captured
in a CUDA graph.
"""

from __future__ import annotations

import torch

from shared.kernels.triton_support import pdl_options, require_triton, tl, triton, wait_for_previous_kernel

SCORINGS = ("softmax", "sigmoid")
GROUP_SCORES = ("max", "top2")
_ROUNDINGS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# One program holds a token's every expert in registers: DeepSeek-V3 has 256.
MAX_EXPERTS = 1024


if triton is not None:

    @triton.jit
    def _route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_experts, stride_row, scaling, epsilon,
                      TOP_K: tl.constexpr, K_PAD: tl.constexpr, EXPERTS_PAD: tl.constexpr,
                      SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, GROUPS: tl.constexpr,
                      TOP_GROUPS: tl.constexpr, GROUP_TOP2: tl.constexpr, RENORMALIZE: tl.constexpr,
                      ROUNDING: tl.constexpr, USE_PDL: tl.constexpr):
        wait_for_previous_kernel(USE_PDL)
        row = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, EXPERTS_PAD)
        real = e < num_experts
        logits = tl.load(logits_ptr + row * stride_row + e, mask=real, other=float("-inf")).to(tl.float32)
        if SIGMOID:
            scores = tl.sigmoid(logits)
        else:
            shifted = tl.exp(logits - tl.max(logits, axis=0))
            scores = shifted / tl.sum(shifted, axis=0)
        choice = scores
        if HAS_BIAS:
            choice += tl.load(bias_ptr + e, mask=real, other=0.0).to(tl.float32)
        choice = tl.where(real, choice, float("-inf"))
        if TOP_GROUPS < GROUPS:
            per_group: tl.constexpr = EXPERTS_PAD // GROUPS
            grouped = tl.reshape(choice, (GROUPS, per_group))
            column = tl.arange(0, per_group)
            best = tl.max(grouped, axis=1)
            if GROUP_TOP2:
                first = tl.argmax(grouped, axis=1)
                best += tl.max(tl.where(column[None, :] == first[:, None], float("-inf"), grouped), axis=1)
            group = tl.arange(0, GROUPS)
            kept = tl.zeros((GROUPS,), tl.int1)
            for _ in tl.static_range(TOP_GROUPS):
                pick = tl.argmax(best, axis=0)
                kept = kept | (group == pick)
                best = tl.where(group == pick, float("-inf"), best)
            # Masked as the models mask: -inf among sigmoid scores (V3), 0 among softmax's (V2).
            masked = float("-inf") if SIGMOID else 0.0
            in_kept = tl.reshape(tl.broadcast_to(kept[:, None], (GROUPS, per_group)), (EXPERTS_PAD,))
            choice = tl.where(in_kept & real, choice, masked)
            choice = tl.where(real, choice, float("-inf"))
        slot = tl.arange(0, K_PAD)
        ids = tl.zeros((K_PAD,), tl.int32)
        weights = tl.zeros((K_PAD,), tl.float32)
        for i in tl.static_range(TOP_K):
            pick = tl.argmax(choice, axis=0)
            ids = tl.where(slot == i, pick, ids)
            weights = tl.where(slot == i, tl.sum(tl.where(e == pick, scores, 0.0), axis=0), weights)
            choice = tl.where(e == pick, float("-inf"), choice)
        if RENORMALIZE:
            weights = weights / (tl.sum(weights, axis=0) + epsilon)
        weights = weights * scaling
        if ROUNDING == 1:
            weights = weights.to(tl.bfloat16).to(tl.float32)
        elif ROUNDING == 2:
            weights = weights.to(tl.float16).to(tl.float32)
        out = row * TOP_K + slot
        tl.store(weights_ptr + out, weights, mask=slot < TOP_K)
        tl.store(ids_ptr + out, ids, mask=slot < TOP_K)


def supports(num_experts: int, groups: int) -> bool:
    """Grouped routing reshapes the experts into [groups, E / groups] in registers, whose sizes
    Triton wants powers of two (DeepSeek-V3's 256 experts in 8 groups are)."""
    def power_of_two(n: int) -> bool:
        return n & (n - 1) == 0

    return triton is not None and num_experts <= MAX_EXPERTS and (
        groups == 1 or (power_of_two(num_experts) and power_of_two(groups) and num_experts % groups == 0))


def route(logits: torch.Tensor, top_k: int, *, scoring: str = "softmax", correction_bias: torch.Tensor | None = None,
          groups: int = 1, top_groups: int = 1, group_score: str = "max", renormalize: bool = False,
          renormalize_epsilon: float = 0.0, scaling: float = 1.0,
          weights_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights float32 [T, top_k], ids int32 [T, top_k]), as shared/model/moe.py's
    route computes them, where supports(E, groups)."""
    require_triton("moe_routing_triton.route")
    tokens, experts = logits.shape
    if scoring not in SCORINGS or group_score not in GROUP_SCORES or weights_dtype not in _ROUNDINGS:
        raise ValueError(f"scoring {scoring!r}, group_score {group_score!r}, weights {weights_dtype}: not supported")
    if not supports(experts, groups) or logits.stride(1) != 1 or not 0 < top_k <= experts:
        raise ValueError(f"{experts} experts in {groups} groups, top_k {top_k}, logits strides "
                         f"{logits.stride()}: not supported")
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int32, device=logits.device)
    if tokens == 0:
        return weights, ids
    experts_pad = triton.next_power_of_2(experts)
    bias = correction_bias if correction_bias is not None else logits
    _route_kernel[(tokens,)](
        logits, bias, weights, ids, experts, logits.stride(0), float(scaling), float(renormalize_epsilon),
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), EXPERTS_PAD=experts_pad,
        SIGMOID=scoring == "sigmoid", HAS_BIAS=correction_bias is not None, GROUPS=groups,
        TOP_GROUPS=top_groups, GROUP_TOP2=group_score == "top2", RENORMALIZE=renormalize,
        ROUNDING=_ROUNDINGS[weights_dtype], num_warps=1 if experts_pad <= 128 else 4, **pdl_options(logits.device))
    return weights, ids
