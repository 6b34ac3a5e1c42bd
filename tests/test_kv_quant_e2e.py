"""Quantized KV and weights through the real stack: a prefill and a decode process with kv.dtype
int8, or float8_e4m3 with FP8 weights (model.quantization fp8: what an FP8 deployment runs), serve
requests whose greedy tokens equal those of the same model run in-process on a quantized pool. The decode reads every prompt token's K/V from pages the handoff brought, values
and scales: pages without their scales would read back as zeros, and the tokens would differ.
Alone, concurrently (batched in the decode), and after a prefix the prefill had cached.

Alone, the two runs compute the same numbers, so their tokens are equal: each worker is pinned to
one core, and the in-process run uses one thread too. That matters: another thread count sums the
float32 matmuls in another order, and quantizing K/V turns those last-bit differences into whole
quantization steps, enough to flip a token whose top two logits are close. Batched, the decode's
matmuls have other shapes, so the tokens may part only where the reference's top two logits are
closer than that same effect, measured in the test itself: the in-process run repeated with two
threads."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pdserve.v1 import generation_pb2
from shared.control.messages import EXIT_REFUSED
from shared.kv.pages import pages_for
from shared.kv.pool import allocate_local_pool
from shared.model.from_checkpoint import load_paged_llama
from tests.conftest import CACHE_DIR
from tests.reference import assert_matches_reference
from tests.stack import ServiceStack
from tests.test_metrics import kv_bytes_per_token, scrape, value

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12
PAGE = 16
PROMPTS = ["The three primary colors are", "def fibonacci(n):\n    ", "Zürich, Köln und Graz sind Städte in",
           "Once upon a time, in a small village,"]
SYSTEM = "You are a careful assistant. You answer every question briefly, in one sentence, and never more. "


WEIGHTS = {"int8": "none", "float8_e4m3": "fp8"}  # model.quantization beside each kv.dtype


@pytest.fixture(scope="module", params=list(WEIGHTS))
def kv_dtype(request):
    return request.param


@pytest.fixture(scope="module")
def stack(checkpoint, tmp_path_factory, kv_dtype):
    cores = sorted(os.sched_getaffinity(0))
    with ServiceStack(tmp_path_factory.mktemp(f"kv-{kv_dtype}"), CACHE_DIR, PDSERVE_KV_DTYPE=kv_dtype,
                      PDSERVE_MODEL_QUANTIZATION=WEIGHTS[kv_dtype], PDSERVE_PREFILL_CPU_CORES=str(cores[0]),
                      PDSERVE_DECODE_CPU_CORES=str(cores[-1])) as services:
        yield services
        services.stop_drained()


@pytest.fixture(scope="module")
def model(checkpoint, kv_dtype):
    return load_paged_llama(checkpoint, "float32", "cpu", WEIGHTS[kv_dtype])


class QuantizedReference:
    """The stack's model in this process, on a pool of the stack's kv.dtype: a prefill (after a
    cached prefix, if asked) and greedy decode steps one at a time."""

    def __init__(self, model, kv_dtype: str):
        self.model = model
        self.pool = allocate_local_pool(model.kv_layout(64, PAGE, kv_dtype), "cpu")[0]

    def greedy(self, prompt: list[int], pages: list[int], start: int = 0,
               threads: int = 1) -> tuple[list[int], list[torch.Tensor]]:
        """threads: 1, as each worker of the stack computes; another count, to see the effect of
        the summation order alone."""
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return self._greedy(prompt, pages, start)
        finally:
            torch.set_num_threads(before)

    def _greedy(self, prompt: list[int], pages: list[int], start: int) -> tuple[list[int], list[torch.Tensor]]:
        logits = [self.model.prefill(prompt, self.pool, pages, start=start)]
        tokens = [int(logits[-1].argmax())]
        table = torch.tensor([pages])
        for step in range(MAX_TOKENS - 1):
            position = torch.tensor([len(prompt) + step])
            logits.append(self.model.decode(torch.tensor(tokens[-1:]), position, table, self.pool)[0])
            tokens.append(int(logits[-1].argmax()))
        return tokens, logits


class Expected:
    """PROMPTS' greedy tokens and logits from the in-process run, and how far a summation in
    another order (two threads) moves those logits: computed once a kv_dtype, for every test here."""

    def __init__(self, model, tokenizer, kv_dtype: str):
        reference = QuantizedReference(model, kv_dtype)
        self.prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
        pages = [list(range(pages_for(len(ids) + MAX_TOKENS, PAGE))) for ids in self.prompts]
        self.runs = [reference.greedy(ids, p) for ids, p in zip(self.prompts, pages)]
        reordered = [reference.greedy(ids, p, threads=2) for ids, p in zip(self.prompts, pages)]
        self.order_effect = max(float((a - b).abs().max())
                                for (_, x), (_, y) in zip(self.runs, reordered) for a, b in zip(x, y))


@pytest.fixture(scope="module")
def expected(model, tokenizer, kv_dtype):
    return Expected(model, tokenizer, kv_dtype)


def _generate(stack, prompt: list[int]) -> tuple[list[int], int]:
    request = generation_pb2.GenerateRequest(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                             ignore_eos=True)
    chunks = list(stack.stub.Generate(request, timeout=120))
    return [t for chunk in chunks for t in chunk.token_ids], chunks[-1].usage.cached_prompt_tokens


def test_greedy_tokens_equal_the_in_process_quantized_run(stack, expected, kv_dtype):
    check_greedy_tokens(stack, expected, kv_dtype)


def check_greedy_tokens(stack, expected: Expected, kv_dtype: str) -> None:
    """The stack's greedy tokens are the in-process run's on a pool of kv_dtype, alone and batched."""
    for ids, (tokens, _) in zip(expected.prompts, expected.runs):
        assert _generate(stack, ids)[0] == tokens, f"{kv_dtype} prompt of {len(ids)}"
    with ThreadPoolExecutor(len(expected.prompts)) as pool:  # batched together in the decode
        answers = pool.map(lambda p: _generate(stack, p), expected.prompts)
        for ids, (got, _), (tokens, logits) in zip(expected.prompts, answers, expected.runs):
            assert_matches_reference(got, tokens, logits, f"{kv_dtype} concurrent prompt of {len(ids)}",
                                     tie=2 * expected.order_effect)


def test_a_worker_of_other_weights_is_refused(stack, kv_dtype, tmp_path):
    """A decode whose weights are quantized otherwise computes other K/V and logits: the router
    refuses it, naming the difference, and it exits EXIT_REFUSED without ever being listed."""
    other = "none" if WEIGHTS[kv_dtype] == "fp8" else "fp8"
    misfit = ServiceStack(tmp_path, CACHE_DIR, services=("decode",), PDSERVE_ROUTER_RUNTIME_DIR=stack.env[
        "PDSERVE_ROUTER_RUNTIME_DIR"], PDSERVE_DECODE_WORKER_ID="decode-misfit", PDSERVE_KV_DTYPE=kv_dtype,
        PDSERVE_MODEL_QUANTIZATION=other)
    try:
        misfit.start("decode")
        assert misfit.processes["decode"].wait(timeout=120) == EXIT_REFUSED
        ours, theirs = (f"float32{'' if q == 'none' else ' weights=' + q}" for q in (WEIGHTS[kv_dtype], other))
        assert f"dtype {theirs} instead of {ours}" in misfit.log_path("decode").read_text()
        assert "decode-misfit" not in {w.worker_id for w in stack.workers()}
    finally:
        misfit.stop()


def test_a_cached_prefix_of_quantized_pages(stack, model, tokenizer, kv_dtype):
    check_cached_prefix(stack, model, tokenizer, kv_dtype)


def check_cached_prefix(stack, model, tokenizer, kv_dtype: str) -> None:
    """The second prompt's prefill computes only what follows the first's cached pages, attending
    to them dequantized, as the in-process run does from the same pages."""
    first = tokenizer(SYSTEM + "What is the capital of France?")["input_ids"]
    second = tokenizer(SYSTEM + "Name the three primary colors.")["input_ids"]
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b) // PAGE * PAGE
    assert shared >= PAGE
    reference = QuantizedReference(model, kv_dtype)
    first_pages = list(range(pages_for(len(first) + MAX_TOKENS, PAGE)))
    expected_first = reference.greedy(first, first_pages)
    second_pages = first_pages[: shared // PAGE] + list(range(40, 40 + pages_for(len(second) + MAX_TOKENS, PAGE)
                                                              - shared // PAGE))
    expected_second = reference.greedy(second, second_pages, start=shared)

    got_first, _ = _generate(stack, first)
    got_second, cached = _generate(stack, second)
    assert cached == shared
    assert got_first == expected_first[0], f"{kv_dtype} first prompt"
    assert got_second == expected_second[0], f"{kv_dtype} prompt after a cached prefix"


def test_a_prefill_of_three_ranks_hands_its_quantized_heads_to_a_decode_of_one(stack, model, expected, kv_dtype):
    """Tensor parallelism with int8 pages (shared/worker/ranks.py): a prefill of 3 ranks, one KV head
    each, takes over from prefill-0 (last in this module: the stack's prefill is gone after it);
    decode-0 copies each rank's head and its scales into its own
    pages. Its sums run in another order than the in-process run's (three partial products), so the
    tokens may part only where the reference's top two logits are closer than that effect allows."""
    if kv_dtype != "int8":
        pytest.skip("int8 is the quantized format the tensor-parallel check runs with; float8 pages move alike")
    stack.start("prefill-1", {"PDSERVE_PREFILL_TENSOR_PARALLEL": "3"})
    stack.wait_registered({"prefill-1"})
    # Every rank's pools together: one byte per value and a float32 scale per token and KV head.
    config = model.config
    int8_bytes = kv_bytes_per_token(config, 1) + 2 * config.num_hidden_layers * config.num_key_value_heads * 4
    for worker in ("prefill-1", "decode-0"):
        role = worker.partition("-")[0]
        assert value(scrape(stack.metrics_url(worker)), "kv_bytes_per_token", worker_id=worker, role=role) == int8_bytes
    stack.signal("prefill-0", signal.SIGTERM)
    assert stack.processes["prefill-0"].wait(timeout=120) == 0
    for ids, (tokens, logits) in zip(expected.prompts, expected.runs):
        assert_matches_reference(_generate(stack, ids)[0], tokens, logits, f"TP 3 int8 prompt of {len(ids)}",
                                 tie=2 * expected.order_effect)
    stack.assert_pools_drained()
