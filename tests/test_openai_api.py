"""The OpenAI-compatible HTTP API, driven by the official `openai` package against the real stack,
checked against what gRPC returns for the same input."""

from __future__ import annotations

import http.client
import json
import time
import urllib.request

import grpc
import openai
import psutil
import pytest
from pdserve.v1 import generation_pb2
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import CACHE_DIR
from tests.stack import ServiceStack
from tests.test_e2e_generation import CHATS, MAX_TOKENS, PROMPTS

pytestmark = pytest.mark.e2e

TOKEN = "openai-test-token"
SALTED_TOKEN = "openai-test-token-of-team-b"
MODEL = "embedded"  # model.path, as router.served_model_name is unset


PREFILL_PAGES = 16  # 256 tokens: room for every prompt here but the one that must not fit


@pytest.fixture(scope="module")
def token_stack(checkpoint, tmp_path_factory):
    """A stack whose every call, gRPC and HTTP, must carry a bearer token: TOKEN, or SALTED_TOKEN,
    whose calls' prefix-cache keys carry a salt of its own."""
    workdir = tmp_path_factory.mktemp("openai")
    (workdir / "tokens").write_text(f"# token [cache salt]\n{TOKEN}\n{SALTED_TOKEN} team-b\n")
    with ServiceStack(workdir, CACHE_DIR, PDSERVE_ROUTER_AUTH_TOKEN_FILE=str(workdir / "tokens"),
                      PDSERVE_KV_PREFILL_PAGES=str(PREFILL_PAGES)) as stack:
        yield stack
        stack.stop_drained()


@pytest.fixture(scope="module")
def client(token_stack) -> openai.OpenAI:
    # No retries: a refusal must show as it is, not be tried again.
    return openai.OpenAI(base_url=token_stack.http_url, api_key=TOKEN, max_retries=0, timeout=120)


def _grpc(stack, **fields) -> generation_pb2.GenerateResponse:
    """gRPC's whole answer as one response: all the text, the last chunk's finish reason and usage."""
    messages = [generation_pb2.ChatMessage(**m) for m in fields.pop("messages", [])]
    request = generation_pb2.GenerateRequest(messages=messages, **fields)
    chunks = list(stack.stub.Generate(request, timeout=120, metadata=stack.bearer))
    return generation_pb2.GenerateResponse(text="".join(c.text for c in chunks), finish_reason=chunks[-1].finish_reason,
                                           usage=chunks[-1].usage)


def _grpc_error(stack, **fields) -> str:
    with pytest.raises(grpc.RpcError) as error:
        _grpc(stack, **fields)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return error.value.details()


def _chat(client, stream: bool, **fields) -> tuple[str, str, object]:
    """(text, finish reason, usage) of a chat completion, streamed with include_usage or not."""
    fields = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, **fields}
    if not stream:
        answer = client.chat.completions.create(**fields)
        return answer.choices[0].message.content, answer.choices[0].finish_reason, answer.usage
    chunks = list(client.chat.completions.create(**fields, stream=True, stream_options={"include_usage": True}))
    *choices, last = chunks
    assert last.choices == [] and all(c.usage is None for c in choices), "the usage comes alone, last"
    assert choices[0].choices[0].delta.role == "assistant"
    return ("".join(c.choices[0].delta.content for c in choices), choices[-1].choices[0].finish_reason, last.usage)


def _completion(client, stream: bool, **fields) -> tuple[str, str, object]:
    fields = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, **fields}
    if not stream:
        answer = client.completions.create(**fields)
        return answer.choices[0].text, answer.choices[0].finish_reason, answer.usage
    *choices, last = list(client.completions.create(**fields, stream=True, stream_options={"include_usage": True}))
    return "".join(c.choices[0].text for c in choices), choices[-1].choices[0].finish_reason, last.usage


def _assert_same(http: tuple[str, str, object], expected: generation_pb2.GenerateResponse) -> None:
    text, finish, usage = http
    assert (text, finish) == (expected.text, expected.finish_reason)
    assert (usage.prompt_tokens, usage.completion_tokens) == (expected.usage.prompt_tokens,
                                                              expected.usage.completion_tokens)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # The prefix cache may hold any part of a prompt sent before (the same one went over the other front).
    assert 0 <= usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens


