"""A decode step's inputs for the GPU tests: requests whose prompts were prefilled into a pool; and
the check that a CUDA-graph replay of the step computes what the eager step does."""

from __future__ import annotations

import torch

from loadtest.lib.decode_batch import decode_batch
from services.decode.step_inputs import StepInputs
from shared.kv.pages import PageAllocator
from shared.kv.pool import PagedKvPool, allocate_local_pool
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


def assert_graph_replay_equals_eager(model: PagedLlama) -> None:
    """Three prompts' next step replayed from a graph captured for batches 1, 4 and 8, against the
    eager step from the same pages."""
    from services.decode.cuda_graphs import GraphedDecode

    layout = model.kv_layout(256, PAGE_SIZE)
    pool, _ = allocate_local_pool(layout, model.device)
    allocator = PageAllocator(layout.num_pages)
    graphs = GraphedDecode(model, pool, allocator.allocate(1)[0], 64, [1, 4, 8])
    inputs = prefilled_step_inputs(model, pool, allocator, [5, 40, 17])
    kv_before = pool.kv.clone()
    graphed = graphs.step(inputs).clone()
    pool.kv.copy_(kv_before)
    eager = model.decode(inputs.token_ids, inputs.positions, inputs.page_table, pool)
    torch.testing.assert_close(graphed, eager, atol=1e-4, rtol=1e-4)
