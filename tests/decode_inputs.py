"""A decode step's inputs for the GPU tests: requests whose prompts were prefilled into a pool."""

from __future__ import annotations

from services.decode.step_inputs import DecodingRequest, StepInputs, step_inputs
from shared.control.messages import SamplingParams, StopParams
from shared.kv.pages import PageAllocator, pages_for
from shared.kv.pool import PagedKvPool
from shared.model.llama import PagedLlama

PAGE_SIZE = 16


def prefilled_step_inputs(model: PagedLlama, pool: PagedKvPool, allocator: PageAllocator,
                          lengths: list[int]) -> StepInputs:
    """One greedy request per prompt length, prompt ids 3, 4, ...; each prefilled by `model`, with
    room for 8 more tokens."""
    requests = []
    for i, length in enumerate(lengths):
        pages = allocator.allocate(pages_for(length + 8, PAGE_SIZE))
        model.prefill(list(range(3, 3 + length)), pool, pages)
        requests.append(DecodingRequest(f"r{i}", pages, length, 7 + i, 1, SamplingParams(0, 1, 0, 0),
                                        StopParams(8, True)))
    return step_inputs(requests, PAGE_SIZE, pool.kv.device)