def test_models_lists_the_served_model(client):
    assert [model.id for model in client.models.list()] == [MODEL]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_greedy_text_equals_grpc(token_stack, client, stream):
    for chat in CHATS:
        _assert_same(_chat(client, stream, messages=chat), _grpc(token_stack, messages=chat, max_tokens=MAX_TOKENS,
                                                                 temperature=0))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_greedy_text_equals_grpc(token_stack, client, stream):
    for prompt in PROMPTS:
        _assert_same(_completion(client, stream, prompt=prompt),
                     _grpc(token_stack, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0))
    ids = [504, 3458, 260, 253, 1345, 30]  # a prompt as token ids
    _assert_same(_completion(client, stream, prompt=ids),
                 _grpc(token_stack, prompt_token_ids=ids, max_tokens=MAX_TOKENS, temperature=0))


def test_sampling_fields_mean_what_they_mean_over_grpc(token_stack, client):
    """seed, top_p, top_k, stop, ignore_eos and max_completion_tokens reach the same sampler."""
    chat = CHATS[1]
    http = _chat(client, stream=True, messages=chat, temperature=0.9, top_p=0.95, seed=1234, stop=["\n", "sky"],
                 max_completion_tokens=16, extra_body={"top_k": 50, "ignore_eos": True})
    _assert_same(http, _grpc(token_stack, messages=chat, temperature=0.9, top_p=0.95, seed=1234, stop=["\n", "sky"],
                             max_tokens=16, top_k=50, ignore_eos=True))
    plain_stop = _completion(client, stream=False, prompt=PROMPTS[0], stop=" and")
    _assert_same(plain_stop, _grpc(token_stack, prompt=PROMPTS[0], stop=[" and"], max_tokens=MAX_TOKENS,
                                   temperature=0))


# The same bad input over both fronts: (OpenAI chat fields, gRPC fields); the message must match.
CHAT = [{"role": "user", "content": "hi"}]
BAD_INPUT = {
    "max_tokens 0": ({"max_tokens": 0}, {"max_tokens": 0}),
    "max_tokens above context": ({"max_tokens": 10**6}, {"max_tokens": 10**6}),
    "negative temperature": ({"temperature": -0.5}, {"temperature": -0.5}),
    "top_p 0": ({"top_p": 0.0}, {"top_p": 0.0}),
    "top_p above 1": ({"top_p": 1.5}, {"top_p": 1.5}),
    "negative top_k": ({"extra_body": {"top_k": -1}}, {"top_k": -1}),
    "top_k above the vocabulary": ({"extra_body": {"top_k": 49153}}, {"top_k": 49153}),
    "too many stop strings": ({"stop": [str(i) for i in range(17)]}, {"stop": [str(i) for i in range(17)]}),
    "unknown chat role": ({"messages": [{"role": "robot", "content": "x"}]},
                          {"messages": [{"role": "robot", "content": "x"}]}),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_chat_input_is_400_with_grpcs_message(token_stack, client, case):
    http_fields, grpc_fields = BAD_INPUT[case]
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(**{"model": MODEL, "messages": CHAT, **http_fields})
    expected = _grpc_error(token_stack, **{"messages": CHAT, **grpc_fields})
    assert error.value.body == {"message": expected, "type": "invalid_request_error", "param": None,
                                "code": "INVALID_ARGUMENT"}


@pytest.mark.parametrize(("prompt", "grpc_fields"), [
    ("", {"prompt": ""}), ([1, 49152], {"prompt_token_ids": [1, 49152]}),
    ([42] * 9000, {"prompt_token_ids": [42] * 9000}),
], ids=["empty prompt", "token id outside vocabulary", "prompt longer than context"])
def test_bad_completion_input_is_400_with_grpcs_message(token_stack, client, prompt, grpc_fields):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt=prompt)
    assert error.value.body["message"] == _grpc_error(token_stack, **grpc_fields)


