"""The stack as children of this process, for the tests and the benchmarks.

Each service gets free ports, its own log file in a work folder and the settings given as
PDSERVE_* variables; the stack is used once health says SERVING, and stopping it fails on shared
memory left behind. Processes start and stop through services/stack/supervisor.py, with restarts when
asked for (`restart`); without, a service that dies stays dead until `start` is called again.

The workers are laid out as `python -m services.stack` lays them out (services/stack/topology.py:
stack.prefill, stack.decode, stack.devices), each with a free metrics port of its own. A worker's
service name is its worker id ("prefill-1"); a role alone names its first worker ("prefill" is
prefill-0), so code written for one worker of each role keeps working.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.v1 import generation_pb2, generation_pb2_grpc
from services.stack.ports import free_port
from services.stack.supervisor import RestartPolicy, Service, Supervisor
from services.stack.topology import ROLES, WorkerPlan, plan_workers
from shared.config.loading import env_name, load_config
from shared.control.messages import Role
from shared.runtime.admin_token import ensure_local_admin_token
from shared.runtime.runtime_dir import prepare_runtime_dir

SERVICES = ("router", "prefill", "decode")
SHM_CLEANUP_S = 5.0  # a killed worker's segment is unlinked by its resource tracker, a moment later


def _admin_token_file(runtime_dir: Path) -> Path:
    prepare_runtime_dir(str(runtime_dir))
    return ensure_local_admin_token(str(runtime_dir))


def service_name(name: str) -> str:
    """A role alone names its first worker; any other name names itself."""
    return f"{name}-0" if name in ROLES else name


V = TypeVar("V")


class ServiceMap(Mapping[str, V]):
    """Something of each service by name, where a role alone names its first worker."""

    def __init__(self, by_name: dict[str, V]):
        self._by_name = by_name

    def __getitem__(self, name: str) -> V:
        return self._by_name[service_name(name)]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    def __repr__(self) -> str:
        return repr(self._by_name)


class LocalStack:
    def __init__(self, workdir: Path, cache_dir: str, services: tuple[str, ...] = SERVICES,
                 start_timeout_s: float = 240.0, service_env: dict[str, dict[str, str]] | None = None,
                 restart: RestartPolicy | None = None, prefill: int = 1, decode: int = 1, devices: str = "",
                 **settings: str):
        """services: the modules to start, under services/ unless the name is a dotted module path;
        a role starts all its workers; ("stack",) runs the all-in-one launcher of `make run`.
        service_env: extra environment of a role's workers or of one service by name (e.g. an MPS
        share of the SMs), on top of settings, which all of them get. restart: the supervisor
        restarts services that die, under this policy. prefill, decode, devices: the workers.
        """
        self.workdir = workdir
        self.services = services
        self.service_env = service_env or {}
        self.address = f"127.0.0.1:{free_port()}"
        admin_token = env_name("router", "admin_token_file")
        if admin_token not in settings:  # as `make run` gives one (services/stack/__main__.py)
            settings = {admin_token: str(_admin_token_file(workdir / "run")), **settings}
        self.env = {
            **os.environ,
            "PDSERVE_ROUTER_GRPC_ADDRESS": self.address,
            "PDSERVE_ROUTER_HTTP_ADDRESS": f"127.0.0.1:{free_port()}",
            "PDSERVE_ROUTER_RUNTIME_DIR": str(workdir / "run"),
            "PDSERVE_MODEL_CACHE_DIR": cache_dir,
            "PDSERVE_LOG_FORMAT": "json",
            "PYTHONUNBUFFERED": "1",
            # Each service's own free port, so that stacks side by side never collide.
            **{f"PDSERVE_{name.upper()}_METRICS_ADDRESS": f"127.0.0.1:{free_port()}" for name in SERVICES},
            env_name("stack", "prefill"): str(prefill),
            env_name("stack", "decode"): str(decode),
            env_name("stack", "devices"): devices,
            **settings,
        }
        self.config = load_config(None, self.env)  # as the services will read it
        # The launcher gets the layout as `make run ARGS="--prefill 2 --decode 2"` gives it.
        self.launcher_args = ("--prefill", str(prefill), "--decode", str(decode),
                              *(("--devices", devices) if devices else ()))
        self.plans = {plan.name: dataclasses.replace(plan, metrics_address=f"127.0.0.1:{free_port()}")
                      for plan in plan_workers(self.config)}
        self.start_timeout_s = start_timeout_s
        self.restart = restart
        self.supervisor = Supervisor(grace_s=20.0)
        self.failure: str | None = None  # why the supervisor gave up, with restart on
        self._supervising: threading.Thread | None = None
        self.channel: grpc.Channel | None = None

    @property
    def processes(self) -> ServiceMap[subprocess.Popen]:
        """Each service's latest process."""
        return ServiceMap(self.supervisor.processes)

    def __enter__(self) -> "LocalStack":
        try:
            for name in self.services:
                for service in [plan.name for plan in self.plans.values() if plan.role == name] or [name]:
                    self.start(service)
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

    @property
    def http_url(self) -> str:
        """The OpenAI API's base URL, as the openai client takes it."""
        return f"http://{self.env['PDSERVE_ROUTER_HTTP_ADDRESS']}/v1"

    def metrics_url(self, name: str) -> str:
        """The Prometheus endpoint of a worker this stack started, else of the router or a role as
        the settings give it (services.colocated serves at the decode's)."""
        plan = self.plans.get(service_name(name))
        if plan is not None and plan.name in self.supervisor.processes:
            return f"http://{plan.metrics_address}/metrics"
        return f"http://{self.env[env_name(name.partition('-')[0], 'metrics_address')]}/metrics"

    def log_path(self, name: str) -> Path:
        return self.workdir / f"{service_name(name)}.log"

    def start(self, name: str, env: dict[str, str] | None = None) -> None:
        """Starts a service: the router, a worker by id (one beyond the layout too: "decode-3"
        joins with a free metrics port), or a module; env: settings of this start alone."""
        name = service_name(name)
        plan = self._worker(name)
        module = f"services.{plan.role.value}" if plan else name if "." in name else f"services.{name}"
        env = {**self.env, **(plan.env() if plan else {}),
               **(self.service_env.get(plan.role.value, {}) if plan else {}), **self.service_env.get(name, {}),
               **(env or {})}
        args = self.launcher_args if module == "services.stack" else ()
        self.supervisor.start(Service(name, module, args, env, self.log_path(name)))

    def _worker(self, name: str) -> WorkerPlan | None:
        role, _, index = name.rpartition("-")
        if name not in self.plans and role in ROLES and index.isdigit():
            self.plans[name] = WorkerPlan(Role(role), int(index), self.config.model.device, (),
                                          f"127.0.0.1:{free_port()}")
        return self.plans.get(name)

    def signal(self, name: str, sig: int) -> None:
        self.supervisor.signal(service_name(name), sig)

    @property
    def bearer(self) -> list[tuple[str, str]]:
        """Call metadata with the stack's (first) bearer token (router.auth_token or auth_token_file); none without one."""
        token = next(iter(self.config.router.bearer_tokens()), "")
        return [("authorization", f"Bearer {token}")] if token else []

    @property
    def admin_bearer(self) -> list[tuple[str, str]]:
        """Call metadata with the stack's admin token (router.admin_token_file), for Admin calls."""
        token = self.config.router.admin_token()
        return [("authorization", f"Bearer {token}")] if token else []

    def workers(self) -> list:
        """The workers the router lists (ListWorkers)."""
        return list(self.stub.ListWorkers(generation_pb2.ListWorkersRequest(), timeout=5, metadata=self.bearer).workers)

    def wait_serving(self) -> None:
        health = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            self._raise_if_down()
            try:
                status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING and self._all_registered():
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        raise TimeoutError("stack did not become SERVING:\n" + "\n".join(self.tail(n) for n in self.processes))

    def _all_registered(self) -> bool:
        """Every worker of the layout that this stack runs is registered, not just a first pair."""
        expected = {name for name, plan in self.plans.items() if "stack" in self.services or plan.role in self.services}
        return not expected or expected <= {worker.worker_id for worker in self.workers()}

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

    def stop(self, timeout_s: float = 20.0) -> ServiceMap[int]:
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
        return ServiceMap(codes)
