"""loadtest/lib's counts, the synthetic decode batch and the baseline attention swap, on the CPU."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from loadtest.lib import baseline_attention
from loadtest.lib.decode_batch import decode_batch, request_pages
from loadtest.lib.model_costs import weight_bytes_per_step
from shared.kv.pages import PageAllocator
from shared.model import attention
from shared.model.llama import PagedLlama

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=1000, max_position_embeddings=256)


@pytest.mark.parametrize("config", [LlamaConfig(**SMALL, tie_word_embeddings=False),
                                    LlamaConfig(**SMALL, tie_word_embeddings=True),
                                    Qwen2Config(**SMALL, tie_word_embeddings=False)],  # q/k/v biases
                         ids=["untied", "tied", "biases"])
def test_a_decode_step_reads_every_parameter_but_an_untied_embedding(config):
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    parameters = sum(p.numel() * p.element_size() for p in hf.parameters())  # a tied lm_head once
    embed = hf.get_input_embeddings().weight
    gathered = 0 if config.tie_word_embeddings else embed.numel() * embed.element_size()
    assert weight_bytes_per_step(PagedLlama.from_hf(hf, "meta")) == parameters - gathered


def test_a_synthetic_batch_holds_each_context_and_feeds_its_last_token():
    allocator = PageAllocator(64)
    batch = decode_batch(allocator, [5, 17, 33], 16, "cpu", spare_tokens=16, last_tokens=[7, 8, 9])
    assert [len(r.pages) for r in batch.requests] == [request_pages(c, 16, 16) for c in (5, 17, 33)] == [2, 3, 4]
    assert [r.kv_len for r in batch.requests] == [4, 16, 32]
    assert batch.inputs.token_ids.tolist() == [7, 8, 9] and batch.inputs.positions.tolist() == [4, 16, 32]
    width = batch.inputs.page_table.shape[1]
    assert width == 3  # the pages up to the furthest position, 32 // 16 + 1
    for row, request in zip(batch.inputs.page_table.tolist(), batch.requests):
        assert row[:len(request.pages)] == request.pages[:width]
    assert allocator.num_free == 64 - 9
    assert decode_batch(PageAllocator(8), [3, 3], 16, "cpu").inputs.token_ids.tolist() == [1, 1]


def test_the_baseline_kernel_stands_in_for_the_model_s_only_inside_its_block(tmp_path):
    """An earlier kernel file, as the benchmarks load it: the decode's attention calls it inside
    in_the_model, today's kernel again after, and it is never asked for what it lacks."""
    path = tmp_path / "earlier.py"
    path.write_text("def paged_decode_attention(*args, **kwargs):\n    return ('earlier', len(args), kwargs)\n")
    earlier = baseline_attention.load(path)
    current = attention.paged_attention_triton
    with baseline_attention.in_the_model(earlier):
        assert attention.paged_attention_triton.paged_decode_attention(1, 2, fp8_query=False) == ("earlier", 2, {})
        with pytest.raises(ValueError, match="no fp8_query"):
            attention.paged_attention_triton.paged_decode_attention(1, 2, fp8_query=True)
    assert attention.paged_attention_triton is current
