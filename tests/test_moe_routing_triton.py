"""The router's choice in one Triton launch against shared/model/moe.py's PyTorch routing, for every
model's routing: Mixtral's and Qwen3-MoE's softmax top-k, DeepSeek-V2's greedy and group-limited
softmax, DeepSeek-V3's grouped sigmoid with its correction bias. Without CUDA in Triton's interpreter."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before triton is imported: @triton.jit picks the interpreter at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from shared.kernels import moe_routing_triton
from shared.model.moe import Routing, route

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.gpu if torch.cuda.is_available() else []

ROUTINGS = {
    "mixtral": (8, Routing(2, True, torch.float32)),
    "qwen3_moe": (128, Routing(8, True, torch.bfloat16)),
    "qwen3_moe_unnormalized": (60, Routing(4, False, torch.bfloat16)),
    "deepseek_v2_greedy": (64, Routing(6, False, torch.float32, fp32_logits=True, scaling=1.0)),
    "deepseek_v2_grouped": (64, Routing(6, False, torch.float32, fp32_logits=True, groups=8, top_groups=3,
                                        scaling=16.0)),
    "deepseek_v3": (256, Routing(8, True, torch.float32, scoring="sigmoid", fp32_logits=True, groups=8,
                                 top_groups=4, group_score="top2", scaling=2.5, renormalize_epsilon=1e-20)),
}


@pytest.mark.parametrize("tokens", [1, 7, 64])
@pytest.mark.parametrize("name", list(ROUTINGS))
def test_the_kernel_chooses_the_experts_pytorch_chooses(name, tokens):
    experts, routing = ROUTINGS[name]
    gen = torch.Generator().manual_seed(tokens)
    # Qwen3-MoE's and Mixtral's router runs in the activations' dtype, DeepSeek's in fp32.
    logits_dtype = torch.float32 if routing.fp32_logits else torch.bfloat16
    logits = (torch.randn(tokens, experts, generator=gen) * 2).to(DEVICE, logits_dtype)
    bias = (torch.randn(experts, generator=gen) * 0.1).to(DEVICE) if routing.scoring == "sigmoid" else None
    expected_weights, expected_ids = route(logits, routing, bias)
    weights, ids = route(logits, routing, bias, in_one_kernel=True)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    # exp and the sum in another order: an ulp or two of fp32, or of bf16 where the model rounds to it.
    tolerance = 1e-6 if routing.weights_dtype == torch.float32 else 8e-3
    if routing.fp32_logits:
        assert torch.equal(ids.long(), expected_ids)
        torch.testing.assert_close(weights, expected_weights, rtol=tolerance, atol=0)
        return
    # bf16 logits tie often among 128 experts, and torch.topk breaks ties its own way on each device
    # (the kernel takes the lowest id): the same logits chosen, the same weights.
    chosen, expected = logits.gather(1, ids.long()), logits.gather(1, expected_ids)
    assert torch.equal(chosen.sort(dim=1).values, expected.sort(dim=1).values)
    assert torch.equal(chosen, chosen.sort(dim=1, descending=True).values), "not in descending order"
    torch.testing.assert_close(weights.sort(dim=1).values, expected_weights.sort(dim=1).values,
                               rtol=tolerance, atol=0)


def test_the_grouped_choice_differs_from_the_greedy_one():
    """The groups do constrain the choice here: without them other experts win."""
    experts, routing = ROUTINGS["deepseek_v3"]
    logits = torch.randn(64, experts, generator=torch.Generator().manual_seed(5)).to(DEVICE) * 2
    grouped = route(logits, routing, None, in_one_kernel=True)[1]
    greedy = route(logits, Routing(8, True, torch.float32, scoring="sigmoid", scaling=2.5), None, in_one_kernel=True)[1]
    assert not torch.equal(grouped.sort().values, greedy.sort().values)


def test_grouped_routing_needs_power_of_two_groups_of_experts():
    assert moe_routing_triton.supports(60, 1) and moe_routing_triton.supports(256, 8)
    assert not moe_routing_triton.supports(60, 4) and not moe_routing_triton.supports(96, 3)
    assert not moe_routing_triton.supports(moe_routing_triton.MAX_EXPERTS * 2, 1)
    logits = torch.randn(3, 48, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with pytest.raises(ValueError, match="not supported"):
        moe_routing_triton.route(logits, 2, groups=3, top_groups=1)
