"""services/prefill/prefix_cache.py and cache_events.py on their own: reuse, reference counts,
eviction, and the batched KvCacheEvents. The model and the real stack: test_prefix_cache_e2e.py."""

from __future__ import annotations

import array
import hashlib
import random

import pytest

from services.prefill import cache_events
from services.prefill.cache_events import CacheEvents
from services.prefill.prefix_cache import PrefixCache
from shared.kv.page_keys import PageKeys
from shared.kv.pages import PoolExhausted

PAGE = 4


def page_keys(token_ids: list[int], page_size: int, salt: str = "") -> list[str]:
    """Every full page's key, hashed at once."""
    return list(PageKeys(token_ids, page_size, salt))


def lease_of(cache: PrefixCache, prompt: list[int]):
    """A prompt through the cache as the worker runs it: acquire, (compute), store."""
    keys = page_keys(prompt, PAGE)
    lease = cache.acquire(keys, len(prompt))
    cache.store(keys, lease)
    return lease


def test_a_cache_salt_starts_another_chain_of_keys():
    """Within a salt prompts share the keys of their shared full pages, as without one; across salts,
    and between salted and unsalted, no key at all; no salt keeps the keys they always were."""
    prompt, longer = list(range(3 * PAGE)), list(range(3 * PAGE)) + [7] * PAGE
    plain = page_keys(prompt, PAGE)
    assert page_keys(prompt, PAGE, "") == plain
    assert plain[0] == hashlib.blake2b(array.array("q", prompt[:PAGE]).tobytes(), digest_size=16).hexdigest()
    salted = {salt: page_keys(prompt, PAGE, salt) for salt in ("a", "b", "1:a")}
    assert page_keys(longer, PAGE, "a")[:3] == salted["a"] and len(salted["a"]) == 3
    groups = [set(plain), *map(set, salted.values())]
    assert sum(map(len, groups)) == len(set().union(*groups))  # no key in two groups


def test_page_keys_hash_as_far_as_they_are_read_and_equal_the_whole_chain():
    prompt = [random.Random(3).randrange(50_000) for _ in range(10 * PAGE + 2)]
    whole = page_keys(prompt, PAGE, "s")
    keys = PageKeys(prompt, PAGE, "s")
    assert (len(keys), keys.hashed) == (10, 0)
    assert (keys[2], keys.hashed) == (whole[2], 3)
    assert keys[-1] == whole[-1] and list(keys) == whole
    for part in (slice(None, -1), slice(None, None, -1), slice(7, 2, -2), slice(-3, None), slice(4, 4)):
        assert PageKeys(prompt, PAGE, "s")[part] == whole[part]
    with pytest.raises(IndexError):
        keys[10]


def test_a_lookup_hashes_the_keys_up_to_its_first_miss():
    """A new prompt costs one hash before its compute; the prefill hashes the rest to store it."""
    cache = PrefixCache(64, PAGE)
    head = list(range(3 * PAGE))
    lease_of(cache, head)
    keys = PageKeys(head + list(range(500, 500 + 8 * PAGE)), PAGE)
    lease = cache.acquire(keys, 11 * PAGE)
    assert (lease.cached_pages, keys.hashed) == (3, 4)
    keys.hash_all()
    cache.store(keys, lease)
    assert cache.reusable_pages(page_keys(head + list(range(500, 500 + 8 * PAGE)) + [1], PAGE), 11 * PAGE + 1) \
        == lease.pages[:11]


def test_a_prompt_reuses_its_longest_cached_prefix_of_full_pages():
    cache = PrefixCache(16, PAGE)
    system = list(range(100, 110))  # two full pages and two tokens
    first = lease_of(cache, system + [1, 2, 3])  # 13 tokens: pages 0-2 full, page 3 holds the last token
    assert first.cached_pages == 0 and len(first.pages) == 4
    second = lease_of(cache, system + [7, 8, 9, 10, 11])  # diverges inside page 2
    assert second.cached_pages == 2 and second.pages[:2] == first.pages[:2]
    assert not set(second.pages[2:]) & set(first.pages)
    again = lease_of(cache, system + [1, 2, 3])
    assert again.cached_pages == 3 and again.pages[:3] == first.pages[:3] and again.pages[3] != first.pages[3]


