"""A decode step's inputs for the GPU tests: requests whose prompts were prefilled into a pool."""

from __future__ import annotations

from loadtest.lib.decode_batch import decode_batch
from services.decode.step_inputs import StepInputs
from shared.kv.pages import PageAllocator
from shared.kv.pool import PagedKvPool
from shared.model.llama import PagedLlama

PAGE_SIZE = 16


def prefilled_step_inputs(model: PagedLlama, pool: PagedKvPool, allocator: PageAllocator,
                          lengths: list[int]) -> StepInputs:
    """One greedy request per prompt length, prompt ids 3, 4, ...; each prefilled by `model`, with
    room for 8 more tokens, and fed token 7, 8, ... by the step."""
    batch = decode_batch(allocator, [length + 1 for length in lengths], PAGE_SIZE, pool.kv.device, spare_tokens=7,
                         last_tokens=range(7, 7 + len(lengths)))
    for request in batch.requests:
        model.prefill(list(range(3, 3 + request.kv_len)), pool, request.pages)
    return batch.inputs
