"""A synthetic decode batch: requests as the decode worker holds them between two steps, and the
inputs of their next step, for the engine benchmarks and the GPU tests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.decode.step_inputs import DecodingRequest, StepInputs, step_inputs
from shared.control.messages import SamplingParams, StopParams
from shared.kv.pages import PageAllocator, pages_for

GREEDY = SamplingParams(0, 1, 0, 0)


@dataclass
class DecodeBatch:
    requests: list[DecodingRequest]
    inputs: StepInputs


def request_pages(context: int, page_size: int, spare_tokens: int = 1) -> int:
    """Pages for a request whose next step attends to `context` tokens, with room for spare_tokens more."""
    return pages_for(context + spare_tokens, page_size)


def decode_batch(allocator: PageAllocator, contexts: Sequence[int], page_size: int, device: torch.device | str,
                 spare_tokens: int = 1, last_tokens: Sequence[int] | None = None) -> DecodeBatch:
    """One greedy request per context: the K/V of its first context - 1 tokens in pages from
    allocator (whatever the pool holds there, unless the caller writes it), the next step feeding in
    the last, token 1 unless last_tokens gives each its own. Nothing samples the batch to a stop:
    its steps are timed or compared, so each request's max_tokens is 1."""
    tokens = last_tokens if last_tokens is not None else [1] * len(contexts)
    requests = [DecodingRequest(str(i), allocator.allocate(request_pages(context, page_size, spare_tokens)),
                                context - 1, token, 1, GREEDY, StopParams(1, True))
                for i, (context, token) in enumerate(zip(contexts, tokens, strict=True))]
    return DecodeBatch(requests, step_inputs(requests, page_size, torch.device(device)))
