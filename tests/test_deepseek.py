"""DeepSeek-V2 and V3 (multi-head latent attention, experts with shared experts and their routings)
against transformers' own implementations, with tiny random checkpoints written here; the latent
pool's layout; and one of them served by the whole stack."""

from __future__ import annotations

from pathlib import Path

import os

import pytest
import torch
import torch.multiprocessing as mp
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

from shared.kv.pool import allocate_local_pool, shard_regions, token_bytes
from shared.model import moe
from shared.model.from_checkpoint import load_paged_llama
from shared.model.llama import PagedLlama
from shared.model.loader import UnsupportedModel
from shared.model.mla import softmax_scale
from shared.model.weights import LlamaWeights
from tests.conftest import CACHE_DIR
from tests.stack import ServiceStack, free_port
from tests.test_kv_quant_e2e import Expected, check_cached_prefix, check_greedy_tokens
from tests.test_metrics import scrape, value
from tests.test_tensor_parallel_model import KV_DTYPES, LOGITS_ATOL, greedy_run, run_rank
from tests.test_qwen3 import (PROMPT, assert_matches_transformers, check_served, checkpoint_stack, fused_decode,
                              greedy_logits, pool_for, save_tiny)

# Small enough to run in seconds, every part of the architecture there: a dense first layer
# (first_k_dense_replace), then layers of routed and shared experts.
SHAPE = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
             n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=2048,
             initializer_range=0.05)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 512,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
VARIANTS = {
    # DeepSeek-V3's routing (sigmoid, correction bias, 2 of 4 groups, scaled), q through its LoRA, YaRN.
    "v3": (DeepseekV3ForCausalLM, DeepseekV3Config(**SHAPE, q_lora_rank=24, n_group=4, topk_group=2,
                                                   n_shared_experts=1, routed_scaling_factor=2.5,
                                                   norm_topk_prob=True, rope_parameters=YARN)),
    # DeepSeek-V2-Lite's: q straight from the hidden state, softmax top-k over all experts, two shared.
    "v2_lite": (DeepseekV2ForCausalLM, DeepseekV2Config(**SHAPE, q_lora_rank=None, topk_method="greedy",
                                                        n_shared_experts=2, num_key_value_heads=4)),
    # DeepSeek-V2's: softmax top-k within the 2 best of 4 groups (their best expert), scaled by 16.
    "v2_grouped": (DeepseekV2ForCausalLM, DeepseekV2Config(**SHAPE, q_lora_rank=24,
                                                           topk_method="group_limited_greedy", n_group=4,
                                                           topk_group=2, n_shared_experts=1,
                                                           routed_scaling_factor=16.0, num_key_value_heads=4)),
}


def write_checkpoint(folder: Path, tokenizer_from: Path, model_class, config) -> Path:
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():  # a correction bias large enough to change choices, so that one ignored shows
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.3, 0.3)
    return save_tiny(model, folder, tokenizer_from, ("norm.weight", "layernorm.weight"))


