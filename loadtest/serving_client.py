"""Replays a schedule open loop against a Generate server over grpc.aio: one CallRecord per request.

Every arrival time is fixed before the run starts, and each call is its own task started at its
time, so a slow server never delays a later arrival. After the last arrival the run waits at most
drain_timeout_s for the calls still open, then cancels them: they stay unanswered (lost).
"""

from __future__ import annotations

import asyncio
import time

import grpc
from pdserve.v1 import generation_pb2, generation_pb2_grpc

from loadtest.serving_metrics import CallRecord
from loadtest.workload import Arrival

STAGE_FIELDS = tuple(f.name for f in generation_pb2.StageTimings.DESCRIPTOR.fields)


async def replay(address: str, schedule: list[Arrival], *, label: str, timeout_s: float, drain_timeout_s: float,
                 channels: int = 1, ignore_eos: bool = True) -> list[CallRecord]:
    """Records are in schedule order (record i is schedule[i]), whatever order the arrivals come in."""
    records = [CallRecord(i, a.spec.name, len(a.spec.prompt_token_ids), a.at_s) for i, a in enumerate(schedule)]
    # A channel of its own subchannel pool gets its own connection; gRPC shares them otherwise.
    opened = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
              for _ in range(channels)]
    stubs = [generation_pb2_grpc.GenerationStub(channel) for channel in opened]
    try:
        zero = time.perf_counter()
        tasks = []
        for number, index in enumerate(sorted(range(len(schedule)), key=lambda i: schedule[i].at_s)):
            delay = zero + schedule[index].at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            request = generate_request(schedule[index], f"{label}-{index}", ignore_eos)
            tasks.append(asyncio.create_task(call(stubs[number % channels], request, records[index], zero, timeout_s)))
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=drain_timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for task in done:
                task.result()  # a bug in the client must not pass for a lost request
    finally:
        for channel in opened:
            await channel.close()
    return records


def generate_request(arrival: Arrival, request_id: str, ignore_eos: bool) -> generation_pb2.GenerateRequest:
    spec = arrival.spec
    return generation_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=spec.prompt_token_ids,
                                          max_tokens=spec.max_tokens, seed=spec.seed, temperature=0.0,
                                          ignore_eos=ignore_eos)


async def call(stub, request, record: CallRecord, zero: float, timeout_s: float) -> None:
    """Fills record as the stream goes; a cancelled call leaves code None (lost)."""
    record.started_s = time.perf_counter() - zero
    try:
        async for chunk in stub.Generate(request, timeout=timeout_s):
            if chunk.token_ids:
                record.chunk_times_s.append(time.perf_counter() - zero)
                record.tokens += len(chunk.token_ids)
            if chunk.HasField("timings"):
                record.timings = {name: getattr(chunk.timings, name) for name in STAGE_FIELDS}
    except grpc.aio.AioRpcError as error:
        record.ended_s, record.code = time.perf_counter() - zero, error.code().name
        return
    record.ended_s, record.code = time.perf_counter() - zero, "OK"
