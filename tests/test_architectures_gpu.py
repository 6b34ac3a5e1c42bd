"""Qwen3, Mixtral (a sliding window), Qwen3-MoE (a dense layer among experts) and DeepSeek-V2/V3 (MLA
over the Triton latent kernel, shared experts) on the GPU: the step and the prefill against the CPU
path (checked against transformers in test_qwen3.py, test_moe.py and test_deepseek.py), a CUDA-graph
replay against the eager step, and greedy tokens against transformers' own on the GPU. Tiny random
models, built in memory."""

from __future__ import annotations

import pytest
import torch
from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM,
                          MixtralConfig, MixtralForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

from services.prefill.warmup import warmup_prompts
from shared.kv.pages import pages_for
from shared.kv.pool import allocate_local_pool
from shared.model.llama import PagedLlama
from tests.reference import assert_matches_reference, reference_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPE = dict(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, initializer_range=0.05,
             tie_word_embeddings=False)
# The latent and the RoPE key a power of two each, as the kernel's tiles need and DeepSeek's are (512, 64).
MLA_SHAPE = dict(vocab_size=1000, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                 num_hidden_layers=2, num_attention_heads=4, kv_lora_rank=64, qk_nope_head_dim=32,
                 qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
                 first_k_dense_replace=1, max_position_embeddings=1024, initializer_range=0.05,
                 tie_word_embeddings=False)
ARCHITECTURES = {
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(**SHAPE, attention_bias=True)),
    "mixtral": (MixtralForCausalLM, MixtralConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2,
                                                  sliding_window=24)),
    "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(**SHAPE, num_experts=8, num_experts_per_tok=2,
                                                      moe_intermediate_size=64, norm_topk_prob=True,
                                                      decoder_sparse_step=1, mlp_only_layers=[1])),
    "deepseek_v3": (DeepseekV3ForCausalLM, DeepseekV3Config(**MLA_SHAPE, q_lora_rank=48, n_group=4, topk_group=2,
                                                            n_shared_experts=1, routed_scaling_factor=2.5)),
    "deepseek_v2": (DeepseekV2ForCausalLM, DeepseekV2Config(**MLA_SHAPE, q_lora_rank=None, topk_method="greedy",
                                                            n_shared_experts=2, num_key_value_heads=4)),
}
PAGE = 16
PROMPTS = (list(range(5, 45)), list(range(60, 73)))  # 40 tokens: past Mixtral's window of 24


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def hf(request):
    model_class, config = ARCHITECTURES[request.param]
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():  # norms away from 1, so that a norm left out shows
        for name, parameter in model.named_parameters():
            if name.endswith(("norm.weight", ".bias", "layernorm.weight")):
                parameter.uniform_(0.5, 1.5)
    return model.to("cuda:0")


def _prefill_and_decode(model, device: str):
    pool = allocate_local_pool(model.kv_layout(16, PAGE), device)[0]
    tables = ([3, 7, 1], [9, 0, 0])
    prefills = [model.prefill(prompt, pool, pages) for prompt, pages in zip(PROMPTS, tables)]
    decoded = model.decode(torch.tensor([11, 12], device=device), torch.tensor([40, 13], device=device),
                           torch.tensor(tables, device=device), pool)
    return torch.stack([p.float().cpu() for p in prefills]), decoded.float().cpu()


def test_the_gpu_path_equals_the_cpu_path(hf):
    from shared.model.llama import PagedLlama

    gpu = _prefill_and_decode(PagedLlama.from_hf(hf, "cuda:0"), "cuda:0")
    cpu = _prefill_and_decode(PagedLlama.from_hf(hf.cpu(), "cpu"), "cpu")
    hf.to("cuda:0")
    for got, expected in zip(gpu, cpu):
        torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)


def test_a_graph_replay_equals_the_eager_step(hf):
    from shared.model.llama import PagedLlama
    from tests.decode_inputs import assert_graph_replay_equals_eager

    assert_graph_replay_equals_eager(PagedLlama.from_hf(hf, "cuda:0"))


def test_greedy_tokens_equal_transformers_on_the_gpu(hf):
    from shared.model.llama import PagedLlama

    model = PagedLlama.from_hf(hf, "cuda:0")
    prompt, steps = PROMPTS[0], 8
    pool = allocate_local_pool(model.kv_layout(8, PAGE), "cuda:0")[0]
    pages = torch.tensor([list(range(pages_for(len(prompt) + steps, PAGE)))[::-1]], device="cuda:0")
    token = int(model.prefill(prompt, pool, pages[0].tolist()).argmax())
    tokens = [token]
    for step in range(steps - 1):
        logits = model.decode(torch.tensor([token], device="cuda:0"),
                              torch.tensor([len(prompt) + step], device="cuda:0"), pages, pool)
        token = int(logits[0].argmax())
        tokens.append(token)
    expected, reference_logits = reference_greedy(hf, prompt, steps)
    assert_matches_reference(tokens, expected, reference_logits, "greedy tokens on the GPU")


def test_after_the_warmup_no_prompt_compiles_a_kernel(hf):
    """services/prefill/warmup.py's prompts compile every kernel variant the prefill reaches: prompts of
    other lengths, whole, in chunks and after a cached prefix, compile nothing more (a compile during
    a request holds the GIL and silences the worker's heartbeat thread)."""
    import triton

    model, pages = PagedLlama.from_hf(hf, "cuda:0"), 64
    pool = allocate_local_pool(model.kv_layout(pages, PAGE), "cuda:0")[0]
    for warmup in warmup_prompts(model, PAGE, pages, 0, True):
        model.prefill(warmup.prompt, pool, warmup.pages, start=warmup.start)
    torch.cuda.synchronize()
    compiled = []
    triton.knobs.runtime.jit_post_compile_hook = lambda **hook: compiled.append(hook["repr"])
    try:
        for length, chunk, start in ((1, 0, 0), (7, 0, 0), (100, 0, 0), (513, 0, 0), (700, 256, 0), (700, 0, 17),
                                     (45, 0, 32)):
            model.prefill(list(range(3, 3 + length)), pool, list(range(pages_for(length, PAGE))), chunk, start=start)
        torch.cuda.synchronize()
    finally:
        triton.knobs.runtime.jit_post_compile_hook = None
    assert compiled == []
