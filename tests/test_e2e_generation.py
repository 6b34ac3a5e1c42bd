"""End to end: three real processes, real gRPC, the real model, checked against transformers."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from pdserve.v1 import generation_pb2

from shared.config.loading import load_config
from tests.conftest import CACHE_DIR, SKEWED_CLOCKS
from tests.reference import assert_matches_reference, reference_greedy
from tests.stack import ServiceStack

pytestmark = pytest.mark.e2e

MAX_TOKENS = 24

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Écris une phrase sur la mer, s'il te plaît. 日本語で一言も。"}],
]
PROMPTS = ["The three primary colors are", "def fibonacci(n):\n    ", "Zürich, Köln und Graz sind Städte in"]


def _request(kind: str, value, **fields) -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest(**{"max_tokens": MAX_TOKENS, "temperature": 0.0, **fields})
    if kind == "prompt":
        request.prompt = value
    elif kind == "messages":
        request.messages.extend(generation_pb2.ChatMessage(**m) for m in value)
    else:
        request.prompt_token_ids.extend(value)
    return request


def _prompt_ids(tokenizer, kind: str, value) -> list[int]:
    if kind == "prompt":
        return tokenizer(value)["input_ids"]
    if kind == "messages":
        return list(tokenizer.apply_chat_template(value, add_generation_prompt=True, tokenize=True)["input_ids"])
    return list(value)


def _cases(tokenizer):
    cases = [("messages", chat) for chat in CHATS] + [("prompt", p) for p in PROMPTS]
    cases.append(("prompt_token_ids", tokenizer("Once upon a time, in a small village,")["input_ids"]))
    return cases


def _generate(stub, request):
    chunks = list(stub.Generate(request, timeout=120))
    return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks), chunks[-1]


@pytest.fixture(scope="module")
def references(tokenizer, reference_model):
    return {i: reference_greedy(reference_model, _prompt_ids(tokenizer, kind, value), MAX_TOKENS)
            for i, (kind, value) in enumerate(_cases(tokenizer))}


def test_health_and_reflection(stack):
    health = health_pb2_grpc.HealthStub(stack.channel)
    for service in ("", "pdserve.v1.Generation"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(stack.channel)
    replies = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for reply in replies for s in reply.list_services_response.service}
    assert {"pdserve.v1.Generation", "grpc.health.v1.Health"} <= names


def test_greedy_matches_transformers_one_by_one(stack, tokenizer, references):
    for i, (kind, value) in enumerate(_cases(tokenizer)):
        ids, text, last = _generate(stack.stub, _request(kind, value))
        expected, logits = references[i]
        assert_matches_reference(ids, expected, logits, f"{kind} #{i}")
        assert text == tokenizer.decode(ids, skip_special_tokens=True)
        assert last.usage.prompt_tokens == len(_prompt_ids(tokenizer, kind, value))
        assert last.usage.completion_tokens == len(ids)
        assert last.finish_reason == ("stop" if ids[-1] == tokenizer.eos_token_id else "length")


def test_greedy_matches_transformers_concurrently(stack, tokenizer, references):
    cases = _cases(tokenizer)
    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(lambda case: _generate(stack.stub, _request(*case)), cases))
    for i, (ids, text, _) in enumerate(results):
        expected, logits = references[i]
        assert_matches_reference(ids, expected, logits, f"concurrent #{i}")
        assert text == tokenizer.decode(ids, skip_special_tokens=True)


# Greedy, the model goes on with the pattern, and each 🦀 it writes comes as three tokens.
MULTI_BYTE_PROMPT, MULTI_BYTE_CHARACTER = "I love 🦀 and 🦀 and 🦀 and", "🦀"


def test_chunks_never_split_a_character(stack, tokenizer):
    chunks = list(stack.stub.Generate(_request("prompt", MULTI_BYTE_PROMPT, max_tokens=12, ignore_eos=True),
                                      timeout=120))
    ids = [t for chunk in chunks for t in chunk.token_ids]
    text = "".join(chunk.text for chunk in chunks)
    assert not any("\ufffd" in chunk.text for chunk in chunks), [chunk.text for chunk in chunks]
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert MULTI_BYTE_CHARACTER in text, f"the model wrote no {MULTI_BYTE_CHARACTER}: {text!r}"
    # The character did come in pieces: a token that alone is part of it, and a chunk that held it back.
    assert any("\ufffd" in tokenizer.decode([token]) for token in ids)
    assert any(chunk.token_ids and not chunk.text for chunk in chunks)


def test_seed_reproduces_sampled_output(stack):
    def sampled(seed: int) -> list[int]:
        request = _request("prompt", "Tell me a story about a dragon.", temperature=0.9, top_p=0.95, top_k=50,
                           seed=seed, ignore_eos=True)
        return _generate(stack.stub, request)[0]

    first = sampled(1234)
    assert len(first) == MAX_TOKENS
    assert sampled(1234) == first
    assert sampled(99) != first


def test_max_tokens_and_ignore_eos(stack):
    ids, _, last = _generate(stack.stub, _request("prompt", "Hello", max_tokens=5, ignore_eos=True))
    assert len(ids) == 5 and last.finish_reason == "length"
    ids, _, last = _generate(stack.stub, _request("prompt", "Hello", max_tokens=1))
    assert len(ids) == 1 and last.finish_reason in ("length", "stop")


def test_stop_string_cuts_text(stack, tokenizer):
    chat = CHATS[0]
    full = _generate(stack.stub, _request("messages", chat))[1]
    assert "Paris" in full, full
    ids, text, last = _generate(stack.stub, _request("messages", chat, stop=["Paris"]))
    assert last.finish_reason == "stop"
    assert text == full[: full.index("Paris")]
    assert "Paris" in tokenizer.decode(ids, skip_special_tokens=True)


BAD_REQUESTS = {
    "no input": generation_pb2.GenerateRequest(),
    "two inputs": generation_pb2.GenerateRequest(prompt="hi", prompt_token_ids=[1, 2]),
    "empty prompt": generation_pb2.GenerateRequest(prompt=""),
    "max_tokens 0": generation_pb2.GenerateRequest(prompt="hi", max_tokens=0),
    "max_tokens above context": generation_pb2.GenerateRequest(prompt="hi", max_tokens=10**6),
    "prompt longer than context": generation_pb2.GenerateRequest(prompt_token_ids=[42] * 9000),
    "negative temperature": generation_pb2.GenerateRequest(prompt="hi", temperature=-0.5),
    "top_p 0": generation_pb2.GenerateRequest(prompt="hi", top_p=0.0),
    "top_p above 1": generation_pb2.GenerateRequest(prompt="hi", top_p=1.5),
    "negative top_k": generation_pb2.GenerateRequest(prompt="hi", top_k=-1),
    "top_k above the vocabulary": generation_pb2.GenerateRequest(prompt="hi", top_k=49153),
    "top_k of int32's largest": generation_pb2.GenerateRequest(prompt="hi", top_k=2**31 - 1),
    "max_tokens of uint32's largest": generation_pb2.GenerateRequest(prompt="hi", max_tokens=2**32 - 1),
    "unknown chat role":
        generation_pb2.GenerateRequest(messages=[generation_pb2.ChatMessage(role="robot", content="x")]),
    "token id outside vocabulary": generation_pb2.GenerateRequest(prompt_token_ids=[1, 49152]),
    "negative token id": generation_pb2.GenerateRequest(prompt_token_ids=[1, -3]),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_input_is_invalid_argument_and_service_keeps_serving(stack, case):
    with pytest.raises(grpc.RpcError) as error:
        list(stack.stub.Generate(BAD_REQUESTS[case], timeout=30))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
    assert error.value.details()
    ids, _, _ = _generate(stack.stub, _request("prompt", "Hello", max_tokens=2, ignore_eos=True))
    assert len(ids) == 2


def test_cancelled_request_frees_its_pages(stack):
    request = _request("prompt", "Count to one thousand:", max_tokens=400, ignore_eos=True)
    call = stack.stub.Generate(request, timeout=120)
    next(call)
    next(call)
    call.cancel()
    stack.assert_pools_drained()


def test_a_long_prompt_cancelled_while_it_runs_stops_at_the_prefills_next_chunk(stack):
    """Cancelled while the prefill computes its prompt, the request's compute ends at the next
    layer's chunk and its pages are freed; before, the prefill ran the rest of the prompt for
    nobody (seconds here, minutes for a 512K-token prompt) while every prompt behind it waited."""
    prefill_log = stack.log_path("prefill-0")
    abandoned = prefill_log.read_text().count('"event": "prompt abandoned mid-way"')
    prompt = generation_pb2.GenerateRequest(prompt_token_ids=[1000 + i % 5000 for i in range(3000)], max_tokens=2,
                                            temperature=0, ignore_eos=True)
    call = stack.stub.Generate(prompt, timeout=300)
    deadline = time.monotonic() + 60
    while not [w for w in stack.workers() if w.role == "prefill" and w.free_pages < w.total_pages]:
        assert time.monotonic() < deadline, "the prompt never took its pages"
        time.sleep(0.05)
    call.cancel()
    deadline = time.monotonic() + 120
    while prefill_log.read_text().count('"event": "prompt abandoned mid-way"') == abandoned:
        assert time.monotonic() < deadline, "the prefill computed the cancelled prompt to its end"
        time.sleep(0.1)
    assert '"reason": "aborted"' in prefill_log.read_text()
    stack.assert_pools_drained()
    ids, _, _ = _generate(stack.stub, _request("prompt", "Hello", max_tokens=2, ignore_eos=True))
    assert len(ids) == 2


def test_workers_report_their_pools(stack):
    config = load_config(None, environ=stack.env)
    stack.assert_pools_drained()  # an earlier test's cancelled request may still be in a heartbeat
    workers = {w.role: w for w in stack.workers()}
    assert set(workers) == {"prefill", "decode"}
    prefill, decode = workers["prefill"], workers["decode"]
    assert (prefill.worker_id, decode.worker_id) == (config.prefill.worker_id, config.decode.worker_id)
    assert (prefill.total_pages, decode.total_pages) == (config.kv.prefill_pages, config.kv.decode_pages)
    for worker in workers.values():
        assert worker.free_pages == worker.total_pages and worker.reserved_pages == 0, worker
        assert worker.running_requests == 0 and worker.waiting_requests == 0, worker
        assert 0 <= worker.seconds_since_heartbeat < config.router.heartbeat_timeout_s, worker


def test_oversized_request_is_refused_and_service_keeps_serving(stack):
    huge = generation_pb2.GenerateRequest(prompt="x" * (5 * 1024 * 1024))  # above router.max_request_bytes
    with pytest.raises(grpc.RpcError) as error:
        list(stack.stub.Generate(huge, timeout=30))
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(_generate(stack.stub, _request("prompt", "Hello", max_tokens=2, ignore_eos=True))[0]) == 2


def test_last_chunk_reports_stage_timings(stack):
    """The session stack's prefill and decode clocks are 10 minutes off the router's, either way
    (tests/conftest.py): a stage timed by one process's clock reading against another's would be
    off by that much, or negative."""
    started = time.perf_counter()
    chunks = []
    for chunk in stack.stub.Generate(_request("prompt", "The three primary colors are", max_tokens=4,
                                              ignore_eos=True), timeout=120):
        chunks.append((time.perf_counter() - started, chunk))
    client_ttft, client_second_token = chunks[0][0], chunks[1][0]
    assert not any(c.HasField("timings") for _, c in chunks[:-1])
    t = chunks[-1][1].timings
    stages = [t.tokenize_s, t.router_queue_s, t.prefill_queue_s, t.prefill_compute_s, t.kv_handoff_s,
              t.decode_queue_s, t.first_decode_step_s]
    assert all(s >= 0 for s in stages) and t.prefill_compute_s > 0 and t.kv_handoff_s > 0
    assert t.first_decode_step_s > 0
    # The first token's stages make up the server's TTFT, which fits inside what the client saw.
    assert sum(stages[:4]) == pytest.approx(t.first_token_s, abs=1e-6) and t.first_token_s <= client_ttft
    # The second token is the decode's first: with the decode's stages, it fits inside the client's.
    assert t.first_token_s + sum(stages[4:]) <= client_second_token


def test_the_session_stacks_workers_run_on_skewed_clocks(stack):
    """What the test above relies on: each worker's time.time is off by its CLOCK_SKEW_S."""
    for role, env in SKEWED_CLOCKS.items():
        shown = subprocess.run([sys.executable, "-c", "import time; print(time.time())"], env={**stack.env, **env},
                               capture_output=True, text=True, timeout=60, check=True).stdout
        assert float(shown) - time.time() == pytest.approx(float(env["CLOCK_SKEW_S"]), abs=30), role


