"""What one client can take of the router, capped, on the real processes: generation requests in
flight (router.max_concurrent_rpcs, both fronts together, health checks never), HTTP connections
(router.http_max_connections, router.connection_idle_timeout_s), streams of clients that stopped
reading (router.stall_timeout_s), and the work before tokenizing (router.max_prompt_bytes,
router.max_chat_messages). In-process: tests/test_http_connections.py, tests/test_prompt_tokenizer.py."""

from __future__ import annotations

import http.client
import json
import socket
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pdserve.v1 import generation_pb2, generation_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from shared.config.schema import RouterConfig
from tests.conftest import CACHE_DIR
from tests.connections import closed_by_peer
from tests.stack import ServiceStack

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# An HTTP request gives its slot back just after its last byte, a moment after its client may have it.
SLOT_FREED_S = 2.0
HTTP_MAX_CONNECTIONS = 32
IDLE_TIMEOUT_S = 3.0
STALL_TIMEOUT_S = 2.0
WAIT_S = 120.0  # for what the router does within its configured timeouts, on a loaded machine


@pytest.fixture(scope="module")
def one_call_stack(tmp_path_factory, checkpoint):
    """One generation request at a time; max_prompt_bytes and max_chat_messages stay at their defaults."""
    with ServiceStack(tmp_path_factory.mktemp("caps"), CACHE_DIR, PDSERVE_ROUTER_MAX_CONCURRENT_RPCS="1",
                      PDSERVE_ROUTER_HTTP_MAX_CONNECTIONS=str(HTTP_MAX_CONNECTIONS),
                      PDSERVE_ROUTER_CONNECTION_IDLE_TIMEOUT_S=str(IDLE_TIMEOUT_S),
                      PDSERVE_ROUTER_STALL_TIMEOUT_S=str(STALL_TIMEOUT_S)) as stack:
        yield stack
        stack.stop_drained()


def _generate(stub, max_tokens: int = 2) -> int:
    request = generation_pb2.GenerateRequest(prompt="Hello", max_tokens=max_tokens, ignore_eos=True, temperature=0)
    return sum(len(chunk.token_ids) for chunk in stub.Generate(request, timeout=120))


def _when_slot_is_free(call):
    """call() again while it is refused for want of a slot (gRPC RESOURCE_EXHAUSTED, HTTP 429), for SLOT_FREED_S."""
    deadline = time.monotonic() + SLOT_FREED_S
    while True:
        try:
            result = call()
            if not (isinstance(result, tuple) and result[0] == 429) or time.monotonic() > deadline:
                return result
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                raise
        time.sleep(0.05)


def _http(stack, method: str, path: str, body: dict | None = None) -> tuple[int, dict | None]:
    connection = http.client.HTTPConnection(stack.env["PDSERVE_ROUTER_HTTP_ADDRESS"], timeout=WAIT_S)
    try:
        connection.request(method, path, body=None if body is None else json.dumps(body),
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        data = response.read()
        return response.status, json.loads(data) if data else None
    finally:
        connection.close()


def _health(stack) -> int:
    return health_pb2_grpc.HealthStub(stack.channel).Check(health_pb2.HealthCheckRequest(), timeout=30).status


def _tokenized_tokens(stack) -> float:
    text = http.client.HTTPConnection(stack.env["PDSERVE_ROUTER_METRICS_ADDRESS"], timeout=30)
    text.request("GET", "/metrics")
    families = text_string_to_metric_families(text.getresponse().read().decode())
    return next(f for f in families if f.name == "pdserve:router_tokenized_tokens").samples[0].value


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


def test_idle_connections_stop_neither_health_nor_a_request_and_are_closed(one_call_stack):
    """Many more idle connections than router.http_max_connections, on both ports: uvicorn alone
    answered every request, /health included, with plain-text 503 once they reached its limit."""
    stack = one_call_stack
    addresses = [stack.env["PDSERVE_ROUTER_HTTP_ADDRESS"]] * 200 + [stack.address] * 50
    idle = [socket.create_connection((a.rpartition(":")[0], int(a.rpartition(":")[2]))) for a in addresses]
    try:
        assert _http(stack, "GET", "/health")[0] == 200
        status, answer = _when_slot_is_free(lambda: _http(stack, "POST", "/v1/completions", {
            "model": "embedded", "prompt": "Hello", "max_tokens": 2, "ignore_eos": True}))
        assert status == 200 and answer["usage"]["completion_tokens"] == 2, answer
        assert _health(stack) == health_pb2.HealthCheckResponse.SERVING
        assert [closed_by_peer(sock, WAIT_S) for sock in idle] == [True] * len(idle)
    finally:
        for sock in idle:
            sock.close()


def test_with_every_slot_taken_http_gets_429_as_an_openai_error_and_health_still_answers(one_call_stack):
    stack, stub = one_call_stack, one_call_stack.stub
    stream = stub.Generate(generation_pb2.GenerateRequest(prompt="Count to one thousand:", max_tokens=64,
                                                          ignore_eos=True, temperature=0), timeout=120)
    received = len(next(stream).token_ids)  # in flight: it holds the one slot
    status, answer = _http(stack, "POST", "/v1/completions", {"model": "embedded", "prompt": "Hi", "max_tokens": 2})
    assert status == 429, answer
    assert (answer["error"]["type"], answer["error"]["code"]) == ("rate_limit_error", "RESOURCE_EXHAUSTED")
    assert "router.max_concurrent_rpcs" in answer["error"]["message"]
    assert _http(stack, "GET", "/health")[0] == 200  # health checks never take a slot, over either front
    assert _health(stack) == health_pb2.HealthCheckResponse.SERVING
    received += sum(len(chunk.token_ids) for chunk in stream)
    assert received == 64
    assert _generate(stub) == 2  # the stream gave its slot back before its status went out


def _unread_call(stack, label: str):
    """A call whose client reads nothing: a window of 1 KiB, never grown, fills within a few chunks."""
    channel = grpc.insecure_channel(stack.address, options=[("grpc.http2.bdp_probe", 0),
                                                             ("grpc.http2.lookahead_bytes", 1024)])
    request = generation_pb2.GenerateRequest(prompt="Tell me a long story.", max_tokens=1000, ignore_eos=True,
                                             temperature=0, request_id=label)
    return channel, generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=600)


