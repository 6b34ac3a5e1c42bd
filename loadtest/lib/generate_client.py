"""The one Generate client of the load tools and benchmarks: how a request is built, and how its
stream is read.

Every tool sends the same request for the same RequestSpec (generate_request): greedy unless the
tool's own flag asks for sampling, so that tools and runs compare. Every tool reads the stream
into a StreamRecord: what the client saw, and where the time went inside pdserve as the server
measured it (the last chunk's StageTimings), so that no tool needs the services' logs. The loop
over the stream is written twice, once blocking (locust, whose grpc gevent patches) and once for
grpc.aio (the benchmarks); both feed the same record. A benchmark that measures only complete
requests sends each with generate_or_raise.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, Callable, Iterable, Sequence
from dataclasses import dataclass, field

import grpc
from pdserve.v1 import generation_pb2

from loadtest.lib.workload import RequestSpec

GREEDY = 0.0
STAGE_FIELDS = tuple(f.name for f in generation_pb2.StageTimings.DESCRIPTOR.fields)

Clock = Callable[[], float]


def generate_request(spec: RequestSpec, request_id: str = "", *, ignore_eos: bool = True,
                     temperature: float = GREEDY) -> generation_pb2.GenerateRequest:
    """ignore_eos: by default every call generates exactly max_tokens, so runs do the same work."""
    return generation_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=spec.prompt_token_ids,
                                          max_tokens=spec.max_tokens, seed=spec.seed, temperature=temperature,
                                          ignore_eos=ignore_eos)


@dataclass
class StreamRecord:
    """One Generate stream as the client saw it, in seconds on the caller's clock.

    - TTFT: the call's start to the first chunk carrying a token;
    - TPOT: (end of the stream - first token) / (tokens - 1), for calls with more than one token. It
      starts at the first token, which the prefill samples, so the KV handoff and the decode's queue
      before its first step are inside it: decode-side numbers never hide them;
    - ITL: the gaps between consecutive chunks carrying tokens, one gap per chunk whatever its token
      count (a k-token chunk adds no zero gaps that would flatter the percentiles);
    - E2E: the call's start to the end of the stream.
    Each is None for a call that did not succeed.
    """

    started_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)  # arrival of each chunk carrying tokens
    token_ids: list[int] = field(default_factory=list)
    ended_s: float | None = None
    code: str | None = None     # "OK" or the gRPC status name; None: never answered (lost)
    details: str = ""           # the gRPC error's message
    finish_reason: str = ""
    timings: dict[str, float] | None = None  # the server's StageTimings, when it sends them

    @property
    def ok(self) -> bool:
        return self.code == "OK"

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] - self.started_s if self.ok and self.chunk_times_s else None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.tokens < 2:
            return None
        return (self.ended_s - self.chunk_times_s[0]) / (self.tokens - 1)

    @property
    def e2e_s(self) -> float | None:
        return self.ended_s - self.started_s if self.ok else None

    @property
    def itls_s(self) -> list[float]:
        return [later - earlier for earlier, later in zip(self.chunk_times_s, self.chunk_times_s[1:])]

    def take(self, chunk: generation_pb2.GenerateResponse, now: float) -> None:
        if chunk.token_ids:
            self.chunk_times_s.append(now)
            self.token_ids.extend(chunk.token_ids)
        if chunk.finish_reason:
            self.finish_reason = chunk.finish_reason
        if chunk.HasField("timings"):
            self.timings = {name: getattr(chunk.timings, name) for name in STAGE_FIELDS}

    def end(self, now: float, error: grpc.RpcError | None = None) -> None:
        self.ended_s = now
        self.code, self.details = ("OK", "") if error is None else (error.code().name, error.details() or "")


def read_stream(call: Iterable, record: StreamRecord, clock: Clock = time.perf_counter) -> StreamRecord:
    """A blocking call's stream, into record (its started_s set by the caller, before the call)."""
    try:
        for chunk in call:
            record.take(chunk, clock())
    except grpc.RpcError as error:
        record.end(clock(), error)
    else:
        record.end(clock())
    return record


async def read_stream_async(call: AsyncIterable, record: StreamRecord,
                            clock: Clock = time.perf_counter) -> StreamRecord:
    """read_stream for a grpc.aio call. A call cancelled under it (asyncio) leaves the record's code None."""
    try:
        async for chunk in call:
            record.take(chunk, clock())
    except grpc.RpcError as error:
        record.end(clock(), error)
    else:
        record.end(clock())
    return record


async def generate(stub, request: generation_pb2.GenerateRequest, timeout_s: float, record: StreamRecord | None = None,
                   clock: Clock = time.perf_counter) -> StreamRecord:
    """One grpc.aio call, start to end; record: a subclass's instance to fill (the serving benchmark's)."""
    record = record if record is not None else StreamRecord()
    record.started_s = clock()
    return await read_stream_async(stub.Generate(request, timeout=timeout_s), record, clock)


async def generate_or_raise(stub, prompt_token_ids: Sequence[int], max_tokens: int, timeout_s: float,
                            request_id: str = "") -> StreamRecord:
    """One greedy call, EOS ignored, for a benchmark that measures only complete requests: raises
    RuntimeError unless it succeeded with exactly max_tokens tokens."""
    spec = RequestSpec("bench", tuple(prompt_token_ids), max_tokens, seed=0)
    record = await generate(stub, generate_request(spec, request_id), timeout_s)
    name = request_id or f"a request of {len(spec.prompt_token_ids)} tokens"
    if not record.ok:
        raise RuntimeError(f"{name}: request failed: {record.code}: {record.details}")
    if record.tokens != max_tokens:
        raise RuntimeError(f"{name}: {record.tokens} tokens, expected {max_tokens} (ignore_eos)")
    return record
