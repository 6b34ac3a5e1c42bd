"""The prompts a prefill runs before it registers, so that no request waits on a kernel compile.

A Triton kernel compiles on its first call with each set of specialized arguments and constants, and
a compile holds the GIL for up to seconds: long enough to silence the worker's heartbeat thread. The
router dropped a prefill for missed heartbeats at its first cache hit, and once early in a long
prompt's benchmark, whose first chunks were the first of 512 rows or more (docs/BENCHMARKS.md). The
kernels take the lengths that vary by request unspecialized (do_not_specialize), so what is left to
compile is one variant per range of chunk lengths (PagedLlama.prefill_variant_rows), and the path of
a prompt after a cached prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.kv.pages import pages_for
from shared.model.llama import PagedLlama

TOKEN = 1  # any id: only the shapes matter


@dataclass(frozen=True)
class Warmup:
    prompt: list[int]
    pages: list[int]
    start: int  # tokens of the prompt taken as a cached prefix


def warmup_prompts(model: PagedLlama, page_size: int, num_pages: int, chunk_tokens: int,
                   prefix_cache: bool) -> list[Warmup]:
    """A two-page prompt, again after a cached first page with the prefix cache on, then one prompt in
    each other range of lengths that shares every kernel variant (PagedLlama.prefill_variant_rows),
    where a chunk reaches it (chunk_tokens, 0: whole) and the pool holds it. Every page is free when
    they run: nothing is allocated before registering."""
    short = Warmup([TOKEN] * 2 * page_size, [0, 1], 0)
    prompts = [short, Warmup(short.prompt, short.pages, page_size)] if prefix_cache else [short]
    for rows in other_ranges(model.prefill_variant_rows(), len(short.prompt)):
        pages = pages_for(rows, page_size)
        if (not chunk_tokens or rows <= chunk_tokens) and pages <= num_pages:
            prompts.append(Warmup([TOKEN] * rows, list(range(pages)), 0))
    return prompts


def other_ranges(boundaries: list[int], short: int) -> list[int]:
    """The first length of each range [1, b0), [b0, b1), ..., [bn, ...) that does not hold `short`."""
    ranges = zip([1, *boundaries], [*boundaries, None])
    return [start for start, end in ranges if not (start <= short and (end is None or short < end))]