def test_the_page_of_the_last_token_is_always_computed():
    cache = PrefixCache(16, PAGE)
    prompt = list(range(12))  # exactly three full pages
    first = lease_of(cache, prompt)
    again = lease_of(cache, prompt)
    assert again.cached_pages == 2 and again.pages[2] != first.pages[2]  # min(3 * 4, (12 - 1) // 4 * 4) = 8 tokens
    assert lease_of(cache, prompt[:8]).cached_pages == 1  # a prefix of another: all but its last page
    assert lease_of(cache, prompt[:4]).cached_pages == 0
    assert cache.reusable_pages(page_keys(prompt + [50], PAGE), 13) == first.pages  # longer: all three


def test_a_duplicate_computed_page_stays_private_and_is_freed_with_its_request():
    cache = PrefixCache(8, PAGE)
    prompt = list(range(8))
    first, second = lease_of(cache, prompt), lease_of(cache, prompt)  # the second recomputes page 1
    assert cache.num_cached == 2
    cache.release(second)
    cache.release(first)
    assert cache.num_available == 8 and cache.num_cached == 2
    assert cache.reusable_pages(page_keys(prompt + [9], PAGE), 9) == first.pages


def test_released_cached_pages_count_as_available_and_are_evicted_only_when_needed():
    cache = PrefixCache(6, PAGE)
    a = lease_of(cache, list(range(12)))  # 3 pages, all cached
    cache.release(a)
    assert cache.num_available == 6 and cache.num_cached == 3
    b = lease_of(cache, list(range(50, 62)))  # fits in the free list: nothing evicted
    assert cache.num_cached == 6 and not set(b.pages) & set(a.pages)
    cache.take_changes()
    c = lease_of(cache, list(range(70, 78)))  # 2 pages: evicts a's tail, its least recently released
    assert set(c.pages) == {a.pages[2], a.pages[1]}
    stored, evicted = cache.take_changes()
    assert evicted == page_keys(list(range(12)), PAGE)[2:0:-1] and stored == page_keys(list(range(70, 78)), PAGE)
    assert cache.reusable_pages(page_keys(list(range(13)), PAGE), 13) == a.pages[:1]  # its head is still cached


def test_reusing_a_page_makes_it_most_recently_used():
    cache = PrefixCache(5, PAGE)
    old, new = lease_of(cache, list(range(8))), lease_of(cache, list(range(20, 28)))
    cache.release(old)
    cache.release(new)
    cache.release(lease_of(cache, list(range(4)) + [99]))  # reuses old's head, released after new's pages
    cache.take_changes()
    lease_of(cache, list(range(40, 52)) + [1])  # 4 pages: the free one, then 3 evicted
    old_keys, new_keys = page_keys(list(range(8)), PAGE), page_keys(list(range(20, 28)), PAGE)
    assert cache.take_changes()[1] == [old_keys[1], new_keys[1], new_keys[0]]
    assert cache.reusable_pages(old_keys + ["x"], 9) == old.pages[:1]


def test_pages_held_by_several_requests_are_never_handed_out_again():
    cache = PrefixCache(8, PAGE)
    prompt = list(range(9))  # 3 pages, 2 of them reusable
    holders = [lease_of(cache, prompt) for _ in range(3)]
    shared = holders[0].pages[:2]
    assert all(lease.pages[:2] == shared for lease in holders)
    cache.release(holders[0])
    cache.release(holders[1])  # one holder left: still not evictable
    assert cache.num_available == 8 - 2 - 1
    other = cache.acquire([], 4 * cache.num_available)  # every page there is room for
    assert not set(other.pages) & set(holders[2].pages)
    with pytest.raises(PoolExhausted):
        cache.acquire([], 1)
    cache.release(other)
    cache.release(holders[2])
    assert cache.num_available == 8


def test_fits_counts_the_reused_pages_it_would_hold():
    cache = PrefixCache(3, PAGE)
    cache.release(lease_of(cache, list(range(8))))  # two cached pages, unheld: all 3 available
    keys = page_keys(list(range(12)), PAGE)
    assert cache.fits(keys, 12)  # reuses 2 (held, so not evictable for it) and needs 1 fresh: the free one
    assert cache.acquire(keys, 12).cached_pages == 2
    assert not cache.fits([], 1)


