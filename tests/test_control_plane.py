"""The control plane under what a new user meets: ids reused, a router killed, clients that stop
reading, stuck or unreachable workers, lost frames, workers that should not join, forged messages.

Real processes and sockets throughout; where a test needs a worker to misbehave on purpose, it
speaks the wire protocol itself (tests/protocol_peer.py) to the real router.
"""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import msgpack
import pytest

from pdserve.v1 import generation_pb2, generation_pb2_grpc
from shared.control import wire
from shared.control.messages import (
    EXIT_REFUSED,
    PROTOCOL_VERSION,
    Abort,
    DecodeTask,
    ErrorCode,
    Failed,
    FinishReason,
    KvPulled,
    KvReady,
    ModelFingerprint,
    MsgKind,
    PrefillTask,
    Refused,
    Registered,
    ReleaseKv,
    Reregister,
    Role,
    TokenBatch,
    TokenOut,
)
from shared.control.router_link import LATE_BEAT_WARNING_S
from shared.model.fingerprint import model_fingerprint
from shared.model.loader import load_hf_config
from tests.conftest import CACHE_DIR
from tests.protocol_peer import ProtocolPeer
from tests.stack import ServiceStack

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FAST_HEARTBEATS = {"PDSERVE_ROUTER_HEARTBEAT_TIMEOUT_S": "1.5", "PDSERVE_WORKER_HEARTBEAT_INTERVAL_S": "0.25"}
LONG_PROMPT = [1000 + i % 5000 for i in range(3000)]  # keeps the prefill's core busy for seconds
HUGE_PROMPT = [1000 + i % 5000 for i in range(8000)]  # near the model's 8,192 positions: a layer takes seconds


def _greedy(prompt: str | None = None, max_tokens: int = 16, label: str = "", ignore_eos: bool = True,
            token_ids: list[int] | None = None) -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest(request_id=label, max_tokens=max_tokens, temperature=0,
                                             ignore_eos=ignore_eos)
    if token_ids is not None:
        request.prompt_token_ids.extend(token_ids)
    else:
        request.prompt = prompt
    return request


def _token_ids(stub, request, timeout: float = 120.0) -> list[int]:
    return [t for chunk in stub.Generate(request, timeout=timeout) for t in chunk.token_ids]


def _outcome(stub, request, timeout: float = 120.0) -> object:
    """The number of tokens a call streamed, or the status code it ended with."""
    try:
        return len(_token_ids(stub, request, timeout))
    except grpc.RpcError as exc:
        return exc.code()


# ---- request identity: the client's request_id is a label, not a key ----

def test_calls_that_share_a_request_id_each_get_their_own_tokens(stack):
    prompts = ["Name three colors.", "What is two plus two?", "Write a haiku about rain.", "Count to five."]
    alone = [_token_ids(stack.stub, _greedy(p)) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: list(stack.stub.Generate(_greedy(p, label="same-id"), timeout=120)),
                                 prompts))
    for chunks, expected in zip(together, alone):
        assert [t for c in chunks for t in c.token_ids] == expected
        assert {c.request_id for c in chunks} == {"same-id"}, "the client's label comes back as it was sent"
    stack.assert_pools_drained()


def test_an_id_reused_right_after_a_cancel_leaves_the_new_call_whole(stack):
    for _ in range(3):
        first = stack.stub.Generate(_greedy("Count slowly:", 2000, label="reused"), timeout=60)
        next(first)
        first.cancel()
        assert len(_token_ids(stack.stub, _greedy("Hello", 8, label="reused"), timeout=60)) == 8
    stack.assert_pools_drained()


# ---- a router that dies ----

def test_a_router_killed_under_load_leaves_nothing_held_and_serving_resumes(checkpoint, tmp_path):
    with ServiceStack(tmp_path, CACHE_DIR, **FAST_HEARTBEATS) as stack:
        requests = [_greedy("Count slowly:", 2000)] * 3 + [_greedy(token_ids=LONG_PROMPT, max_tokens=4)] * 2
        with ThreadPoolExecutor(len(requests)) as pool:
            outcomes = [pool.submit(_outcome, stack.stub, r, 60) for r in requests]
            time.sleep(3.0)  # the long ones stream, the long prompts queue at the prefill
            stack.signal("router", signal.SIGKILL)
            ended = [o.result(timeout=30) for o in outcomes]
        assert all(o == grpc.StatusCode.UNAVAILABLE for o in ended), ended
        stack.processes["router"].wait(timeout=10)
        stack.start("router")
        stack.wait_serving()
        # The workers met a router of another epoch: they dropped the old requests and their pages,
        # though the old ones had 2,000 tokens to go and the prefill still held KV for its decode.
        stack.assert_pools_drained(timeout_s=15)
        assert len(_token_ids(stack.stub, _greedy("Hello", 3))) == 3
        stack.assert_pools_drained()


