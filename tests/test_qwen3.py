"""Qwen3 against transformers: its RMSNorm over each head's q and k before RoPE, its head_dim of its
own (32 here, where hidden / heads is 16), in every path that computes q and k, in-process and
through the real stack. The checkpoint is a tiny random one written with transformers, its norms
and biases drawn at random (transformers starts them at ones and zeros, which would hide a
skipped norm), the embedded model's tokenizer beside it."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from pdserve.v1 import generation_pb2
from transformers import Qwen3Config, Qwen3ForCausalLM

from shared.kv.pages import pages_for
from shared.kv.pool import allocate_local_pool
from shared.model.from_checkpoint import load_paged_llama
from shared.model.llama import PagedLlama
from shared.model.loader import UnsupportedModel, layer_windows, load_hf_config
from shared.model.tensor_parallel import TensorParallel, shard_weights
from shared.model.weights import LlamaWeights
from tests.conftest import CACHE_DIR
from tests.reference import assert_matches_reference, reference_greedy
from tests.stack import ServiceStack
from tests.test_metrics import kv_bytes_per_token, scrape, value

# The embedded tokenizer's vocabulary. initializer_range 0.05, not transformers' 0.02: attention then
# weighs enough that without the head norms every prompt of the stack's test goes another way at once.
SHAPE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, initializer_range=0.05)
VARIANTS = {"tied": dict(tie_word_embeddings=True),  # as Qwen3-0.6B is
            "biased": dict(tie_word_embeddings=False, attention_bias=True)}  # q, k, v and o_proj biases
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
PAGE = 16
DECODE_STEPS = 6
PROMPT = "Paged attention splits the key-value cache into fixed-size blocks, so that"


def save_tiny(model, folder: Path, tokenizer_from: Path, perturbed: tuple[str, ...]) -> Path:
    """A random model saved as transformers saves one, the embedded tokenizer beside it; the
    parameters whose names end in `perturbed` drawn in [0.5, 1.5], so that one left out shows."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(perturbed):
                parameter.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    (folder / "generation_config.json").unlink()  # transformers writes one of its own
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, folder / name)
    return folder


def write_qwen3(folder: Path, tokenizer_from: Path, **settings) -> Path:
    torch.manual_seed(0)
    return save_tiny(Qwen3ForCausalLM(Qwen3Config(**SHAPE, **settings)), folder, tokenizer_from,
                     ("norm.weight", ".bias"))


