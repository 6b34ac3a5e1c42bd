"""services/router/prompt_tokenizer.py in-process, with the embedded model's own tokenizer: a bounded
number of prompts tokenized at once, a turn held until its thread ends, and a chat refused by its
rendered size before a token of it is made. On the real stack: tests/test_caps.py."""

from __future__ import annotations

import asyncio

import pytest

from services.router.control.request import RequestError
from services.router.prompt_tokenizer import PromptTokenizer
from services.router.validation import ChatMessage, GenerateInput, InvalidRequest, ModelLimits
from shared.control.messages import ErrorCode
from shared.model.tokenizer import load_tokenizer
from shared.runtime import metrics

LIMITS = ModelLimits(vocab_size=49152, max_context=8192, default_max_tokens=16, max_prompt_bytes=2 * 1024 * 1024)
HUGE = GenerateInput(prompt="All work and no play makes Jack a dull boy. " * 40_000)  # seconds of tokenizing, not µs
SMALL = GenerateInput(prompt="Hello")


@pytest.fixture(scope="module")
def serving(checkpoint):
    return load_tokenizer(checkpoint)


def _tokenized() -> float:
    return next(s.value for s in metrics.ROUTER_TOKENIZED_TOKENS.collect()[0].samples if s.name.endswith("_total"))


def test_a_prompt_beyond_the_turns_is_refused_and_a_turn_outlives_its_clients_cancel(serving):
    async def run() -> None:
        prompts = PromptTokenizer(serving, LIMITS, at_once=1, wait_s=0)
        first = asyncio.create_task(prompts.token_ids(HUGE))
        await asyncio.sleep(0)  # it takes the one turn; its thread tokenizes
        with pytest.raises(RequestError) as refused:
            await prompts.token_ids(SMALL)
        assert refused.value.code == ErrorCode.RESOURCE_EXHAUSTED
        assert "router.max_concurrent_tokenizations" in str(refused.value)
        first.cancel()  # its client left; its thread still works, and keeps the turn until it ends
        with pytest.raises(RequestError):
            await prompts.token_ids(SMALL)
        prompts.wait_s = 120.0
        assert await prompts.token_ids(SMALL) == serving.encode("Hello")
        assert first.cancelled()

    asyncio.run(run())


def test_token_ids_pass_through_without_a_turn(serving):
    async def run() -> list[int]:
        prompts = PromptTokenizer(serving, LIMITS, at_once=1, wait_s=0)
        first = asyncio.create_task(prompts.token_ids(HUGE))
        await asyncio.sleep(0)
        ids = await prompts.token_ids(GenerateInput(prompt_token_ids=(1, 2, 3)))
        await first
        return ids

    assert asyncio.run(run()) == [1, 2, 3]


def test_a_chat_that_renders_above_max_prompt_bytes_is_refused_before_tokenizing(serving):
    messages = tuple(ChatMessage("user", "x" * 100) for _ in range(3))  # 312 bytes of contents and roles
    chat = GenerateInput(messages=messages)
    rendered = len(serving.render_chat([{"role": m.role, "content": m.content} for m in messages]).encode())
    prompts = PromptTokenizer(serving, ModelLimits(49152, 8192, 16, max_prompt_bytes=rendered - 1), 1, 1.0)
    tokenized = _tokenized()
    with pytest.raises(InvalidRequest, match=rf"renders them to {rendered} bytes, above router.max_prompt_bytes"):
        prompts.encode(chat)
    assert _tokenized() == tokenized
    fits = PromptTokenizer(serving, ModelLimits(49152, 8192, 16, max_prompt_bytes=rendered), 1, 1.0)
    assert fits.encode(chat) == serving.encode_chat([{"role": m.role, "content": m.content} for m in messages])
    assert _tokenized() > tokenized
