"""One process supervisor for the whole project: `make run` (services.stack), the tests'
stacks and the benchmarks' children all start and stop their processes here.

Each service runs as `python -m <module>` from the repository root, in a session of its own: a
Ctrl-C in the terminal reaches only the supervisor, which then stops each service with SIGTERM,
and a laggard gets SIGKILL, then its process group: whatever that service started itself.

Restarts follow systemd's `Restart=on-failure` with a backoff (`supervise`, RestartPolicy): a
service that exits is started again after a delay that doubles up to a ceiling and falls back to
the first once the service had run stably. Unlike on-failure, exit 0 counts as a failure too: a
supervised service stops only when the supervisor tells it to, so one that exits 0 unasked (the
services exit 0 on someone's `kill <pid>`) leaves the stack without that service all the same.
The supervisor gives up, stopping everything with a message that names the service, when one
crash-loops (crash_limit exits within crash_window_s) or exits with EXIT_REFUSED: it was refused,
by the router (another protocol version, its worker id held by a live worker) or at its own start
(a port or the runtime folder taken, a checkpoint it cannot serve), and would be again.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog

from shared.control.messages import EXIT_REFUSED

# On stderr even where structlog is left unconfigured (the benchmarks): their stdout is their report.
log = structlog.wrap_logger(structlog.PrintLogger(sys.stderr))

REPO = Path(__file__).resolve().parents[2]
POLL_S = 0.1
GROUP_EXIT_S = 3.0  # how long a killed service's process group may take to finish by itself


@dataclass(frozen=True)
class Service:
    name: str
    module: str                            # run as `python -m <module>`
    args: tuple[str, ...] = ()
    env: Mapping[str, str] | None = None   # the child's whole environment; None: this process's
    log_path: Path | None = None           # stdout and stderr appended here (across restarts); None: ours
    # stdin and stdout as text pipes, for a child that speaks a line protocol on them (the
    # benchmarks' measuring children); stderr still goes to log_path.
    pipes: bool = False
    # A command the child runs under, which must exec it (same pid), e.g. `ip netns exec NS` for a
    # test's second host.
    wrapper: tuple[str, ...] = ()


@dataclass(frozen=True)
class RestartPolicy:
    first_delay_s: float = 0.5
    max_delay_s: float = 10.0
    stable_after_s: float = 30.0   # a run at least this long resets the delay to first_delay_s
    crash_limit: int = 5           # this many exits within crash_window_s: give up
    crash_window_s: float = 60.0


class Backoff:
    """One service's restart delay and recent exits under a RestartPolicy."""

    def __init__(self, policy: RestartPolicy):
        self.policy = policy
        self.delay_s = policy.first_delay_s
        self.exits: collections.deque[float] = collections.deque()

    def exited(self, now: float, ran_s: float) -> float | None:
        """Seconds to wait before the restart, or None when the service is crash-looping."""
        policy = self.policy
        if ran_s >= policy.stable_after_s:
            self.delay_s = policy.first_delay_s
        self.exits.append(now)
        while self.exits[0] <= now - policy.crash_window_s:
            self.exits.popleft()
        if len(self.exits) >= policy.crash_limit:
            return None
        delay, self.delay_s = self.delay_s, min(2 * self.delay_s, policy.max_delay_s)
        return delay


def describe_exit(code: int) -> str:
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:  # a real-time signal has no name of its own
        return f"killed by signal {-code}"


