"""Prometheus metrics, each declared once; every service serves the ones it updates.

Names are vLLM's with the `pdserve:` prefix (`vllm:time_to_first_token_seconds` ->
`pdserve:time_to_first_token_seconds`), so a vLLM dashboard needs only the prefix changed. The
router records each request's latencies and outcome and, per worker, the KV pages its heartbeats
report and its own reservations; each worker serves its own pages and queue lengths, and a prefill
its prefix cache (tokens looked up and found, pages held).

Gauges are read when scraped (`set_function`): nothing is computed on the request path and no
value goes stale. Every update swallows its own errors: a metrics bug must never fail a request.
"""

from __future__ import annotations

import functools
import time
from typing import Callable
from wsgiref.simple_server import WSGIServer

import structlog
from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.registry import Collector

from shared.control.messages import ErrorCode, FinishReason, Role
from shared.control.router_link import WorkerLoad

log = structlog.get_logger()

# From a GPU's milliseconds to a CPU's seconds in one set of buckets each, so the same dashboard
# reads both. Per token: ITL, TPOT, KV pull, handoff. Per request: TTFT, e2e, queue.
TOKEN_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                 0.75, 1.0, 2.5, 5.0, 10.0)
REQUEST_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                   40.0, 80.0, 160.0, 320.0, 640.0, 1280.0)

# registry=None: a service registers only what it updates (serve()), so a worker's endpoint
# shows no empty router histograms.
TIME_TO_FIRST_TOKEN = Histogram(
    "pdserve:time_to_first_token_seconds", "From the request's arrival at the router to its first chunk.",
    buckets=REQUEST_BUCKETS, registry=None)
TIME_PER_OUTPUT_TOKEN = Histogram(
    "pdserve:time_per_output_token_seconds", "Per finished request: (e2e - TTFT) / (tokens - 1).",
    buckets=TOKEN_BUCKETS, registry=None)
INTER_TOKEN_LATENCY = Histogram(
    "pdserve:inter_token_latency_seconds", "Each gap between two chunks of a stream.",
    buckets=TOKEN_BUCKETS, registry=None)
E2E_REQUEST_LATENCY = Histogram(
    "pdserve:e2e_request_latency_seconds", "From arrival to the last chunk, successful requests only.",
    buckets=REQUEST_BUCKETS, registry=None)
REQUEST_QUEUE_TIME = Histogram(
    "pdserve:request_queue_time_seconds", "The router's wait for KV room plus the prefill's queue.",
    buckets=REQUEST_BUCKETS, registry=None)
KV_HANDOFF = Histogram(
    "pdserve:kv_handoff_seconds", "From the first token at the router to the decode's first step for it.",
    buckets=TOKEN_BUCKETS, registry=None)
KV_PULL = Histogram(
    "pdserve:kv_pull_seconds", "The decode's copy of a request's pages from the prefill's pool.",
    buckets=TOKEN_BUCKETS, registry=None)
REQUEST_SUCCESS = Counter(
    "pdserve:request_success_total", "Finished requests.", ["finished_reason"], registry=None)
REQUEST_FAILURE = Counter(
    "pdserve:request_failure_total", "Failed requests, by gRPC status (an HTTP error: the one it stands for).",
    ["code"], registry=None)
NUM_REQUESTS_RUNNING = Gauge(
    "pdserve:num_requests_running", "Router: requests placed on workers. Worker: those it holds.", registry=None)
NUM_REQUESTS_WAITING = Gauge(
    "pdserve:num_requests_waiting", "Router: requests waiting for KV room. Worker: its queue.", registry=None)
KV_PAGES_USED = Gauge(
    "pdserve:kv_pages_used", "KV pages in use, as the worker reports them.", ["worker_id", "role"], registry=None)
KV_PAGES_FREE = Gauge(
    "pdserve:kv_pages_free", "KV pages free, as the worker reports them.", ["worker_id", "role"], registry=None)
KV_BYTES_PER_TOKEN = Gauge(
    "pdserve:kv_bytes_per_token", "What one token's KV takes in the worker's pools, all its ranks together: "
    "K and V of every layer, with their scales where the pages are quantized.", ["worker_id", "role"], registry=None)
KV_PAGES_RESERVED = Gauge(
    "pdserve:kv_pages_reserved", "KV pages the router promised to requests in flight.", ["worker_id", "role"],
    registry=None)
WORKER_PENDING_PROMPT_TOKENS = Gauge(
    "pdserve:worker_pending_prompt_tokens", "Prompt tokens placed on a prefill and not prefilled yet.",
    ["worker_id", "role"], registry=None)
WORKER_ASSIGNED_REQUESTS = Gauge(
    "pdserve:worker_assigned_requests", "Requests the router placed on a worker that it still holds.",
    ["worker_id", "role"], registry=None)
