"""Prometheus metrics: the helpers in-process, then each service's endpoint scraped over HTTP."""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from pdserve.v1 import generation_pb2
from services.router.control.worker_records import WorkerRecord
from shared.config.loading import load_config
from shared.config.schema import ConfigError
from shared.control.messages import FinishReason, ModelFingerprint, Role
from shared.model.loader import load_hf_config
from shared.runtime import metrics

GOOD_REQUESTS = 3
MAX_TOKENS = 4
ROUTER_HISTOGRAMS = ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds")

Samples = dict[tuple[str, frozenset], float]


def scrape(url: str) -> Samples:
    """Every sample an endpoint serves: (sample name, labels) -> value."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((f"pdserve:{name}", frozenset(labels.items())))


def scrape_until(url: str, condition, timeout_s: float = 15.0) -> Samples:
    """Scrapes until condition(samples) holds (heartbeats and cancellations arrive late), else the last."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(url)
        if condition(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)


def _idle(samples: Samples, workers) -> bool:
    return all(value(samples, "kv_pages_used", worker_id=w.worker_id, role=w.role) == 0 for w in workers)


# ---- in-process ----

@pytest.fixture()
def registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    for collector in metrics.ROUTER:
        registry.register(collector)
    return registry


def test_request_timer_counts_one_outcome_and_never_raises(registry):
    def sample(name: str, **labels: str) -> float:
        return registry.get_sample_value(f"pdserve:{name}", labels) or 0.0

    before = {name: sample(f"{name}_count") for name in (*ROUTER_HISTOGRAMS, "inter_token_latency_seconds")}
    timer = metrics.RequestTimer()
    for _ in range(3):
        timer.chunk()
    successes = sample("request_success_total", finished_reason="length")
    failures = sample("request_failure_total", code="UNAVAILABLE")
    timer.succeeded(FinishReason.LENGTH, 3)
    timer.failed("UNAVAILABLE")  # too late: the outcome is already counted
    assert sample("request_success_total", finished_reason="length") == successes + 1
    assert sample("request_failure_total", code="UNAVAILABLE") == failures
    for name in ROUTER_HISTOGRAMS:
        assert sample(f"{name}_count") == before[name] + 1, name
    assert sample("inter_token_latency_seconds_count") == before["inter_token_latency_seconds"] + 2

    metrics.RequestTimer().succeeded("not a finish reason", "not a count")  # a caller's bug: logged, not raised
    for remaining, code in ((0.0, "DEADLINE_EXCEEDED"), (None, "CANCELLED"), (30.0, "CANCELLED")):
        count = sample("request_failure_total", code=code)
        metrics.RequestTimer(lambda: remaining).cancelled()
        assert sample("request_failure_total", code=code) == count + 1, (remaining, code)


def test_routed_worker_gauges_read_live_values_and_go_with_their_worker(registry):
    worker = WorkerRecord("decode-t", Role.DECODE, b"id", None, "inc", 1, total_pages=10, max_batch_size=4,
                          window=0, pool_handles=[], fingerprint=ModelFingerprint("c", "w", "t", "float32", "layers=1"),
                          free_pages=7)
    worker.reservations["r1"] = 2
    metrics.watch_routed(worker)
    labels = {"worker_id": "decode-t", "role": "decode"}
    assert registry.get_sample_value("pdserve:kv_pages_used", labels) == 3
    assert registry.get_sample_value("pdserve:kv_pages_reserved", labels) == 2
    assert registry.get_sample_value("pdserve:worker_assigned_requests", labels) == 1
    worker.free_pages = 10
    worker.reservations.clear()
    worker.pending_tokens["r2"] = 300
    assert registry.get_sample_value("pdserve:kv_pages_used", labels) == 0
    assert registry.get_sample_value("pdserve:kv_pages_free", labels) == 10
    assert registry.get_sample_value("pdserve:kv_pages_reserved", labels) == 0
    assert registry.get_sample_value("pdserve:worker_pending_prompt_tokens", labels) == 300
    metrics.forget_pages("decode-t", Role.DECODE)
    for name in ("kv_pages_used", "kv_pages_reserved", "worker_pending_prompt_tokens", "worker_assigned_requests"):
        assert registry.get_sample_value(f"pdserve:{name}", labels) is None


def test_metrics_addresses_are_checked_and_empty_turns_them_off():
    config = load_config(None, environ={})
    assert (config.router.metrics_address, config.prefill.metrics_address, config.decode.metrics_address) == (
        "127.0.0.1:9400", "127.0.0.1:9401", "127.0.0.1:9402")
    assert load_config(None, environ={"PDSERVE_DECODE_METRICS_ADDRESS": ""}).decode.metrics_address == ""
    assert load_config(None, environ={"PDSERVE_ROUTER_METRICS_ADDRESS": "[::1]:9500"}).router.metrics_address
    for bad in ("9400", "localhost", "host:port", "127.0.0.1:70000"):
        with pytest.raises(ConfigError, match="router.metrics_address"):
            load_config(None, environ={"PDSERVE_ROUTER_METRICS_ADDRESS": bad})
    assert metrics.serve("", metrics.ROUTER) is None


