"""A decode step launched and not yet read back: what the decode needs to finish it later.

With steps overlapped (decode.overlap_steps) the decode launches step n before it reads step n - 1's
tokens, so the GPU has the next step queued while the host streams the last one's tokens, checks
which requests finished and takes in messages. The step's tokens go to the host by a non-blocking
copy into one of two pinned buffers, taken in turns: the decode reads step n - 1's before it launches
step n + 1, which reuses that buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.decode.step_inputs import DecodingRequest, PreviousTokens
from shared.kernels.device import Moment
from shared.kv.transfer import Transfer


class TokenReadback:
    """Sampled tokens on their way to the host."""

    def __init__(self, max_batch: int, device: torch.device):
        self.device = device
        pinned = device.type == "cuda"
        self._buffers = [torch.empty(max_batch, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self._turn = 0

    def start(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """(where the tokens will be, the event after their copy: None on the CPU, where they are there)."""
        if self.device.type != "cuda":
            return tokens, None
        host = self._buffers[self._turn][: len(tokens)]
        self._turn ^= 1
        host.copy_(tokens, non_blocking=True)
        # Timed: a step's first moment is dated against it (shared/kernels/device.date_moments).
        done = torch.cuda.Event(enable_timing=True)
        done.record()
        return host, done


@dataclass
class LaunchedStep:
    requests: list[DecodingRequest]   # the batch, row by row
    counts: list[tuple[int, int]]     # each request's (num_generated, kv_len) once the step has run
    tokens: torch.Tensor              # [B] int64, sampled on the device
    host_tokens: torch.Tensor         # where TokenReadback copies them
    done: torch.cuda.Event | None     # recorded after that copy (None on the CPU)
    joining: list[tuple[DecodingRequest, Transfer]]  # the requests it is the first of, their pages' transfer
    started: Moment | None            # the step's start, where some request joins
    # Pages of requests that left the batch while this step ran them: free once it has run.
    free_after: list[list[int]] = field(default_factory=list)

    def __post_init__(self):
        self._members = {id(request) for request in self.requests}  # held by self.requests: ids stay theirs

    def includes(self, request: DecodingRequest) -> bool:
        return id(request) in self._members

    def previous_tokens(self) -> PreviousTokens:
        return PreviousTokens(self.requests, self.tokens)

    def read(self) -> list[int]:
        """The tokens on the host, waiting for the step if it has not run yet."""
        if self.done is not None:
            self.done.synchronize()
        return self.host_tokens.tolist()
