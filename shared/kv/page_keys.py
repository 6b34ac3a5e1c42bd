"""The keys of a prompt's full KV pages, as the prefix cache stores them and the router routes by them.

A page's key covers every token before its end: key(i) = hash(key(i-1), the page's tokens), so two
prompts share the key of page i exactly when they share their first (i+1) * page_size tokens. The
hash is BLAKE2b over fixed-width bytes, the same in every process (Python's hash() is salted per
process). A partly filled last page has no key: only full pages are cached and shared.

A request's cache salt (vLLM's cache_salt: its own, and its bearer token's) starts the chain in
place of the empty key(-1), so prompts of different salts share no key and no page; without a
salt the keys are as they always were.

The keys are hashed as far as they are read (PageKeys). A lookup reads them up to its first miss,
so a new 8K-token prompt costs the router and the prefill one hash before its compute, where
hashing all 512 took 1.5 ms in each on a CPU machine (21 ms at 128K). The prefill hashes the rest
while the GPU computes the prompt, to cache its pages.
"""

from __future__ import annotations

import array
import hashlib
from collections.abc import Sequence

DIGEST_BYTES = 16  # 128 bits: a collision would hand one prompt another's KV, so not fewer
SALT_PERSON = b"pdserve-salt"  # BLAKE2b's personalization: a salt's hash is never a page's


class PageKeys(Sequence[str]):
    """A prompt's page keys, each hashed when first read (the chain needs those before it)."""

    def __init__(self, token_ids: Sequence[int], page_size: int, salt: str = ""):
        self._tokens = token_ids
        self._page_size = page_size
        self._pages = len(token_ids) // page_size
        self._keys: list[str] = []
        self._parent = _chain_start(salt)

    @property
    def hashed(self) -> int:
        """How many keys have been hashed so far."""
        return len(self._keys)

    def __len__(self) -> int:
        return self._pages

    def hash_all(self) -> None:
        self._hash_to(self._pages)

    def __getitem__(self, index):
        if isinstance(index, slice):
            pages = range(*index.indices(self._pages))
            self._hash_to(max(pages, default=-1) + 1)
            return [self._keys[i] for i in pages]
        if index < 0:
            index += self._pages
        if not 0 <= index < self._pages:
            raise IndexError(f"page {index} of a prompt with {self._pages} full pages")
        self._hash_to(index + 1)
        return self._keys[index]

    def _hash_to(self, count: int) -> None:
        """Hashes the keys up to page count - 1."""
        parent, size = self._parent, self._page_size
        for start in range(len(self._keys) * size, count * size, size):
            # Packed a page at a time: packing a 128K-token prompt whole took 5.8 ms.
            page = array.array("q", self._tokens[start:start + size])
            parent = hashlib.blake2b(parent + page.tobytes(), digest_size=DIGEST_BYTES).digest()
            self._keys.append(parent.hex())
        self._parent = parent


def _chain_start(salt: str) -> bytes:
    """The key before the first page: empty without a salt, else the salt's own hash."""
    return hashlib.blake2b(salt.encode(), digest_size=DIGEST_BYTES, person=SALT_PERSON).digest() if salt else b""
