"""The paged forward pass against transformers, in-process (the e2e tests do it across processes)."""

from __future__ import annotations

import pytest
import torch

from shared.kernels import fused_triton, kv_quant
from shared.kv.pages import pages_for
from shared.kv.pool import allocate_local_pool
from shared.model.from_checkpoint import load_paged_llama

PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "Les fleurs du jardin sont très belles et"]
KV_FORMATS = ["int8", "float8_e4m3"]
# How far the embedded model's logits (up to ~20) may move when a cached prefix's K/V come from
# quantized pages (when a prompt's own earlier chunks were read back from them too, they moved 0.15
# for int8 and 0.32 for float8_e4m3).
QUANTIZED_LOGITS_ATOL = 1.0


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_paged_llama(checkpoint, "float32", "cpu")


@pytest.fixture()
def pool(model):
    layout = model.kv_layout(48, 16)
    return allocate_local_pool(layout, "cpu")[0]


@pytest.mark.slow
def test_prefill_logits_match_transformers(model, pool, tokenizer, reference_model):
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        pages = list(range(pages_for(len(ids), 16)))[::-1]  # pages out of order on purpose
        ours = model.prefill(ids, pool, pages)
        with torch.no_grad():
            theirs = reference_model(torch.tensor([ids])).logits[0, -1]
        torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_chunked_prefill_equals_whole_prefill(model, pool, tokenizer):
    ids = tokenizer("A long prompt, cut into chunks that do not line up with pages: " * 3)["input_ids"]
    pages = list(range(pages_for(len(ids), 16)))
    whole = model.prefill(ids, pool, pages)
    whole_kv = pool.kv[:, pages].clone()
    chunked = model.prefill(ids, pool, pages, chunk_tokens=7)
    torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pool.kv[:, pages], whole_kv, atol=1e-4, rtol=1e-3)


@pytest.mark.slow
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


def quantized_pool(model, kv_dtype: str, num_pages: int = 48):
    layout = model.kv_layout(num_pages, 16, kv_dtype)
    return allocate_local_pool(layout, model.device)[0]