# ---- a client that stops reading ----

STALLED_LABEL = "x" * 256  # in every chunk: an unread call fills its HTTP/2 window within ~200 tokens


def _unread_call(stack, max_tokens: int):
    """A call whose client reads nothing until told; no BDP probing, so its window stays 64 KiB."""
    channel = grpc.insecure_channel(stack.address, options=[("grpc.http2.bdp_probe", 0)])
    call = generation_pb2_grpc.GenerationStub(channel).Generate(
        _greedy("Tell me a long story.", max_tokens, label=STALLED_LABEL), timeout=600)
    return channel, call


def _finished_labels(stack) -> list[str]:
    return [line.get("label") for line in stack.logged("router", "request finished")]


def test_a_stalled_stream_holds_no_kv_room_once_the_decode_is_done(checkpoint, tmp_path):
    """Decode room for one request: the second is admitted as soon as the decode has finished the
    first, while the first's stream still waits for its client to read."""
    # 24 pages of 16 tokens: the first (340 tokens, well past the ~200 chunks that fill its window,
    # should the router coalesce a few) takes 22 of them, the second wants 3.
    settings = {"PDSERVE_KV_DECODE_PAGES": "24", "PDSERVE_ROUTER_STALL_TIMEOUT_S": "600",
                "PDSERVE_ROUTER_ADMISSION_TIMEOUT_S": "300"}
    with ServiceStack(tmp_path, CACHE_DIR, **settings) as stack:
        channel, unread = _unread_call(stack, 340)
        try:
            time.sleep(1.0)
            assert len(_token_ids(stack.stub, _greedy("Hi", 40), timeout=600)) == 40
            assert STALLED_LABEL not in _finished_labels(stack), "the first stream was not stalled: no test"
            assert sum(len(c.token_ids) for c in unread) == 340, "the unread call still gets every token"
        finally:
            channel.close()
        stack.assert_pools_drained()


def test_a_stream_not_read_for_the_stall_timeout_is_cancelled(checkpoint, tmp_path):
    with ServiceStack(tmp_path, CACHE_DIR, PDSERVE_ROUTER_STALL_TIMEOUT_S="2") as stack:
        channel, unread = _unread_call(stack, 1500)
        try:
            deadline = time.monotonic() + 300
            while STALLED_LABEL not in _finished_labels(stack):  # the router let go of it
                assert time.monotonic() < deadline, "the stalled stream was never cancelled"
                time.sleep(0.5)
            stack.assert_pools_drained()
            with pytest.raises(grpc.RpcError) as error:
                for _ in unread:  # what was sent before the stall, then the status
                    pass
            assert error.value.code() == grpc.StatusCode.CANCELLED
            assert "router.stall_timeout_s" in error.value.details()
        finally:
            channel.close()
        assert len(_token_ids(stack.stub, _greedy("Hello", 3))) == 3


# ---- liveness by progress, unreachable workers, stage timeouts ----

def test_a_router_stopped_past_the_heartbeat_timeout_drops_no_worker_and_loses_no_request(stack):
    """The router's own loop stands still (here SIGSTOP; a starved host, a long callback) for longer
    than router.heartbeat_timeout_s while the workers beat into its socket: when it runs again it
    must read those heartbeats, not drop both workers and fail what they hold."""
    stopped_s = stack.config.router.heartbeat_timeout_s + 2
    workers = {(w.worker_id, w.role) for w in stack.workers()}
    logged = len(stack.log_path("router").read_text().splitlines())
    call = stack.stub.Generate(_greedy("Count slowly:", 40), timeout=120)
    next(call)  # decoding
    stack.signal("router", signal.SIGSTOP)
    try:
        time.sleep(stopped_s)
    finally:
        stack.signal("router", signal.SIGCONT)
    assert sum(len(chunk.token_ids) for chunk in call) == 39, "the rest of the 40 tokens, after the first"
    assert {(w.worker_id, w.role) for w in stack.workers()} == workers
    since = stack.log_path("router").read_text().splitlines()[logged:]
    assert not [line for line in since if '"dropping worker"' in line or '"worker registered"' in line], since
    stalls = [json.loads(line)["seconds"] for line in since if '"router event loop stood still"' in line]
    assert stalls and max(stalls) >= stopped_s - 0.5, since
    stack.assert_pools_drained()


