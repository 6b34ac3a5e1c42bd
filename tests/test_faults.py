"""Faults done for real: workers killed mid-request, the router restarted, pools too small."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
from pdserve.v1 import generation_pb2

from tests.conftest import CACHE_DIR
from tests.stack import ServiceStack

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FAST_HEARTBEATS = {"PDSERVE_ROUTER_HEARTBEAT_TIMEOUT_S": "1.5", "PDSERVE_WORKER_HEARTBEAT_INTERVAL_S": "0.25"}


def _long_request() -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt="Count slowly:", max_tokens=2000, ignore_eos=True, temperature=0)


def _short_request() -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt="Hello", max_tokens=3, ignore_eos=True, temperature=0)


def _tokens(stub, request, timeout=60.0) -> int:
    return sum(len(c.token_ids) for c in stub.Generate(request, timeout=timeout))


@pytest.fixture(scope="module")
def one_stack(checkpoint, tmp_path_factory):
    """Its decode overlaps its steps (decode.overlap_steps), so the faults also find a step in flight:
    a drop, a failure or a deadline must free the pages that step still writes once it has run. The
    other stacks' decodes run the plain steps through their faults."""
    with ServiceStack(tmp_path_factory.mktemp("faults"), CACHE_DIR, PDSERVE_DECODE_OVERLAP_STEPS="on",
                      **FAST_HEARTBEATS) as services:
        yield services


@pytest.fixture()
def stack(one_stack):
    """The module's stack, mended after the faults of the test before: each service that one stopped
    or killed started again, the router first, every worker registered and no page held. A stack
    for each test cost about 14 s of CPU to start, on a 2-core CI machine that runs the suite."""
    down = [name for name, process in one_stack.processes.items() if process.poll() is not None]
    if "router" in down:
        one_stack.start("router")  # a new router lists no worker yet
    for name in down:
        if name != "router":
            if "router" not in down:
                one_stack.wait_worker_gone(name.partition("-")[0])
            one_stack.start(name)
    one_stack.wait_serving()
    one_stack.assert_pools_drained()
    return one_stack


def _log_from(stack, name: str, offset: int) -> str:
    """What a service logged from offset on: the module's tests share its logs."""
    return stack.log_path(name).read_text()[offset:]


def _log_size(stack, name: str) -> int:
    return len(stack.log_path(name).read_text())


def test_the_modules_decode_overlaps_its_steps(one_stack):
    ready = [line["overlap_steps"] for line in one_stack.logged("decode", "decode worker ready")]
    assert ready and all(ready), ready


