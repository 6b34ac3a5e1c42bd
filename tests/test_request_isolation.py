"""One request's trouble stays its own: the token router in-process (services/router/control/token_router.py)
on its real ZeroMQ socket, its workers played by protocol peers (tests/protocol_peer.py).

Validation keeps every value a client sends within what the wire takes (tests/test_validation.py),
so a message that cannot be encoded is a bug of ours; these tests put one past validation in-process,
by building the request's job themselves, to show what such a bug may cost: its own request, never
another's tokens, a reservation, the waiting line or a loop of the router. Messages from a worker
that make a handler raise are injected the same way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import tempfile
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest
from structlog.testing import capture_logs

from services.router.control.request import ErrorEvent, InflightRequest, TokenEvent
from services.router.control.token_router import TokenRouter
from services.router.validation import Job
from shared.config.schema import Config
from shared.control import wire
from shared.control.messages import (
    Abort,
    DecodeTask,
    ErrorCode,
    Failed,
    FinishReason,
    KvPulled,
    KvReady,
    ModelFingerprint,
    PrefillTask,
    Registered,
    Role,
    SamplingParams,
    StopParams,
    TokenBatch,
    TokenOut,
)
from tests.protocol_peer import ProtocolPeer

CHECKPOINT = ("config-sha", "weights-sha", "tokenizer-sha")  # the router's model, as the peers claim it
FINGERPRINT = ModelFingerprint(*CHECKPOINT, "float32", "layout")
WAIT_S = 10.0  # for what the router does at once; every timeout it could fire by is far longer
PROMPT = [1, 2, 3]
DECODE_PAGES = 2  # what one request needs: 3 prompt tokens and 20 to generate, 16 to a page


def job(top_k: int = 0) -> Job:
    """A greedy job; top_k of 2^64 is one msgpack cannot pack, which validation would have refused."""
    return Job(PROMPT, SamplingParams(0.0, 1.0, top_k, 7), StopParams(max_tokens=20, ignore_eos=True), [])


UNENCODABLE_TOP_K = 1 << 64


@dataclass
class Harness:
    router: TokenRouter
    peers: dict[str, ProtocolPeer]
    failures: list[BaseException]  # what stopped the router: a background loop that died

    async def received(self, worker_id: str, kind: type, timeout_s: float = WAIT_S):
        return await asyncio.to_thread(self.peers[worker_id].receive, kind, timeout_s)

    async def submitted(self, request: InflightRequest) -> None:
        """The request placed, and its PrefillTask at the prefill it was placed on."""
        await asyncio.wait_for(self.router.submit(request), WAIT_S)
        task = await self.received(request.prefill.worker_id, PrefillTask)
        assert task.request_id == request.request_id

    async def decoding(self, request: InflightRequest) -> None:
        """A placed request handed over to decode-0: its first token out, its pages pulled."""
        prefill = request.prefill.worker_id
        self.peers[prefill].send(KvReady(request.request_id, prefill, wire.pack_page_ids([0]), len(PROMPT), 42,
                                         None, 0.0, 0))
        assert (await self.received("decode-0", DecodeTask)).request_id == request.request_id
        self.peers["decode-0"].send(KvPulled(request.request_id, prefill, 0.0))
        assert await next_event(request) == TokenEvent(42, None)

    def reserved(self) -> dict[str, list[str]]:
        return {w.worker_id: sorted(w.reservations) for w in self.router.registry.workers.values() if w.reservations}


async def next_event(request: InflightRequest) -> object:
    return await asyncio.wait_for(request.events.get(), WAIT_S)


async def until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.01)


@asynccontextmanager
async def running_router(workers: dict[str, tuple[Role, int]], **router_settings):
    """The router started on an ipc:// socket of its own, with a peer per worker id registered."""
    runtime_dir = tempfile.mkdtemp(prefix="pdserve-test-")
    config = Config()
    config.router.runtime_dir = runtime_dir
    config.router.heartbeat_timeout_s = 120.0  # the peers send no heartbeats
    for name, value in router_settings.items():
        setattr(config.router, name, value)
    failures: list[BaseException] = []
    router = TokenRouter(config, CHECKPOINT, lambda serving: None, failures.append)
    await router.start()
    endpoint = config.router.zmq_endpoint()
    peers = {worker_id: ProtocolPeer(endpoint, worker_id, role, FINGERPRINT, total_pages=pages)
             for worker_id, (role, pages) in workers.items()}
    harness = Harness(router, peers, failures)
    try:
        for worker_id, peer in peers.items():
            peer.register()
            peer.epoch = (await harness.received(worker_id, Registered)).router_epoch
        yield harness
    finally:
        await router.stop()
        for peer in peers.values():
            peer.close()
        shutil.rmtree(runtime_dir)


