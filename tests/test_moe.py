"""Mixtral and Qwen3-MoE against transformers: the router's softmax top-k (renormalized by Mixtral
always, by Qwen3-MoE with norm_topk_prob), the experts' weighted sum, dense layers among the MoE
ones (Qwen3-MoE's decoder_sparse_step), in every path that runs the MLP, in-process and through the
real stack. The checkpoints are tiny random ones written with transformers, norms drawn at random
(transformers starts them at ones, which would hide a skipped norm), the embedded model's tokenizer
beside them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import (AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig,
                          Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from shared.model import moe
from shared.model.from_checkpoint import load_paged_llama
from shared.model.llama import PagedLlama
from shared.model.loader import UnsupportedModel, layer_windows, load_hf_config
from shared.model.tensor_parallel import TensorParallel, shard_weights
from shared.model.weights import LlamaWeights
from tests.test_qwen3 import (PROMPT, assert_matches_transformers, check_served, checkpoint_stack, fused_decode,
                              greedy_logits, pool_for, save_tiny)

SHAPE = dict(vocab_size=49152, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048, num_experts_per_tok=2, initializer_range=0.05)
VARIANTS = {
    "mixtral": (MixtralForCausalLM, MixtralConfig(**SHAPE, num_local_experts=8)),
    # norm_topk_prob off (Qwen3MoeConfig's default): the top-2 weights as the softmax gave them.
    "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(**SHAPE, moe_intermediate_size=32, num_experts=8)),
    # Layer 0 dense (decoder_sparse_step 2: only every second layer has experts), layer 1 of experts.
    "qwen3_moe_mixed": (Qwen3MoeForCausalLM, Qwen3MoeConfig(**SHAPE, moe_intermediate_size=32, num_experts=8,
                                                            decoder_sparse_step=2, norm_topk_prob=True)),
}


def write_checkpoint(folder: Path, tokenizer_from: Path, model_class, config) -> Path:
    torch.manual_seed(0)
    return save_tiny(model_class(config), folder, tokenizer_from, ("norm.weight",))


@pytest.fixture(scope="module")
def folders(checkpoint, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {name: write_checkpoint(root / name, Path(checkpoint), *variant) for name, variant in VARIANTS.items()}


@pytest.fixture(scope="module")
def references(folders) -> dict:
    return {name: AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
            for name, folder in folders.items()}


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return tokenizer(PROMPT)["input_ids"]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_match_transformers(variant, folders, references, prompt):
    model = load_paged_llama(folders[variant], "float32", "cpu")
    experts = [layer.moe is not None for layer in model.layers]
    assert experts == ([False, True] if variant == "qwen3_moe_mixed" else [True, True])
    assert_matches_transformers(greedy_logits(model, prompt, pool_for(model)), references[variant], prompt)


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton interprets CPU tensors only without CUDA")
def test_the_gpu_paths_fused_kernels_match_transformers(folders, references, prompt):
    """The GPU's prefill layer and decode step, the post-attention norm's output fed to the experts
    (on the CPU, moe_forward runs the kernels' reference), a dense layer among them."""
    model = load_paged_llama(folders["qwen3_moe_mixed"], "float32", "cpu")
    model.fused_prefill = True
    logits = greedy_logits(model, prompt, pool_for(model), fused_decode(model))
    assert_matches_transformers(logits, references["qwen3_moe_mixed"], prompt)


@pytest.mark.parametrize("variant", ["mixtral", "qwen3_moe"])
def test_routing_renormalized_the_other_way_fails(variant, folders, references, prompt, monkeypatch):
    """The comparison above is tight enough to see the routing: flipping the renormalization fails it."""
    route = moe.route
    monkeypatch.setattr(moe, "route", lambda logits, routing, *rest: route(
        logits, dataclasses.replace(routing, renormalize=not routing.renormalize), *rest))
    model = load_paged_llama(folders[variant], "float32", "cpu")
    with pytest.raises(AssertionError):
        assert_matches_transformers(greedy_logits(model, prompt, pool_for(model)), references[variant], prompt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("router_class", [MixtralTopKRouter, Qwen3MoeTopKRouter])
def test_route_equals_transformers_router_bit_for_bit(router_class, dtype):
    """Qwen3-MoE rounds its weights to the activations' dtype, Mixtral keeps them in fp32."""
    config = VARIANTS["qwen3_moe_mixed" if router_class is Qwen3MoeTopKRouter else "mixtral"][1]
    torch.manual_seed(1)
    router = router_class(config).to(dtype)
    torch.nn.init.normal_(router.weight)
    hidden = torch.randn(33, config.hidden_size, dtype=dtype)
    logits, their_weights, their_ids = router(hidden)
    model_config = type("Config", (), {"model_type": config.model_type, "num_experts_per_tok": 2,
                                       "norm_topk_prob": getattr(config, "norm_topk_prob", None)})
    routing = moe.Routing.of(model_config, dtype)
    weights, ids = moe.route(logits, routing)
    assert torch.equal(ids, their_ids) and weights.dtype == torch.float32
    assert torch.equal(weights, their_weights.float())


def test_shared_weights_carry_the_experts(folders, prompt):
    """What weight_share.py publishes and maps: every tensor by name, the experts' included; a dense
    layer's none of them."""
    model = load_paged_llama(folders["qwen3_moe_mixed"], "float32", "cpu")
    named = model.weights.named()
    assert {"layers.1.moe.router", "layers.1.moe.gate_up", "layers.1.moe.down", "layers.0.gate_up"} <= named.keys()
    assert not any(name.startswith(("layers.0.moe.", "layers.1.gate_up", "layers.1.down")) for name in named)
    mapped = PagedLlama(model.config, LlamaWeights.from_named(named, model.num_layers), "cpu")
    assert torch.equal(mapped.prefill(prompt, pool_for(mapped), [0, 1]), model.prefill(prompt, pool_for(model), [0, 1]))


def test_shards_of_the_experts_sum_to_the_whole(folders):
    """Each rank's experts cut to its intermediate columns, the router whole: the ranks' outputs (what
    the all-reduce after the MLP sums) add up to the unsharded layer's."""
    model = load_paged_llama(folders["mixtral"], "float32", "cpu")
    whole = model.layers[0].moe
    hidden = torch.randn(5, model.config.hidden_size)
    routing = model.routing
    partial = []
    for rank in range(2):
        shard = shard_weights(model.weights, model.config, TensorParallel(rank, 2)).layers[0].moe
        assert shard.router is whole.router
        assert shard.gate_up.shape == (8, 32, 64) and shard.down.shape == (8, 64, 16)
        assert torch.equal(shard.gate_up[:, 16:], whole.gate_up[:, 32 + 16 * rank: 32 + 16 * (rank + 1)])
        partial.append(moe.moe_forward(hidden, shard, routing))
    expected = moe.moe_forward(hidden, whole, routing)
    torch.testing.assert_close(partial[0] + partial[1], expected, atol=1e-6, rtol=1e-5)


def test_a_dense_layer_among_experts_shards_as_a_dense_mlp(folders):
    model = load_paged_llama(folders["qwen3_moe_mixed"], "float32", "cpu")
    dense, sparse = shard_weights(model.weights, model.config, TensorParallel(1, 2)).layers
    assert dense.moe is None and dense.gate_up.shape == (32, 64) and dense.down.shape == (64, 16)
    assert sparse.gate_up is None and sparse.down is None and sparse.moe.down.shape == (8, 64, 16)


def test_fp8_experts_are_refused(folders):
    with pytest.raises(UnsupportedModel, match="FP8 weights for a mixture-of-experts model are not implemented"):
        load_paged_llama(folders["mixtral"], "float32", "cpu", quantization="fp8")


def test_a_shared_expert_is_refused():
    """Qwen2-MoE's shared expert: refused by the loader's model types, and by the weights if built anyway."""
    config = Qwen2MoeConfig(**{**SHAPE, "vocab_size": 128}, moe_intermediate_size=32, num_experts=8,
                            shared_expert_intermediate_size=32)
    with pytest.raises(UnsupportedModel, match="shared expert"):
        LlamaWeights.from_hf(Qwen2MoeForCausalLM(config), 64)


def test_the_model_types_load_and_mixtrals_window_covers_every_layer(folders, checkpoint, tmp_path):
    assert load_hf_config(folders["mixtral"]).sliding_window is None  # MixtralConfig's default: no window
    assert load_hf_config(folders["qwen3_moe"]).model_type == "qwen3_moe"
    windowed = MixtralConfig(**SHAPE, num_local_experts=8, sliding_window=48)
    folder = write_checkpoint(tmp_path / "windowed", Path(checkpoint), MixtralForCausalLM, windowed)
    assert layer_windows(load_hf_config(folder)) == [48] * windowed.num_hidden_layers


# ---- through the stack ----

@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe_mixed"])
def served(request, folders, tmp_path_factory):
    with checkpoint_stack(folders[request.param], tmp_path_factory, f"{request.param}-stack") as services:
        yield request.param, services


@pytest.mark.e2e
def test_the_stack_generates_transformers_greedy_tokens(served, references, tokenizer):
    variant, stack = served
    check_served(stack, references[variant], tokenizer, variant)