# ---- the real services ----

@pytest.mark.e2e
def test_router_counts_requests_latencies_and_pages(stack):
    url = stack.metrics_url("router")
    workers = stack.workers()
    before = scrape(url)
    request = generation_pb2.GenerateRequest(prompt="Hello", max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0)
    gaps = 0  # between two chunks of a stream; tokens that reach the router together go in one chunk
    for _ in range(GOOD_REQUESTS):
        chunks = list(stack.stub.Generate(request, timeout=60))
        assert sum(len(c.token_ids) for c in chunks) == MAX_TOKENS
        gaps += len(chunks) - 1
    done = scrape(url)

    def grew(name: str, samples: Samples = done, **labels: str) -> float:
        return (value(samples, name, **labels) or 0.0) - (value(before, name, **labels) or 0.0)

    for name in ROUTER_HISTOGRAMS:
        assert grew(f"{name}_count") == GOOD_REQUESTS, name
        assert grew(f"{name}_sum") > 0, name
    assert gaps >= GOOD_REQUESTS and grew("inter_token_latency_seconds_count") == gaps
    for name in ("request_queue_time_seconds", "kv_handoff_seconds", "kv_pull_seconds"):
        assert grew(f"{name}_count") == GOOD_REQUESTS, name
    assert grew("request_success_total", finished_reason="length") == GOOD_REQUESTS

    with pytest.raises(grpc.RpcError) as error:
        list(stack.stub.Generate(generation_pb2.GenerateRequest(), timeout=30))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    long_request = generation_pb2.GenerateRequest(prompt="Count to one thousand:", max_tokens=400, ignore_eos=True,
                                                  temperature=0)
    call = stack.stub.Generate(long_request, timeout=120)
    next(call)
    next(call)  # the second token comes from the decode: it holds the request now
    busy = scrape(url)
    decode = next(w for w in workers if w.role == "decode")
    assert value(busy, "num_requests_running") >= 1
    assert value(busy, "kv_pages_reserved", worker_id=decode.worker_id, role="decode") > 0
    decode_own = scrape(stack.metrics_url("decode"))
    assert value(decode_own, "kv_pages_used", worker_id=decode.worker_id, role="decode") > 0
    assert value(decode_own, "num_requests_running") == 1
    call.cancel()

    final = scrape_until(url, lambda s: grew("request_failure_total", s, code="CANCELLED") >= 1 and _idle(s, workers))
    assert grew("request_failure_total", final, code="INVALID_ARGUMENT") == 1
    assert grew("request_failure_total", final, code="CANCELLED") == 1
    for name in ("e2e_request_latency_seconds_count", "time_per_output_token_seconds_count"):
        assert value(final, name) == value(done, name), "a failed request is no success"
    for worker in workers:
        labels = {"worker_id": worker.worker_id, "role": worker.role}
        assert value(final, "kv_pages_used", **labels) == 0, labels
        assert value(final, "kv_pages_free", **labels) == worker.total_pages, labels
        assert value(final, "kv_pages_reserved", **labels) == 0, labels
    assert value(final, "num_requests_running") == 0 and value(final, "num_requests_waiting") == 0


def kv_bytes_per_token(config, itemsize: int) -> int:
    """K and V of every layer for every KV head, unquantized: what the pool should report; an MLA
    model's latent and RoPE key of every layer instead."""
    if hasattr(config, "kv_lora_rank"):
        return config.num_hidden_layers * (config.kv_lora_rank + config.qk_rope_head_dim) * itemsize
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * itemsize


@pytest.mark.e2e
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_workers_serve_their_own_pages(stack, role, checkpoint):
    worker = next(w for w in stack.workers() if w.role == role)
    samples = scrape_until(stack.metrics_url(role), lambda s: _idle(s, [worker]))
    labels = {"worker_id": worker.worker_id, "role": role}
    assert value(samples, "kv_pages_used", **labels) == 0
    assert value(samples, "kv_pages_free", **labels) == worker.total_pages
    assert value(samples, "kv_bytes_per_token", **labels) == kv_bytes_per_token(load_hf_config(checkpoint), 4)
    assert value(samples, "num_requests_running") == 0 and value(samples, "num_requests_waiting") == 0
    assert value(samples, "time_to_first_token_seconds_count") is None, "request metrics are the router's"
    assert not [name for name, _ in samples if name.startswith("pdserve:gpu_")], "a CPU worker has no GPU telemetry"