# Counted in prompt tokens, as vLLM counts them: hits / queries is the share of prompt tokens not computed.
PREFIX_CACHE_QUERIES = Counter(
    "pdserve:prefix_cache_queries", "Prompt tokens looked up in the prefill's prefix cache.", registry=None)
PREFIX_CACHE_HITS = Counter(
    "pdserve:prefix_cache_hits", "Prompt tokens whose KV the prefill's prefix cache held.", registry=None)
PREFIX_CACHE_PAGES = Gauge(
    "pdserve:prefix_cache_pages", "KV pages the prefill's prefix cache holds, in use or evictable.", registry=None)
WORKER_ROUTED_REQUESTS = Counter(
    "pdserve:worker_routed_requests_total", "Requests routed to each worker.", ["worker_id", "role"], registry=None)
WORKER_ROUTED_PROMPT_TOKENS = Counter(
    "pdserve:worker_routed_prompt_tokens_total", "Prompt tokens routed to each worker (a prefill: those it was "
    "expected to compute, its cached prefix left out).", ["worker_id", "role"], registry=None)
ROUTER_TOKENIZED_TOKENS = Counter(
    "pdserve:router_tokenized_tokens_total", "Prompt tokens the router's tokenizer produced, refused prompts "
    "included: the tokenizing work clients made it do.", registry=None)
REQUEST_RETRIES = Counter(
    "pdserve:request_retries_total", "Requests moved to another prefill after theirs failed before the first token.",
    registry=None)
REQUEST_MIGRATIONS = Counter(
    "pdserve:request_migrations_total", "Requests moved to another decode after theirs failed mid-stream "
    "(services/router/control/migration.py).", registry=None)

ROUTER = (TIME_TO_FIRST_TOKEN, TIME_PER_OUTPUT_TOKEN, INTER_TOKEN_LATENCY, E2E_REQUEST_LATENCY, REQUEST_QUEUE_TIME,
          KV_HANDOFF, KV_PULL, REQUEST_SUCCESS, REQUEST_FAILURE, NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING,
          KV_PAGES_USED, KV_PAGES_FREE, KV_PAGES_RESERVED, WORKER_PENDING_PROMPT_TOKENS, WORKER_ASSIGNED_REQUESTS,
          WORKER_ROUTED_REQUESTS, WORKER_ROUTED_PROMPT_TOKENS, REQUEST_RETRIES, ROUTER_TOKENIZED_TOKENS,
          REQUEST_MIGRATIONS)
WORKER = (NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING, KV_PAGES_USED, KV_PAGES_FREE, KV_BYTES_PER_TOKEN,
          PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS, PREFIX_CACHE_PAGES)

# Each label value exported from the start at 0, so rate() sees a counter's first increment.
FAILURE_CODES = ("INVALID_ARGUMENT", *ErrorCode, "CANCELLED", "DEADLINE_EXCEEDED", "UNKNOWN")
for _reason in FinishReason:
    REQUEST_SUCCESS.labels(_reason.value)
for _code in FAILURE_CODES:
    REQUEST_FAILURE.labels(str(_code))

_served: set[Collector] = set()  # REGISTRY refuses a collector twice


def _never_raises(update):
    @functools.wraps(update)
    def guarded(*args, **kwargs):
        try:
            update(*args, **kwargs)
        except Exception:
            log.exception("metrics update failed", update=update.__qualname__)
    return guarded


def serve(address: str, collectors: tuple[Collector, ...]) -> WSGIServer | None:
    """Serves the collectors, with the process's CPU and memory, over HTTP at "host:port" (a GPU
    worker adds its GPU's state: shared/worker/gpu_telemetry.py).

    "" serves nothing. A port already taken is logged, not fatal: the service matters more
    than its metrics. Returns the HTTP server, or None.
    """
    if not address:
        return None
    for collector in collectors:
        if collector not in _served:
            REGISTRY.register(collector)
            _served.add(collector)
    host, _, port = address.rpartition(":")
    try:
        server, _thread = start_http_server(int(port), addr=host.strip("[]"))
    except OSError as exc:
        log.error("metrics endpoint not served", address=address, error=str(exc))
        return None
    log.info("metrics endpoint serving", address=address)
    return server


@_never_raises
def observe(histogram: Histogram, seconds: float) -> None:
    histogram.observe(seconds)


@_never_raises
def watch_load(running: Callable[[], int], waiting: Callable[[], int]) -> None:
    NUM_REQUESTS_RUNNING.set_function(running)
    NUM_REQUESTS_WAITING.set_function(waiting)