def test_a_worker_that_could_not_beat_for_a_while_says_so_in_its_log(stack):
    """A decode stopped long enough that its next heartbeat is due LATE_BEAT_WARNING_S before it
    can go out logs how late it was: what tells a worker's own stall from the router's after a drop."""
    stopped_s = LATE_BEAT_WARNING_S + stack.config.worker.heartbeat_interval_s + 0.3
    logged = len(stack.log_path("decode").read_text().splitlines())
    stack.signal("decode", signal.SIGSTOP)
    try:
        time.sleep(stopped_s)
    finally:
        stack.signal("decode", signal.SIGCONT)
    stack.wait_serving()
    assert len(_token_ids(stack.stub, _greedy("Hello", 3))) == 3
    since = stack.log_path("decode").read_text().splitlines()[logged:]
    late = [json.loads(line)["late_s"] for line in since if '"heartbeat went out late"' in line]
    assert late and max(late) >= LATE_BEAT_WARNING_S, since


def test_a_worker_whose_loop_makes_no_progress_is_dropped_though_it_beats(checkpoint, tmp_path):
    """A prompt one layer of which keeps the prefill's main loop away for longer than
    progress_timeout_s (8,000 tokens: 1.8 s a layer on one of CI's cores, idle): its heartbeat
    thread still beats, but the router drops it and fails the request; the prefill hears it has been
    forgotten (at the layer's end, abandoning the prompt), registers again and serves."""
    settings = {**FAST_HEARTBEATS, "PDSERVE_ROUTER_PROGRESS_TIMEOUT_S": "1"}
    with ServiceStack(tmp_path, CACHE_DIR, **settings) as stack:
        assert _outcome(stack.stub, _greedy(token_ids=HUGE_PROMPT, max_tokens=2)) == grpc.StatusCode.UNAVAILABLE
        assert "made no progress" in stack.log_path("router").read_text()
        # A loaded machine may hold the loop back past the 1 s at other times too (a CI run's was
        # dropped before the prompt reached it): the router is right to drop it then, and it comes
        # back again.
        deadline = time.monotonic() + 120
        while True:
            stack.wait_serving()
            try:
                assert len(_token_ids(stack.stub, _greedy("Hello", 3))) == 3
                break
            except grpc.RpcError as error:
                assert "made no progress" in error.details() and time.monotonic() < deadline, error
        stack.assert_pools_drained()


def test_a_request_sent_to_a_vanished_worker_fails_at_once(checkpoint, tmp_path):
    """ROUTER_MANDATORY: a task for a prefill whose process is gone fails now, not after the
    (here 30 s) heartbeat timeout."""
    with ServiceStack(tmp_path, CACHE_DIR, PDSERVE_ROUTER_HEARTBEAT_TIMEOUT_S="30") as stack:
        stack.signal("prefill", signal.SIGKILL)
        stack.processes["prefill"].wait(timeout=10)
        time.sleep(0.5)  # the connection's end reaches the router's socket
        started = time.monotonic()
        assert _outcome(stack.stub, _greedy("Hello", 3), timeout=60) == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - started < 5
        assert not [w for w in stack.workers() if w.role == "prefill"]
        stack.start("prefill")
        stack.wait_serving()
        assert len(_token_ids(stack.stub, _greedy("Hello", 3))) == 3


def test_a_request_past_its_stage_timeout_ends_unavailable_and_frees_its_pages(checkpoint, tmp_path):
    with ServiceStack(tmp_path, CACHE_DIR, PDSERVE_ROUTER_PREFILL_TIMEOUT_S="1") as stack:
        with pytest.raises(grpc.RpcError) as error:
            _token_ids(stack.stub, _greedy(token_ids=LONG_PROMPT, max_tokens=2))
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "prefill stage timed out" in error.value.details()
        stack.assert_pools_drained(timeout_s=60)  # the prefill abandons the prompt (Abort), freeing its pages
        assert len(_token_ids(stack.stub, _greedy("Hello", 3))) == 3


