"""Page arithmetic and the free list of page ids: what the router, the prefix cache and the pools
share about pages, with no torch (the router reserves pages without ever touching a tensor)."""

from __future__ import annotations


class PoolExhausted(RuntimeError):
    pass


class PageAllocator:
    """Free list of page ids; every page has exactly one owner or is free.

    Slices and set operations rather than a Python loop per page: a 32K-token request holds
    2,048 pages, and the decode allocates them on the handoff's critical path."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # taken from the end: low ids first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise PoolExhausted(f"need {count} pages, {len(self._free)} free of {self.num_pages}")
        split = len(self._free) - count
        pages = self._free[split:][::-1]
        del self._free[split:]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        freed = set(pages)
        if len(freed) != len(pages):
            raise ValueError(f"duplicate page ids in {pages}")
        if not freed <= self._used:
            raise ValueError(f"page {min(freed - self._used)} freed twice or out of range")
        self._used -= freed
        self._free.extend(pages)


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def decode_pages_needed(num_prompt_tokens: int, max_tokens: int, page_size: int) -> int:
    """Pages a decode holds for a request: the router reserves exactly this before the prefill."""
    return pages_for(num_prompt_tokens + max_tokens, page_size)