class Supervisor:
    def __init__(self, grace_s: float = 15.0):
        self.grace_s = grace_s
        self.processes: dict[str, subprocess.Popen] = {}  # each service's latest process
        # Every process started, restarts included: what they leave behind (shared memory) is named by pid.
        self.pids: list[int] = []
        self._services: dict[str, Service] = {}
        self._started_at: dict[str, float] = {}
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # a restart and a stop from two threads never interleave

    def start(self, service: Service) -> subprocess.Popen:
        with self._lock:
            return self._start(service)

    def _start(self, service: Service) -> subprocess.Popen:
        pipe = subprocess.PIPE if service.pipes else None
        with open(service.log_path, "ab") if service.log_path else contextlib.nullcontext() as log_file:
            process = subprocess.Popen(
                [*service.wrapper, sys.executable, "-m", service.module, *service.args], cwd=REPO, env=service.env,
                stdin=pipe, stdout=pipe or log_file, stderr=log_file if service.pipes else subprocess.STDOUT,
                text=service.pipes, bufsize=1 if service.pipes else -1, start_new_session=True)
        self._services[service.name] = service
        self.processes[service.name] = process
        self._started_at[service.name] = time.monotonic()
        self.pids.append(process.pid)
        log.info("service started", child=service.name, pid=process.pid)
        return process

    def signal(self, name: str, sig: int) -> None:
        self.processes[name].send_signal(sig)

    def request_stop(self) -> None:
        """Ends `supervise`, which then stops everything; safe in a signal handler."""
        self._stopping.set()

    def supervise(self, policy: RestartPolicy) -> str | None:
        """Restarts every service that exits until stop is requested (returns None) or it gives up
        (returns why); either way all services are stopped when it returns.

        Run it in a thread that outlives the services: PR_SET_PDEATHSIG, with which each service
        dies with its parent (shared.runtime.process.die_with_parent), fires when the thread that started
        the child ends, not only its process."""
        backoffs = collections.defaultdict(lambda: Backoff(policy))
        restart_at: dict[str, float] = {}
        failure = None
        while failure is None and not self._stopping.wait(POLL_S):
            failure = self._check(backoffs, restart_at)
        if failure is not None:
            log.error("giving up", reason=failure)
        self.stop()
        return failure

    def _check(self, backoffs: dict[str, Backoff], restart_at: dict[str, float]) -> str | None:
        now = time.monotonic()
        with self._lock:
            if self._stopping.is_set():
                return None
            for name, process in list(self.processes.items()):
                if name in restart_at:
                    if now >= restart_at[name]:
                        del restart_at[name]
                        self._start(self._services[name])
                    continue
                code = process.poll()
                if code is None:
                    continue
                if code == EXIT_REFUSED:
                    return (f"{name} exited with code {code} (refused: by the router, or at its start; its log says "
                            "why): not restarted; stopped the others")
                delay = backoffs[name].exited(now, ran_s=now - self._started_at[name])
                if delay is None:
                    policy = backoffs[name].policy
                    return (f"{name} exited {policy.crash_limit} times within {policy.crash_window_s:g} s "
                            f"(last: {describe_exit(code)}); stopped the others")
                log.warning("service exited", child=name, pid=process.pid, code=code, why=describe_exit(code),
                            restart_in_s=delay)
                restart_at[name] = now + delay
        return None

    def stop(self, grace_s: float | None = None) -> dict[str, int]:
        """SIGTERM to every service (a worker drains: it finishes what it holds, and goes once the
        router, stopping too, tells it Drained), SIGKILL to the process group of those still running
        after the grace period; returns each one's exit code. Calling it again only reports them."""
        self._stopping.set()
        with self._lock:
            processes = dict(self.processes)
        for process in processes.values():
            process.send_signal(signal.SIGTERM)  # a no-op for one already reaped
        deadline = time.monotonic() + (self.grace_s if grace_s is None else grace_s)
        codes = {}
        for name, process in processes.items():
            try:
                codes[name] = process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("service outlived the grace period: killing its process group", child=name,
                            pid=process.pid)
                codes[name] = _kill_group(process)
        return codes


def _kill_group(process: subprocess.Popen) -> int:
    """SIGKILL to the service first, then to what is left of its process group: its resource
    tracker, in that group, unlinks the shared memory the service exported once the service is
    gone, and would leave the segments behind were it killed alongside."""
    process.kill()
    code = process.wait()
    deadline = time.monotonic() + GROUP_EXIT_S
    try:
        while time.monotonic() < deadline:
            os.killpg(process.pid, 0)  # raises once the group is empty
            time.sleep(0.05)
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return code

