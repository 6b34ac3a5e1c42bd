"""Chaos: the stack (one prefill, two decodes) under the supervisor with restarts on, mixed traffic
from a few clients, and a SIGKILL to a service every few seconds. Every call must still end
explicitly, and once the killing stops the stack must serve again with nothing held: no KV page,
no shared memory.

Beside the normal clients a hostile one (tests/hostile_client.py) sends values out of range over
both fronts, chats of too many messages, connections that never send a byte and streams it never
reads: each must get what it is owed, and none may cost a normal call its answer.

It runs in two phases on one stack. First only decodes are killed, each while it holds requests
and only while the other serves: migration (services/router/control/migration.py) must then save
every call, so none of those that end in this phase may fail. Then any service is killed at random,
where a call may end UNAVAILABLE (a prefill or the router killed, both decodes down at once).
The first phase also ends where the router drops a live worker: a stall of the loaded machine
longer than the 1.5 s heartbeat timeout (a CI run saw the prefill and a decode silent for 6 s while
a killed decode reloaded its model) looks like a death, and the worker's own log says it was
dropped once it hears so.

A killed service takes 10-40 s to serve again on a busy 2-core CPU, far longer than a few seconds:
most kills wait for the stack to serve again and then for a few seconds of traffic, so that each
hits requests in flight; the others come at once and may hit a service that is still starting.

The random choices (calls, victims, pauses) come from a fixed seed; the timings do not.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import json
import random
import signal
import threading
import time

import grpc
import pytest

from pdserve.v1 import generation_pb2, generation_pb2_grpc
from services.stack.supervisor import RestartPolicy
from tests.conftest import CACHE_DIR
from tests.hostile_client import HostileClient
from tests.stack import ServiceStack
from tests.test_faults import FAST_HEARTBEATS

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SEED = 20240611
CHAOS_S = 100.0
DECODES_ONLY_S = 40.0            # the first phase, of CHAOS_S
VICTIMS = ("router", "prefill-0", "decode-0", "decode-1")
DECODES = ("decode-0", "decode-1")
KILL_EVERY_S = (4.0, 10.0)       # of serving, between two kills
IMPATIENT = 0.25                 # the share of kills that do not wait for the stack to serve again
CLIENTS = 4
CALL_DEADLINE_S = 60.0           # every call has one: a call that reaches it was hung...
PURPOSE_DEADLINE_S = (0.3, 2.0)  # ...unless it set a short one on purpose
ANSWERS = {"UNAVAILABLE", "RESOURCE_EXHAUSTED", "CANCELLED", "DEADLINE_EXCEEDED"}
# How each kind of call may end while a decode dies and the other serves: as it meant to.
SAVED = {"short": {"finished:length"}, "long": {"finished:length"}, "cancelled": {"CANCELLED", "finished:length"},
         "deadline": {"DEADLINE_EXCEEDED", "finished:length"}}
# Every stage of a request bounded well inside CALL_DEADLINE_S, so that a lost request ends on
# the router's side first.
SETTINGS = {**FAST_HEARTBEATS, "PDSERVE_ROUTER_ADMISSION_TIMEOUT_S": "10", "PDSERVE_ROUTER_PREFILL_TIMEOUT_S": "30",
            "PDSERVE_ROUTER_HANDOFF_TIMEOUT_S": "20", "PDSERVE_KV_TRANSFER_TIMEOUT_S": "10",
            "PDSERVE_ROUTER_DECODE_TOKEN_TIMEOUT_S": "10",
            # The hostile client's unread streams and idle connections are let go of within seconds.
            "PDSERVE_ROUTER_STALL_TIMEOUT_S": "3", "PDSERVE_ROUTER_CONNECTION_IDLE_TIMEOUT_S": "2"}
# A service may be killed again while it starts: restart quickly, and give up only on a real crash loop.
RESTARTS = RestartPolicy(first_delay_s=0.5, max_delay_s=2.0, stable_after_s=10.0, crash_limit=20, crash_window_s=60)
# The router comes back within seconds: reconnect as fast, instead of gRPC's backoff of up to 2 minutes.
CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                   ("grpc.max_reconnect_backoff_ms", 1000)]
PROMPTS = ("Hello", "Count slowly:", "Tell me about the sea.", "What is the capital of France?")


def _call(rng: random.Random) -> tuple[str, generation_pb2.GenerateRequest, float, int]:
    """A kind of call, its request, its deadline and after how many chunks the client cancels it (0: never)."""
    kind = rng.choices(("short", "long", "cancelled", "deadline"), weights=(4, 3, 2, 2))[0]
    request = generation_pb2.GenerateRequest(prompt=rng.choice(PROMPTS), temperature=rng.choice((0.0, 0.8)),
                                             seed=rng.randrange(1 << 31), ignore_eos=True)
    if kind == "short":
        request.max_tokens = rng.randint(1, 8)
        return kind, request, CALL_DEADLINE_S, 0
    request.max_tokens = rng.randint(24, 64)  # some seconds of decoding on a busy CPU
    if kind == "long":
        return kind, request, CALL_DEADLINE_S, 0
    if kind == "cancelled":
        return kind, request, CALL_DEADLINE_S, rng.randint(1, 4)
    request.max_tokens = 200
    return kind, request, rng.uniform(*PURPOSE_DEADLINE_S), 0


def _outcome(stub, request, deadline_s: float, cancel_after: int) -> str:
    """The gRPC status the call ended with, or finished:<its finish_reason>."""
    call = stub.Generate(request, timeout=deadline_s)
    finish_reason = ""
    try:
        for chunks, chunk in enumerate(call, start=1):
            finish_reason = chunk.finish_reason or finish_reason
            if chunks == cancel_after:
                call.cancel()
    except grpc.RpcError as error:
        return error.code().name
    return f"finished:{finish_reason}"


def _client(address: str, seed: int, until: float, outcomes: list) -> None:
    rng = random.Random(seed)
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        while time.monotonic() < until:
            kind, request, deadline_s, cancel_after = _call(rng)
            outcome = _outcome(stub, request, deadline_s, cancel_after)
            outcomes.append((kind, outcome, time.monotonic()))
            if outcome == "UNAVAILABLE":
                time.sleep(0.5)  # a service is restarting: do not spin


def _kill_decodes_in_turn(stack: ServiceStack, rng: random.Random, until: float) -> list[tuple[float, str, float]]:
    """Only decodes, each while it holds requests and the other serves, so that every request it
    held has somewhere to move."""
    kills = []
    while time.monotonic() + KILL_EVERY_S[1] < until:
        time.sleep(rng.uniform(*KILL_EVERY_S))
        victim = rng.choice(DECODES)
        _wait_until_holding(stack, victim)
        kills.append(_kill(stack, victim, wait=True))
    return kills


def _kill_at_random(stack: ServiceStack, rng: random.Random, until: float) -> list[tuple[float, str, float | None]]:
    kills = []
    while time.monotonic() + KILL_EVERY_S[1] < until:
        time.sleep(rng.uniform(*KILL_EVERY_S))
        kills.append(_kill(stack, rng.choice(VICTIMS), wait=rng.random() >= IMPATIENT))
    return kills


def _kill(stack: ServiceStack, victim: str, wait: bool) -> tuple[float, str, float | None]:
    """When the kill came, its victim, and how long the stack took to serve again with every worker
    registered (None: the next kill did not wait)."""
    stack.signal(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    if not wait:
        return killed_at, victim, None
    # By then the router has dropped a killed worker, so it serves with all of them only once it is back.
    time.sleep(1.5 * float(FAST_HEARTBEATS["PDSERVE_ROUTER_HEARTBEAT_TIMEOUT_S"]))
    stack.wait_serving()
    return killed_at, victim, round(time.monotonic() - killed_at, 1)


def _first_live_worker_dropped(stack: ServiceStack) -> float | None:
    """When (wall clock) the router first dropped a worker that was alive: a "dropping worker" of it
    after it registered and before it logged that the router no longer knew it. A killed worker's
    successor registers afresh and never logs that; after a router restart it logs it with no drop."""
    def times(log: str, prefix: str, worker: str) -> list[float]:
        lines = (json.loads(line) for line in stack.log_path(log).read_text().splitlines() if line.startswith("{"))
        return [datetime.datetime.fromisoformat(line["timestamp"].replace("Z", "+00:00")).timestamp()
                for line in lines if line.get("event", "").startswith(prefix) and line.get("worker", worker) == worker]

    dropped_at = []
    for worker in VICTIMS[1:]:
        drops = times("router", "dropping worker", worker)
        registered = times(worker, "registered with router", worker)
        for heard in times(worker, "the router does not know this worker", worker):
            since = max((at for at in registered if at <= heard), default=0.0)
            dropped_at += [at for at in drops if since <= at <= heard][-1:]
    return min(dropped_at, default=None)


def _wait_until_holding(stack: ServiceStack, decode: str, timeout_s: float = 30.0) -> None:
    """Until the decode holds a request, so that its death has requests to move (or the timeout)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(grpc.RpcError):  # the router itself may be restarting
            if any(w.worker_id == decode and w.assigned_requests for w in stack.workers()):
                return
        time.sleep(0.1)


