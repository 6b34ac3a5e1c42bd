"""The OpenAI API in-process: each body becomes the GenerateInput gRPC's request would (openai_protocol.py),
and each failure gets its HTTP status and OpenAI's error object (openai_errors.py)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from services.router.api import openai_errors
from services.router.api.openai_protocol import ChatCompletionRequest, CompletionRequest
from services.router.control.request import RequestError
from services.router.validation import ChatMessage, GenerateInput, InvalidRequest
from shared.control.messages import ErrorCode


def test_a_chat_body_becomes_grpcs_messages():
    body = ChatCompletionRequest(model="m", messages=[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": None}], max_tokens=5, max_completion_tokens=7, stop="\n", seed=-1,
        temperature=0.5, top_p=0.9, top_k=3, ignore_eos=True, unknown_field="ignored")
    assert body.to_input("label") == GenerateInput(
        request_id="label", messages=(ChatMessage("system", "be brief"), ChatMessage("user", "hi there"),
                                      ChatMessage("assistant", "")),
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=3, seed=-1, stop=("\n",), ignore_eos=True)


@pytest.mark.parametrize(("prompt", "given"), [
    ("text", {"prompt": "text"}), (["text"], {"prompt": "text"}),
    ([5, 6], {"prompt_token_ids": (5, 6)}), ([[5, 6]], {"prompt_token_ids": (5, 6)}),
])
def test_a_completion_prompt_is_text_or_token_ids(prompt, given):
    assert CompletionRequest(model="m", prompt=prompt).to_input("") == GenerateInput(**given)


@pytest.mark.parametrize(("body", "field"), [
    (dict(prompt=["a", "b"]), "prompt"), (dict(prompt="a", n=2), "n"), (dict(prompt="a", logprobs=0), "logprobs"),
])
def test_what_pdserve_cannot_honour_is_refused(body, field):
    with pytest.raises(ValidationError, match=f"{field}: "):
        CompletionRequest(model="m", **body)


@pytest.mark.parametrize(("error", "status", "kind", "code"), [
    (InvalidRequest("top_p must be in (0, 1], got 2.0"), 400, "invalid_request_error", "INVALID_ARGUMENT"),
    (RequestError(ErrorCode.RESOURCE_EXHAUSTED, "no room"), 429, "rate_limit_error", "RESOURCE_EXHAUSTED"),
    (RequestError(ErrorCode.UNAVAILABLE, "no decode worker"), 503, "service_unavailable", "UNAVAILABLE"),
    (RequestError(ErrorCode.INTERNAL, "a bug"), 500, "server_error", "INTERNAL"),
])
def test_each_failure_has_its_status_and_grpc_code(error, status, kind, code):
    response = openai_errors.response(error)
    assert response.status_code == status
    assert json.loads(response.body) == {"error": {"message": str(error), "type": kind, "param": None, "code": code}}


@pytest.mark.parametrize("fields", [{"stream": "yes"}, {"max_tokens": True}, {"max_tokens": "5"}, {"n": "1"},
                                    {"top_p": "0.5"}, {"ignore_eos": 1}])
def test_values_are_parsed_as_json_types_them_not_coerced(fields):
    with pytest.raises(ValidationError) as error:
        CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})
    assert error.value.errors()[0]["loc"][0] == next(iter(fields))


def test_an_integer_is_a_float_as_json_has_one_number_type():
    assert CompletionRequest.model_validate({"model": "m", "prompt": "hi", "temperature": 1}).temperature == 1.0


def test_the_developer_role_becomes_system():
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "developer", "content": "x"}]})
    assert body.to_input("").messages == (ChatMessage("system", "x"),)