def test_random_traffic_never_overwrites_a_page_in_use():
    """Prompts from a few shared prefixes come and go at random on a small pool; a fake pool
    records which prompt tokens each page holds. Every request keeps reading its own tokens in its
    pages until it releases them, and every cached page holds what its key says."""
    rng = random.Random(7)
    cache = PrefixCache(24, PAGE)
    contents: dict[int, tuple[int, ...]] = {}
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(1, 14))] for _ in range(4)]
    held, reused, evicted = [], 0, 0
    for _ in range(2000):
        if held and (rng.random() < 0.45 or not cache.fits([], 4 * PAGE)):
            cache.release(held.pop(rng.randrange(len(held)))[0])
            continue
        prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 10))]
        keys = page_keys(prompt, PAGE)
        if not cache.fits(keys, len(prompt)):
            continue
        lease = cache.acquire(keys, len(prompt))
        for i, page in enumerate(lease.pages):
            if i < lease.cached_pages:
                assert contents[page] == tuple(prompt[i * PAGE:(i + 1) * PAGE])
            else:
                contents[page] = tuple(prompt[i * PAGE:(i + 1) * PAGE])  # "computed"
        cache.store(keys, lease)
        held.append((lease, prompt))
        reused, evicted = reused + lease.cached_pages, evicted + len(cache.take_changes()[1])
        for lease_held, tokens in held:
            for i, page in enumerate(lease_held.pages):
                assert contents[page] == tuple(tokens[i * PAGE:(i + 1) * PAGE])
    for lease, _ in held:
        cache.release(lease)
    assert cache.num_available == 24
    assert reused > 500 and evicted > 500  # the traffic did share pages and did evict them


class FakeLink:
    def __init__(self, epoch: str = "e1"):
        self.epoch = epoch
        self.sent = []

    def send(self, message):
        self.sent.append(message)


@pytest.fixture()
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(cache_events.time, "monotonic", lambda: now[0])
    return now


def test_events_start_with_the_whole_cache_then_go_in_batches(clock):
    cache, link = PrefixCache(16, PAGE), FakeLink()
    events = CacheEvents("prefill-0", cache, link)
    assert events.due_in_s() == 0.0
    events.flush()
    assert [(m.stored, m.evicted, m.cleared) for m in link.sent] == [([], [], True)]  # a fresh start
    assert events.due_in_s() == float("inf")
    first = lease_of(cache, list(range(9)))
    second = lease_of(cache, list(range(20, 29)))
    assert events.due_in_s() == pytest.approx(cache_events.FLUSH_INTERVAL_S)
    events.flush()  # within the interval of the last message: nothing yet
    assert len(link.sent) == 1
    clock[0] += cache_events.FLUSH_INTERVAL_S
    events.flush()
    assert len(link.sent) == 2  # one message for both prompts' pages
    assert link.sent[1].stored == page_keys(list(range(9)), PAGE) + page_keys(list(range(20, 29)), PAGE)
    assert not link.sent[1].cleared and link.sent[1].worker_id == "prefill-0"
    clock[0] += 1.0
    events.flush()
    assert len(link.sent) == 2  # nothing changed, nothing sent
    cache.release(first)
    cache.release(second)


def test_a_router_that_forgot_us_hears_every_key_again_once_we_are_registered(clock):
    cache, link = PrefixCache(16, PAGE), FakeLink()
    events = CacheEvents("prefill-0", cache, link)
    events.flush()
    lease = lease_of(cache, list(range(9)))
    events.resync()  # forget_all: the router dropped us
    link.epoch = ""  # registering again: a router that does not know us would drop what we send
    assert events.due_in_s() == float("inf")
    events.flush()
    assert len(link.sent) == 1
    link.epoch = "e1"  # the same router took us back
    events.flush()
    assert (link.sent[-1].cleared, link.sent[-1].stored) == (True, page_keys(list(range(9)), PAGE))
    clock[0] += 1.0
    events.flush()
    assert len(link.sent) == 2  # the resync covered the changes before it
    link.epoch = "e2"  # a new router
    events.flush()
    assert (link.sent[-1].cleared, link.sent[-1].stored) == (True, page_keys(list(range(9)), PAGE))
    cache.release(lease)


def test_a_key_stored_then_evicted_between_two_messages_goes_as_evicted():
    cache = PrefixCache(2, PAGE)
    cache.release(lease_of(cache, list(range(4)) + [1]))
    cache.release(lease_of(cache, list(range(50, 54)) + [1]))  # evicts the first's page
    assert cache.take_changes() == (page_keys(list(range(50, 54)), PAGE), page_keys(list(range(4)), PAGE))
