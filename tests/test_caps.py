"""What one client can take of the router, capped: gRPC calls at once (router.max_concurrent_rpcs)
and a prompt's bytes before it is tokenized (router.max_prompt_bytes), on the real processes."""

from __future__ import annotations

import time

import grpc
import pytest
from pdserve.v1 import generation_pb2

from shared.config import RouterConfig
from tests.conftest import CACHE_DIR
from tests.stack import ServiceStack

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SLOT_FREED_S = 2.0  # gRPC frees a call's slot once its handler task is done, a moment after the client sees the end


@pytest.fixture(scope="module")
def one_call_stack(tmp_path_factory, checkpoint):
    """max_prompt_bytes stays at its default."""
    with ServiceStack(tmp_path_factory.mktemp("caps"), CACHE_DIR, PDSERVE_ROUTER_MAX_CONCURRENT_RPCS="1") as stack:
        yield stack
        stack.stop_drained()


def _generate(stub, max_tokens: int = 2) -> int:
    request = generation_pb2.GenerateRequest(prompt="Hello", max_tokens=max_tokens, ignore_eos=True, temperature=0)
    return sum(len(chunk.token_ids) for chunk in stub.Generate(request, timeout=120))


def _when_slot_is_free(call):
    deadline = time.monotonic() + SLOT_FREED_S
    while True:
        try:
            return call()
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_a_call_beyond_max_concurrent_rpcs_is_resource_exhausted(one_call_stack):
    stub = one_call_stack.stub
    long = generation_pb2.GenerateRequest(prompt="Count to one thousand:", max_tokens=64, ignore_eos=True,
                                          temperature=0)
    stream = stub.Generate(long, timeout=120)
    received = len(next(stream).token_ids)  # in flight: it holds the one slot
    with pytest.raises(grpc.RpcError) as error:
        _generate(stub)
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.value.details()
    received += sum(len(chunk.token_ids) for chunk in stream)
    assert received == 64  # the refused call took nothing from the one in flight
    assert _when_slot_is_free(lambda: _generate(stub)) == 2


def test_a_prompt_above_max_prompt_bytes_is_invalid_argument(one_call_stack):
    stub, limit = one_call_stack.stub, RouterConfig().max_prompt_bytes
    heavy = [
        generation_pb2.GenerateRequest(prompt="x" * (limit + 1)),
        generation_pb2.GenerateRequest(messages=[generation_pb2.ChatMessage(role="user", content="x" * limit)]),
        generation_pb2.GenerateRequest(prompt_token_ids=[1] * (limit // 4 + 1)),
    ]
    for request in heavy:
        with pytest.raises(grpc.RpcError) as error:
            _when_slot_is_free(lambda: list(stub.Generate(request, timeout=30)))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"above router.max_prompt_bytes ({limit})" in error.value.details()
    assert _when_slot_is_free(lambda: _generate(stub)) == 2
