"""The prefix cache's changes, told to the router in batches (KvCacheEvents), which routes by them.

Each router epoch that has not heard from this cache yet (a fresh start, a new router, or one
that forgot us and hears us register again) first gets the whole cache: cleared=True with every
key cached now. After that, the keys stored and evicted go out together, at most one message
every FLUSH_INTERVAL_S, never one per page. Nothing goes out while unregistered: a router that
does not know us would drop it, and the resync that follows registration covers it.
"""

from __future__ import annotations

import math
import time

from services.prefill.prefix_cache import PrefixCache
from shared.control.messages import KvCacheEvents
from shared.control.router_link import RouterLink

FLUSH_INTERVAL_S = 0.01


class CacheEvents:
    def __init__(self, worker_id: str, cache: PrefixCache, link: RouterLink):
        self.worker_id = worker_id
        self.cache = cache
        self.link = link
        self.told_epoch = ""  # the router epoch that has the cache's keys; empty: none has them
        self.last_sent = 0.0

    def resync(self) -> None:
        """The router forgot our keys: send them all again once registered."""
        self.told_epoch = ""

    def due_in_s(self) -> float:
        """How long the loop may wait for messages before flush() has something to send: at once for
        a router to resync, the rest of the interval for changes, and never for nothing or while
        registering (the router's answer wakes the loop)."""
        if not self.link.epoch or (self.link.epoch == self.told_epoch and not self.cache.has_changes):
            return math.inf
        if self.link.epoch != self.told_epoch:
            return 0.0
        return max(0.0, self.last_sent + FLUSH_INTERVAL_S - time.monotonic())

    def flush(self) -> None:
        """Sends what the router has not heard yet, if anything and if it is time."""
        epoch = self.link.epoch
        if not epoch:
            return
        if epoch != self.told_epoch:
            self.cache.take_changes()  # the full list below covers them
            self._send(self.cache.keys(), [], cleared=True)
            self.told_epoch = epoch
        elif time.monotonic() - self.last_sent >= FLUSH_INTERVAL_S:
            stored, evicted = self.cache.take_changes()
            if stored or evicted:
                self._send(stored, evicted, cleared=False)

    def _send(self, stored: list[str], evicted: list[str], cleared: bool) -> None:
        self.link.send(KvCacheEvents(self.worker_id, stored, evicted, cleared))
        self.last_sent = time.monotonic()
