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
    # The counts run ahead of the tokens: each advances when a step is launched, before its token is read.
    kv_len: int               # tokens whose K/V are in the pages once the steps launched have run
    last_token: int           # the last token read back: its first step feeds it in; with steps
                              # overlapped, a later one takes the step before's token on the device
    num_generated: int        # tokens produced by the steps launched, the prefill's first one included
    sampling: SamplingParams
    stop: StopParams
    handoff: Transfer | None = None  # its pages' transfer, until its first step reports the wait for it
    finished: bool = False    # it has left the batch: a step still in flight ran it for nothing


@dataclass
class StepInputs:
    token_ids: torch.Tensor   # [B]
    positions: torch.Tensor   # [B] where each fed token sits
    page_table: torch.Tensor  # [B, max pages]; padding rows point at page 0, masked by length


@dataclass
class PreviousTokens:
    """The tokens a step sampled, still on the device, and the batch it ran: the next step's inputs
    for the requests in both (services/decode/worker.py, overlapped steps)."""
    requests: list[DecodingRequest]
    tokens: torch.Tensor  # [len(requests)] int64


class _HostBuffers:
    """One step's inputs on the host. The page table, whose rows are rewritten only when the batch's
    members change; the part of it a step reads, copied out contiguous; per row the token, its
    position and the token's row in the step before's sample (-1: the token is the host's, as a
    request's first is). What goes to a GPU is pinned and contiguous: a copy from pageable memory
    may wait for the work queued on the stream, which would undo overlapped steps."""

    def __init__(self, max_batch: int, max_pages: int, pinned: bool):
        self.table = torch.zeros((max_batch, max_pages), dtype=torch.int32)
        self.table_part = torch.zeros(max_batch * max_pages, dtype=torch.int32, pin_memory=pinned)
        self.scalars = torch.zeros((max_batch, 3), dtype=torch.int64, pin_memory=pinned)
        self.members: tuple[DecodingRequest, ...] = ()


class StepInputBuilder:
    """Each step's input tensors, without a Python loop over every page of every request.

    The page table lives in a host buffer whose rows are rewritten only when the running batch
    changes (a request joins or leaves), not at every step: at batch 32 and 8K context, building it
    from lists meant 16K Python ints converted every step. A step sends the device only the pages up
    to each request's current position (attention reads no further).
    Two sets of buffers take turns. The device copies a step's inputs when it reaches the step, so
    the buffers are rewritten only once the decode has waited for that step's tokens: with steps
    overlapped the decode builds step n while step n - 1 may not have copied its inputs yet, and has
    waited for step n - 2, which used the other set.
    """

    def __init__(self, max_batch: int, max_pages: int, page_size: int, device: torch.device):
        self.device, self.page_size = device, page_size
        self._buffers = [_HostBuffers(max_batch, max_pages, device.type == "cuda") for _ in range(2)]
        self._turn = 0

    def build(self, running: list[DecodingRequest], previous: PreviousTokens | None = None) -> StepInputs:
        """previous: the step before, not waited for; a request of both takes its token from there."""
        buffers = self._buffers[self._turn]
        self._turn ^= 1
        batch = len(running)
        # By identity, holding the requests: an id() could be reused by the next request's object.
        if len(running) != len(buffers.members) or any(a is not b for a, b in zip(running, buffers.members)):
            table = buffers.table.numpy()
            for row, request in enumerate(running):
                # Index i holds pages[i % len(pages)] (shared/kv/pages.ring_row): a windowed request's
                # ring; for others, cells past their pages repeat them and are never read.
                table[row] = np.resize(np.asarray(request.pages, dtype=np.int32), table.shape[1])
            buffers.members = tuple(running)
        width = max(r.kv_len for r in running) // self.page_size + 1
        part = buffers.table_part[: batch * width].view(batch, width)
        part.copy_(buffers.table[:batch, :width])
        scalars = buffers.scalars.numpy()
        scalars[:batch, 0] = [r.last_token for r in running]
        scalars[:batch, 1] = [r.kv_len for r in running]
        if previous is not None:
            rows = {id(request): row for row, request in enumerate(previous.requests)}
            scalars[:batch, 2] = [rows.get(id(r), -1) for r in running]
        values = buffers.scalars[:batch].to(self.device, non_blocking=True)
        token_ids, positions, source = values.unbind(1)
        if previous is not None:
            token_ids = torch.where(source >= 0, previous.tokens[source.clamp(min=0)], token_ids)
        return StepInputs(token_ids=token_ids, positions=positions,
                          page_table=part.to(self.device, non_blocking=True))


def step_inputs(running: list[DecodingRequest], page_size: int, device: torch.device) -> StepInputs:
    """One step's inputs, built once (benchmarks and tests; the decode keeps a StepInputBuilder)."""
    max_pages = max(max(len(r.pages), r.kv_len // page_size + 1) for r in running)
    return StepInputBuilder(len(running), max_pages, page_size, device).build(running)