def test_a_full_slow_batch_makes_the_next_request_wait_in_admission_not_fail_at_the_handoff(checkpoint, tmp_path):
    """One batch slot (decode.max_batch_size 1), taken by a long stream: the next request waits in the
    router's admission queue, not in the decode's, where router.handoff_timeout_s (2 s) would end it
    UNAVAILABLE; it is placed once the first ends, and streams whole."""
    settings = {"PDSERVE_DECODE_MAX_BATCH_SIZE": "1", "PDSERVE_ROUTER_HANDOFF_TIMEOUT_S": "2",
                "PDSERVE_KV_TRANSFER_TIMEOUT_S": "1", "PDSERVE_ROUTER_ADMISSION_TIMEOUT_S": "120"}
    with ServiceStack(tmp_path, CACHE_DIR, **settings) as stack, ThreadPoolExecutor(1) as pool:
        first = stack.stub.Generate(_greedy("Count to one thousand:", 150), timeout=120)
        received = len(next(first).token_ids)
        second = pool.submit(_outcome, stack.stub, _greedy("Hello", 8))
        deadline = time.monotonic() + stack.config.router.admission_timeout_s
        while not second.done() and stack.metric("pdserve:num_requests_waiting") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stack.metric("pdserve:num_requests_waiting") == 1, second.result()  # before the fix: placed at once
        received += sum(len(chunk.token_ids) for chunk in first)
        assert (received, second.result(timeout=120)) == (150, 8)


# ---- registration as a handshake ----

def test_a_worker_the_router_refuses_exits_and_is_never_listed(stack, tmp_path):
    """A prefill of another page size joins the running stack: refused once, it exits EXIT_REFUSED
    instead of registering again forever."""
    misfit = ServiceStack(tmp_path, CACHE_DIR, services=("prefill",), PDSERVE_ROUTER_RUNTIME_DIR=stack.env[
        "PDSERVE_ROUTER_RUNTIME_DIR"], PDSERVE_PREFILL_WORKER_ID="prefill-misfit", PDSERVE_KV_PAGE_SIZE="32")
    try:
        misfit.start("prefill")
        assert misfit.processes["prefill"].wait(timeout=120) == EXIT_REFUSED
        assert "page size 32" in misfit.log_path("prefill").read_text()
        assert "prefill-misfit" not in {w.worker_id for w in stack.workers()}
    finally:
        misfit.stop()


def test_a_worker_of_another_model_never_pairs(stack, tmp_path):
    """Pairing check: a decode whose KV differs (bfloat16 against the stack's float32) is refused
    with what differs, and exits EXIT_REFUSED."""
    misfit = ServiceStack(tmp_path, CACHE_DIR, services=("decode",), PDSERVE_ROUTER_RUNTIME_DIR=stack.env[
        "PDSERVE_ROUTER_RUNTIME_DIR"], PDSERVE_DECODE_WORKER_ID="decode-misfit", PDSERVE_MODEL_DTYPE="bfloat16")
    try:
        misfit.start("decode")
        assert misfit.processes["decode"].wait(timeout=120) == EXIT_REFUSED
        assert "dtype bfloat16 instead of float32" in misfit.log_path("decode").read_text()
        assert "decode-misfit" not in {w.worker_id for w in stack.workers()}
    finally:
        misfit.stop()


def test_a_second_decode_under_a_live_decodes_id_is_refused_and_evicts_nothing(stack, tmp_path):
    """A second stack's decode-0 on this stack's runtime folder reaches this stack's router: refused
    with the reason (it exits EXIT_REFUSED, not restarted), while this stack's decode-0 keeps its
    registration and serves."""
    registered = stack.log_path("router").read_text().count('"worker registered"')
    evicted = stack.log_path("decode").read_text().count("registering again")
    double = ServiceStack(tmp_path, CACHE_DIR, services=("decode",), PDSERVE_ROUTER_RUNTIME_DIR=stack.env[
        "PDSERVE_ROUTER_RUNTIME_DIR"])
    try:
        double.start("decode")
        assert double.processes["decode"].wait(timeout=120) == EXIT_REFUSED
        assert "worker id 'decode-0' is held by a live worker" in double.log_path("decode").read_text()
    finally:
        double.stop()
    assert len(_token_ids(stack.stub, _greedy("Hello", 3))) == 3
    assert stack.log_path("router").read_text().count('"worker registered"') == registered
    assert stack.log_path("decode").read_text().count("registering again") == evicted


