"""A request's prompt into token ids, off the event loop and a bounded number at once.

A chat is rendered by the model's template first: jinja2, pure Python, whose cost the checks before
bound (router.max_chat_messages and router.max_prompt_bytes, validation.py); the rendered text is
checked against router.max_prompt_bytes again before a token of it is made. `tokenizers` encodes
with the GIL let go (shared/model/tokenizer.py), so the event loop serves meanwhile. At most
router.max_concurrent_tokenizations prompts are in threads at once, a turn held until its thread
ends even if its client left: a burst of huge prompts cannot take every core from the requests
being served. A request beyond waits its turn up to router.admission_timeout_s, then gets
RESOURCE_EXHAUSTED. Every token made is counted (pdserve:router_tokenized_tokens_total), refused
prompts too: the work clients had the router do.
"""

from __future__ import annotations

import asyncio

from services.router.control.request import RequestError
from services.router.validation import GenerateInput, InvalidRequest, ModelLimits
from shared.control.messages import ErrorCode
from shared.model.tokenizer import ServingTokenizer
from shared.runtime import metrics


class PromptTokenizer:
    def __init__(self, tokenizer: ServingTokenizer, limits: ModelLimits, at_once: int, wait_s: float):
        self.tokenizer = tokenizer
        self.limits = limits
        self.at_once = at_once
        self.wait_s = wait_s
        self._turns = asyncio.Semaphore(at_once)

    async def token_ids(self, request: GenerateInput) -> list[int]:
        """InvalidRequest for a rendered chat above the bound, RequestError when no turn came in time."""
        if request.prompt is None and not request.messages:
            return list(request.prompt_token_ids)
        await self._wait_turn()
        work = asyncio.get_running_loop().run_in_executor(None, self.encode, request)
        work.add_done_callback(self._turn_done)
        return await asyncio.shield(work)  # a client that leaves ends its wait, not the thread's work

    def _turn_done(self, work: asyncio.Future) -> None:
        self._turns.release()
        if not work.cancelled():
            work.exception()  # retrieved: when its client has left, asyncio would log it as never retrieved

    async def _wait_turn(self) -> None:
        try:
            async with asyncio.timeout(self.wait_s):
                await self._turns.acquire()
        except TimeoutError:
            raise RequestError(ErrorCode.RESOURCE_EXHAUSTED, (
                f"no turn to tokenize within {self.wait_s} s (router.admission_timeout_s): {self.at_once} "
                "prompts are tokenized at once (router.max_concurrent_tokenizations)")) from None

    def encode(self, request: GenerateInput) -> list[int]:
        """The same work in the caller's thread, without a turn."""
        if request.prompt is None and not request.messages:
            return list(request.prompt_token_ids)
        if request.prompt is not None:
            ids = self.tokenizer.encode(request.prompt)
        else:
            text = self.tokenizer.render_chat([{"role": m.role, "content": m.content} for m in request.messages])
            self._check_rendered(len(text.encode()))
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        metrics.count_tokenized(len(ids))
        return ids

    def _check_rendered(self, size: int) -> None:
        if size > self.limits.max_prompt_bytes:
            raise InvalidRequest(f"messages: the chat template renders them to {size} bytes, above "
                                 f"router.max_prompt_bytes ({self.limits.max_prompt_bytes})")