# JSON integers beyond what GenerateRequest's fields can carry, and beyond what msgpack packs (2^64)
# or torch holds (2^63): each refused by name, before it reaches the wire or a worker.
HOSTILE_INTEGERS = {
    "top_k of 2^63": ({"extra_body": {"top_k": 2**63}}, "top_k"),
    "top_k of 2^64": ({"extra_body": {"top_k": 2**64}}, "top_k"),
    "a 400-digit top_k": ({"extra_body": {"top_k": 10**400}}, "top_k"),
    "seed of 2^64": ({"seed": 2**64}, "seed"),
    "negative seed": ({"seed": -1}, "seed"),
    "max_tokens of 2^64": ({"max_tokens": 2**64}, "max_tokens"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_INTEGERS))
def test_integers_beyond_the_wire_are_400_by_name_and_the_next_request_is_served(client, case):
    fields, name = HOSTILE_INTEGERS[case]
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(**{"model": MODEL, "messages": CHAT, **fields})
    assert error.value.body["code"] == "INVALID_ARGUMENT" and error.value.body["message"].startswith(f"{name} ")
    assert len(error.value.body["message"]) < 200, "the value is quoted back cut short"
    text, finish, _ = _chat(client, stream=False, messages=CHAT, max_tokens=2, extra_body={"ignore_eos": True})
    assert finish == "length" and text


