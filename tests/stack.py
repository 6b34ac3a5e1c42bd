"""The stack the tests start (services/stack/local.py), with what they check of it: the workers and their pools."""

from __future__ import annotations

import json
import time
import urllib.request

from services.stack.local import SERVICES, LocalStack
from services.stack.ports import free_port
from services.stack.supervisor import REPO

__all__ = ["REPO", "SERVICES", "ServiceStack", "free_port"]


class ServiceStack(LocalStack):
    def wait_worker_gone(self, role: str, timeout_s: float = 15.0) -> float:
        """Seconds until the router no longer lists a worker of that role."""
        started = time.monotonic()
        while any(w.role == role for w in self.workers()):
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"the router still lists a {role} worker")
            time.sleep(0.1)
        return time.monotonic() - started

    def wait_registered(self, names: set[str]) -> None:
        """Until the router lists every worker named, within the stack's start timeout."""
        deadline = time.monotonic() + self.start_timeout_s
        while not names <= {w.worker_id for w in self.workers()}:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{sorted(names)} not all registered:\n" + "\n".join(self.tail(n) for n in names))
            time.sleep(0.2)

    def metric(self, name: str, service: str = "router") -> float:
        """A Prometheus metric of a service, summed over its labels."""
        text = urllib.request.urlopen(self.metrics_url(service), timeout=5).read().decode()
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith(name + " ") or line.startswith(name + "{"))

    def logged(self, name: str, event: str) -> list[dict]:
        """The lines of a service's JSON log (it logs JSON when not on a terminal) for one event."""
        lines = (json.loads(line) for line in self.log_path(name).read_text().splitlines() if line.startswith("{"))
        return [line for line in lines if line.get("event") == event]

    def stop_drained(self) -> None:
        """The end of a test's stack: every pool drained, then every service exits 0."""
        self.assert_pools_drained()
        codes = self.stop()
        assert codes == {name: 0 for name in codes}, f"services did not exit cleanly: {codes}"

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