def test_the_session_stacks_decode_overlaps_its_steps(stack):
    """The session stack's decode launches each step before it reads the last one back
    (SESSION_STACK_ENV): the tests on this stack check that path; the other stacks run the plain one."""
    ready = [line["overlap_steps"] for line in stack.logged("decode", "decode worker ready")]
    assert ready and all(ready), ready


def test_a_request_ended_by_its_first_token_has_no_decode_stages(stack):
    last = _generate(stack.stub, _request("prompt", "Hello", max_tokens=1))[2]
    assert last.timings.first_token_s > 0
    assert (last.timings.kv_handoff_s, last.timings.decode_queue_s, last.timings.first_decode_step_s) == (0, 0, 0)


def test_a_prompt_waiting_behind_another_counts_the_wait_as_prefill_queue(stack):
    """Two prompts at once on one prefill: the second waits while the first computes, and that wait
    (spent in the worker's socket, not yet in its queue) is prefill queue time, not router hops."""
    prompts = [[1000 + (7 * i + k) % 30000 for i in range(400)] for k in range(2)]

    def timings(prompt):
        request = generation_pb2.GenerateRequest(prompt_token_ids=prompt, max_tokens=1, temperature=0)
        return _generate(stack.stub, request)[2].timings

    with ThreadPoolExecutor(2) as pool:
        first, second = sorted(pool.map(timings, prompts), key=lambda t: t.prefill_queue_s)
    assert second.prefill_queue_s >= 0.5 * first.prefill_compute_s > 0


