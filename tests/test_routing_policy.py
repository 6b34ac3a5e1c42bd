"""The routing policy's costs (services/router/control/routing.py) on the router's own worker records."""

from __future__ import annotations

import dataclasses
import time

from services.router.control.registration import RegistrationPolicy
from services.router.control.request import InflightRequest
from services.router.control.routing import RoutingPolicy
from services.router.control.worker_records import WorkerRecord, WorkerRegistry
from services.router.validation import Job
from shared.config.schema import RoutingConfig
from shared.control.messages import (
    PROTOCOL_VERSION,
    Heartbeat,
    KvCacheEvents,
    ModelFingerprint,
    Register,
    Role,
    SamplingParams,
    StopParams,
)
from shared.kv.page_keys import PageKeys

PAGE = 16


def page_keys(token_ids: list[int], page_size: int, salt: str = "") -> list[str]:
    """Every full page's key, hashed at once."""
    return list(PageKeys(token_ids, page_size, salt))
FINGERPRINT = ModelFingerprint("c", "w", "t", "float32", "layers=1")


def _worker(worker_id: str, role: Role = Role.PREFILL, total_pages: int = 100,
            max_batch_size: int = 64) -> WorkerRecord:
    return WorkerRecord(worker_id, role, worker_id.encode(), None, "inc", 1, total_pages,
                        max_batch_size if role == Role.DECODE else 0, 0, [], FINGERPRINT)


def _request(tokens: list[int], max_tokens: int = 8, cache_salt: str = "") -> InflightRequest:
    job = Job(tokens, SamplingParams(0.0, 1.0, 0, 1), StopParams(max_tokens, False), [], cache_salt)
    return InflightRequest(job)


def test_a_prefill_is_chosen_by_queued_prompt_tokens_not_by_request_count():
    busy, idle = _worker("prefill-0"), _worker("prefill-1")
    busy.pending_tokens["long"] = 8192
    idle.pending_tokens.update({f"short-{i}": 100 for i in range(5)})  # five requests, fewer tokens
    policy = RoutingPolicy(RoutingConfig(), PAGE)
    assert policy.pick_prefill([busy, idle], _request(list(range(64))), 4) is idle


def test_a_cached_prefix_draws_the_prompt_unless_the_queues_are_too_uneven():
    prompt = list(range(40, 40 + 20 * PAGE + 5))
    cached, cold = _worker("prefill-0"), _worker("prefill-1")
    cached.cached_keys.update(page_keys(prompt, PAGE)[:15])
    cached.pending_tokens["other"] = 200  # some load, less than the 240 tokens its cache saves
    policy = RoutingPolicy(RoutingConfig(), PAGE)
    assert policy.tokens_to_compute(cached, _request(prompt)) == len(prompt) - 15 * PAGE
    assert policy.pick_prefill([cold, cached], _request(prompt), 4) is cached
    cached.pending_tokens["other"] = 40_000  # past balance_tokens: load alone decides
    assert policy.pick_prefill([cold, cached], _request(prompt), 4) is cold
    blind = RoutingPolicy(RoutingConfig(prefix_aware=False), PAGE)
    cached.pending_tokens["other"] = 200
    assert blind.pick_prefill([cold, cached], _request(prompt), 4) is cold


def test_routing_hashes_a_prompts_pages_only_as_far_as_a_prefill_has_them():
    """A long prompt no prefill has cached costs the router one page hash, not one a page."""
    prompt = list(range(1000, 1000 + 512 * PAGE))
    cached, cold = _worker("prefill-0"), _worker("prefill-1")
    cached.cached_keys.update(page_keys(prompt, PAGE)[:5])
    request = _request(prompt)
    policy = RoutingPolicy(RoutingConfig(), PAGE)
    assert policy.pick_prefill([cold, cached], request, 4) is cached
    assert request.page_keys(PAGE).hashed == 6


