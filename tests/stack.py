"""Start and stop the three services as real processes for tests (and benchmarks)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pdserve.v1 import generation_pb2, generation_pb2_grpc


REPO = Path(__file__).resolve().parent.parent
SERVICES = ("router", "prefill", "decode")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServiceStack:
    def __init__(self, workdir: Path, cache_dir: str, services: tuple[str, ...] = SERVICES,
                 start_timeout_s: float = 240.0, service_env: dict[str, dict[str, str]] | None = None,
                 **settings: str):
        """services: the modules to start, under services/ unless the name is a dotted module path;
        ("stack",) runs the all-in-one launcher of `make run`. service_env: extra environment of
        one service (e.g. its MPS share of the SMs), on top of settings, which all of them get."""
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
        self.processes: dict[str, subprocess.Popen] = {}
        self.channel: grpc.Channel | None = None

    def __enter__(self) -> "ServiceStack":
        try:
            for name in self.services:
                self.start(name)
            self.channel = grpc.insecure_channel(self.address)
            self.wait_serving()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def stub(self) -> generation_pb2_grpc.GenerationStub:
        return generation_pb2_grpc.GenerationStub(self.channel)

    def metrics_url(self, name: str) -> str:
        """The Prometheus endpoint of "router", "prefill" or "decode"."""
        return f"http://{self.env[f'PDSERVE_{name.upper()}_METRICS_ADDRESS']}/metrics"

    def log_path(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def start(self, name: str) -> None:
        log = self.log_path(name).open("ab")
        module = name if "." in name else f"services.{name}"
        self.processes[name] = subprocess.Popen([sys.executable, "-m", module], cwd=REPO,
                                                env={**self.env, **self.service_env.get(name, {})},
                                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def signal(self, name: str, sig: int) -> None:
        self.processes[name].send_signal(sig)

    def wait_serving(self) -> None:
        health = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited with {process.returncode}:\n{self.tail(name)}")
            try:
                status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        raise TimeoutError("stack did not become SERVING:\n" + "\n".join(self.tail(n) for n in self.processes))

    def tail(self, name: str, lines: int = 30) -> str:
        return "\n".join(self.log_path(name).read_text(errors="replace").splitlines()[-lines:])

    def workers(self) -> list:
        return list(self.stub.ListWorkers(generation_pb2.ListWorkersRequest(), timeout=5).workers)

    def wait_worker_gone(self, role: str, timeout_s: float = 15.0) -> float:
        """Seconds until the router no longer lists a worker of that role."""
        started = time.monotonic()
        while any(w.role == role for w in self.workers()):
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"the router still lists a {role} worker")
            time.sleep(0.1)
        return time.monotonic() - started

    def assert_pools_drained(self, timeout_s: float = 10.0) -> None:
        """Every page of every pool is free and unreserved (heartbeats report it within a second)."""
        deadline = time.monotonic() + timeout_s
        while True:
            workers = self.workers()
            if workers and all(w.free_pages == w.total_pages and w.reserved_pages == 0 for w in workers):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"KV pages still held: {workers}")
            time.sleep(0.2)

    def shm_segments(self) -> list[str]:
        pids = {str(p.pid) for p in self.processes.values()}
        return [n for n in os.listdir("/dev/shm") if n.startswith("pdserve-kv-") and n.rsplit("-", 1)[-1] in pids]

    def stop(self, timeout_s: float = 20.0) -> dict[str, int]:
        """SIGTERM to all, SIGKILL to laggards; returns exit codes and fails on leftovers."""
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        codes = {}
        for name, process in self.processes.items():
            try:
                codes[name] = process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                codes[name] = process.wait()
        leftovers = self.shm_segments()
        if leftovers:
            raise RuntimeError(f"shared memory left behind: {leftovers}")
        return codes