def _cpu_seconds(pid: int, window_s: float) -> float:
    """CPU time (user + system) the process uses over the next window_s."""
    def used() -> float:
        fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    before = used()
    time.sleep(window_s)
    return used() - before


def _quietest_second(pid: int, tries: int = 10) -> float:
    """The CPU a process uses in one second, once its start-up work is over (it registers before it
    has mapped the prefill's pool, for one): the first reading under 0.05 s, else the least of them."""
    readings = []
    while len(readings) < tries and min(readings, default=1.0) >= 0.05:
        readings.append(_cpu_seconds(pid, 1.0))
    return min(readings)


def test_a_decode_with_idle_spin_polls_after_its_work_and_sleeps_after_that(checkpoint, tmp_path):
    """A spinning decode burns CPU where a sleeping one does not. On a loaded machine the spinner gets
    only its share of a core, so it is compared with its own sleeping windows, not with a whole core:
    CPU seconds per second, the spin read over 3 of its 4 seconds so that a small share still adds
    up to many clock ticks (a CI run's spinner had 0.23 of a core, its quietest second 0.05)."""
    with ServiceStack(tmp_path, CACHE_DIR, PDSERVE_DECODE_IDLE_SPIN_S="4") as stack:
        decode = stack.processes["decode"].pid
        asleep_before = _quietest_second(decode)  # no step yet: nothing to spin after
        request = generation_pb2.GenerateRequest(prompt="Hello", max_tokens=4, ignore_eos=True, temperature=0)
        assert sum(len(c.token_ids) for c in stack.stub.Generate(request, timeout=60)) == 4
        finished = time.monotonic()
        spinning = _cpu_seconds(decode, 3.0) / 3.0
        time.sleep(max(0.0, finished + 4.5 - time.monotonic()))
        asleep_after = _cpu_seconds(decode, 1.5) / 1.5
    readings = (asleep_before, spinning, asleep_after)
    assert spinning >= 0.1 and spinning > 3 * max(asleep_before, asleep_after), readings