def test_a_fully_cached_prompt_still_computes_its_last_page():
    prompt = list(range(3 * PAGE))
    worker = _worker("prefill-0")
    worker.cached_keys.update(page_keys(prompt, PAGE))
    assert RoutingPolicy(RoutingConfig(), PAGE).tokens_to_compute(worker, _request(prompt)) == PAGE


def test_a_prefix_cached_under_another_salt_draws_nothing():
    """The router hashes a request's pages with its cache salt, as the prefill does: pages cached
    for other salts (or none) count as not cached."""
    prompt = list(range(4 * PAGE))
    worker = _worker("prefill-0")
    worker.cached_keys.update(page_keys(prompt, PAGE, "1:a"))
    policy = RoutingPolicy(RoutingConfig(), PAGE)
    assert policy.tokens_to_compute(worker, _request(prompt, cache_salt="1:a")) == PAGE
    assert policy.tokens_to_compute(worker, _request(prompt, cache_salt="1:b")) == len(prompt)
    assert policy.tokens_to_compute(worker, _request(prompt)) == len(prompt)


def test_a_decode_is_chosen_by_requests_in_flight_and_promised_pages():
    crowded, roomy = _worker("decode-0", Role.DECODE), _worker("decode-1", Role.DECODE)
    crowded.reservations.update({"a": 1, "b": 1, "c": 1})
    roomy.reservations["d"] = 90  # one request, but 90% of its pool promised: 1 + 4 * 0.9 > 3 + 4 * 0.03
    prefill = _worker("prefill-0")
    policy = RoutingPolicy(RoutingConfig(), PAGE)
    assert policy.pick_pair([prefill], [crowded, roomy], _request([1, 2, 3]), 1, 5) == (prefill, crowded)
    assert RoutingPolicy(RoutingConfig(decode_kv_weight=0.0), PAGE).pick_pair(
        [prefill], [crowded, roomy], _request([1, 2, 3]), 1, 5) == (prefill, roomy)


def test_a_pair_whose_decode_cannot_pull_from_the_prefill_is_never_chosen():
    near, far = _worker("prefill-0"), _worker("prefill-1")
    far.pending_tokens["queued"] = 500  # near is the cheaper prefill
    decode = _worker("decode-0", Role.DECODE)
    decode.unreachable["prefill-0"] = "a decode on cpu cannot pull a 'cuda_ipc' pool"
    policy = RoutingPolicy(RoutingConfig(), PAGE)
    assert policy.pick_pair([near, far], [decode], _request([1, 2, 3]), 1, 1) == (far, decode)
    assert policy.pick_pair([near], [decode], _request([1, 2, 3]), 1, 1) is None
    other = _worker("decode-1", Role.DECODE)
    other.reservations.update({"a": 1, "b": 1})  # costlier, but it reaches the cheaper prefill
    assert policy.pick_pair([near, far], [decode, other], _request([1, 2, 3]), 1, 1) == (near, other)


def test_draining_full_and_failed_workers_are_no_candidates():
    draining, full, failed, fine = (_worker(f"prefill-{i}") for i in range(4))
    draining.draining = True
    full.reservations["x"] = 99
    request = _request([1, 2, 3])
    request.failed_on.add("prefill-2")
    policy = RoutingPolicy(RoutingConfig(), PAGE)
    assert policy.pick_prefill([draining, full, failed, fine], request, 2) is fine
    assert policy.pick_prefill([draining, full, failed], request, 2) is None