def first_tokens(kv, count: int) -> torch.Tensor:
    """[shards, count, ...]: the first `count` token slots of the pages kv[:, pages] lists."""
    return kv.flatten(1, 2)[:, :count]


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", KV_FORMATS)
def test_quantized_prefill_in_chunks_and_after_a_cached_prefix(model, pool, tokenizer, kv_dtype):
    """A prompt attends to its own K/V as computed, whole or in chunks (the prefill keeps them
    beside the pages), so its logits are the unquantized cache's; its pages hold that K/V
    quantized. After a cached prefix, the prefix's K/V come from the quantized pages: the logits
    move within quantization error, and the cached pages stay as they were."""
    quantized = quantized_pool(model, kv_dtype)
    ids = tokenizer("A long prompt, cut into chunks that do not line up with pages: " * 3)["input_ids"]
    pages = list(range(pages_for(len(ids), 16)))
    exact = model.prefill(ids, pool, pages)
    whole = model.prefill(ids, quantized, pages)
    torch.testing.assert_close(whole, exact, atol=1e-5, rtol=1e-5)
    values, scales = kv_quant.quantize(first_tokens(pool.kv[:, pages], len(ids)), quantized.kv.dtype)
    assert torch.equal(first_tokens(quantized.kv[:, pages], len(ids)).view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(first_tokens(quantized.scales[:, pages], len(ids)), scales)
    chunked = model.prefill(ids, quantized, pages, chunk_tokens=7)
    torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=1e-4)

    system = tokenizer("You are a careful assistant. You answer every question briefly, in one sentence. ")["input_ids"]
    first = system + tokenizer("What is the capital of France?")["input_ids"]
    second = system + tokenizer("Name the three primary colors.")["input_ids"]
    shared = len(system) // 16
    first_pages = list(range(pages_for(len(first), 16)))
    model.prefill(first, quantized, first_pages)
    cached = quantized.kv[:, first_pages[:shared]].clone(), quantized.scales[:, first_pages[:shared]].clone()
    whole = model.prefill(second, quantized, list(range(20, 20 + pages_for(len(second), 16))))
    own_pages = first_pages[:shared] + list(range(40, 40 + pages_for(len(second), 16) - shared))
    for chunk_tokens in (0, 5):
        ours = model.prefill(second, quantized, own_pages, chunk_tokens=chunk_tokens, start=shared * 16)
        assert (ours - whole).abs().max() < QUANTIZED_LOGITS_ATOL and ours.argmax() == whole.argmax()
    assert torch.equal(quantized.kv[:, first_pages[:shared]].view(torch.uint8), cached[0].view(torch.uint8))
    assert torch.equal(quantized.scales[:, first_pages[:shared]], cached[1])


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", KV_FORMATS)
def test_quantized_decode_keeps_the_greedy_tokens(model, pool, tokenizer, kv_dtype):
    """Batched decode steps over quantized pages (the CPU path: dequantized gathers) generate the
    unquantized cache's greedy tokens on a prompt whose continuation has clear margins."""
    quantized = quantized_pool(model, kv_dtype)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    page_sets = [[3, 17, 5], [0, 22, 9]]
    table = torch.tensor(page_sets)
    tokens = {}
    for name, kv in (("exact", pool), (kv_dtype, quantized)):
        step = torch.stack([model.prefill(ids, kv, pages).argmax() for ids, pages in zip(prompts, page_sets)])
        generated = [step]
        for i in range(11):
            positions = torch.tensor([len(ids) + i for ids in prompts])
            generated.append(model.decode(generated[-1], positions, table, kv).argmax(-1))
        tokens[name] = torch.stack(generated, dim=1)
    assert torch.equal(tokens[kv_dtype], tokens["exact"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton interprets CPU tensors only without CUDA; on a GPU, "
                    "test_kv_quant.py compares the compiled kernels with the CPU path")
def test_the_gpu_prefills_fused_quantized_write_equals_the_cpu_path():
    """On a GPU a quantizing prefill writes its K/V with the Triton RoPE kernel (here interpreted),
    after the Triton RMSNorm: q, k, v as _qkv computes them, within float32 rounding, and the pages
    and scales the pool's own write makes of that K/V."""
    tiny = load_paged_llama("random:llama-tiny", "float32", "cpu")
    fused, plain = quantized_pool(tiny, "int8", 8), quantized_pool(tiny, "int8", 8)
    x = tiny.embed[torch.tensor([1, 5, 9, 13, 200, 31, 7, 2, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20])]
    positions = torch.arange(3, 3 + len(x))
    pages, offsets = torch.tensor([2, 5])[positions // 16], positions % 16
    k = torch.empty((len(x), tiny.num_kv_heads, tiny.head_dim))
    q, v = tiny._fused_qkv(tiny.layers[1], x, positions, fused, 1, pages, offsets, k)
    ref_q, ref_k, ref_v = tiny._qkv(tiny.layers[1], x, positions)
    plain.write(1, pages, offsets, k, v)
    torch.testing.assert_close((q, k, v), (ref_q, ref_k, ref_v), atol=1e-6, rtol=1e-6)
    assert torch.equal(fused.kv, plain.kv) and torch.equal(fused.scales, plain.scales)


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton interprets CPU tensors only without CUDA; on a GPU, "
                    "test_gpu.py and test_kv_quant.py compare the compiled path with the CPU's")
@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_the_gpu_prefills_fused_layers_equal_the_cpu_path(kv_dtype, monkeypatch):
    """The GPU's prefill layer (Triton RMSNorm, RoPE with the KV write, SiLU; here interpreted), with
    the residual adds in the matmuls and apart (as FP8 weights and tensor parallelism have them),
    against the CPU's, on a prompt in chunks after a cached prefix: the same logits and the same
    pages, within float32 rounding. The RoPE runs blocks of rows a program, as chunks of 512 rows
    or more do: its one-row programs, interpreted, took 93% of this test (test_fused_triton.py
    checks both)."""
    monkeypatch.setattr(fused_triton, "ROPE_BLOCKED_FROM_ROWS", 1)
    tiny = load_paged_llama("random:llama-tiny", "float32", "cpu")
    prompt, pages = list(range(3, 44)), [4, 1, 6]
    runs = {}
    for fused, adds_in_matmuls in ((False, True), (True, True), (True, False)):
        pool = quantized_pool(tiny, kv_dtype, 8) if kv_dtype != "float32" else allocate_local_pool(
            tiny.kv_layout(8, 16), "cpu")[0]
        tiny.fused_prefill = False
        tiny.prefill(prompt[:16] + [7], pool, pages[:2])  # the cached prefix: page 4
        tiny.fused_prefill, tiny.adds_in_matmuls = fused, adds_in_matmuls
        runs[fused, adds_in_matmuls] = tiny.prefill(prompt, pool, pages, chunk_tokens=10, start=16), pool
    plain, plain_pool = runs.pop((False, True))
    for fused, fused_pool in runs.values():
        torch.testing.assert_close(fused, plain, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(fused_pool.kv.float(), plain_pool.kv.float(),
                                   atol=1.0 if kv_dtype == "int8" else 1e-5, rtol=1e-5)


def test_random_preset_builds_the_8b_shape():
    from shared.model.presets import preset_config

    config = preset_config("random:llama-3.1-8b")
    assert (config.num_hidden_layers, config.num_key_value_heads, config.intermediate_size) == (32, 8, 14336)
    tiny = load_paged_llama("random:llama-tiny", "float32", "cpu")
    layout = tiny.kv_layout(8, 16)
    tiny_pool = allocate_local_pool(layout, "cpu")[0]
    logits = tiny.prefill([1, 5, 9, 13], tiny_pool, [0])
    assert logits.shape == (32000,) and torch.isfinite(logits).all()


def test_building_a_presets_config_leaves_its_fingerprint_as_the_router_hashed_it():
    """transformers' config writes into nested dicts (the 512K preset's rope_scaling): a preset handed
    over by reference made every worker's config_sha differ from the router's, which refused them."""
    from shared.model.fingerprint import checkpoint_fingerprint
    from shared.model.presets import preset_config

    preset = "random:llama-3.1-8b-512k"
    before = checkpoint_fingerprint(preset)
    preset_config(preset)
    assert checkpoint_fingerprint(preset) == before
