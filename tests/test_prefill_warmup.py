"""The prompts a prefill runs before registering (services/prefill/warmup.py): a short one, one after a
cached page, and one of each length from which a kernel takes another compiled variant, as far as the
chunk size and the pool allow. On a GPU, tests/test_architectures_gpu.py checks that after them no
prompt compiles a kernel."""

from __future__ import annotations

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from services.prefill.warmup import other_ranges, warmup_prompts
from shared.kernels import fused_triton
from shared.model.from_checkpoint import load_paged_llama
from shared.model.llama import PagedLlama

PAGE = 16


def lengths(prompts) -> list[tuple[int, int]]:
    return [(len(w.prompt), w.start) for w in prompts]


def test_a_dense_model_warms_the_short_path_the_cached_path_and_blocked_rope():
    model = load_paged_llama("random:llama-tiny", "float32", "cpu")
    assert model.prefill_variant_rows() == [fused_triton.ROPE_BLOCKED_FROM_ROWS]
    prompts = warmup_prompts(model, PAGE, 64, 0, True)
    assert lengths(prompts) == [(32, 0), (32, PAGE), (512, 0)]
    assert prompts[-1].pages == list(range(32)) and prompts[0].pages == [0, 1]
    assert all(len(w.pages) * PAGE >= len(w.prompt) for w in prompts)


def test_a_variant_no_chunk_reaches_or_the_pool_cannot_hold_is_left_out():
    model = load_paged_llama("random:llama-tiny", "float32", "cpu")
    assert lengths(warmup_prompts(model, PAGE, 64, 256, True)) == [(32, 0), (32, PAGE)]
    assert lengths(warmup_prompts(model, PAGE, 31, 0, True)) == [(32, 0), (32, PAGE)]
    assert lengths(warmup_prompts(model, PAGE, 64, 512, False)) == [(32, 0), (512, 0)]


def test_experts_add_the_first_length_of_their_long_run_tiles():
    """8 experts, 2 a token: 32 pairs an expert (fused_moe_triton's long runs) from 128 tokens."""
    config = Qwen3MoeConfig(vocab_size=100, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                            num_experts=8, num_experts_per_tok=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    model = PagedLlama.from_hf(Qwen3MoeForCausalLM(config).eval(), "cpu")
    assert model.prefill_variant_rows() == [128, 512]
    assert lengths(warmup_prompts(model, PAGE, 64, 0, False)) == [(32, 0), (128, 0), (512, 0)]
    assert lengths(warmup_prompts(model, PAGE, 64, 200, False)) == [(32, 0), (128, 0)]


def test_a_range_below_the_short_prompt_gets_a_prompt_of_its_own():
    """With the first boundary at or below the short prompt's 32 tokens, shorter prompts take another
    variant: one token stands for them."""
    assert other_ranges([32, 512], 32) == [1, 512]
    assert other_ranges([20, 512], 32) == [1, 512]
    assert other_ranges([128, 512], 32) == [128, 512]
    assert other_ranges([], 32) == []