def test_a_decode_whose_batch_is_full_is_no_candidate_though_its_pool_has_room():
    full, free = _worker("decode-0", Role.DECODE, max_batch_size=2), _worker("decode-1", Role.DECODE)
    full.reservations.update({"a": 1, "b": 1})
    free.reservations.update({"c": 50, "d": 40})  # costlier by its pages, but it has a slot
    prefill = _worker("prefill-0")
    prefill.reservations.update({f"queued-{i}": 1 for i in range(80)})  # a prefill's queue has no slot bound
    policy = RoutingPolicy(RoutingConfig(), PAGE)
    assert policy.pick_pair([prefill], [full, free], _request([1, 2, 3]), 1, 1) == (prefill, free)
    assert policy.pick_pair([prefill], [full], _request([1, 2, 3]), 1, 1) is None
    del full.reservations["a"]
    assert policy.pick_pair([prefill], [full], _request([1, 2, 3]), 1, 1) == (prefill, full)


def test_a_decode_that_registers_no_batch_slot_is_refused():
    policy = RegistrationPolicy(PAGE, (FINGERPRINT.config_sha, FINGERPRINT.weights_sha, FINGERPRINT.tokenizer_sha), None)
    decode = Register("decode-0", Role.DECODE, PROTOCOL_VERSION, "inc", 1, 100, PAGE, 0, 0, [], FINGERPRINT)
    assert policy.refusal(decode, None, WorkerRegistry()) == "max_batch_size 0: a decode must run at least one request"
    assert policy.refusal(dataclasses.replace(decode, max_batch_size=1), None, WorkerRegistry()) == ""


def test_the_router_serves_only_while_some_decode_can_pull_from_some_prefill():
    registry = WorkerRegistry()
    prefill, decode = _worker("prefill-0"), _worker("decode-0", Role.DECODE)
    registry.workers.update({"prefill-0": prefill, "decode-0": decode})
    assert registry.paired()
    decode.unreachable["prefill-0"] = "a decode on cpu cannot pull a 'cuda_ipc' pool"
    assert not registry.paired()


def test_a_prefill_registering_anew_is_tried_afresh_by_the_decodes_that_could_not_reach_it():
    registry = WorkerRegistry()
    decode = _worker("decode-0", Role.DECODE)
    decode.unreachable["prefill-0"] = "its old pool was gone"
    registry.workers["decode-0"] = decode
    registry.register(b"prefill-0", None, Register("prefill-0", Role.PREFILL, 3, "new-incarnation", 1, 100, PAGE, 0, 0,
                                                    [], FINGERPRINT))
    assert decode.unreachable == {}
    assert registry.paired()


def test_time_the_router_stood_still_is_no_workers_silence():
    """Heartbeats wait unread while the router's loop stands still: only the time it listened counts."""
    registry = WorkerRegistry()
    alive, dead = _worker("decode-0", Role.DECODE), _worker("prefill-0")
    registry.workers.update({"decode-0": alive, "prefill-0": dead})
    now = time.monotonic()
    alive.last_seen, dead.last_seen = now - 5.0, now - 8.0
    assert registry.silent_since(3.0) == [alive, dead]
    registry.router_stalled_s += 4.5  # stood still after both were last heard from
    assert registry.silent_since(3.0) == [dead], "listened 0.5 s for the one, 3.5 s for the other"
    registry.router_stalled_s += 10.0  # a stall before a heartbeat excuses nothing after it
    registry.heartbeat(alive, Heartbeat("decode-0", "epoch", 100, 0, 0, 0.0, []))
    alive.last_seen -= 4.0  # heard from 4 s ago, the router listening since
    assert registry.silent_since(3.0) == [alive]


def test_a_prefills_cache_events_say_which_keys_it_holds():
    prefill = _worker("prefill-0")
    WorkerRegistry.cache_changed(prefill, KvCacheEvents("prefill-0", stored=["a", "b"], evicted=[], cleared=False))
    WorkerRegistry.cache_changed(prefill, KvCacheEvents("prefill-0", stored=["c"], evicted=["a"], cleared=False))
    assert prefill.cached_keys == {"b", "c"}
    WorkerRegistry.cache_changed(prefill, KvCacheEvents("prefill-0", stored=["d"], evicted=[], cleared=True))
    assert prefill.cached_keys == {"d"}
