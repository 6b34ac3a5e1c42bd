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


def decode_pages_needed(num_prompt_tokens: int, max_tokens: int, page_size: int, window: int = 0) -> int:
    """Pages a decode holds for a request: the router reserves exactly this before the prefill.

    window > 0 (the model's every layer attends to its last `window` tokens): no more than the
    pages those tokens can span, plus the one the next token is written to. The request's pages
    are then a ring over its positions: position t's page is pages[t // page_size %
    len(pages)] (ring_row), reused once the window has left the tokens it held."""
    whole = pages_for(num_prompt_tokens + max_tokens, page_size)
    return min(whole, pages_for(window, page_size) + 1) if window > 0 else whole


def ring_row(pages: list[int], width: int) -> list[int]:
    """A request's page table row, `width` page indices long: index i holds pages[i % len(pages)].
    Equal to `pages` over their length for a request that holds a page for every position."""
    return [pages[i % len(pages)] for i in range(width)]


def pulled_indices(num_prompt_pages: int, held: int) -> range:
    """The prompt's page indices a decode pulls into a ring of `held` pages: the last `held` of them,
    each to its own page (the window needs no earlier one; earlier ones would share pages)."""
    return range(max(0, num_prompt_pages - held), num_prompt_pages)