ONE_PAIR = {"prefill-0": (Role.PREFILL, 64), "decode-0": (Role.DECODE, 64)}


def test_a_task_that_cannot_be_encoded_fails_its_request_and_holds_nothing():
    async def scenario() -> None:
        async with running_router(ONE_PAIR) as harness:
            poisoned = InflightRequest(job(top_k=UNENCODABLE_TOP_K))
            with pytest.raises(wire.EncodeError, match="PrefillTask cannot be encoded"):
                await harness.router.submit(poisoned)
            assert harness.reserved() == {} and poisoned.request_id not in harness.router.requests
            await harness.submitted(InflightRequest(job()))  # the next one is placed as ever
            assert not harness.failures

    asyncio.run(scenario())


def test_a_waiting_request_that_cannot_be_sent_fails_alone_when_anothers_last_token_makes_room():
    """The issue's case: two requests fill the decode, a poisoned one and a good one wait behind
    them. One batch ends the first and brings the second a token: the room goes to the poisoned
    request, whose task cannot be sent. It fails alone, to its own caller, holding nothing; the
    batch's other token is delivered, and the good request behind it is placed at once."""
    async def scenario() -> None:
        workers = {"prefill-0": (Role.PREFILL, 64), "decode-0": (Role.DECODE, 2 * DECODE_PAGES)}
        async with running_router(workers, admission_timeout_s=300.0) as harness:
            first, second = InflightRequest(job()), InflightRequest(job())
            for request in (first, second):
                await harness.submitted(request)
                await harness.decoding(request)
            poisoned, behind = InflightRequest(job(top_k=UNENCODABLE_TOP_K)), InflightRequest(job())
            poisoned_admission = asyncio.create_task(harness.router.submit(poisoned))
            behind_admission = asyncio.create_task(harness.router.submit(behind))
            await asyncio.sleep(0.1)
            assert not poisoned_admission.done() and not behind_admission.done(), "no room: both wait"

            harness.peers["decode-0"].send(TokenBatch([TokenOut(first.request_id, 50, FinishReason.LENGTH),
                                                       TokenOut(second.request_id, 51, None)]))
            assert await next_event(first) == TokenEvent(50, FinishReason.LENGTH)
            assert await next_event(second) == TokenEvent(51, None), "the batch's other token was dropped"
            with pytest.raises(wire.EncodeError):
                await asyncio.wait_for(poisoned_admission, WAIT_S)
            await asyncio.wait_for(behind_admission, WAIT_S)
            assert (await harness.received("prefill-0", PrefillTask)).request_id == behind.request_id
            assert poisoned.request_id not in {r for held in harness.reserved().values() for r in held}
            for request in (first, second, poisoned, behind):
                harness.router.finish(request)  # as the fronts do
            assert harness.reserved() == {}
            assert not harness.failures

    asyncio.run(scenario())


def test_a_retried_placement_that_cannot_be_sent_fails_the_request_and_releases_every_reservation():
    """A request whose prefill fails before its first token moves to another prefill; when that
    task cannot be sent, the request ends INTERNAL at once, its reservations on the first prefill,
    the second and the decode all released (a drain of any of them would otherwise wait for it)."""
    async def scenario() -> None:
        workers = {"prefill-0": (Role.PREFILL, 64), "prefill-1": (Role.PREFILL, 64), "decode-0": (Role.DECODE, 64)}
        async with running_router(workers) as harness:
            request = InflightRequest(job())
            await harness.submitted(request)
            first = request.prefill.worker_id
            # What the retry will send can no longer be encoded: put in-process, past validation.
            request.job = dataclasses.replace(request.job, sampling=dataclasses.replace(
                request.job.sampling, top_k=UNENCODABLE_TOP_K))
            harness.peers[first].send(Failed(request.request_id, ErrorCode.UNAVAILABLE, "prefill failed"))
            with capture_logs() as logs:
                event = await next_event(request)
            assert isinstance(event, ErrorEvent) and event.code == ErrorCode.INTERNAL, event
            assert event.message.startswith("internal error (error id ") and "Overflow" not in event.message
            assert any(entry["event"] == "internal error" and entry["error_id"] in event.message
                       and "cannot be encoded" in str(entry["exc_info"]) for entry in logs), logs
            assert harness.reserved() == {}
            harness.router.finish(request)
            await harness.submitted(InflightRequest(job()))
            assert not harness.failures

    asyncio.run(scenario())


