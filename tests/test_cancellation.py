"""A client's cancel always ends its request in the router, even when it lands in the same turn of the
event loop as what the request was waiting for: a write to its stream that completes, or its
placement by admission. Python 3.11's asyncio.wait_for returned the awaited result then and dropped
the cancel; the router went on waiting for tokens nobody would read, and its decode never heard
Abort (a CI run of tests/test_control_plane.py's cancel during the pull).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from services.router.control.request import InflightRequest
from services.router.frontend import Generation
from shared.control.messages import Role
from tests.test_request_isolation import DECODE_PAGES, job, running_router


def test_a_cancel_that_lands_as_a_write_completes_ends_the_stream():
    async def scenario() -> None:
        generation = Generation(SimpleNamespace(stall_timeout_s=60.0), None, None)
        written = asyncio.get_running_loop().create_future()  # the transport taking the chunk
        delivering = asyncio.create_task(generation.deliver(written))
        await asyncio.sleep(0)  # waiting for the write
        written.set_result(None)
        delivering.cancel()  # the client's cancel, in the same turn
        with pytest.raises(asyncio.CancelledError):
            await delivering

    asyncio.run(scenario())


def test_a_cancel_that_lands_as_admission_places_the_request_ends_its_wait():
    async def scenario() -> None:
        workers = {"prefill-0": (Role.PREFILL, 64), "decode-0": (Role.DECODE, DECODE_PAGES)}
        async with running_router(workers, admission_timeout_s=300.0) as harness:
            first, waiting = InflightRequest(job()), InflightRequest(job())
            await harness.submitted(first)
            admitting = asyncio.create_task(harness.router.submit(waiting))
            await asyncio.sleep(0.1)
            assert not admitting.done(), "the decode is full: the second waits"
            harness.router.finish(first)  # its room goes back, and the waiting request is placed
            admitting.cancel()  # the client's cancel, in the same turn
            with pytest.raises(asyncio.CancelledError):
                await admitting
            harness.router.finish(waiting)  # as the front does with a request it was cancelled in
            assert harness.reserved() == {}
            assert not harness.failures

    asyncio.run(scenario())
