"""The keys of a prompt's full KV pages, as the prefix cache stores them and the router routes by them.

A page's key covers every token before its end: key(i) = hash(key(i-1), the page's tokens), so two
prompts share the key of page i exactly when they share their first (i+1) * page_size tokens. The
hash is BLAKE2b over fixed-width bytes, the same in every process (Python's hash() is salted per
process). A partly filled last page has no key: only full pages are cached and shared.

A request's cache salt (vLLM's cache_salt: its own, and its bearer token's) starts the chain in
place of the empty key(-1), so prompts of different salts share no key and no page; without a
salt the keys are as they always were.
"""

from __future__ import annotations

import array
import hashlib

DIGEST_BYTES = 16  # 128 bits: a collision would hand one prompt another's KV, so not fewer
SALT_PERSON = b"pdserve-salt"  # BLAKE2b's personalization: a salt's hash is never a page's


def page_keys(token_ids: list[int], page_size: int, salt: str = "") -> list[str]:
    # The whole prompt packed once, each page a slice of it: a 512K-token prompt has 32K pages, and
    # its keys are on the critical path of the router and of the prefill.
    tokens, page_bytes = memoryview(array.array("q", token_ids)).cast("B"), 8 * page_size
    keys, parent = [], _chain_start(salt)
    for start in range(0, len(tokens) - page_bytes + 1, page_bytes):
        parent = hashlib.blake2b(parent + tokens[start:start + page_bytes], digest_size=DIGEST_BYTES).digest()
        keys.append(parent.hex())
    return keys


def _chain_start(salt: str) -> bytes:
    """The key before the first page: empty without a salt, else the salt's own hash."""
    return hashlib.blake2b(salt.encode(), digest_size=DIGEST_BYTES, person=SALT_PERSON).digest() if salt else b""