def test_a_worker_without_a_router_gives_up_after_the_register_timeout(checkpoint, tmp_path):
    stack = ServiceStack(tmp_path, CACHE_DIR, services=("prefill",), PDSERVE_WORKER_REGISTER_TIMEOUT_S="2")
    try:
        stack.start("prefill")
        assert stack.processes["prefill"].wait(timeout=120) == 1
        assert "no answer to Register" in stack.log_path("prefill").read_text()
    finally:
        stack.stop()


# ---- protocol peers against the real router: who may say what ----

def _fingerprint(checkpoint) -> ModelFingerprint:
    """What the stack's real workers would register with (float32 on the CPU)."""
    hf_config = load_hf_config(checkpoint)
    return model_fingerprint(checkpoint, "float32", "none", hf_config.num_hidden_layers,
                             hf_config.num_key_value_heads, hf_config.head_dim, 16, "bfloat16")


@pytest.fixture()
def router_and_peers(checkpoint, tmp_path):
    """The real router alone, with a prefill, a decode and a small second decode played by peers."""
    stack = ServiceStack(tmp_path, CACHE_DIR, services=("router",), PDSERVE_ROUTER_HEARTBEAT_TIMEOUT_S="120")
    endpoint = f"ipc://{tmp_path}/run/router.ipc"
    fingerprint = _fingerprint(checkpoint)
    peers = {"prefill": ProtocolPeer(endpoint, "prefill-0", Role.PREFILL, fingerprint, total_pages=64),
             "decode": ProtocolPeer(endpoint, "decode-0", Role.DECODE, fingerprint, total_pages=256),
             "other": ProtocolPeer(endpoint, "decode-1", Role.DECODE, fingerprint, total_pages=4)}
    for peer in peers.values():
        peer.register()  # queued until the router binds
    try:
        with stack:
            for peer in peers.values():
                peer.epoch = peer.receive(Registered).router_epoch
            yield stack, peers
    finally:
        for peer in peers.values():
            peer.close()


def test_messages_about_a_request_count_only_from_its_own_workers(router_and_peers):
    stack, peers = router_and_peers
    prefill, decode, other = peers["prefill"], peers["decode"], peers["other"]
    with ThreadPoolExecutor(1) as pool:
        # 100 tokens need more pages than decode-1's pool of 4: only decode-0 can be given it.
        call = pool.submit(lambda: list(stack.stub.Generate(_greedy("Hello", 100), timeout=60)))
        task = prefill.receive(PrefillTask)
        rid = task.request_id
        prefill.send(KvReady(rid, "prefill-0", wire.pack_page_ids([0]), len(wire.unpack_token_ids(task.prompt_token_ids)), 42, None, 0.0, 0))
        assert decode.receive(DecodeTask).request_id == rid
        # Forgeries: the other decode, and the prefill speaking as a decode.
        other.send(TokenBatch([TokenOut(rid, 666, FinishReason.LENGTH)]))
        other.send(Failed(rid, ErrorCode.INTERNAL, "forged"))
        other.send(KvPulled(rid, "prefill-0", 0.0))
        prefill.send(TokenBatch([TokenOut(rid, 777, FinishReason.STOP)]))
        with pytest.raises(TimeoutError):
            prefill.receive(ReleaseKv, timeout_s=1.0)  # the forged KvPulled freed nothing
        decode.send(KvPulled(rid, "prefill-0", 0.0))
        assert prefill.receive(ReleaseKv).request_id == rid
        decode.send(TokenBatch([TokenOut(rid, 43, None)]))
        decode.send(TokenBatch([TokenOut(rid, 44, FinishReason.LENGTH)]))
        chunks = call.result(timeout=30)
    assert [t for c in chunks for t in c.token_ids] == [42, 43, 44]
    assert chunks[-1].finish_reason == "length"
    assert all(w.reserved_pages == 0 for w in stack.workers())


