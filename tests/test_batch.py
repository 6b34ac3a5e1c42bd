"""The decode's step inputs: rebuilt when the batch changes, trimmed to what attention reads, fed the
step before's tokens where its steps overlap."""

from __future__ import annotations

import torch

from services.decode.step_inputs import DecodingRequest, PreviousTokens, StepInputBuilder
from shared.control.messages import SamplingParams, StopParams


def request(name: str, pages: list[int], kv_len: int, last_token: int) -> DecodingRequest:
    return DecodingRequest(name, pages, kv_len, last_token, 1, SamplingParams(0, 1, 0, 0), StopParams(8, True))


def test_rows_follow_the_batch_and_stop_at_the_current_position():
    builder = StepInputBuilder(max_batch=4, max_pages=8, page_size=4, device=torch.device("cpu"))
    a, b = request("a", [5, 6, 7], kv_len=5, last_token=11), request("b", [1, 2], kv_len=2, last_token=12)
    inputs = builder.build([a, b])
    assert inputs.token_ids.tolist() == [11, 12] and inputs.positions.tolist() == [5, 2]
    assert inputs.page_table.tolist() == [[5, 6], [1, 2]]  # up to position 5 of a: pages 0 and 1
    a.kv_len, a.last_token = 8, 13
    assert builder.build([a, b]).page_table[0].tolist() == [5, 6, 7]
    # b leaves and a new request (maybe at b's old address) takes its row: its own pages are used.
    c = request("c", [3, 4], kv_len=1, last_token=14)
    inputs = builder.build([c, a])
    assert inputs.page_table[:, :2].tolist() == [[3, 4], [5, 6]] and inputs.token_ids.tolist() == [14, 13]


def test_with_steps_overlapped_the_step_befores_requests_take_its_tokens_and_new_ones_their_own():
    """The step before was not read back: a request it ran feeds in the token it sampled (by its row
    there), a request new to the batch its own last token."""
    builder = StepInputBuilder(max_batch=4, max_pages=8, page_size=4, device=torch.device("cpu"))
    a, b, c = request("a", [5, 6], kv_len=5, last_token=11), request("b", [1], 2, 12), request("c", [3], 1, 14)
    inputs = builder.build([a, c, b], PreviousTokens([b, a], torch.tensor([22, 21])))
    assert inputs.token_ids.tolist() == [21, 14, 22] and inputs.positions.tolist() == [5, 1, 2]
    assert inputs.page_table.tolist() == [[5, 6], [3, 3], [1, 1]]
