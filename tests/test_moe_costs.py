"""The random Qwen3-30B-A3B preset's shape and what loadtest/lib/model_costs counts for a model of
experts, on the meta device; a dense model's counts as they were."""

from __future__ import annotations

import pytest
import torch

from loadtest.lib.model_costs import (
    experts_read,
    linear_flops,
    model_shape,
    weight_bytes_per_step,
)
from shared.model import presets
from shared.model.llama import PagedLlama
from shared.model.loader import UnsupportedModel

QWEN3_MOE = "random:qwen3-30b-a3b"
BF16 = 2


@pytest.fixture(scope="module")
def hf():
    return presets.random_hf_model(QWEN3_MOE, torch.bfloat16, torch.device("meta"))


@pytest.fixture(scope="module")
def model(hf):
    return PagedLlama.from_hf(hf, "meta")


def inactive_expert_params(config) -> int:
    """The parameters of the experts a token is not routed to, over all layers."""
    expert = 3 * config.hidden_size * config.moe_intermediate_size
    return config.num_hidden_layers * (config.num_experts - config.num_experts_per_tok) * expert


def test_the_preset_is_qwen3_moe_with_128_experts_8_per_token():
    config = presets.preset_config(QWEN3_MOE)
    assert (config.model_type, config.num_experts, config.num_experts_per_tok) == ("qwen3_moe", 128, 8)
    assert (config.moe_intermediate_size, config.head_dim, config.mlp_only_layers) == (768, 128, [])


def test_the_preset_holds_30_5b_parameters_3_3b_active(hf):
    total = sum(p.numel() for p in hf.parameters())
    assert total == pytest.approx(30.5e9, rel=0.02)
    assert total - inactive_expert_params(hf.config) == pytest.approx(3.3e9, rel=0.02)


def test_llama_presets_build_the_config_they_built_before():
    from transformers import LlamaConfig

    for name in ("llama-3.1-8b", "llama-3.1-70b", "llama-3.1-8b-512k", "llama-tiny"):
        fields = presets.preset_fields(presets.PREFIX + name)
        assert "model_type" not in fields  # the fingerprint hashes these fields: unchanged
        assert presets.preset_config(presets.PREFIX + name).to_dict() == LlamaConfig(**fields).to_dict()


def hand_weight_bytes(config, experts: float) -> float:
    """Qwen3-MoE's bf16 bytes a decode step reads with `experts` experts read in each layer."""
    h, q = config.hidden_size, config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    attention = (q + 2 * kv) * h + q * h + 2 * config.head_dim  # qkv, o_proj, q_norm and k_norm
    layer = 2 * h + attention + config.num_experts * h + experts * 3 * h * config.moe_intermediate_size
    return BF16 * (config.num_hidden_layers * layer + h + config.vocab_size * h)  # final norm, lm_head


@pytest.mark.parametrize("batch", [1, 64])
def test_a_decode_step_reads_the_router_and_the_experts_its_batch_touches(model, batch):
    config = model.config
    touched = 128 * (1 - (1 - 8 / 128) ** batch)  # uniform routing: 8 at batch 1, 125.9 at 64
    assert experts_read(model, batch) == pytest.approx(touched)
    assert weight_bytes_per_step(model, batch) == pytest.approx(hand_weight_bytes(config, touched), rel=1e-9)


def test_a_decode_step_of_one_token_reads_its_active_parameters(hf, model):
    """At batch 1 a step reads exactly the active parameters, less the row-gathered embedding."""
    active = sum(p.numel() for p in hf.parameters()) - inactive_expert_params(hf.config)
    embed = hf.get_input_embeddings().weight.numel()
    assert weight_bytes_per_step(model) == pytest.approx(BF16 * (active - embed), rel=1e-9)


def test_linear_flops_count_the_router_and_the_top_k_experts(hf, model):
    """2 x the active parameters per token, less the embedding and the norms (not matmuls), the
    lm_head counted once, for the last position."""
    active = sum(p.numel() for p in hf.parameters()) - inactive_expert_params(hf.config)
    norms = sum(p.numel() for p in hf.parameters() if p.dim() == 1)
    embed, lm_head = hf.get_input_embeddings().weight.numel(), hf.lm_head.weight.numel()
    per_token = active - embed - norms - lm_head
    assert linear_flops(model, 1) == 2 * (per_token + lm_head)
    assert linear_flops(model, 100) == 2 * (100 * per_token + lm_head)


def test_model_shape_builds_experts_on_meta_and_refuses_fp8_for_them():
    model = model_shape(QWEN3_MOE, torch.bfloat16)
    assert model.layers[0].moe.gate_up.shape == (128, 2 * 768, 2048) and model.layers[0].gate_up is None
    with pytest.raises(UnsupportedModel):
        model_shape(QWEN3_MOE, torch.bfloat16, "fp8")


def test_a_dense_model_s_counts_are_as_before():
    """Llama-3.1-8B: every named weight but the embedding and RoPE tables, whatever the batch; its
    linears 2 x 6.98B parameters per token."""
    model = model_shape("random:llama-3.1-8b", torch.bfloat16)
    before = sum(t.numel() * t.element_size() for name, t in model.weights.named().items()
                 if name not in ("embed", "cos", "sin"))
    assert weight_bytes_per_step(model) == weight_bytes_per_step(model, 64) == before == 15_009_849_344
    linear = sum(l.qkv.numel() + l.o_proj.numel() + l.gate_up.numel() + l.down.numel() for l in model.layers)
    assert linear_flops(model, 10) == 2 * linear * 10 + 2 * model.lm_head.numel()
