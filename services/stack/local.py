"""The stack as children of this process, for the tests and the benchmarks.

Each service gets free ports, its own log file in a work folder and the settings given as
PDSERVE_* variables; the stack is used once health says SERVING, and stopping it fails on shared
memory left behind. Processes start and stop through services/supervisor.py, with restarts when
asked for (`restart`); without, a service that dies stays dead until `start` is called again.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pdserve.v1 import generation_pb2_grpc

from services.supervisor import RestartPolicy, Service, Supervisor

SERVICES = ("router", "prefill", "decode")
SHM_CLEANUP_S = 5.0  # a killed worker's segment is unlinked by its resource tracker, a moment later


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalStack:
    def __init__(self, workdir: Path, cache_dir: str, services: tuple[str, ...] = SERVICES,
                 start_timeout_s: float = 240.0, service_env: dict[str, dict[str, str]] | None = None,
                 restart: RestartPolicy | None = None, **settings: str):
        """services: the modules to start, under services/ unless the name is a dotted module path;
        ("stack",) runs the all-in-one launcher of `make run`. service_env: extra environment of
        one service (e.g. its MPS share of the SMs), on top of settings, which all of them get.
        restart: the supervisor restarts services that die, under this policy."""
        self.workdir = workdir
        self.services = services
        self.service_env = service_env or {}
        self.address = f"127.0.0.1:{free_port()}"
        self.env = {
            **os.environ,
            "PDSERVE_ROUTER_GRPC_ADDRESS": self.address,
            "PDSERVE_ROUTER_RUNTIME_DIR": str(workdir / "run"),
            "PDSERVE_MODEL_CACHE_DIR": cache_dir,
            "PDSERVE_LOG_FORMAT": "json",
            "PYTHONUNBUFFERED": "1",
            # Each service's own free port, so that stacks side by side never collide.
            **{f"PDSERVE_{name.upper()}_METRICS_ADDRESS": f"127.0.0.1:{free_port()}" for name in SERVICES},
            **settings,
        }
        self.start_timeout_s = start_timeout_s
        self.restart = restart
        self.supervisor = Supervisor(grace_s=20.0)
        self.failure: str | None = None  # why the supervisor gave up, with restart on
        self._supervising: threading.Thread | None = None
        self.channel: grpc.Channel | None = None

    @property
    def processes(self) -> dict[str, subprocess.Popen]:
        """Each service's latest process."""
        return self.supervisor.processes

    def __enter__(self) -> "LocalStack":
        try:
            for name in self.services:
                self.start(name)
            if self.restart is not None:
                self._supervising = threading.Thread(target=self._supervise, name="supervisor", daemon=True)
                self._supervising.start()
            self.channel = grpc.insecure_channel(self.address)
            self.wait_serving()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _supervise(self) -> None:
        self.failure = self.supervisor.supervise(self.restart)

    @property
    def stub(self) -> generation_pb2_grpc.GenerationStub:
        return generation_pb2_grpc.GenerationStub(self.channel)

    def metrics_url(self, name: str) -> str:
        """The Prometheus endpoint of "router", "prefill" or "decode"."""
        return f"http://{self.env[f'PDSERVE_{name.upper()}_METRICS_ADDRESS']}/metrics"

    def log_path(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def start(self, name: str) -> None:
        module = name if "." in name else f"services.{name}"
        self.supervisor.start(Service(name, module, env={**self.env, **self.service_env.get(name, {})},
                                      log_path=self.log_path(name)))

    def signal(self, name: str, sig: int) -> None:
        self.supervisor.signal(name, sig)

    def wait_serving(self) -> None:
        health = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            self._raise_if_down()
            try:
                status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        raise TimeoutError("stack did not become SERVING:\n" + "\n".join(self.tail(n) for n in self.processes))

    def _raise_if_down(self) -> None:
        """Without restarts a service that exited is down for good; with them, only once the supervisor gave up."""
        if self.failure is not None:
            raise RuntimeError(f"the supervisor gave up: {self.failure}")
        if self.restart is None:
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited with {process.returncode}:\n{self.tail(name)}")

    def tail(self, name: str, lines: int = 30) -> str:
        return "\n".join(self.log_path(name).read_text(errors="replace").splitlines()[-lines:])

    def shm_segments(self) -> list[str]:
        """Shared-memory segments of any process this stack ran, restarted ones included."""
        pids = {str(pid) for pid in self.supervisor.pids}
        return [n for n in os.listdir("/dev/shm") if n.startswith("pdserve-kv-") and n.rsplit("-", 1)[-1] in pids]

    def stop(self, timeout_s: float = 20.0) -> dict[str, int]:
        """SIGTERM to all, SIGKILL to laggards; returns exit codes and fails on leftovers."""
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self._supervising is not None:
            self.supervisor.request_stop()
            self._supervising.join()
        codes = self.supervisor.stop(timeout_s)
        deadline = time.monotonic() + SHM_CLEANUP_S
        while (leftovers := self.shm_segments()) and time.monotonic() < deadline:
            time.sleep(0.1)
        if leftovers:
            raise RuntimeError(f"shared memory left behind: {leftovers}")
        return codes
