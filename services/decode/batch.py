"""The running batch of the decode: per-request state and the tensors of one step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.messages import SamplingParams, StopParams


@dataclass
class DecodingRequest:
    request_id: str
    pages: list[int]          # reserved for prompt + max_tokens, allocated at handoff
    kv_len: int               # tokens whose K/V are in the pages
    last_token: int           # the token the next step feeds in (its K/V not yet written)
    num_generated: int        # tokens produced so far, the prefill's first one included
    sampling: SamplingParams
    stop: StopParams


@dataclass
class StepInputs:
    token_ids: torch.Tensor   # [B]
    positions: torch.Tensor   # [B] where each last_token sits
    page_table: torch.Tensor  # [B, max pages]; padding rows point at page 0, masked by length


def step_inputs(running: list[DecodingRequest], page_size: int, device: torch.device) -> StepInputs:
    # Only the pages up to each request's current position: attention reads no further.
    used = [r.pages[: r.kv_len // page_size + 1] for r in running]
    width = max(map(len, used))
    table = [pages + [0] * (width - len(pages)) for pages in used]
    return StepInputs(
        token_ids=torch.tensor([r.last_token for r in running], device=device),
        positions=torch.tensor([r.kv_len for r in running], device=device),
        page_table=torch.tensor(table, device=device),
    )
