"""Tensor-parallel workers through the real stack (gloo on the CPU, the embedded model: 9 heads, 3
KV heads): a prefill and a decode of 3 ranks or 1 pair in every combination, each decode rank
pulling its KV heads from the prefill ranks that hold them, and serve transformers' greedy tokens,
one by one, concurrently and after a cached prefix. One stack serves the three pairings in turn:
the workers a pairing needs join, the others drain away. A rank killed under load takes its worker
down as one group: every call ends with an explicit status, no page stays held, and the group
started again serves as before.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from pdserve.v1 import generation_pb2

from shared.config.loading import env_name
from shared.model.loader import load_hf_config
from shared.worker.ranks import RANK_VARIABLE
from tests.conftest import CACHE_DIR
from tests.reference import assert_matches_reference, reference_greedy
from tests.stack import ServiceStack
from tests.test_metrics import kv_bytes_per_token, scrape, value

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12
PREFILL_TP, DECODE_TP = env_name("prefill", "tensor_parallel"), env_name("decode", "tensor_parallel")
WORKERS = ("prefill-0", "prefill-1", "decode-0", "decode-1")
RANKS = {"prefill-0": 3, "prefill-1": 1, "decode-0": 1, "decode-1": 3}
PROMPTS = ["The three primary colors are", "def fibonacci(n):\n    ", "Zürich, Köln und Graz sind Städte in",
           "Once upon a time, in a small village,"]
# Longer than a page, so that the second prompt's prefill starts from the first one's cached pages.
SYSTEM = "You are a careful assistant. You answer every question briefly, in one sentence, and never more. "
CACHED = [SYSTEM + "What is the capital of France?", SYSTEM + "Name the three primary colors."]
RPC_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def stack(checkpoint, tmp_path_factory):
    """prefill-0 of 3 ranks and decode-0 of 1 to begin with; prefill-1 (1 rank) and decode-1 (3)
    join when a test pairs them."""
    service_env = {name: {PREFILL_TP if name.startswith("prefill") else DECODE_TP: str(ranks)}
                   for name, ranks in RANKS.items()}
    with ServiceStack(tmp_path_factory.mktemp("tp"), CACHE_DIR, service_env=service_env) as services:
        yield services
        services.stop_drained()


@pytest.fixture(scope="module")
def expected(tokenizer, reference_model):
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS + CACHED]
    return [(ids, *reference_greedy(reference_model, ids, MAX_TOKENS)) for ids in prompts]


def serve_only(stack: ServiceStack, prefill: str, decode: str) -> None:
    """The pair registered and every other worker gone (drained, exited 0)."""
    for name in (prefill, decode):
        if name not in stack.processes or stack.processes[name].poll() is not None:
            stack.start(name)
    stack.wait_registered({prefill, decode})
    for name in set(WORKERS) - {prefill, decode}:
        if name in stack.processes and stack.processes[name].poll() is None:
            stack.signal(name, signal.SIGTERM)
            assert stack.processes[name].wait(timeout=RPC_TIMEOUT_S) == 0, stack.tail(name)
    assert {w.worker_id for w in stack.workers()} == {prefill, decode}


def generate(stack: ServiceStack, prompt: list[int]) -> tuple[list[int], int]:
    request = generation_pb2.GenerateRequest(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0)
    chunks = list(stack.stub.Generate(request, timeout=RPC_TIMEOUT_S))
    return [t for chunk in chunks for t in chunk.token_ids], chunks[-1].usage.cached_prompt_tokens


def check_pairing(stack: ServiceStack, expected, what: str) -> None:
    """transformers' greedy tokens one by one, then concurrently (batched in the decode), then after
    a cached prefix (the prefill's ranks each start from their own cached heads)."""
    singles = expected[:len(PROMPTS)]
    for ids, tokens, logits in singles:
        assert_matches_reference(generate(stack, ids)[0], tokens, logits, f"{what}, prompt of {len(ids)}")
    with ThreadPoolExecutor(len(singles)) as pool:
        for (ids, tokens, logits), (got, _) in zip(singles, pool.map(lambda e: generate(stack, e[0]), singles)):
            assert_matches_reference(got, tokens, logits, f"{what}, concurrent prompt of {len(ids)}")
    (first, first_tokens, first_logits), (second, second_tokens, second_logits) = expected[len(PROMPTS):]
    assert_matches_reference(generate(stack, first)[0], first_tokens, first_logits, f"{what}, first of a prefix")
    got, cached = generate(stack, second)
    assert cached >= 16, f"{what}: the shared prefix was not served from the cache"
    assert_matches_reference(got, second_tokens, second_logits, f"{what}, after a cached prefix")
    stack.assert_pools_drained()


def test_a_prefill_of_three_ranks_and_a_decode_of_one(stack, expected):
    serve_only(stack, "prefill-0", "decode-0")
    check_pairing(stack, expected, "prefill TP 3, decode TP 1")


def test_three_ranks_on_both_sides(stack, expected, checkpoint):
    serve_only(stack, "prefill-0", "decode-1")
    check_pairing(stack, expected, "prefill TP 3, decode TP 3")
    whole = kv_bytes_per_token(load_hf_config(checkpoint), 4)  # every rank's pools together: the model's KV
    for worker in ("prefill-0", "decode-1"):
        role = worker.partition("-")[0]
        assert value(scrape(stack.metrics_url(worker)), "kv_bytes_per_token", worker_id=worker, role=role) == whole


def test_a_prefill_of_one_and_a_decode_of_three(stack, expected):
    serve_only(stack, "prefill-1", "decode-1")
    check_pairing(stack, expected, "prefill TP 1, decode TP 3")


def ranks_of(pid: int) -> list[int]:
    """A worker's follower ranks: the children of its rank 0 that carry a rank (shared/worker/ranks.py);
    its shared-memory resource tracker is a child too."""
    children = [int(child) for task in Path(f"/proc/{pid}/task").iterdir()
                for child in (task / "children").read_text().split()]
    return [child for child in children if f"{RANK_VARIABLE}=".encode() in Path(f"/proc/{child}/environ").read_bytes()]


def test_a_rank_killed_under_load_takes_its_worker_down_and_the_group_serves_again(stack, expected):
    serve_only(stack, "prefill-1", "decode-1")
    decode = stack.processes["decode-1"]
    followers = ranks_of(decode.pid)
    assert len(followers) == RANKS["decode-1"] - 1
    request = generation_pb2.GenerateRequest(prompt_token_ids=expected[0][0], max_tokens=400, temperature=0,
                                             ignore_eos=True)
    calls = [stack.stub.Generate(request, timeout=RPC_TIMEOUT_S) for _ in range(3)]
    with ThreadPoolExecutor(len(calls)) as pool:
        outcomes = [pool.submit(_outcome, call) for call in calls]
        _wait_decoding(stack, "decode-1", len(calls))
        os.kill(followers[-1], signal.SIGKILL)
        results = [outcome.result(timeout=RPC_TIMEOUT_S) for outcome in outcomes]
    # Each call ends with an explicit status, none hangs: 400 tokens take far longer than the kill.
    assert [status for status, _ in results] == [grpc.StatusCode.UNAVAILABLE] * len(calls), results
    assert decode.wait(timeout=RPC_TIMEOUT_S) != 0, "rank 0 went on without a rank"
    _wait_gone(followers)
    stack.start("decode-1")  # what the supervisor does, and systemd: the group starts again as one
    stack.wait_registered({"decode-1"})
    ids, tokens, logits = expected[1]
    assert_matches_reference(generate(stack, ids)[0], tokens, logits, "after the group's restart")
    stack.assert_pools_drained()


def _outcome(call) -> tuple[grpc.StatusCode, str]:
    try:
        for _ in call:
            pass
    except grpc.RpcError as error:
        return error.code(), error.details()
    return grpc.StatusCode.OK, ""


def _wait_decoding(stack: ServiceStack, decode: str, count: int) -> None:
    deadline = time.monotonic() + RPC_TIMEOUT_S
    while not any(w.worker_id == decode and w.assigned_requests >= count for w in stack.workers()):
        assert time.monotonic() < deadline, "the calls never reached the decode"
        time.sleep(0.05)


def _wait_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 30
    while any(_running(pid) for pid in pids):
        assert time.monotonic() < deadline, "a rank outlived its worker"
        time.sleep(0.1)


def _running(pid: int) -> bool:
    """Neither gone nor a zombie (the follower's parent, rank 0, has exited: init reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
