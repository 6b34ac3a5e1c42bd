"""Request migration (services/router/control/migration.py): a stream whose decode dies goes on on
another decode, token-exact, and reports that it moved.

Two halves. The real router alone, with its workers played by protocol peers (tests/protocol_peer.py),
shows exactly what goes over the wire when a decode fails: which ids, which prefix, in which order,
and when the request ends UNAVAILABLE instead. Then one 1P2D stack of real processes, whose decode
is killed with SIGKILL under streams over gRPC and the OpenAI API.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from pdserve.v1 import generation_pb2
from shared.config.schema import RouterConfig
from shared.control import wire
from shared.control.messages import (
    Abort,
    DecodeTask,
    Deregister,
    ErrorCode,
    Failed,
    FinishReason,
    KvPulled,
    KvReady,
    PrefillTask,
    Registered,
    ReleaseKv,
    Role,
    TokenBatch,
    TokenOut,
)
from services.stack.supervisor import RestartPolicy
from tests.conftest import CACHE_DIR
from tests.protocol_peer import ProtocolPeer
from tests.stack import ServiceStack
from tests.test_control_plane import _fingerprint
from tests.test_faults import FAST_HEARTBEATS

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


# ---- the real router, its workers played by peers ----

@contextlib.contextmanager
def _router_and_peers(checkpoint, workdir, **settings):
    """The router alone, with two prefills and two decodes played by peers. Rooms differ by a page,
    so that a tie goes to prefill-0 and to decode-0 (the roomier) and a placement elsewhere shows a choice."""
    stack = ServiceStack(workdir, CACHE_DIR, services=("router",), PDSERVE_ROUTER_HEARTBEAT_TIMEOUT_S="120",
                         **settings)
    endpoint = f"ipc://{workdir}/run/router.ipc"
    fingerprint = _fingerprint(checkpoint)
    peers = {"prefill-0": ProtocolPeer(endpoint, "prefill-0", Role.PREFILL, fingerprint, total_pages=64),
             "prefill-1": ProtocolPeer(endpoint, "prefill-1", Role.PREFILL, fingerprint, total_pages=63),
             "decode-0": ProtocolPeer(endpoint, "decode-0", Role.DECODE, fingerprint, total_pages=256),
             "decode-1": ProtocolPeer(endpoint, "decode-1", Role.DECODE, fingerprint, total_pages=255)}
    for peer in peers.values():
        peer.register()  # queued until the router binds
    try:
        with stack:
            for peer in peers.values():
                peer.epoch = peer.receive(Registered).router_epoch
            with ThreadPoolExecutor(2) as calls:
                yield stack, peers, calls
    finally:
        for peer in peers.values():
            peer.close()


def _stream(stack, max_tokens: int, token_ids: tuple[int, ...] = ()) -> list:
    request = generation_pb2.GenerateRequest(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    if token_ids:
        request.prompt_token_ids.extend(token_ids)
    else:
        request.prompt = "Hello"
    return list(stack.stub.Generate(request, timeout=60))


def _ids(task: PrefillTask) -> list[int]:
    return wire.unpack_token_ids(task.prompt_token_ids).tolist()


def _prefilled(prefill: ProtocolPeer, token: int) -> PrefillTask:
    """The prefill's next task, answered with KvReady and that token. It comes within the router's
    admission timeout, the longest a request waits to be placed (a loaded CI machine took over 10 s)."""
    task = prefill.receive(PrefillTask, timeout_s=RouterConfig.admission_timeout_s)
    prefill.send(KvReady(task.request_id, prefill.worker_id, wire.pack_page_ids([0]), len(_ids(task)),
                         token, None, 0.0, 0))
    return task


def _wait_for(condition, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _tokens(decode: ProtocolPeer, request_id: str, tokens: list[int], last: bool = False) -> None:
    for i, token in enumerate(tokens):
        finish = FinishReason.LENGTH if last and i == len(tokens) - 1 else None
        decode.send(TokenBatch([TokenOut(request_id, token, finish)]))


def test_a_stream_whose_decode_dies_goes_on_from_its_prefix_on_the_other(checkpoint, tmp_path):
    """decode-0 streams three tokens and dies: the prompt and those three are prefilled again under a
    new id, the next token counted as the fourth; decode-1 finishes. The re-prefill's prefill dies
    too: it is retried on the other prefill, as a first prefill would be."""
    with _router_and_peers(checkpoint, tmp_path) as (stack, peers, calls):
        call = calls.submit(_stream, stack, 6)
        first = _prefilled(peers["prefill-0"], 42)
        handoff = peers["decode-0"].receive(DecodeTask)
        assert (handoff.request_id, handoff.generated) == (first.request_id, 0)
        peers["decode-0"].send(KvPulled(first.request_id, "prefill-0", 0.0))
        _tokens(peers["decode-0"], first.request_id, [43, 44])
        peers["decode-0"].send(Deregister("decode-0"))  # dropped as a dead decode is, at once

        moved = peers["prefill-0"].receive(PrefillTask)
        assert moved.request_id != first.request_id, "each placement has its own id on the wire"
        assert _ids(moved) == _ids(first) + [42, 43, 44] and moved.generated == 3
        peers["prefill-0"].send(Deregister("prefill-0"))
        retried = _prefilled(peers["prefill-1"], 45)
        assert (retried.request_id, _ids(retried), retried.generated) == (moved.request_id, _ids(moved), 3)

        handoff = peers["decode-1"].receive(DecodeTask)
        assert (handoff.request_id, handoff.first_token_id, handoff.generated) == (moved.request_id, 45, 3)
        assert handoff.num_tokens == len(_ids(first)) + 3
        peers["decode-1"].send(KvPulled(moved.request_id, "prefill-1", 0.0))
        _tokens(peers["decode-1"], moved.request_id, [46, 47], last=True)
        chunks = call.result(timeout=30)
    assert [t for c in chunks for t in c.token_ids] == [42, 43, 44, 45, 46, 47]
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.migrations == chunks[-1].timings.migrations == 1


def test_a_decode_that_fails_the_handoff_is_left_and_past_the_limit_the_stream_ends(checkpoint, tmp_path):
    """decode-0 answers the handoff with Failed UNAVAILABLE: the prefill hears ReleaseKv for the old
    id before the task under the new one, and the request moves to decode-1 though decode-0, still
    registered and roomier, would win the tie. decode-1 dies: with router.migration_limit 1 the
    stream ends UNAVAILABLE, saying why, and nothing stays reserved."""
    with _router_and_peers(checkpoint, tmp_path, PDSERVE_ROUTER_MIGRATION_LIMIT="1") as (stack, peers, calls):
        call = calls.submit(_stream, stack, 6)
        first = _prefilled(peers["prefill-0"], 42)
        peers["decode-0"].receive(DecodeTask)
        peers["decode-0"].send(Failed(first.request_id, ErrorCode.UNAVAILABLE, "KV handoff failed: a test's"))

        assert peers["prefill-0"].receive(ReleaseKv).request_id == first.request_id
        moved = _prefilled(peers["prefill-0"], 43)
        assert _ids(moved) == _ids(first) + [42] and moved.generated == 1
        assert peers["decode-1"].receive(DecodeTask).request_id == moved.request_id
        peers["decode-1"].send(Deregister("decode-1"))

        assert peers["prefill-0"].receive(ReleaseKv).request_id == moved.request_id  # that handoff was not pulled
        with pytest.raises(grpc.RpcError) as error:
            call.result(timeout=30)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "not moved to another decode: router.migration_limit (1) reached" in error.value.details()
        assert all(w.reserved_pages == 0 for w in stack.workers())


def test_a_decode_that_stops_streaming_is_left_once_its_token_is_late(checkpoint, tmp_path):
    """decode-0 streams a token and then nothing: past router.decode_token_timeout_s it is told Abort
    and the request moves to decode-1, never back to decode-0 (still registered, and roomier). A
    token decode-0 sends late under the old id is answered with Abort and reaches no client."""
    with _router_and_peers(checkpoint, tmp_path, PDSERVE_ROUTER_DECODE_TOKEN_TIMEOUT_S="2") as (stack, peers, calls):
        call = calls.submit(_stream, stack, 4)
        first = _prefilled(peers["prefill-0"], 42)
        peers["decode-0"].receive(DecodeTask)
        peers["decode-0"].send(KvPulled(first.request_id, "prefill-0", 0.0))
        _tokens(peers["decode-0"], first.request_id, [43])
        assert peers["decode-0"].receive(Abort, timeout_s=30).request_id == first.request_id

        moved = _prefilled(peers["prefill-0"], 44)
        assert _ids(moved) == _ids(first) + [42, 43] and moved.generated == 2
        assert peers["decode-1"].receive(DecodeTask).request_id == moved.request_id
        _tokens(peers["decode-0"], first.request_id, [666])
        assert peers["decode-0"].receive(Abort).request_id == first.request_id
        peers["decode-1"].send(KvPulled(moved.request_id, "prefill-0", 0.0))
        _tokens(peers["decode-1"], moved.request_id, [45], last=True)
        chunks = call.result(timeout=30)
    assert [t for c in chunks for t in c.token_ids] == [42, 43, 44, 45]
    assert chunks[-1].usage.migrations == 1


def test_a_moved_request_waits_first_in_line_until_the_other_decode_has_room(checkpoint, tmp_path):
    """decode-1's pool is all promised to a long request when decode-0 dies under a stream: the stream
    waits, and is prefilled again the moment the long request ends."""
    with _router_and_peers(checkpoint, tmp_path) as (stack, peers, calls):
        call = calls.submit(_stream, stack, 4)
        first = _prefilled(peers["prefill-0"], 42)
        peers["decode-0"].receive(DecodeTask)
        peers["decode-0"].send(KvPulled(first.request_id, "prefill-0", 0.0))
        _tokens(peers["decode-0"], first.request_id, [43])
        # 16 prompt tokens and 4,064 to generate: decode-1's 255 pages, all of them.
        long = calls.submit(_stream, stack, 255 * 16 - 16, (1000,) * 16)
        long_task = _prefilled(peers["prefill-0"], 7)
        assert peers["decode-1"].receive(DecodeTask).request_id == long_task.request_id
        peers["decode-1"].send(KvPulled(long_task.request_id, "prefill-0", 0.0))
        _wait_for(lambda: {w.worker_id: w.reserved_pages for w in stack.workers()}["decode-1"] == 255, "long placed")

        peers["decode-0"].send(Deregister("decode-0"))
        with pytest.raises(TimeoutError):
            peers["prefill-0"].receive(PrefillTask, timeout_s=1.0)
        _tokens(peers["decode-1"], long_task.request_id, [8], last=True)
        moved = _prefilled(peers["prefill-0"], 44)
        assert _ids(moved) == _ids(first) + [42, 43] and moved.generated == 2
        assert peers["decode-1"].receive(DecodeTask).request_id == moved.request_id
        peers["decode-1"].send(KvPulled(moved.request_id, "prefill-0", 0.0))
        _tokens(peers["decode-1"], moved.request_id, [45], last=True)
        assert [t for c in call.result(timeout=30) for t in c.token_ids] == [42, 43, 44, 45]
        assert [t for c in long.result(timeout=30) for t in c.token_ids] == [7, 8]
        assert all(w.reserved_pages == 0 for w in stack.workers())


def test_with_no_other_decode_the_stream_ends_unavailable(checkpoint, tmp_path):
    with _router_and_peers(checkpoint, tmp_path) as (stack, peers, calls):
        peers["decode-1"].send(Deregister("decode-1"))
        # Two peers' messages keep no order between them: decode-1 must be gone before decode-0 stops.
        _wait_for(lambda: "decode-1" not in {w.worker_id for w in stack.workers()}, "decode-1 dropped")
        call = calls.submit(_stream, stack, 6)
        first = _prefilled(peers["prefill-0"], 42)
        peers["decode-0"].receive(DecodeTask)
        peers["decode-0"].send(KvPulled(first.request_id, "prefill-0", 0.0))
        _tokens(peers["decode-0"], first.request_id, [43])
        peers["decode-0"].send(Deregister("decode-0"))
        with pytest.raises(grpc.RpcError) as error:
            call.result(timeout=30)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "not moved to another decode: no other decode serves" in error.value.details()
        with pytest.raises(TimeoutError):
            peers["prefill-0"].receive(PrefillTask, timeout_s=0.5)
        assert all(w.reserved_pages == 0 for w in stack.workers())


# ---- one 1P2D stack of real processes, a decode killed under streams ----

CONTEXT = 8192  # the embedded model's: a request of prompt + max_tokens up to it reserves 512 pages
# A decode pool of 516 pages: a request as long as the context leaves 4, too few for any stream
# here, so that every stream is placed on the other decode (the one the test kills).
DECODE_PAGES = 516
MAX_TOKENS = 96
STREAMED_BEFORE_KILL = 8
RESTARTS = RestartPolicy(first_delay_s=0.5, max_delay_s=2.0, stable_after_s=10.0)
MODEL = "embedded"


@pytest.fixture(scope="module")
def two_decodes(checkpoint, tmp_path_factory):
    """prefill-0, decode-0 and decode-1 under the supervisor: a killed decode is restarted and re-registers."""
    with ServiceStack(tmp_path_factory.mktemp("migration"), CACHE_DIR, decode=2, restart=RESTARTS,
                      PDSERVE_KV_DECODE_PAGES=str(DECODE_PAGES), **FAST_HEARTBEATS) as stack:
        yield stack
        stack.wait_serving()
        stack.stop_drained()


class Streams:
    """Four calls: gRPC streams greedy and seeded-sampled, an OpenAI completion streamed and an OpenAI
    chat answered whole. Each returns (tokens or text, finish reason, completion tokens) and the
    migrations its usage (and gRPC's StageTimings) report; started() says once each streamed call
    has had STREAMED_BEFORE_KILL pieces."""

    def __init__(self, stack):
        self.stack = stack
        self.client = openai.OpenAI(base_url=stack.http_url, api_key="unused", max_retries=0, timeout=300)
        self.streaming = [threading.Event() for _ in range(3)]

    def calls(self) -> list:
        return [lambda: self._grpc(0, temperature=0.0), lambda: self._grpc(1, temperature=0.8, seed=7),
                self._openai_streamed, self._openai_whole]

    def started(self, timeout_s: float) -> bool:
        return all(event.wait(timeout_s) for event in self.streaming)

    def _grpc(self, index: int, **sampling) -> tuple:
        request = generation_pb2.GenerateRequest(prompt=f"Count slowly from {index}:", max_tokens=MAX_TOKENS,
                                                 ignore_eos=True, **sampling)
        tokens, last = [], None
        for last in self.stack.stub.Generate(request, timeout=300):
            tokens += last.token_ids
            if len(tokens) >= STREAMED_BEFORE_KILL:
                self.streaming[index].set()
        return (tokens, last.finish_reason, last.usage.completion_tokens), (last.usage.migrations,
                                                                            last.timings.migrations)

    def _openai_streamed(self) -> tuple:
        chunks = self.client.completions.create(
            model=MODEL, prompt="The three primary colors are", max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        pieces, finish, usage = [], None, None
        for chunk in chunks:
            if chunk.choices:
                pieces.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
            if len(pieces) >= STREAMED_BEFORE_KILL:
                self.streaming[2].set()
        return ("".join(pieces), finish, usage.completion_tokens), (usage.migrations,)

    def _openai_whole(self) -> tuple:
        answer = self.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me about the sea."}], max_tokens=MAX_TOKENS,
            temperature=0, extra_body={"ignore_eos": True})
        choice = answer.choices[0]
        return (choice.message.content, choice.finish_reason, answer.usage.completion_tokens), (
            answer.usage.migrations,)


def _decodes(stack) -> dict[str, object]:
    return {w.worker_id: w for w in stack.workers() if w.role == "decode"}


def test_streams_whose_decode_is_killed_finish_as_undisturbed_ones_over_grpc_and_openai(two_decodes):
    """Run undisturbed first, then again with their decode killed mid-stream (SIGKILL): every call
    returns the same tokens (the greedy ones and the seeded sampled one), with no error, and says it
    moved once. The pools drain once the killed decode is back."""
    stack = two_decodes
    with ThreadPoolExecutor(4) as pool:
        undisturbed = list(pool.map(lambda call: call(), Streams(stack).calls()))
    assert [moves for _, moves in undisturbed] == [(0, 0), (0, 0), (0,), (0,)], undisturbed
    assert all(answer[1] == "length" and answer[2] == MAX_TOKENS for answer, _ in undisturbed), undisturbed

    # A request as long as the context fills one decode's pool: the streams go to the other.
    ballast = stack.stub.Generate(generation_pb2.GenerateRequest(prompt="Hello", max_tokens=CONTEXT, temperature=0,
                                                                 ignore_eos=True), timeout=300)
    _wait_for(lambda: any(w.reserved_pages > DECODE_PAGES - 8 for w in _decodes(stack).values()), "ballast placed")
    full = next(name for name, w in _decodes(stack).items() if w.reserved_pages > DECODE_PAGES - 8)
    victim = next(name for name in _decodes(stack) if name != full)
    streams = Streams(stack)
    with ThreadPoolExecutor(4) as pool:
        outcomes = [pool.submit(call) for call in streams.calls()]
        assert streams.started(timeout_s=120), "the streams never got going"
        _wait_for(lambda: _decodes(stack)[victim].assigned_requests == 4, "all four placed on the victim")
        ballast.cancel()
        _wait_for(lambda: _decodes(stack)[full].reserved_pages == 0, "the ballast's room given back")
        stack.signal(victim, signal.SIGKILL)
        disturbed = [outcome.result(timeout=300) for outcome in outcomes]

    assert [answer for answer, _ in disturbed] == [answer for answer, _ in undisturbed]
    assert [moves for _, moves in disturbed] == [(1, 1), (1, 1), (1,), (1,)], "each says it moved, once"
    assert stack.metric("pdserve:request_migrations_total") == 4
    stack.wait_serving()  # the killed decode restarted and registered again
    stack.assert_pools_drained()