class _QueueThatRefuses(asyncio.Queue):
    """A request's event queue whose put of one token raises: a handler's bug, injected."""

    def __init__(self, token_id: int):
        super().__init__()
        self.token_id = token_id

    def put_nowait(self, item) -> None:
        if isinstance(item, TokenEvent) and item.token_id == self.token_id:
            raise RuntimeError("injected: this token cannot be handled")
        super().put_nowait(item)


def test_a_token_whose_handling_raises_fails_its_request_alone_and_the_batch_is_delivered():
    async def scenario() -> None:
        async with running_router(ONE_PAIR) as harness:
            broken, whole = InflightRequest(job(), events=_QueueThatRefuses(666)), InflightRequest(job())
            for request in (broken, whole):
                await harness.submitted(request)
                await harness.decoding(request)
            harness.peers["decode-0"].send(TokenBatch([TokenOut(broken.request_id, 666, None),
                                                       TokenOut(whole.request_id, 43, None),
                                                       TokenOut(whole.request_id, 44, FinishReason.LENGTH)]))
            assert await next_event(whole) == TokenEvent(43, None)
            assert await next_event(whole) == TokenEvent(44, FinishReason.LENGTH)
            event = await next_event(broken)
            assert isinstance(event, ErrorEvent) and event.code == ErrorCode.INTERNAL
            assert "injected" not in event.message
            assert (await harness.received("decode-0", Abort)).request_id == broken.request_id
            assert harness.reserved() == {}
            assert not harness.failures

    asyncio.run(scenario())


def test_the_timeouts_loop_survives_a_failed_iteration_and_still_ends_stages():
    async def scenario() -> None:
        async with running_router(ONE_PAIR, prefill_timeout_s=1.0) as harness:
            membership = harness.router.membership
            healthy, injected = membership.drop_silent, []

            def fails_once() -> None:
                if not injected:
                    injected.append(True)
                    raise RuntimeError("injected into the timeouts loop")
                healthy()

            membership.drop_silent = fails_once
            with capture_logs() as logs:
                request = InflightRequest(job())
                await harness.submitted(request)  # the peer never answers: its prefill stage times out
                event = await asyncio.wait_for(request.events.get(), WAIT_S + 1.0)
            assert injected and not harness.failures, "the loop died"
            assert event == ErrorEvent(ErrorCode.UNAVAILABLE, "the request's prefill stage timed out")
            [failed] = [entry for entry in logs if entry["event"].startswith("loop iteration failed")]
            assert failed["loop"] == "timeouts" and failed["exc_info"] is True  # logged with its traceback

    asyncio.run(scenario())


def test_the_socket_loop_survives_a_frame_whose_handling_raises():
    """Outside the dispatch's own guard: who sent a frame is looked up before any handler runs."""
    async def scenario() -> None:
        async with running_router(ONE_PAIR) as harness:
            membership = harness.router.membership
            healthy, injected = membership.peer, []

            def fails_once(identity, user_id):
                if not injected:
                    injected.append(True)
                    raise RuntimeError("injected into the socket loop")
                return healthy(identity, user_id)

            membership.peer = fails_once
            harness.peers["decode-0"].heartbeat()
            # Frames of two peers keep no order between them: the request's own frames start only
            # once the heartbeat has been through the failing lookup.
            await asyncio.wait_for(until(lambda: injected), WAIT_S)
            request = InflightRequest(job())
            await harness.submitted(request)
            await harness.decoding(request)  # KvReady and KvPulled arrive through the same loop
            assert injected and not harness.failures, "the loop died"

    asyncio.run(scenario())
