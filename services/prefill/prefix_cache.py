"""The prefill's prefix cache: the KV pages of prompts already computed, kept for the prompts after.

A full page is cached once its prompt has been computed, under its shared/kv/page_keys key (which
covers every token up to the page's end), so a new prompt that starts with the same tokens reads
those pages instead of computing them. A cached page is read-only for as long as it is cached.

Every page in use counts the requests holding it. A page no request holds goes back to the free
list, or, when cached, stays cached and evictable: an allocation that finds the free list short
evicts the least recently released. So cached pages that no request holds count as available
(`num_available`, what the heartbeat reports free): each request takes at most its prompt's pages
out of that number, which is what the router reserves for it.

The page holding a prompt's last token is always computed, even when cached: its logits pick the
first token, and a page other requests may read is never written. Hence the cap in reusable_pages.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from shared.kv.pages import PageAllocator, PoolExhausted, pages_for


@dataclass(frozen=True)
class Lease:
    """What a request holds: every page of its prompt, in order, the first `cached_pages` from the cache."""
    pages: list[int]
    cached_pages: int


class PrefixCache:
    def __init__(self, num_pages: int, page_size: int):
        self.page_size = page_size
        self._allocator = PageAllocator(num_pages)
        self._refs: dict[int, int] = {}  # page -> requests holding it; pages no one holds are absent
        self._page_of: dict[str, int] = {}
        self._key_of: dict[int, str] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached and unheld, least recently released first
        self._changes: dict[str, bool] = {}  # key -> stored (True) or evicted (False) since take_changes

    @property
    def num_pages(self) -> int:
        return self._allocator.num_pages

    @property
    def num_available(self) -> int:
        """Pages an allocation can get: the free ones and the cached ones no request holds."""
        return self._allocator.num_free + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._page_of)

    @property
    def has_changes(self) -> bool:
        return bool(self._changes)

    def keys(self) -> list[str]:
        return list(self._page_of)

    def reusable_pages(self, keys: Sequence[str], num_tokens: int) -> list[int]:
        """The cached pages a prompt of num_tokens tokens, whose full pages have these keys, starts with;
        keys read up to the first that is not cached (PageKeys hashes no further)."""
        pages = []
        for key in itertools.islice(keys, (num_tokens - 1) // self.page_size):
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def fits(self, keys: Sequence[str], num_tokens: int) -> bool:
        reused = self.reusable_pages(keys, num_tokens)
        unheld = sum(page in self._evictable for page in reused)  # held once reused: not evictable for the rest
        return pages_for(num_tokens, self.page_size) - len(reused) <= self.num_available - unheld

    def acquire(self, keys: Sequence[str], num_tokens: int) -> Lease:
        """Holds the prompt's cached pages and allocates the others; raises PoolExhausted if they do not fit."""
        if not self.fits(keys, num_tokens):
            raise PoolExhausted(f"need {pages_for(num_tokens, self.page_size)} pages, {self.num_available} available")
        reused = self.reusable_pages(keys, num_tokens)
        for page in reused:
            self._hold(page)
        fresh = self._allocate(pages_for(num_tokens, self.page_size) - len(reused))
        for page in fresh:
            self._refs[page] = 1
        return Lease(reused + fresh, len(reused))

    def store(self, keys: Sequence[str], lease: Lease) -> None:
        """Caches the full pages of a computed prompt. A key cached already keeps its page: the
        lease's copy stays private and is freed with the lease."""
        for key, page in zip(keys[lease.cached_pages:], lease.pages[lease.cached_pages:]):
            if key not in self._page_of:
                self._page_of[key], self._key_of[page] = page, key
                self._changes[key] = True

    def release(self, lease: Lease) -> None:
        """Drops the lease's hold on its pages. The last pages go first into the evictable order, so
        a prompt's tail is evicted before its head, which other prompts are likelier to share."""
        freed = []
        for page in reversed(lease.pages):
            self._refs[page] -= 1
            if self._refs[page]:
                continue
            del self._refs[page]
            if page in self._key_of:
                self._evictable[page] = None
            else:
                freed.append(page)
        self._allocator.free(freed)

    def take_changes(self) -> tuple[list[str], list[str]]:
        """The keys stored and the keys evicted since the last call, each key once, as it stands now."""
        changes, self._changes = self._changes, {}
        return [k for k, stored in changes.items() if stored], [k for k, stored in changes.items() if not stored]

    def _hold(self, page: int) -> None:
        self._evictable.pop(page, None)
        self._refs[page] = self._refs.get(page, 0) + 1

    def _allocate(self, count: int) -> list[int]:
        """Free pages first; then the least recently released cached pages, evicted."""
        pages = self._allocator.allocate(min(count, self._allocator.num_free))
        while len(pages) < count:
            page, _ = self._evictable.popitem(last=False)
            key = self._key_of.pop(page)
            del self._page_of[key]
            self._changes[key] = False
            pages.append(page)
        return pages
