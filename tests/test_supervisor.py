"""The process supervisor (services/stack/supervisor.py): first on tiny real children, then `make run`'s
stack with each of its services killed in turn."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest

from pdserve.v1 import generation_pb2
from services.stack.supervisor import Backoff, RestartPolicy, Service, Supervisor
from shared.control.messages import EXIT_REFUSED
from tests.conftest import CACHE_DIR
from tests.stack import ServiceStack
from tests.test_faults import FAST_HEARTBEATS

QUICK = RestartPolicy(first_delay_s=0.3, max_delay_s=1.2, crash_limit=5, crash_window_s=60)


def _child(tmp_path: Path, name: str, *args: str) -> Service:
    return Service(name, "tests.supervised_child", ("--starts", str(tmp_path / f"{name}.starts"), *args),
                   log_path=tmp_path / f"{name}.log")


def _starts(tmp_path: Path, name: str) -> list[float]:
    path = tmp_path / f"{name}.starts"
    return [float(line) for line in path.read_text().split()] if path.exists() else []


def _zombie(pid: int) -> bool:
    """Killed, but not reaped yet by its parent (here init, once the laggard is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_delays_double_up_to_the_ceiling_and_a_stable_run_starts_them_over():
    policy = RestartPolicy(first_delay_s=0.5, max_delay_s=3.0, stable_after_s=30, crash_limit=5, crash_window_s=60)
    crashing = Backoff(policy)
    assert [crashing.exited(now, ran_s=1) for now in (0, 2, 4, 6)] == [0.5, 1.0, 2.0, 3.0]
    assert crashing.exited(8, ran_s=1) is None, "five exits within 60 s"
    recovering = Backoff(policy)
    assert [recovering.exited(now, ran_s=1) for now in (0, 2)] == [0.5, 1.0]
    assert recovering.exited(40, ran_s=35) == 0.5, "a run past stable_after_s starts the doubling over"
    assert [recovering.exited(now, ran_s=1) for now in (41, 42)] == [1.0, None]
    assert recovering.exited(200, ran_s=1) == 2.0, "the exits before fell out of the window"


@pytest.mark.e2e
def test_a_crashing_service_is_restarted_with_doubling_delays_until_the_supervisor_gives_up(tmp_path):
    supervisor = Supervisor()
    supervisor.start(_child(tmp_path, "flaky", "--exit-code", "3", "--after", "0"))
    steady = supervisor.start(_child(tmp_path, "steady"))
    failure = supervisor.supervise(QUICK)
    assert failure is not None and failure.startswith("flaky exited 5 times within 60 s (last: exit code 3)")
    starts = _starts(tmp_path, "flaky")
    assert len(starts) == 5 and len(supervisor.pids) == 6
    gaps = [later - earlier for earlier, later in zip(starts, starts[1:])]
    for gap, delay in zip(gaps, (0.3, 0.6, 1.2, 1.2)):
        assert delay <= gap < delay + 2.0, f"restart gaps {gaps}"
    assert steady.returncode == 0, "giving up stops the others with SIGTERM"


@pytest.mark.e2e
def test_exit_zero_unasked_is_restarted_too(tmp_path):
    supervisor = Supervisor()
    supervisor.start(_child(tmp_path, "quitter", "--exit-code", "0", "--after", "0.2"))
    supervising = threading.Thread(target=supervisor.supervise, args=(QUICK,))
    supervising.start()
    try:
        _wait_for(lambda: len(_starts(tmp_path, "quitter")) >= 2)
    finally:
        supervisor.request_stop()
        supervising.join()


@pytest.mark.e2e
def test_a_service_the_router_refused_is_never_restarted(tmp_path):
    supervisor = Supervisor()
    supervisor.start(_child(tmp_path, "refused", "--exit-code", str(EXIT_REFUSED), "--after", "0.2"))
    steady = supervisor.start(_child(tmp_path, "steady"))
    failure = supervisor.supervise(QUICK)
    assert failure == (f"refused exited with code {EXIT_REFUSED} (refused: by the router, or at its start; its "
                       "log says why): not restarted; stopped the others")
    assert len(_starts(tmp_path, "refused")) == 1
    assert steady.returncode == 0


@pytest.mark.e2e
def test_stop_terms_every_service_and_kills_the_group_of_a_laggard(tmp_path):
    """The laggard exported shared memory and started a child of its own: once it is killed, its
    resource tracker still unlinks the segment (a CI run left a killed prefill's pool in /dev/shm
    when the tracker was killed alongside), and the child goes with the group."""
    segment, sleeper = f"pdserve-test-{os.getpid()}-{time.monotonic_ns()}", tmp_path / "sleeper.pid"
    supervisor = Supervisor(grace_s=1.0)
    polite, laggard = (supervisor.start(_child(tmp_path, "polite")),
                       supervisor.start(_child(tmp_path, "laggard", "--ignore-sigterm", "--shared-memory", segment,
                                               "--sleeper", str(sleeper))))
    supervising = threading.Thread(target=supervisor.supervise, args=(QUICK,))
    supervising.start()
    _wait_for(lambda: _starts(tmp_path, "polite") and _starts(tmp_path, "laggard"))
    assert Path("/dev/shm", segment).exists()
    sleeper_pid = int(sleeper.read_text())
    asked = time.monotonic()
    supervisor.request_stop()  # what services.stack's SIGTERM and SIGINT handlers call
    supervising.join()
    assert polite.returncode == 0 and laggard.returncode == -signal.SIGKILL
    assert 1.0 <= time.monotonic() - asked
    assert not Path("/dev/shm", segment).exists(), "the killed laggard's shared memory was left behind"
    _wait_for(lambda: not Path(f"/proc/{sleeper_pid}").exists() or _zombie(sleeper_pid))
    assert supervisor.stop() == {"polite": 0, "laggard": -signal.SIGKILL}, "a second stop only reports"
    assert len(supervisor.pids) == 2, "nothing was restarted while stopping"


# ---- make run's stack ----------------------------------------------------------------------------

def _service_pids(launcher: int) -> dict[str, int]:
    """The launcher's live children by service, from /proc: each runs `python -m services.<name>`."""
    pids = {}
    for children in Path(f"/proc/{launcher}/task").glob("*/children"):
        for pid in children.read_text().split():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            except FileNotFoundError:
                continue  # gone meanwhile
            if "-m" in argv and argv[argv.index("-m") + 1].startswith("services."):  # a zombie's is empty
                pids[argv[argv.index("-m") + 1].removeprefix("services.")] = int(pid)
    return pids


def _in_flight(stack: ServiceStack, victim: str):
    """A call that the victim holds: a prompt being prefilled, or a stream being decoded."""
    if victim == "prefill":
        call = stack.stub.Generate(generation_pb2.GenerateRequest(
            prompt_token_ids=[1000 + i % 5000 for i in range(3000)], max_tokens=4, temperature=0), timeout=120)
        time.sleep(0.5)  # a 3,000-token prompt keeps the prefill's core busy for seconds
        return call
    call = stack.stub.Generate(generation_pb2.GenerateRequest(
        prompt="Count slowly:", max_tokens=2000, ignore_eos=True, temperature=0), timeout=120)
    next(call)
    return call


@pytest.mark.e2e
@pytest.mark.slow
def test_make_run_restarts_each_killed_service_and_serves_again(tmp_path, checkpoint):
    short = generation_pb2.GenerateRequest(prompt="Hello", max_tokens=3, ignore_eos=True, temperature=0)
    with ServiceStack(tmp_path, CACHE_DIR, services=("stack",), **FAST_HEARTBEATS) as stack:
        launcher = stack.processes["stack"].pid
        pids = _service_pids(launcher)
        assert sorted(pids) == ["decode", "prefill", "router"]
        seen = set(pids.values())
        for victim in ("decode", "prefill", "router"):
            call = _in_flight(stack, victim)
            killed_at = time.monotonic()
            os.kill(pids[victim], signal.SIGKILL)
            with pytest.raises(grpc.RpcError) as error:
                for _ in call:
                    pass
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE, f"{victim}: {error.value}"
            assert time.monotonic() - killed_at < 10, f"{victim}: the call must end promptly"
            _wait_for(lambda: _service_pids(launcher).get(victim, pids[victim]) != pids[victim])
            pids = _service_pids(launcher)
            seen |= set(pids.values())
            stack.wait_serving()
            assert sum(len(c.token_ids) for c in stack.stub.Generate(short, timeout=60)) == 3, victim
            stack.assert_pools_drained()
        # The services share the launcher's stdout, and a line's newline is a write of its own: match
        # the supervisor's records, not lines.
        records = map(json.loads, re.findall(r'\{[^{}]*"event": "service exited"[^{}]*\}',
                                             stack.log_path("stack").read_text()))
        exits = [(r["child"], r["why"]) for r in records]
        assert exits == [(name, "killed by SIGKILL") for name in ("decode-0", "prefill-0", "router")]
        assert stack.stop() == {"stack": 0}
    assert not [pid for pid in seen if Path(f"/proc/{pid}").exists()], "services outlived the launcher"
    assert not [n for n in os.listdir("/dev/shm")
                if n.startswith("pdserve-kv-") and int(n.rsplit("-", 1)[-1]) in seen], "shared memory left behind"
