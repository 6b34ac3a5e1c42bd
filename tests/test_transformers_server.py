"""The serving benchmark's floor: transformers generate behind the same gRPC API."""

from __future__ import annotations

import grpc
import pytest
import torch
from pdserve.v1 import generation_pb2

from tests.conftest import CACHE_DIR
from tests.stack import ServiceStack

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def floor(tmp_path_factory, checkpoint):
    with ServiceStack(tmp_path_factory.mktemp("floor"), CACHE_DIR,
                      services=("loadtest.stack.transformers_server",)) as stack:
        yield stack


def test_greedy_tokens_are_transformers_own(floor, tokenizer, reference_model):
    prompt = tokenizer("The three primary colors are")["input_ids"]
    request = generation_pb2.GenerateRequest(prompt_token_ids=prompt, max_tokens=12, temperature=0, ignore_eos=True)
    chunks = list(floor.stub.Generate(request, timeout=120))
    ids = [t for c in chunks for t in c.token_ids]
    expected = reference_model.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12,
                                        do_sample=False)[0, len(prompt):].tolist()
    assert ids == expected
    assert len(chunks) == 12  # streamed token by token
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 12
    assert "".join(c.text for c in chunks) == tokenizer.decode(ids, skip_special_tokens=True)


def test_bad_input_is_refused_and_it_keeps_serving(floor):
    with pytest.raises(grpc.RpcError) as error:
        list(floor.stub.Generate(generation_pb2.GenerateRequest(prompt_token_ids=[1, 2], top_p=0), timeout=30))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    ok = list(floor.stub.Generate(generation_pb2.GenerateRequest(prompt="Hi", max_tokens=2, ignore_eos=True),
                                  timeout=60))
    assert sum(len(c.token_ids) for c in ok) == 2


def test_a_cancelled_call_frees_the_model_for_the_next(floor):
    call = floor.stub.Generate(generation_pb2.GenerateRequest(prompt="Once upon a time", max_tokens=200,
                                                              ignore_eos=True), timeout=120)
    next(call)
    call.cancel()
    ok = list(floor.stub.Generate(generation_pb2.GenerateRequest(prompt="Hi", max_tokens=2, ignore_eos=True),
                                  timeout=30))
    assert sum(len(c.token_ids) for c in ok) == 2
