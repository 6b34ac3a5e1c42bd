"""The page ids of the decode's own copies, staged where the copy kernel reads them."""

from __future__ import annotations

import numpy as np
import torch


class PageIdStaging:
    """The two page-id lists of a pull in one reused buffer of pinned host memory, which the copy
    kernel reads in place: a GPU reads pinned memory over PCIe, and a pull's ids are a few KiB.

    Numpy fills a view of the buffer in one call; nothing is uploaded and no event recorded,
    because when a request reaches a decode that sat idle, each torch call is slow, an upload
    slower still (docs/BENCHMARKS.md, "Handoff"). Pulls take consecutive slices. A slice is rewritten
    only after the copy that reads it: a full buffer makes the host wait for the last copy (they
    run in stream order, so then all are done). Every list starts 16-byte aligned: Triton compiles
    a kernel per alignment of its pointers, and a compile on a request's path stalls it.
    """

    def __init__(self, capacity: int, device: torch.device):
        self.host = torch.empty(capacity, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.ids = self.host.numpy()
        self.used = 0
        self._last_reader: torch.cuda.Event | None = None  # recorded after the latest copy that read ids

    def stage(self, src: np.ndarray, dst: list[int], src_limit: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Both id lists as index tensors for the copy; ValueError unless every src id is in
        [0, src_limit)."""
        n = len(src)
        slot = n + n % 2  # two int64 ids are 16 bytes
        if len(dst) != n or 2 * slot > len(self.ids):
            raise ValueError(f"{n} source and {len(dst)} destination pages do not fit a buffer of {len(self.ids)}")
        if self.used + 2 * slot > len(self.ids):
            if self._last_reader is not None:
                self._last_reader.synchronize()
            self.used = 0
        src_at, dst_at = self.used, self.used + slot
        self.used += 2 * slot
        self.ids[src_at: src_at + n], self.ids[dst_at: dst_at + n] = src, dst
        if n and (self.ids[src_at: src_at + n].min() < 0 or self.ids[src_at: src_at + n].max() >= src_limit):
            raise ValueError(f"source page ids outside [0, {src_limit})")
        return self.host[src_at: src_at + n], self.host[dst_at: dst_at + n]

    def read_by(self, copy_done: torch.cuda.Event) -> None:
        """The staged lists are read by the copy that this event follows on the device."""
        self._last_reader = copy_done