@pytest.fixture(scope="module")
def folders(checkpoint, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek")
    return {name: write_checkpoint(root / name, Path(checkpoint), *variant) for name, variant in VARIANTS.items()}


@pytest.fixture(scope="module")
def references(folders) -> dict:
    return {name: VARIANTS[name][0].from_pretrained(str(folder), dtype=torch.float32).eval()
            for name, folder in folders.items()}


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return tokenizer(PROMPT)["input_ids"]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_match_transformers(variant, folders, references, prompt):
    """The prefill attends through keys and values expanded from the latent, the decode in the
    absorbed form over the latent pages: both give transformers' logits."""
    model = load_paged_llama(folders[variant], "float32", "cpu")
    assert [layer.moe is not None for layer in model.layers] == [False, True, True]
    assert all(layer.mla is not None and layer.qkv is None for layer in model.layers)
    assert_matches_transformers(greedy_logits(model, prompt, pool_for(model)), references[variant], prompt)


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton interprets CPU tensors only without CUDA")
@pytest.mark.parametrize("variant", ["v3", "v2_lite"])
def test_the_gpu_prefill_and_decode_step_match_transformers(variant, folders, references, prompt):
    """The GPU's prefill and step (the fused norms and residual adds, RoPE, the latent write, the
    routing, the chosen matmuls for q, the latent, o_proj and the shared experts; the Triton kernels
    interpreted here) over the same latent pages."""
    model = load_paged_llama(folders[variant], "float32", "cpu")
    model.fused_prefill = True
    logits = greedy_logits(model, prompt, pool_for(model), fused_decode(model))
    assert_matches_transformers(logits, references[variant], prompt)


def test_a_cached_prefix_expanded_from_its_pages_gives_the_whole_prompts_logits(folders, prompt):
    model = load_paged_llama(folders["v3"], "float32", "cpu")
    pool = pool_for(model, num_pages=16)
    whole = model.prefill(prompt, pool, [0, 1])
    cached = model.prefill(prompt, pool, [0, 5], start=16)  # page 0 holds the first 16 tokens' latents
    torch.testing.assert_close(cached, whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3"])
def test_quantized_latent_pages_keep_the_logits_close(kv_dtype, folders, prompt):
    """One scale per token's latent; the decode's logits (of magnitude up to 1.7 here) within the
    format's rounding of the unquantized pages' (the last step's top two are 1e-4 apart: a tie)."""
    model = load_paged_llama(folders["v3"], "float32", "cpu")
    exact, quantized = (greedy_logits(model, prompt, pool_for(model, kv)) for kv in ("bfloat16", kv_dtype))
    torch.testing.assert_close(quantized[0], exact[0])  # the prefill attends to its own latents as computed
    torch.testing.assert_close(quantized, exact, atol={"int8": 0.01, "float8_e4m3": 0.05}[kv_dtype], rtol=0)


def test_the_pool_keeps_one_latent_shard_a_layer_256_byte_aligned(folders):
    model = load_paged_llama(folders["v3"], "float32", "cpu")
    layout = model.kv_layout(num_pages=5, page_size=16)
    latent = SHAPE["kv_lora_rank"] + SHAPE["qk_rope_head_dim"]
    assert (layout.shards_per_layer, layout.num_kv_heads, layout.head_dim) == (1, 1, latent)
    assert token_bytes(layout) == SHAPE["num_hidden_layers"] * latent * 4  # fp32: 4 bytes a value
    regions = shard_regions(layout)
    assert len(regions) == SHAPE["num_hidden_layers"] and all(offset % 256 == 0 for offset, _ in regions)
    pool = allocate_local_pool(layout, "cpu")[0]
    assert pool.latent(2).shape == (5, 16, 1, latent)
    int8 = allocate_local_pool(model.kv_layout(5, 16, "int8"), "cpu")[0]
    assert int8.latent_scale(2).shape == (5, 16, 1)  # one scale per token and layer


def test_yarns_mscale_scales_the_softmax(folders, references):
    scale = softmax_scale(references["v3"].config)
    mscale = 0.1 * 1.0 * torch.log(torch.tensor(4.0)).item() + 1.0
    assert scale == pytest.approx((16 + 8) ** -0.5 * mscale ** 2)
    assert references["v3"].model.layers[0].self_attn.scaling == pytest.approx(scale)
    assert softmax_scale(references["v2_lite"].config) == (16 + 8) ** -0.5


@pytest.mark.parametrize("variant", ["v3", "v2_grouped"])
def test_route_equals_transformers_router(variant, references):
    """Our routing of the same logits picks transformers' experts with its weights, groups, bias and scale."""
    reference = references[variant]
    gate = reference.model.layers[1].mlp.gate
    torch.manual_seed(2)
    hidden = torch.randn(41, SHAPE["hidden_size"])
    logits, their_weights, their_ids = gate(hidden)
    ours, ids = moe.route(logits, moe.Routing.of(reference.config, torch.float32),
                          getattr(gate, "e_score_correction_bias", None))
    order, their_order = ids.sort(dim=-1), their_ids.sort(dim=-1)
    assert torch.equal(order.values, their_order.values)
    torch.testing.assert_close(ours.gather(1, order.indices), their_weights.gather(1, their_order.indices))


def test_a_correction_bias_ignored_changes_the_choice(references):
    gate = references["v3"].model.layers[1].mlp.gate
    torch.manual_seed(3)
    logits = gate(torch.randn(64, SHAPE["hidden_size"]))[0]
    routing = moe.Routing.of(references["v3"].config, torch.float32)
    assert not torch.equal(moe.route(logits, routing, gate.e_score_correction_bias)[1].sort().values,
                           moe.route(logits, routing)[1].sort().values)


def test_shared_weights_carry_the_latent_and_shared_experts(folders, prompt):
    model = load_paged_llama(folders["v2_lite"], "float32", "cpu")
    named = model.weights.named()
    assert {"layers.0.mla.kv_a", "layers.0.mla.kv_b", "layers.0.mla.q", "layers.1.moe.shared_gate_up",
            "layers.1.moe.shared_down", "layers.0.gate_up"} <= named.keys()
    mapped = PagedLlama(model.config, LlamaWeights.from_named(named, model.num_layers), "cpu")
    assert torch.equal(mapped.prefill(prompt, pool_for(mapped), [0, 1]), model.prefill(prompt, pool_for(model), [0, 1]))


def test_fp8_weights_are_refused(folders):
    with pytest.raises(UnsupportedModel, match="FP8 weights"):
        load_paged_llama(folders["v2_lite"], "float32", "cpu", quantization="fp8")


@pytest.mark.e2e
@pytest.mark.slow
def test_two_ranks_of_their_heads_and_the_whole_latent_generate_what_one_process_does(folders, prompt, tmp_path):
    """Each gloo rank holds two of the four heads (q, kv_b, o_proj), half of every expert and of the
    shared experts, and the whole latent in its pool: its logits are one process's."""
    mp.spawn(run_rank, args=(str(folders["v3"]), free_port(), prompt, str(tmp_path), 2), nprocs=2)
    single = load_paged_llama(folders["v3"], "float32", "cpu")
    for kv in KV_DTYPES:
        expected = greedy_run(single, prompt, kv)
        for rank in range(2):
            saved = torch.load(tmp_path / f"rank{rank}.pt")
            assert saved["heads"] == (2, 1, 1)
            torch.testing.assert_close(saved[kv], expected, atol=LOGITS_ATOL[kv], rtol=1e-4)


# ---- through the stack ----

@pytest.fixture(scope="module", params=["v3", "v2_lite"])
def served(request, folders, tmp_path_factory):
    with checkpoint_stack(folders[request.param], tmp_path_factory, f"deepseek-{request.param}") as services:
        yield request.param, services


@pytest.mark.e2e
def test_the_stack_generates_transformers_greedy_tokens(served, references, tokenizer):
    variant, stack = served
    check_served(stack, references[variant], tokenizer, f"deepseek {variant}")


@pytest.fixture(scope="module")
def int8_stack(folders, tmp_path_factory):
    """DeepSeek-V2-Lite's architecture on int8 latent pages, each worker on one core as the in-process
    reference computes."""
    cores = sorted(os.sched_getaffinity(0))
    with ServiceStack(tmp_path_factory.mktemp("deepseek-int8"), CACHE_DIR, PDSERVE_MODEL_PATH=str(folders["v2_lite"]),
                      PDSERVE_KV_DTYPE="int8", PDSERVE_PREFILL_CPU_CORES=str(cores[0]),
                      PDSERVE_DECODE_CPU_CORES=str(cores[-1])) as services:
        yield services
        services.stop_drained()


@pytest.mark.e2e
def test_int8_latent_pages_through_the_stack(int8_stack, folders, tokenizer):
    """Alone, batched and after a cached prefix, the stack's greedy tokens are the in-process run's on
    int8 latent pages; the pool reports a byte a value plus a float32 scale per token and layer."""
    model = load_paged_llama(folders["v2_lite"], "float32", "cpu")
    check_greedy_tokens(int8_stack, Expected(model, tokenizer, "int8"), "int8")
    check_cached_prefix(int8_stack, model, tokenizer, "int8")
    decode = scrape(int8_stack.metrics_url("decode"))
    layers, latent = SHAPE["num_hidden_layers"], SHAPE["kv_lora_rank"] + SHAPE["qk_rope_head_dim"]
    assert value(decode, "kv_bytes_per_token", worker_id="decode-0", role="decode") == layers * (latent + 4)
