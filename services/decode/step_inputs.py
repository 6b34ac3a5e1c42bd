"""The running batch of the decode: per-request state and the tensors of one step."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shared.control.messages import SamplingParams, StopParams
from shared.kv.transfer import Transfer


@dataclass
class DecodingRequest:
    request_id: str
    pages: list[int]          # reserved for prompt + max_tokens (or a window's ring), allocated at handoff
    kv_len: int               # tokens whose K/V are in the pages
    last_token: int           # the token the next step feeds in (its K/V not yet written)
    num_generated: int        # tokens produced so far, the prefill's first one included
    sampling: SamplingParams
    stop: StopParams
    handoff: Transfer | None = None  # its pages' transfer, until its first step reports the wait for it


@dataclass
class StepInputs:
    token_ids: torch.Tensor   # [B]
    positions: torch.Tensor   # [B] where each last_token sits
    page_table: torch.Tensor  # [B, max pages]; padding rows point at page 0, masked by length


class StepInputBuilder:
    """Each step's input tensors, without a Python loop over every page of every request.

    The page table lives in a host buffer (pinned on a GPU) whose rows are rewritten only when the
    running batch changes (a request joins or leaves), not at every step: at batch 32 and 8K
    context, building it from lists meant 16K Python ints converted every step. A step sends one slice of it to the
    device, only the pages up to each request's current position (attention reads no further).
    Reusing the buffers is safe because sampling waits for every step's results, and with them
    for the copies that fed it, before the next step rewrites them.
    """

    def __init__(self, max_batch: int, max_pages: int, page_size: int, device: torch.device):
        pinned = device.type == "cuda"
        self.device, self.page_size = device, page_size
        self._table = torch.zeros((max_batch, max_pages), dtype=torch.int32, pin_memory=pinned)
        self._scalars = torch.zeros((2, max_batch), dtype=torch.int64, pin_memory=pinned)
        self._members: tuple[DecodingRequest, ...] = ()

    def build(self, running: list[DecodingRequest]) -> StepInputs:
        batch = len(running)
        # By identity, holding the requests: an id() could be reused by the next request's object.
        if len(running) != len(self._members) or any(a is not b for a, b in zip(running, self._members)):
            table = self._table.numpy()
            for row, request in enumerate(running):
                # Index i holds pages[i % len(pages)] (shared/kv/pages.ring_row): a windowed request's
                # ring; for others, cells past their pages repeat them and are never read.
                table[row] = np.resize(np.asarray(request.pages, dtype=np.int32), table.shape[1])
            self._members = tuple(running)
        scalars = self._scalars.numpy()
        scalars[0, :batch] = [r.last_token for r in running]
        scalars[1, :batch] = [r.kv_len for r in running]
        width = max(r.kv_len for r in running) // self.page_size + 1
        token_ids, positions = self._scalars[:, :batch].to(self.device, non_blocking=True)
        return StepInputs(token_ids=token_ids, positions=positions,
                          page_table=self._table[:batch, :width].to(self.device, non_blocking=True))


def step_inputs(running: list[DecodingRequest], page_size: int, device: torch.device) -> StepInputs:
    """One step's inputs, built once (benchmarks and tests; the decode keeps a StepInputBuilder)."""
    max_pages = max(max(len(r.pages), r.kv_len // page_size + 1) for r in running)
    return StepInputBuilder(len(running), max_pages, page_size, device).build(running)