@pytest.mark.parametrize(("create", "fields", "param"), [
    ("chat", {"n": 2}, "n"), ("chat", {"logprobs": True}, "logprobs"),
    ("chat", {"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ("completions", {"logprobs": 1}, "logprobs"), ("completions", {"n": 2}, "n"),
])
def test_what_pdserve_cannot_honour_is_refused_by_name(client, create, fields, param):
    with pytest.raises(openai.BadRequestError) as error:
        if create == "chat":
            client.chat.completions.create(model=MODEL, messages=CHAT, **fields)
        else:
            client.completions.create(model=MODEL, prompt="hi", **fields)
    assert error.value.body["param"] == param and error.value.body["message"].startswith(f"{param}: ")


def test_a_model_not_served_is_404(client):
    with pytest.raises(openai.NotFoundError) as error:
        client.chat.completions.create(model="gpt-4o", messages=CHAT)
    assert "'embedded'" in error.value.body["message"] and error.value.body["code"] == "NOT_FOUND"


def _raw(stack, method: str, path: str, body: bytes = b"{}", **headers: str) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of a request no client library shapes."""
    url = stack.http_url.removesuffix("/v1") + path
    request = urllib.request.Request(url, method=method, data=body if method == "POST" else None,
                                     headers={"content-type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read() or b"null"), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), dict(error.headers)


def test_a_body_that_is_not_json_is_400(token_stack):
    status, body, _ = _raw(token_stack, "POST", "/v1/chat/completions", b"{not json",
                           authorization=f"Bearer {TOKEN}")
    assert status == 400 and body["error"]["code"] == "INVALID_ARGUMENT", body
    assert body["error"]["message"].startswith("the body is not JSON"), body


def test_a_body_above_max_request_bytes_is_413(token_stack):
    """Refused by its Content-Length before a byte of it is read; a client still sending it would see
    the connection close under it instead, so this one sends the headers alone."""
    connection = http.client.HTTPConnection(token_stack.env["PDSERVE_ROUTER_HTTP_ADDRESS"], timeout=30)
    connection.putrequest("POST", "/v1/completions")
    for name, value in (("Content-Type", "application/json"), ("Authorization", f"Bearer {TOKEN}"),
                        ("Content-Length", str(5 * 1024 * 1024))):  # router.max_request_bytes: 4 MiB
        connection.putheader(name, value)
    connection.endheaders()
    response = connection.getresponse()
    body = response.read()
    connection.close()
    assert response.status == 413, body  # Starlette's own answer, in plain text


def test_a_prompt_no_pool_can_hold_is_429_as_grpc_is_resource_exhausted(token_stack, client):
    ids = [1000 + i for i in range(PREFILL_PAGES * 16 + 1)]
    with pytest.raises(openai.RateLimitError) as error:
        client.completions.create(model=MODEL, prompt=ids, max_tokens=1)
    with pytest.raises(grpc.RpcError) as grpc_error:
        _grpc(token_stack, prompt_token_ids=ids, max_tokens=1)
    assert grpc_error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.value.body == {"message": grpc_error.value.details(), "type": "rate_limit_error", "param": None,
                                "code": "RESOURCE_EXHAUSTED"}


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong-token"}, {"authorization": TOKEN}],
                         ids=["missing", "wrong", "not a bearer"])
def test_calls_without_the_right_token_are_401(token_stack, headers):
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions")):
        status, body, response_headers = _raw(token_stack, method, path, **headers)
        assert status == 401 and body["error"]["code"] == "UNAUTHENTICATED", (path, body)
        assert response_headers["www-authenticate"] == "Bearer"
    assert _raw(token_stack, "GET", "/health")[0] == 200  # open to probes, as gRPC's health service


def test_a_call_without_the_token_is_401_before_its_body_is_read(token_stack):
    """FastAPI reads and parses a body before a route's dependencies run: a broken body without the
    token was a 400, and a body announced but not sent kept the answer waiting for it."""
    status, body, _ = _raw(token_stack, "POST", "/v1/chat/completions", b"{not json")
    assert status == 401 and body["error"]["code"] == "UNAUTHENTICATED", body
    connection = http.client.HTTPConnection(token_stack.env["PDSERVE_ROUTER_HTTP_ADDRESS"], timeout=30)
    connection.putrequest("POST", "/v1/completions")
    for name, value in (("Content-Type", "application/json"), ("Content-Length", "1000")):
        connection.putheader(name, value)
    connection.endheaders()
    response = connection.getresponse()
    answer = json.loads(response.read())
    connection.close()
    assert response.status == 401 and answer["error"]["code"] == "UNAUTHENTICATED", answer


def _failures(stack, code: str) -> float:
    text = urllib.request.urlopen(stack.metrics_url("router"), timeout=5).read().decode()
    family = next(f for f in text_string_to_metric_families(text) if f.name == "pdserve:request_failure")
    return next(s.value for s in family.samples if s.name.endswith("_total") and s.labels["code"] == code)


def test_a_client_that_disconnects_mid_stream_frees_its_pages(token_stack, client):
    cancelled = _failures(token_stack, "CANCELLED")
    stream = client.completions.create(model=MODEL, prompt="Count to one thousand:", max_tokens=400, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    next(iter(stream))
    stream.close()
    token_stack.assert_pools_drained()
    deadline = time.monotonic() + 5
    while _failures(token_stack, "CANCELLED") != cancelled + 1:  # counted as gRPC counts a cancel
        assert time.monotonic() < deadline, "the disconnect was not counted as CANCELLED"
        time.sleep(0.1)


def test_a_client_that_gives_up_on_a_whole_answer_frees_its_pages(token_stack):
    impatient = openai.OpenAI(base_url=token_stack.http_url, api_key=TOKEN, max_retries=0, timeout=1.5)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(model=MODEL, prompt="Count to one thousand:", max_tokens=400,
                                     extra_body={"ignore_eos": True})
    token_stack.assert_pools_drained()


def _listening_ports(stack) -> set[int]:
    router = psutil.Process(stack.processes["router"].pid)
    return {c.laddr.port for c in router.net_connections("tcp") if c.status == psutil.CONN_LISTEN}


def test_an_empty_http_address_serves_no_http(checkpoint, tmp_path):
    with ServiceStack(tmp_path, CACHE_DIR, PDSERVE_ROUTER_HTTP_ADDRESS="") as stack:
        ports = {int(stack.env[f"PDSERVE_ROUTER_{name}_ADDRESS"].rpartition(":")[2]) for name in ("GRPC", "METRICS")}
        assert _listening_ports(stack) == ports
        request = generation_pb2.GenerateRequest(prompt="Hi", max_tokens=2, ignore_eos=True)
        assert sum(len(c.token_ids) for c in stack.stub.Generate(request, timeout=60)) == 2


def test_each_stack_serves_http_on_a_port_of_its_own(token_stack):
    http_port = int(token_stack.env["PDSERVE_ROUTER_HTTP_ADDRESS"].rpartition(":")[2])
    assert http_port != 8000 and http_port in _listening_ports(token_stack)


@pytest.mark.parametrize("fields", [{"stream": "yes"}, {"max_tokens": True}, {"max_tokens": "5"}, {"n": "1"},
                                    {"temperature": "0"}])
def test_a_field_of_the_wrong_json_type_is_400_not_coerced(token_stack, fields):
    body = {"model": MODEL, "prompt": "Hello", **fields}
    status, answer, _ = _raw(token_stack, "POST", "/v1/completions", json.dumps(body).encode(),
                             authorization=f"Bearer {TOKEN}")
    assert status == 400 and answer["error"]["param"] == next(iter(fields)), answer


def test_the_developer_role_is_the_system_prompt(token_stack, client):
    """Current OpenAI clients send instructions as `developer`: the same tokens as `system`."""
    asked = [{"role": "user", "content": "What is the capital of France?"}]
    answers = [client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=[
        {"role": role, "content": "Answer in one word."}, *asked]) for role in ("developer", "system")]
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    assert answers[0].usage.prompt_tokens == answers[1].usage.prompt_tokens


def test_an_unknown_role_is_quoted_back_cut_short(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, max_tokens=1, messages=[{"role": "x" * 100_000, "content": "hi"}])
    message = error.value.body["message"]
    assert "unknown chat role" in message and len(message) < 200, message[:300]


def _cached_tokens(stack, front: str, prompt: list[int], token: str = TOKEN, salt: str | None = None) -> int:
    """The prompt tokens the prefill took from its cache for one request over gRPC or HTTP."""
    if front == "grpc":
        request = generation_pb2.GenerateRequest(prompt_token_ids=prompt, max_tokens=1, cache_salt=salt)
        chunks = list(stack.stub.Generate(request, timeout=120, metadata=[("authorization", f"Bearer {token}")]))
        return chunks[-1].usage.cached_prompt_tokens
    client = openai.OpenAI(base_url=stack.http_url, api_key=token, max_retries=0, timeout=120)
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                       extra_body={} if salt is None else {"cache_salt": salt})
    return answer.usage.prompt_tokens_details.cached_tokens


def test_a_cache_salt_shares_cached_pages_only_within_that_salt_over_both_fronts(token_stack):
    """vLLM's cache_salt: another salt (or none) computes the whole prompt, so cached_tokens tells a
    client nothing of what others sent; the same salt hits, whichever front sent it."""
    prompt = [2000 + i for i in range(3 * 16)]  # three pages; a hit reuses two (the last is computed)
    assert _cached_tokens(token_stack, "grpc", prompt, salt="tenant-a") == 0
    assert _cached_tokens(token_stack, "grpc", prompt, salt="tenant-a") == 32
    assert _cached_tokens(token_stack, "grpc", prompt, salt="tenant-b") == 0
    assert _cached_tokens(token_stack, "http", prompt, salt="tenant-a") == 32
    assert _cached_tokens(token_stack, "http", prompt, salt="tenant-c") == 0
    assert _cached_tokens(token_stack, "http", prompt, salt="tenant-c") == 32
    assert _cached_tokens(token_stack, "http", prompt) == 0
    assert _cached_tokens(token_stack, "grpc", prompt) == 32
    token_stack.assert_pools_drained()


def test_a_tokens_cache_salt_keeps_its_calls_apart(token_stack):
    """router.auth_token_file's `TOKEN SALT`: that token's calls share pages only among themselves,
    and a salt of the request's own adds to its token's."""
    prompt = [3000 + i for i in range(3 * 16)]
    assert _cached_tokens(token_stack, "grpc", prompt) == 0
    assert _cached_tokens(token_stack, "http", prompt, SALTED_TOKEN) == 0
    assert _cached_tokens(token_stack, "grpc", prompt, SALTED_TOKEN) == 32
    assert _cached_tokens(token_stack, "grpc", prompt, SALTED_TOKEN, salt="x") == 0
    assert _cached_tokens(token_stack, "http", prompt) == 32
    token_stack.assert_pools_drained()


def test_a_cache_salt_too_long_is_400_as_grpc_is_invalid_argument(token_stack, client):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, extra_body={"cache_salt": "s" * 257})
    assert error.value.body["message"] == _grpc_error(token_stack, prompt="Hi", max_tokens=1, cache_salt="s" * 257)