def test_every_call_ends_explicitly_while_services_are_killed_at_random(checkpoint, tmp_path):
    outcomes: list[tuple[str, str, float]] = []  # kind, outcome, when it ended
    with ServiceStack(tmp_path, CACHE_DIR, restart=RESTARTS, decode=len(DECODES), **SETTINGS) as stack:
        started, started_wall = time.monotonic(), time.time()
        until = started + CHAOS_S
        hostile = HostileClient(stack.config, stack.address, stack.env["PDSERVE_ROUTER_HTTP_ADDRESS"])
        acts: list[tuple[str, str]] = []
        clients = [threading.Thread(target=_client, args=(stack.address, SEED + i, until, outcomes))
                   for i in range(CLIENTS)]
        clients.append(threading.Thread(target=hostile.run, args=(SEED, until, acts)))
        for client in clients:
            client.start()
        rng = random.Random(SEED)
        decode_kills = _kill_decodes_in_turn(stack, rng, started + DECODES_ONLY_S)
        kills = decode_kills + _kill_at_random(stack, rng, until)
        for client in clients:
            client.join(timeout=CALL_DEADLINE_S + 30)
        calls = collections.Counter((kind, outcome) for kind, outcome, _ in outcomes)
        restarts = len(stack.supervisor.pids) - len(VICTIMS)
        moved = stack.log_path("router").read_text().count("request moved to another decode")
        summary = (f"kills (victim, seconds to serve again): {[k[1:] for k in kills]}; {restarts=}; {moved=}; "
                   f"calls: {calls}; hostile acts: {collections.Counter(acts)}")
        print(summary)
        assert not any(client.is_alive() for client in clients), "a call outlived its deadline: " + summary
        assert stack.failure is None, summary
        # The first phase: no call lost to a dead decode while the other served.
        first_other_kill = kills[len(decode_kills)][0] if len(kills) > len(decode_kills) else until
        live_dropped = _first_live_worker_dropped(stack)
        if live_dropped is not None:
            first_other_kill = min(first_other_kill, live_dropped - started_wall + started)
        lost = [(kind, o) for kind, o, at in outcomes if at < first_other_kill and o not in SAVED[kind]]
        saved_by_moving = [kill for kill in decode_kills if kill[0] < first_other_kill]
        assert saved_by_moving and moved and not lost, f"{lost=}; {live_dropped=}; " + summary
        unanswered = [o for _, o, _ in outcomes if o not in ANSWERS and o not in ("finished:stop", "finished:length")]
        assert not unanswered, summary
        hung = [kind for kind, o, _ in outcomes if o == "DEADLINE_EXCEEDED" and kind != "deadline"]
        assert not hung, summary
        assert kills and any(o.startswith("finished:") and at > kills[0][0] for _, o, at in outcomes), \
            "restarted services served: " + summary
        assert all(hostile.allowed(act, outcome) for act, outcome in acts), summary
        assert {act for act, outcome in acts if hostile.owed(act, outcome)} == set(hostile.acts), \
            "every hostile act got what it is owed at least once: " + summary

        time.sleep(2 * float(FAST_HEARTBEATS["PDSERVE_ROUTER_HEARTBEAT_TIMEOUT_S"]))  # the last victim is dropped
        stack.wait_serving()  # every worker registered again
        stack.assert_pools_drained(timeout_s=90)
        short = generation_pb2.GenerateRequest(prompt="Hello", max_tokens=3, ignore_eos=True, temperature=0)
        assert _outcome(stack.stub, short, CALL_DEADLINE_S, 0) == "finished:length", "serving again after the chaos"
        codes = stack.stop()  # fails on shared memory left by any process of the run
    assert codes == {name: 0 for name in codes} and len(codes) == len(VICTIMS), codes
    assert not stack.shm_segments()