def test_killed_decode_fails_its_requests_and_a_restarted_one_serves(stack):
    call = stack.stub.Generate(_long_request(), timeout=120)
    next(call)  # the request is decoding
    killed_at = time.monotonic()
    stack.signal("decode", signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as error:
        for _ in call:
            pass
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - killed_at < 10, "the request must end promptly"
    _restart_and_serve(stack, "decode")


def test_killed_prefill_fails_only_what_it_held_and_a_restarted_one_serves(stack):
    """Killed mid-prompt: that request ends UNAVAILABLE; one already decoding (its KV pulled) finishes."""
    decoding = stack.stub.Generate(generation_pb2.GenerateRequest(
        prompt="Count slowly:", max_tokens=40, ignore_eos=True, temperature=0), timeout=120)
    next(decoding)
    prefilling = stack.stub.Generate(generation_pb2.GenerateRequest(
        prompt_token_ids=[1000 + i % 5000 for i in range(3000)], max_tokens=4, temperature=0), timeout=120)
    time.sleep(0.5)  # a 3,000-token prompt keeps the prefill's core busy for seconds
    killed_at = time.monotonic()
    stack.signal("prefill", signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as error:
        list(prefilling)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - killed_at < 10, "the request must end promptly"
    assert sum(len(c.token_ids) for c in decoding) == 39  # the rest of the 40, after the first
    _restart_and_serve(stack, "prefill")


def _restart_and_serve(stack, victim: str) -> None:
    assert stack.wait_worker_gone(victim) < 10, "the router must notice a dead worker through heartbeats"
    stack.processes[victim].wait(timeout=10)
    stack.start(victim)
    stack.wait_serving()
    assert _tokens(stack.stub, _short_request()) == 3
    stack.assert_pools_drained()


def test_prefill_killed_before_handoff_fails_the_request_unavailable(stack):
    stack.signal("prefill", signal.SIGSTOP)  # a hung prefill: heartbeats stop, tasks pile up
    try:
        with pytest.raises(grpc.RpcError) as error:
            _tokens(stack.stub, _short_request(), timeout=30)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        stack.signal("prefill", signal.SIGKILL)
        stack.processes["prefill"].wait(timeout=10)
    stack.wait_worker_gone("prefill")
    stack.start("prefill")
    stack.wait_serving()
    assert _tokens(stack.stub, _short_request()) == 3
    stack.assert_pools_drained()


def test_workers_reregister_after_router_restart(stack):
    stack.signal("router", signal.SIGTERM)
    assert stack.processes["router"].wait(timeout=30) == 0
    stack.start("router")
    stack.wait_serving()  # SERVING means both workers registered with the new router
    assert _tokens(stack.stub, _short_request()) == 3


def test_overload_is_resource_exhausted_and_nothing_is_lost(checkpoint, tmp_path):
    """A decode pool with room for one request and a queue of one: the rest are refused explicitly."""
    settings = {"PDSERVE_KV_DECODE_PAGES": "15", "PDSERVE_ROUTER_MAX_WAITING_REQUESTS": "1",
                "PDSERVE_ROUTER_ADMISSION_TIMEOUT_S": "60"}
    with ServiceStack(tmp_path, CACHE_DIR, **settings) as stack:
        request = generation_pb2.GenerateRequest(prompt="Tell me about the sea.", max_tokens=150, ignore_eos=True,
                                                 temperature=0)  # 10 pages
        outcomes: list[object] = []

        def run():
            try:
                outcomes.append(_tokens(stack.stub, request, timeout=300))
            except grpc.RpcError as exc:
                outcomes.append(exc.code())

        threads = [threading.Thread(target=run) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=320)
        assert len(outcomes) == 4, "every request ends, with tokens or an explicit error"
        assert outcomes.count(150) >= 1
        assert outcomes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 1
        assert set(outcomes) <= {150, grpc.StatusCode.RESOURCE_EXHAUSTED}
        too_big = generation_pb2.GenerateRequest(prompt="Hi", max_tokens=1000, ignore_eos=True)  # > 15 pages
        with pytest.raises(grpc.RpcError) as error:
            _tokens(stack.stub, too_big)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "pages" in error.value.details()
        stack.assert_pools_drained()


def test_deadline_ends_the_request_and_frees_its_pages(stack):
    with pytest.raises(grpc.RpcError) as error:
        _tokens(stack.stub, _long_request(), timeout=1.5)
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stack.assert_pools_drained()
    assert _tokens(stack.stub, _short_request()) == 3


@pytest.mark.parametrize("victim", ["decode", "prefill"])
def test_sigint_fails_in_flight_requests_explicitly_and_exits_zero(stack, victim):
    """A worker told to stop now (SIGINT, or SIGTERM twice) fails what it holds at once (not after
    missed heartbeats), and exits 0."""
    if victim == "prefill":
        stack.signal("decode", signal.SIGSTOP)  # keep the request parked at the prefill's side
    call = stack.stub.Generate(_long_request(), timeout=60)
    try:
        if victim == "decode":
            next(call)
        else:
            time.sleep(2.0)  # the prefill has computed the prompt and holds its KV for the stopped decode
        stopped_at = time.monotonic()
        stack.signal(victim, signal.SIGINT)
        with pytest.raises(grpc.RpcError) as error:
            for _ in call:
                pass
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - stopped_at < 1.0, "failed at once, not after the 1.5 s heartbeat timeout"
    finally:
        if victim == "prefill":
            stack.signal("decode", signal.SIGCONT)
    assert stack.processes[victim].wait(timeout=30) == 0
    assert not [s for s in stack.shm_segments()
                if s.endswith(f"-{stack.processes[victim].pid}")], "the stopped worker's pool is gone"


@pytest.mark.parametrize("victim", ["decode", "prefill"])
def test_sigterm_drains_a_worker_its_requests_finish_and_it_exits_zero(stack, victim):
    """SIGTERM (systemd's stop, a rolling restart): the worker takes no new work, finishes what it
    holds (the decode its stream, the prefill a prompt in work and its handoff), then exits 0."""
    if victim == "decode":
        request = generation_pb2.GenerateRequest(prompt="Count slowly:", max_tokens=40, ignore_eos=True, temperature=0)
    else:
        # About 9 s alone on a CI core (3,000 tokens ran past the call's 120 s beside the other test processes).
        request = generation_pb2.GenerateRequest(prompt_token_ids=[1000 + i % 5000 for i in range(1000)],
                                                 max_tokens=4, ignore_eos=True, temperature=0)
    logged = _log_size(stack, victim)
    call = stack.stub.Generate(request, timeout=120)
    if victim == "decode":
        next(call)
    else:
        time.sleep(0.5)  # the prompt is in work
    stack.signal(victim, signal.SIGTERM)
    received = sum(len(c.token_ids) for c in call)
    assert received == (39 if victim == "decode" else 4), "the drained worker finished the request"
    assert stack.processes[victim].wait(timeout=30) == 0
    assert f'"{victim} worker draining"' in _log_from(stack, victim, logged)
    stack.wait_worker_gone(victim)
    stack.start(victim)
    stack.wait_serving()
    assert _tokens(stack.stub, _short_request()) == 3
    stack.assert_pools_drained()


def test_a_worker_stopped_with_its_router_goes_at_once_though_the_routers_drained_came_first(stack):
    """The whole stack stopped at once (make run's Ctrl-C, the tests): the stopping router tells
    every worker Drained. Here the decode hears it before its own SIGTERM, frozen meanwhile, and
    must still exit at once rather than wait worker.drain_timeout_s (60 s) for a router long gone."""
    stack.signal("decode", signal.SIGSTOP)
    try:
        stack.signal("router", signal.SIGTERM)
        stack.processes["router"].wait(timeout=30)
        stack.signal("decode", signal.SIGTERM)
    finally:
        stack.signal("decode", signal.SIGCONT)
    assert stack.processes["decode"].wait(timeout=15) == 0


def test_a_prefill_busy_for_longer_than_the_heartbeat_timeout_stays_registered(stack):
    """The heartbeat thread borrows the worker's socket while its main thread computes: a prompt
    that keeps the prefill busy for several heartbeat timeouts (1.5 s) neither drops it nor fails. 1,000
    tokens take the embedded model about 9 s on one core of the CI machine: 4,000 (about 50 s alone)
    ran past the call's 120 s beside the other test processes on a fresh clone."""
    logged = _log_size(stack, "router")
    started = time.monotonic()
    request = generation_pb2.GenerateRequest(prompt_token_ids=[1000 + i % 5000 for i in range(1000)], max_tokens=2,
                                             ignore_eos=True, temperature=0)
    assert _tokens(stack.stub, request, timeout=120) == 2
    assert time.monotonic() - started > 3.0, "the prompt must outlast two heartbeat timeouts for this to test anything"
    assert '"dropping worker"' not in _log_from(stack, "router", logged)