def test_a_cancel_during_the_pull_gives_the_prefills_pages_back_at_once(router_and_peers):
    """The decode is still reading the prompt's pages (a NIXL read in flight: here a decode that has
    not answered its DecodeTask) when the client cancels: the prefill hears ReleaseKv at once, not
    at router.handoff_timeout_s (120 s here), so the router never counts on room the prefill lacks."""
    stack, peers = router_and_peers
    prefill, decode = peers["prefill"], peers["decode"]
    stream = stack.stub.Generate(_greedy("Hello", 100), timeout=60)  # only decode-0 holds 100 tokens
    task = prefill.receive(PrefillTask)
    prefill.send(KvReady(task.request_id, "prefill-0", wire.pack_page_ids([3]), len(wire.unpack_token_ids(task.prompt_token_ids)), 42, None,
                         0.0, 0))
    assert next(stream).token_ids == [42]
    assert decode.receive(DecodeTask).request_id == task.request_id
    stream.cancel()
    assert decode.receive(Abort, timeout_s=30).request_id == task.request_id
    assert prefill.receive(ReleaseKv, timeout_s=30).request_id == task.request_id
    assert all(w.reserved_pages == 0 for w in stack.workers())


def test_the_router_aborts_what_a_worker_holds_that_it_does_not_know(router_and_peers):
    _, peers = router_and_peers
    peers["decode"].heartbeat(holding=["a-request-the-router-never-made"])
    with pytest.raises(TimeoutError):  # once may be a heartbeat that crossed a ReleaseKv or Abort
        peers["decode"].receive(Abort, timeout_s=1.0)
    peers["decode"].heartbeat(holding=["a-request-the-router-never-made"])
    assert peers["decode"].receive(Abort).request_id == "a-request-the-router-never-made"


def test_a_live_workers_id_is_refused_to_another_process_and_taken_back_once_that_one_is_gone(router_and_peers):
    """A second process under decode-0's id (a second stack on the same runtime folder) is refused
    while decode-0 beats and its connection is there, and evicts nothing; once decode-0's process is
    gone (its connection closed), a new incarnation takes the id at once, long before the 120 s
    heartbeat timeout would have dropped the old one."""
    stack, peers = router_and_peers
    endpoint, live = f"ipc://{stack.workdir}/run/router.ipc", peers["decode"]
    double = ProtocolPeer(endpoint, "decode-0", Role.DECODE, live.fingerprint, incarnation="a-second-stack")
    try:
        double.register()
        reason = double.receive(Refused).reason
        assert "worker id 'decode-0' is held by a live worker" in reason and "another stack" in reason
        assert live.receive(Registered).router_epoch == live.epoch  # the probe, which a worker ignores
        live.heartbeat()
        with pytest.raises(TimeoutError):
            live.receive(Reregister, timeout_s=1.0)  # still the router's decode-0
    finally:
        double.close()
    live.close()  # the process dies: its connection goes with it
    restarted = ProtocolPeer(endpoint, "decode-0", Role.DECODE, live.fingerprint, incarnation="restarted")
    peers["decode"] = restarted  # the fixture closes it
    restarted.register()
    assert restarted.receive(Registered, timeout_s=30).router_epoch == live.epoch
    assert "decode-0" in {w.worker_id for w in stack.workers()}


def test_a_worker_of_another_protocol_version_is_refused_with_the_reason(router_and_peers):
    stack, peers = router_and_peers
    endpoint = f"ipc://{stack.workdir}/run/router.ipc"
    old = ProtocolPeer(endpoint, "prefill-old", Role.PREFILL, next(iter(peers.values())).fingerprint)
    try:
        old.register(protocol_version=1)
        assert "protocol version 1" in old.receive(Refused).reason
        assert "prefill-old" not in {w.worker_id for w in stack.workers()}
    finally:
        old.close()


def test_a_worker_whose_register_this_router_cannot_read_is_refused_by_its_version(router_and_peers):
    """A newer worker's Register has fields this router does not know: it still hears why."""
    stack, peers = router_and_peers
    newer = ProtocolPeer(f"ipc://{stack.workdir}/run/router.ipc", "prefill-new", Role.PREFILL,
                         peers["prefill"].fingerprint)
    try:
        version = PROTOCOL_VERSION + 1
        newer.socket.send(msgpack.packb([int(MsgKind.REGISTER), "prefill-new", "prefill", version, "a-new-field"]))
        assert f"protocol version {version}" in newer.receive(Refused).reason
    finally:
        newer.close()