@pytest.fixture(scope="module")
def folders(checkpoint, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen3")
    return {name: write_qwen3(root / name, Path(checkpoint), **settings) for name, settings in VARIANTS.items()}


@pytest.fixture(scope="module")
def references(folders) -> dict[str, Qwen3ForCausalLM]:
    return {name: Qwen3ForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
            for name, folder in folders.items()}


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return tokenizer(PROMPT)["input_ids"]


def pool_for(model: PagedLlama, kv_dtype: str = "bfloat16", num_pages: int = 8):
    return allocate_local_pool(model.kv_layout(num_pages, PAGE, kv_dtype), "cpu")[0]


def greedy_logits(model: PagedLlama, prompt: list[int], pool, decode=None) -> torch.Tensor:
    """The prefill's logits, then DECODE_STEPS greedy steps' [1 + DECODE_STEPS, V], on pages out of order."""
    decode = decode or model.decode
    pages = list(range(pages_for(len(prompt) + DECODE_STEPS, PAGE)))[::-1]
    logits = [model.prefill(prompt, pool, pages)]
    for step in range(DECODE_STEPS):
        token, position = logits[-1].argmax()[None], torch.tensor([len(prompt) + step])
        logits.append(decode(token, position, torch.tensor([pages]), pool)[0])
    return torch.stack(logits)


def fused_decode(model: PagedLlama):
    """The GPU's decode step (Triton kernels, here interpreted) on the CPU's tensors."""
    def step(token_ids, positions, page_table, pool):
        pages = page_table.gather(1, (positions // PAGE)[:, None])[:, 0]
        return model._decode_fused(token_ids, positions, page_table, pool, pages, positions % PAGE, positions + 1)
    return step


def assert_matches_transformers(logits: torch.Tensor, reference, prompt: list[int]) -> None:
    tokens, expected = reference_greedy(reference, prompt, DECODE_STEPS + 1)
    assert logits.argmax(-1).tolist() == tokens
    torch.testing.assert_close(logits, torch.stack(expected), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_match_transformers(variant, folders, references, prompt):
    model = load_paged_llama(folders[variant], "float32", "cpu")
    assert model.head_dim == 32 and model.layers[0].q_norm is not None
    assert_matches_transformers(greedy_logits(model, prompt, pool_for(model)), references[variant], prompt)


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton interprets CPU tensors only without CUDA")
def test_the_gpu_paths_fused_kernels_match_transformers(folders, references, prompt):
    """The GPU's prefill layer and decode step, whose norms run on the fused projection in place
    (the biased variant: whether the embeddings are tied changes nothing there)."""
    model = load_paged_llama(folders["biased"], "float32", "cpu")
    model.fused_prefill = True
    logits = greedy_logits(model, prompt, pool_for(model), fused_decode(model))
    assert_matches_transformers(logits, references["biased"], prompt)


def test_int8_pages_keep_the_greedy_tokens(folders, prompt):
    """The prefill attends to its own K/V as computed; the decode reads them back dequantized."""
    model = load_paged_llama(folders["tied"], "float32", "cpu")
    exact, int8 = (greedy_logits(model, prompt, pool_for(model, kv)) for kv in ("bfloat16", "int8"))
    torch.testing.assert_close(int8[0], exact[0])
    assert torch.equal(int8.argmax(-1), exact.argmax(-1))


def test_shared_weights_keep_the_head_norms(folders, prompt):
    """What weight_share.py publishes and maps: every tensor by name, the head norms included."""
    model = load_paged_llama(folders["biased"], "float32", "cpu")
    named = model.weights.named()
    assert {"layers.1.q_norm", "layers.1.k_norm", "layers.1.o_proj_bias"} <= named.keys()
    mapped = PagedLlama(model.config, LlamaWeights.from_named(named, model.num_layers), "cpu")
    assert torch.equal(mapped.prefill(prompt, pool_for(mapped), [0, 1]), model.prefill(prompt, pool_for(model), [0, 1]))


def test_weights_without_the_head_norms_are_refused(folders):
    model = load_paged_llama(folders["tied"], "float32", "cpu")
    for layer in model.layers:
        layer.q_norm = layer.k_norm = None
    with pytest.raises(UnsupportedModel, match="lack the per-head q_norm/k_norm"):
        PagedLlama(model.config, model.weights, "cpu")


def test_a_shard_replicates_the_head_norms_and_adds_the_bias_once(folders):
    model = load_paged_llama(folders["biased"], "float32", "cpu")
    whole = model.layers[0]
    for rank in range(2):
        layer = shard_weights(model.weights, model.config, TensorParallel(rank, 2)).layers[0]
        assert layer.q_norm is whole.q_norm and layer.k_norm is whole.k_norm
        assert layer.o_proj_bias is (whole.o_proj_bias if rank == 0 else None)


def test_a_sliding_window_covers_the_layers_from_max_window_layers_on(checkpoint, tmp_path):
    """As transformers reads max_window_layers (shared/model/loader.py layer_windows)."""
    folder = write_qwen3(tmp_path / "windowed", Path(checkpoint), use_sliding_window=True, sliding_window=48,
                         max_window_layers=1)
    assert layer_windows(load_hf_config(folder)) == [0, 48]


def test_qwen3s_default_window_unused_loads(folders):
    """Qwen3Config's sliding_window of 4096 counts only with use_sliding_window, off by default."""
    config = load_hf_config(folders["tied"])
    assert (config.model_type, config.use_sliding_window, config.sliding_window) == ("qwen3", False, None)


# ---- through the stack ----

MAX_TOKENS = 8
PROMPTS = ["The three primary colors are", "def fibonacci(n):\n    ", "Zürich, Köln und Graz sind Städte in"]
SYSTEM = "You are a careful assistant. You answer every question briefly, in one sentence, and never more. "


@contextmanager
def checkpoint_stack(folder: Path, tmp_path_factory, name: str) -> Iterator[ServiceStack]:
    """The whole stack serving the checkpoint in `folder`, drained at the end."""
    with ServiceStack(tmp_path_factory.mktemp(name), CACHE_DIR, PDSERVE_MODEL_PATH=str(folder)) as services:
        yield services
        services.stop_drained()


@pytest.fixture(scope="module")
def stack(folders, tmp_path_factory):
    with checkpoint_stack(folders["tied"], tmp_path_factory, "qwen3-stack") as services:
        yield services


def generate(stack, prompt: list[int]) -> tuple[list[int], int]:
    request = generation_pb2.GenerateRequest(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                             ignore_eos=True)  # the random model's eos comes whenever
    chunks = list(stack.stub.Generate(request, timeout=120))
    return [t for chunk in chunks for t in chunk.token_ids], chunks[-1].usage.cached_prompt_tokens


def check_served(stack, reference, tokenizer, what: str) -> None:
    """transformers' greedy tokens alone, concurrently (batched in the decode) and after a cached
    prefix; the pool's KV bytes per token as the config says (Qwen3's head_dim of 32 is not hidden /
    heads)."""
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    expected = [reference_greedy(reference, ids, MAX_TOKENS) for ids in prompts]
    for i, (ids, (tokens, logits)) in enumerate(zip(prompts, expected)):
        assert_matches_reference(generate(stack, ids)[0], tokens, logits, f"{what} prompt #{i}")
    with ThreadPoolExecutor(len(prompts)) as pool:
        for i, ((got, _), (tokens, logits)) in enumerate(zip(pool.map(lambda p: generate(stack, p), prompts),
                                                             expected)):
            assert_matches_reference(got, tokens, logits, f"{what} concurrent prompt #{i}")
    first, second = (tokenizer(SYSTEM + question)["input_ids"]
                     for question in ("What is the capital of France?", "Name the three primary colors."))
    generate(stack, first)
    tokens, cached = generate(stack, second)
    assert cached >= PAGE
    assert_matches_reference(tokens, *reference_greedy(reference, second, MAX_TOKENS), f"{what} after a cached prefix")
    decode = scrape(stack.metrics_url("decode"))
    assert value(decode, "kv_bytes_per_token", worker_id="decode-0", role="decode") == kv_bytes_per_token(
        reference.config, 4)


@pytest.mark.e2e
def test_the_stack_generates_transformers_greedy_tokens(stack, references, tokenizer):
    check_served(stack, references["tied"], tokenizer, "qwen3")