def _finished_labels(stack) -> set[str]:
    return {line.get("label") for line in stack.logged("router", "request finished")}


def test_streams_cancelled_for_not_reading_give_their_slots_back(one_call_stack):
    """More stalled readers, one after another, than router.max_concurrent_rpcs: each is cancelled
    and its slot taken by the next, though gRPC still keeps its status behind the unread chunks;
    then a health check and a Generate are served while all of them are still connected."""
    stack, stalled = one_call_stack, []
    try:
        for index in range(3):
            label = f"stalled-{index}-" + "x" * 200  # in every chunk: the window fills sooner
            stalled.append(_unread_call(stack, label))
            deadline = time.monotonic() + WAIT_S
            while label not in _finished_labels(stack):  # the router cancelled it and let go of it
                assert time.monotonic() < deadline, f"stalled reader {index} was never cancelled: {stack.tail('router')}"
                time.sleep(0.2)
        assert _health(stack) == health_pb2.HealthCheckResponse.SERVING
        assert _when_slot_is_free(lambda: _generate(stack.stub)) == 2
        stack.assert_pools_drained()
    finally:
        for channel, _ in stalled:
            channel.close()


def test_a_chat_of_many_empty_messages_is_refused_before_its_template_runs(one_call_stack):
    """120,000 empty messages fit in a 4 MiB body and under max_prompt_bytes; templated and tokenized,
    they were 600K tokens of router CPU before the context check refused them."""
    stack, tokenized = one_call_stack, _tokenized_tokens(one_call_stack)
    messages = [{"role": "user", "content": ""}] * 120_000
    status, answer = _when_slot_is_free(lambda: _http(stack, "POST", "/v1/chat/completions",
                                                      {"model": "embedded", "messages": messages}))
    assert status == 400, answer
    limit = RouterConfig().max_chat_messages
    assert answer["error"]["message"] == f"120000 chat messages, above router.max_chat_messages ({limit})"
    with pytest.raises(grpc.RpcError) as error:
        _when_slot_is_free(lambda: list(stack.stub.Generate(generation_pb2.GenerateRequest(
            messages=[generation_pb2.ChatMessage(role="user", content="")] * 120_000), timeout=60)))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details() == answer["error"]["message"]
    assert _tokenized_tokens(stack) == tokenized, "the refused chats were tokenized"


def test_a_chat_whose_rendering_is_above_max_prompt_bytes_is_refused_before_tokenizing(one_call_stack):
    """Its contents fit under router.max_prompt_bytes; the template's framing of 2,000 messages does not."""
    stack, tokenized = one_call_stack, _tokenized_tokens(one_call_stack)
    limit = RouterConfig().max_prompt_bytes
    content = "x" * (limit // 2000 - 8)
    messages = [{"role": role, "content": content} for _ in range(1000) for role in ("user", "assistant")]
    status, answer = _when_slot_is_free(lambda: _http(stack, "POST", "/v1/chat/completions",
                                                      {"model": "embedded", "messages": messages}))
    assert status == 400, answer
    assert f"above router.max_prompt_bytes ({limit})" in answer["error"]["message"]
    assert "chat template renders them" in answer["error"]["message"]
    assert _tokenized_tokens(stack) == tokenized, "the refused chat was tokenized"
    assert _when_slot_is_free(lambda: _generate(stack.stub)) == 2
    assert _tokenized_tokens(stack) > tokenized  # the counter counts what is tokenized
