"""The OpenAI API's request bodies as pydantic models: what each turns into (a GenerateInput, the
gRPC API's terms) and what its answers look like.

Fields other servers or newer API versions add are ignored, as OpenAI's own API ignores them. What
pdserve cannot honour is refused with the field named, rather than answered with less than was
asked: more than one choice (`n`), log probabilities, a batch of prompts, content other than text.
`top_k`, `ignore_eos` and `cache_salt` are not OpenAI's but vLLM's (and SGLang's), which benchmark
tools send.
Values are parsed strictly, as JSON types them: `"stream": "yes"`, `"max_tokens": true` or `"n": "1"`
are refused, not coerced. The `developer` role, which current OpenAI clients send for instructions,
is the chat template's `system`.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, field_validator
from pydantic_core import PydanticCustomError

from services.router.frontend import Chunk, Usage
from services.router.validation import ChatMessage, GenerateInput, quoted


def _refused(field: str, why: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported", f"{field}: {why}")


STRICT = ConfigDict(extra="ignore", strict=True)
ROLE_ALIASES = {"developer": "system"}


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False  # one more chunk at the end, with the usage and no choices


class _GenerateBody(BaseModel):
    """What both endpoints take. None: unset, pdserve's default applies (README.md, The API)."""
    model_config = STRICT

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    cache_salt: str | None = None  # vLLM's: prompts share prefix-cache pages only within one salt

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise _refused("n", f"pdserve generates one choice per request, not {quoted(n)}")
        return n

    def _input(self, label: str, max_tokens: int | None, **given) -> GenerateInput:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return GenerateInput(request_id=label, max_tokens=max_tokens, temperature=self.temperature,
                             top_p=self.top_p, top_k=self.top_k, seed=self.seed, stop=stop,
                             ignore_eos=self.ignore_eos, cache_salt=self.cache_salt, **given)

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_GenerateBody):
    """POST /v1/completions: text in, text out, no chat template."""
    ID_PREFIX: ClassVar[str] = "cmpl-"

    prompt: str | list[int] | list[str] | list[list[int]]  # text, or token ids; a list of one is one prompt
    logprobs: int | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) > 1:
                raise _refused("prompt", f"one prompt per request, not a batch of {len(prompt)}")
            return prompt[0]
        return prompt

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, logprobs: int | None) -> None:
        if logprobs is not None:
            raise _refused("logprobs", "pdserve does not return log probabilities")

    def to_input(self, label: str) -> GenerateInput:
        if isinstance(self.prompt, str):
            return self._input(label, self.max_tokens, prompt=self.prompt)
        return self._input(label, self.max_tokens, prompt_token_ids=tuple(self.prompt))

    def object_name(self, stream: bool) -> str:
        return "text_completion"  # the whole answer and each streamed chunk alike

    def choice(self, chunk_text: str, finish_reason: str | None, stream: bool, first: bool) -> dict:
        return {"index": 0, "text": chunk_text, "logprobs": None, "finish_reason": finish_reason}


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class ChatMessageBody(BaseModel):
    model_config = STRICT

    role: str
    content: str | list[TextPart] | None = None  # None: an assistant turn of tool calls only

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_GenerateBody):
    """POST /v1/chat/completions: messages rendered with the model's chat template, as gRPC's `messages`."""
    ID_PREFIX: ClassVar[str] = "chatcmpl-"

    messages: list[ChatMessageBody]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; it wins when both are set
    logprobs: bool | None = None
    top_logprobs: int | None = None

    @field_validator("logprobs", "top_logprobs")
    @classmethod
    def _no_logprobs(cls, value, info) -> None:
        if value:
            raise _refused(info.field_name, "pdserve does not return log probabilities")

    def to_input(self, label: str) -> GenerateInput:
        max_tokens = self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens
        return self._input(label, max_tokens, messages=tuple(ChatMessage(ROLE_ALIASES.get(m.role, m.role), m.text())
                                                             for m in self.messages))

    def object_name(self, stream: bool) -> str:
        return "chat.completion.chunk" if stream else "chat.completion"

    def choice(self, chunk_text: str, finish_reason: str | None, stream: bool, first: bool) -> dict:
        if not stream:
            return {"index": 0, "message": {"role": "assistant", "content": chunk_text}, "logprobs": None,
                    "finish_reason": finish_reason}
        delta = {"role": "assistant", "content": chunk_text} if first else {"content": chunk_text}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


GenerateBody = CompletionRequest | ChatCompletionRequest


def usage(numbers: Usage) -> dict:
    return {"prompt_tokens": numbers.prompt_tokens, "completion_tokens": numbers.completion_tokens,
            "total_tokens": numbers.prompt_tokens + numbers.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": numbers.cached_prompt_tokens},
            "migrations": numbers.migrations}  # pdserve's own: moves to another decode (gRPC's Usage.migrations)


class Answer:
    """The JSON bodies of one request's answer: whole, or as the chunks of its event stream."""

    def __init__(self, body: GenerateBody, label: str, created: int):
        self.body = body
        self.head = {"id": f"{body.ID_PREFIX}{label}", "created": created, "model": body.model}
        self.first = True

    def whole(self, chunks: list[Chunk]) -> dict:
        last = chunks[-1]
        text = "".join(chunk.text for chunk in chunks)
        return {**self.head, "object": self.body.object_name(stream=False), "system_fingerprint": None,
                "choices": [self.body.choice(text, last.finish_reason, stream=False, first=True)],
                "usage": usage(last.usage)}

    def events(self, chunk: Chunk) -> list[dict]:
        """The chunk's event, and after the last one the usage's when the client asked for it."""
        choice = self.body.choice(chunk.text, chunk.finish_reason, stream=True, first=self.first)
        self.first = False
        events = [{**self.head, "object": self.body.object_name(stream=True), "choices": [choice]}]
        if chunk.usage is not None and self.body.include_usage():
            events.append({**self.head, "object": self.body.object_name(stream=True), "choices": [],
                           "usage": usage(chunk.usage)})
        return events
