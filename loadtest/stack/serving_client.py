"""Replays a schedule open loop against a Generate server over grpc.aio: one CallRecord per request.

Every arrival time is fixed before the run starts, and each call is its own task started at its
time, so a slow server never delays a later arrival. After the last arrival the run waits at most
drain_timeout_s for the calls still open, then cancels them: they stay unanswered (lost).
"""

from __future__ import annotations

import asyncio
import time

import grpc
from pdserve.v1 import generation_pb2_grpc

from loadtest.lib.generate_client import generate, generate_request
from loadtest.lib.workload import Arrival
from loadtest.stack.serving_metrics import CallRecord


async def replay(address: str, schedule: list[Arrival], *, label: str, timeout_s: float, drain_timeout_s: float,
                 channels: int = 1, ignore_eos: bool = True) -> list[CallRecord]:
    """Records are in schedule order (record i is schedule[i]), whatever order the arrivals come in."""
    records = [CallRecord(index=i, name=a.spec.name, prompt_tokens=len(a.spec.prompt_token_ids), scheduled_s=a.at_s)
               for i, a in enumerate(schedule)]
    # A channel of its own subchannel pool gets its own connection; gRPC shares them otherwise.
    opened = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
              for _ in range(channels)]
    stubs = [generation_pb2_grpc.GenerationStub(channel) for channel in opened]
    try:
        zero = time.perf_counter()

        def clock() -> float:  # the run's clock, the one the schedule is in
            return time.perf_counter() - zero

        tasks = []
        for number, index in enumerate(sorted(range(len(schedule)), key=lambda i: schedule[i].at_s)):
            delay = schedule[index].at_s - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            request = generate_request(schedule[index].spec, f"{label}-{index}", ignore_eos=ignore_eos)
            tasks.append(asyncio.create_task(generate(stubs[number % channels], request, timeout_s, records[index],
                                                      clock)))
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
