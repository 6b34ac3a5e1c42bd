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
    """A two-page prompt, again after a cached first page with the prefix cache on, then a prompt of
    each variant's first length that a chunk reaches (chunk_tokens, 0: whole) and the pool holds.
    Every page is free when they run: nothing is allocated before registering."""
    short = Warmup([TOKEN] * 2 * page_size, [0, 1], 0)
    prompts = [short, Warmup(short.prompt, short.pages, page_size)] if prefix_cache else [short]
    for rows in model.prefill_variant_rows():
        pages = pages_for(rows, page_size)
        if (not chunk_tokens or rows <= chunk_tokens) and pages <= num_pages and rows > len(short.prompt):
            prompts.append(Warmup([TOKEN] * rows, list(range(pages)), 0))
    return prompts