@_never_raises
def watch_pages(worker_id: str, role: Role, total_pages: int, free: Callable[[], int]) -> None:
    """A worker's pool as the worker itself reports it."""
    KV_PAGES_USED.labels(worker_id, role).set_function(lambda: total_pages - free())
    KV_PAGES_FREE.labels(worker_id, role).set_function(free)


@_never_raises
def report_kv_bytes_per_token(worker_id: str, role: Role, token_bytes: int) -> None:
    KV_BYTES_PER_TOKEN.labels(worker_id, role).set(token_bytes)


@_never_raises
def count_prefix_cache(queried_tokens: int, hit_tokens: int) -> None:
    PREFIX_CACHE_QUERIES.inc(queried_tokens)
    PREFIX_CACHE_HITS.inc(hit_tokens)


@_never_raises
def watch_prefix_cache(cached_pages: Callable[[], int]) -> None:
    PREFIX_CACHE_PAGES.set_function(cached_pages)


@_never_raises
def watch_routed(worker) -> None:
    """A worker as the router sees it (services/router/control/worker_records.WorkerRecord): its
    pages as last reported, what the router promised away, and the load that routing weighs."""
    labels = (worker.worker_id, worker.role)
    watch_pages(*labels, worker.total_pages, lambda: worker.free_pages)
    KV_PAGES_RESERVED.labels(*labels).set_function(lambda: worker.reserved_pages)
    WORKER_PENDING_PROMPT_TOKENS.labels(*labels).set_function(lambda: worker.pending_prompt_tokens)
    WORKER_ASSIGNED_REQUESTS.labels(*labels).set_function(lambda: len(worker.reservations))


@_never_raises
def count_routed(worker_id: str, role: Role, prompt_tokens: int) -> None:
    WORKER_ROUTED_REQUESTS.labels(worker_id, role).inc()
    WORKER_ROUTED_PROMPT_TOKENS.labels(worker_id, role).inc(prompt_tokens)


@_never_raises
def count_tokenized(tokens: int) -> None:
    ROUTER_TOKENIZED_TOKENS.inc(tokens)


@_never_raises
def forget_pages(worker_id: str, role: Role) -> None:
    """A dropped worker's series go with it, rather than freezing at their last values."""
    for gauge in (KV_PAGES_USED, KV_PAGES_FREE, KV_PAGES_RESERVED, WORKER_PENDING_PROMPT_TOKENS,
                  WORKER_ASSIGNED_REQUESTS):
        gauge.remove(worker_id, role)


@_never_raises
def watch_workers(loads: list[Callable[[], WorkerLoad]]) -> None:
    """The unlabelled load gauges of a worker process: the sum over the workers it runs (two in
    services.colocated), read from what their heartbeats report, the numbers the router is told."""
    watch_load(lambda: sum(load().running for load in loads), lambda: sum(load().waiting for load in loads))


class RequestTimer:
    """One request's latencies, and its outcome, which is counted exactly once: gRPC streams and
    HTTP requests alike (services/router/frontend.py counts both), under gRPC's status names.

    time_remaining: seconds until the client's deadline, None for none (grpc.aio's
    ServicerContext.time_remaining); it tells a deadline from a cancel. HTTP carries no deadline.
    """

    def __init__(self, time_remaining: Callable[[], float | None] = lambda: None) -> None:
        self.time_remaining = time_remaining
        self.arrived = time.perf_counter()
        self.first_at: float | None = None
        self.last_at = 0.0
        self.counted = False

    @_never_raises
    def chunk(self) -> None:
        """A chunk is about to go to the client."""
        now = time.perf_counter()
        if self.first_at is None:
            self.first_at = now
            TIME_TO_FIRST_TOKEN.observe(now - self.arrived)
        else:
            INTER_TOKEN_LATENCY.observe(now - self.last_at)
        self.last_at = now

    @_never_raises
    def succeeded(self, finished_reason: FinishReason, tokens: int) -> None:
        if self._count():
            now = time.perf_counter()
            E2E_REQUEST_LATENCY.observe(now - self.arrived)
            if tokens > 1 and self.first_at is not None:  # (e2e - TTFT) / (tokens - 1); one token has no TPOT
                TIME_PER_OUTPUT_TOKEN.observe((now - self.first_at) / (tokens - 1))
            REQUEST_SUCCESS.labels(finished_reason.value).inc()

    @_never_raises
    def failed(self, code: str) -> None:
        """code: the gRPC status name. A no-op once the outcome is counted."""
        if self._count():
            REQUEST_FAILURE.labels(code).inc()

    @_never_raises
    def cancelled(self) -> None:
        """The request was cancelled under us: by the client, or its deadline."""
        remaining = self.time_remaining()
        self.failed("DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED")

    def _count(self) -> bool:
        first, self.counted = not self.counted, True
        return first
