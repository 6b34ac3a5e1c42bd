"""How evenly the router spread a workload over the workers: requests and prompt tokens per worker,
read from the router's own counters (shared/runtime/metrics.py) before and after the workload.

- requests: pdserve:worker_routed_requests_total. A request moved to another prefill after its own
  failed before the first token counts on both prefills;
- prompt tokens: pdserve:worker_routed_prompt_tokens_total. A decode's are the whole prompt; a
  prefill's are those it was expected to compute, its cached prefix left out;
- balance: max / mean over a role's workers, of prompt tokens over the prefills (their work) and of
  requests over the decodes (their batch). 1.0 is even; N, the role's worker count, is one worker
  taking everything. None where the role got nothing.
"""

from __future__ import annotations

import urllib.request
from dataclasses import asdict, dataclass

from prometheus_client.parser import text_string_to_metric_families

REQUESTS = "pdserve:worker_routed_requests_total"
PROMPT_TOKENS = "pdserve:worker_routed_prompt_tokens_total"
SCRAPE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Routed:
    """What the router sent one worker."""

    role: str
    requests: int = 0
    prompt_tokens: int = 0

    def __add__(self, other: Routed) -> Routed:
        return Routed(self.role, self.requests + other.requests, self.prompt_tokens + other.prompt_tokens)

    def __sub__(self, other: Routed) -> Routed:
        return Routed(self.role, self.requests - other.requests, self.prompt_tokens - other.prompt_tokens)


def parse(text: str) -> dict[str, Routed]:
    """The counters in a Prometheus text page, by worker id."""
    values: dict[tuple[str, str], dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (REQUESTS, PROMPT_TOKENS):
                key = (sample.labels["worker_id"], sample.labels["role"])
                values.setdefault(key, {})[sample.name] = sample.value
    return {worker: Routed(role, round(v.get(REQUESTS, 0)), round(v.get(PROMPT_TOKENS, 0)))
            for (worker, role), v in values.items()}


def scrape(url: str) -> dict[str, Routed]:
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as page:
        return parse(page.read().decode())


def routed_between(before: dict[str, Routed], after: dict[str, Routed], roles: dict[str, str]) -> dict[str, Routed]:
    """What each worker got between two scrapes. roles: worker id -> role of the workers serving, so
    that one sent nothing (and so absent from the counters) shows as 0."""
    workers = {**{worker: Routed(role) for worker, role in roles.items()}, **after}
    return {worker: now - before.get(worker, Routed(now.role)) for worker, now in sorted(workers.items())}


def max_over_mean(values: list[int]) -> float | None:
    return max(values) / (sum(values) / len(values)) if values and sum(values) else None


def balance(routed: dict[str, Routed]) -> dict:
    """The report's part: each worker's counts and the two balance figures."""
    def of(role: str, field: str) -> list[int]:
        return [getattr(r, field) for r in routed.values() if r.role == role]

    return {"workers": {worker: asdict(r) for worker, r in routed.items()},
            "prefill_prompt_tokens_max_over_mean": max_over_mean(of("prefill", "prompt_tokens")),
            "decode_requests_max_over_mean": max_over_mean(of("decode", "requests"))}


def combined(balances: list[dict]) -> dict:
    """The balance of several workloads' counts summed per worker."""
    total: dict[str, Routed] = {}
    for part in balances:
        for worker, counts in part["workers"].items():
            total[worker] = total.get(worker, Routed(counts["role"])) + Routed(**counts)
    return balance(dict(sorted(total.items())))


class RouterCounters:
    """A stack's router counters, read around each workload."""

    def __init__(self, url: str, roles: dict[str, str]):
        self.url = url
        self.roles = roles  # worker id -> role, as ListWorkers gave them

    def read(self) -> dict[str, Routed] | str:
        """The counters now, or why they could not be read (a metrics failure must not end the run)."""
        try:
            return scrape(self.url)
        except OSError as error:
            return f"{type(error).__name__}: {error} ({self.url})"

    def since(self, before: dict[str, Routed] | str) -> dict:
        after = self.read()
        for reading in (before, after):
            if isinstance(reading, str):
                return {"error": reading}
        return balance(routed_between(before, after, self.roles))
