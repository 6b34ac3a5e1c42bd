"""loadtest/lib/generate_client.py: the request every load tool sends, and one stream read into a record,
blocking and with grpc.aio alike; the benchmarks' call that must come back whole."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from pdserve.v1 import generation_pb2

from loadtest.lib.generate_client import (STAGE_FIELDS, StreamRecord, generate_or_raise, generate_request, read_stream,
                                          read_stream_async)
from loadtest.lib.workload import RequestSpec

SPEC = RequestSpec("fixed", (5, 6, 7), 9, seed=3)


def test_requests_are_greedy_unless_a_tool_asks_for_sampling():
    request = generate_request(SPEC, "r-1")
    # Present and 0: an unset temperature would sample at the API's default of 1.0.
    assert request.HasField("temperature") and request.temperature == 0.0
    assert list(request.prompt_token_ids) == [5, 6, 7] and request.max_tokens == 9 and request.seed == 3
    assert request.ignore_eos and request.request_id == "r-1"
    sampled = generate_request(SPEC, temperature=0.7, ignore_eos=False)
    assert sampled.temperature == pytest.approx(0.7) and not sampled.ignore_eos


def stream() -> list[generation_pb2.GenerateResponse]:
    timings = generation_pb2.StageTimings(first_token_s=0.25, kv_handoff_s=0.01)
    return [generation_pb2.GenerateResponse(token_ids=[1], text="a"),
            generation_pb2.GenerateResponse(token_ids=[2, 3], text="bc"),
            generation_pb2.GenerateResponse(token_ids=[4], text="d", finish_reason="length", timings=timings)]


class Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "worker died"


def failing_stream():
    yield generation_pb2.GenerateResponse(token_ids=[1])
    raise Unavailable()


async def as_async(chunks):
    for chunk in chunks:
        yield chunk


def clock(*times: float):
    return iter(times).__next__


def test_a_stream_is_recorded_the_same_blocking_and_async():
    blocking = read_stream(stream(), StreamRecord(started_s=9.0), clock(10.0, 11.0, 13.0, 14.0))
    awaited = asyncio.run(read_stream_async(as_async(stream()), StreamRecord(started_s=9.0),
                                            clock(10.0, 11.0, 13.0, 14.0)))
    assert blocking == awaited
    assert blocking.ok and blocking.token_ids == [1, 2, 3, 4] and blocking.finish_reason == "length"
    assert blocking.chunk_times_s == [10.0, 11.0, 13.0] and blocking.ended_s == 14.0
    assert blocking.ttft_s == 1.0 and blocking.e2e_s == 5.0
    assert blocking.tpot_s == pytest.approx((14.0 - 10.0) / 3)  # from the first token to the end, per later token
    assert blocking.itls_s == [1.0, 2.0]  # one gap per chunk, however many tokens it holds
    assert set(blocking.timings) == set(STAGE_FIELDS)
    assert blocking.timings["first_token_s"] == 0.25 and blocking.timings["prefill_compute_s"] == 0.0


def test_a_failed_stream_keeps_its_status_and_has_no_latencies():
    record = read_stream(failing_stream(), StreamRecord(started_s=0.0), clock(1.0, 2.0))
    assert (record.code, record.details, record.ended_s, record.tokens) == ("UNAVAILABLE", "worker died", 2.0, 1)
    assert not record.ok and record.ttft_s is None and record.tpot_s is None and record.e2e_s is None
    assert record.timings is None and record.finish_reason == ""


async def failing_async():
    yield generation_pb2.GenerateResponse(token_ids=[1])
    raise Unavailable()


class Stub:
    """A Generate stub whose every call streams what `chunks()` yields."""

    def __init__(self, chunks):
        self.chunks, self.requests = chunks, []

    def Generate(self, request, timeout: float):
        self.requests.append(request)
        return self.chunks()


def test_a_benchmark_call_comes_back_whole_or_raises():
    stub = Stub(lambda: as_async(stream()))
    record = asyncio.run(generate_or_raise(stub, [5, 6], 4, 10.0, "r-2"))
    assert record.token_ids == [1, 2, 3, 4]
    (request,) = stub.requests
    assert request.request_id == "r-2" and list(request.prompt_token_ids) == [5, 6] and request.max_tokens == 4
    assert request.ignore_eos and request.temperature == 0.0
    with pytest.raises(RuntimeError, match="r-3: 4 tokens, expected 5"):
        asyncio.run(generate_or_raise(Stub(lambda: as_async(stream())), [5], 5, 10.0, "r-3"))
    with pytest.raises(RuntimeError, match="a request of 1 tokens: request failed: UNAVAILABLE: worker died"):
        asyncio.run(generate_or_raise(Stub(failing_async), [5], 4, 10.0))
