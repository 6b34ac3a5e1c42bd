"""The paged forward pass against transformers, in-process (the e2e tests do it across processes)."""

from __future__ import annotations

import pytest
import torch

from shared.kv_pool import allocate_local_pool, make_layout, pages_for
from shared.model.llama import load_paged_llama

PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "Les fleurs du jardin sont très belles et"]


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_paged_llama(checkpoint, "float32", "cpu")


@pytest.fixture()
def pool(model):
    layout = make_layout(model.num_layers, 48, 16, model.num_kv_heads, model.head_dim, torch.float32)
    return allocate_local_pool(layout, "cpu")[0]


def test_prefill_logits_match_transformers(model, pool, tokenizer, reference_model):
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        pages = list(range(pages_for(len(ids), 16)))[::-1]  # pages out of order on purpose
        ours = model.prefill(ids, pool, pages)
        with torch.no_grad():
            theirs = reference_model(torch.tensor([ids])).logits[0, -1]
        torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)


def test_batched_decode_equals_decode_alone(model, pool, tokenizer):
    """Requests of different lengths on scattered pages, stepped together, give the logits each
    gets alone: the paged attention masks every request to its own pages and length."""
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    page_sets = [[3, 17, 5, 40], [0, 22, 9, 31], [44, 2, 28, 11]]
    firsts = [int(model.prefill(ids, pool, pages).argmax()) for ids, pages in zip(prompts, page_sets)]
    positions = torch.tensor([len(ids) for ids in prompts])
    table = torch.tensor(page_sets)
    batched = model.decode(torch.tensor(firsts), positions, table, pool)
    for i in range(len(prompts)):
        alone = model.decode(torch.tensor(firsts[i:i + 1]), positions[i:i + 1], table[i:i + 1], pool)
        torch.testing.assert_close(batched[i], alone[0], atol=1e-4, rtol=1e-4)


def test_greedy_continuation_matches_transformers(model, pool, tokenizer, reference_model):
    ids = tokenizer(PROMPTS[0])["input_ids"]
    pages = list(range(pages_for(len(ids) + 16, 16)))
    tokens = [int(model.prefill(ids, pool, pages).argmax())]
    for step in range(15):
        logits = model.decode(torch.tensor(tokens[-1:]), torch.tensor([len(ids) + step]), torch.tensor([pages]), pool)
        tokens.append(int(logits[0].argmax()))
    prompt = torch.tensor([ids])
    expected = reference_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16,
                                        do_sample=False)[0, len(ids):].tolist()
    assert tokens[: len(expected)] == expected


def test_chunked_prefill_equals_whole_prefill(model, pool, tokenizer):
    ids = tokenizer("A long prompt, cut into chunks that do not line up with pages: " * 3)["input_ids"]
    pages = list(range(pages_for(len(ids), 16)))
    whole = model.prefill(ids, pool, pages)
    whole_kv = pool.kv[:, pages].clone()
    chunked = model.prefill(ids, pool, pages, chunk_tokens=7)
    torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pool.kv[:, pages], whole_kv, atol=1e-4, rtol=1e-3)


def test_prefill_after_a_cached_prefix_equals_the_whole_prefill(model, pool, tokenizer, reference_model):
    """A second prompt on the first's pages of a shared system prompt (the prefix cache's case):
    only the rest is computed, attending to those pages, which it leaves as they were."""
    system = tokenizer("You are a careful assistant. You answer every question briefly, in one sentence. ")["input_ids"]
    first = system + tokenizer("What is the capital of France?")["input_ids"]
    second = system + tokenizer("Name the three primary colors.")["input_ids"]
    shared = len(system) // 16
    assert shared >= 1
    first_pages = list(range(pages_for(len(first), 16)))
    model.prefill(first, pool, first_pages)
    cached_kv = pool.kv[:, first_pages[:shared]].clone()
    whole = model.prefill(second, pool, list(range(20, 20 + pages_for(len(second), 16))))
    own_pages = first_pages[:shared] + list(range(40, 40 + pages_for(len(second), 16) - shared))
    for chunk_tokens in (0, 5):
        ours = model.prefill(second, pool, own_pages, chunk_tokens=chunk_tokens, start=shared * 16)
        torch.testing.assert_close(ours, whole, atol=1e-4, rtol=1e-4)
    assert torch.equal(pool.kv[:, first_pages[:shared]], cached_kv)
    with torch.no_grad():
        theirs = reference_model(torch.tensor([second])).logits[0, -1]
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="at least one"):
        model.prefill(second, pool, own_pages, start=len(second))


def test_random_preset_builds_the_8b_shape():
    from shared.model.presets import preset_config

    config = preset_config("random:llama-3.1-8b")
    assert (config.num_hidden_layers, config.num_key_value_heads, config.intermediate_size) == (32, 8, 14336)
    tiny = load_paged_llama("random:llama-tiny", "float32", "cpu")
    layout = make_layout(tiny.num_layers, 8, 16, tiny.num_kv_heads, tiny.head_dim, torch.float32)
    tiny_pool = allocate_local_pool(layout, "cpu")[0]
    logits = tiny.prefill([1, 5, 9, 13], tiny_pool, [0])
    assert logits.shape == (32000,) and torch.isfinite(logits).all()
