"""A request from either front -> a validated job, or InvalidRequest with a message that says what is wrong.

Both fronts fill one GenerateInput (the gRPC front from its GenerateRequest, the OpenAI front from its
JSON body), so the same input is refused by the same check with the same message, whichever way it came.
Every number is bounded here, not only where it makes sense but where it must travel: a JSON integer
has no size, and one that msgpack cannot pack, the proto cannot carry or torch cannot hold would fail
inside the router or a worker instead of coming back as the client's mistake.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

from shared.config.schema import RouterConfig
from shared.control.messages import SamplingParams, StopParams
from shared.model.generation_config import SamplingDefaults

CHAT_ROLES = {"system", "user", "assistant", "tool"}
MAX_ECHOED_CHARS = 32  # of a client's bad value quoted back in an error, which must not echo megabytes
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_REQUEST_ID_CHARS = 256
MAX_SEED = (1 << 64) - 1  # GenerateRequest's seed is a uint64, and the sampler uses all of its bits
MAX_CACHE_SALT_CHARS = 256


class InvalidRequest(ValueError):
    pass


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class GenerateInput:
    """One request in the gRPC API's terms (proto/pdserve/v1/generation.proto, GenerateRequest, says
    what each field means and its default); None is a field left unset."""
    request_id: str = ""
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] = ()
    prompt_token_ids: tuple[int, ...] = ()
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    cache_salt: str | None = None
    # Not the client's: the salt of the bearer token the call came with (router.auth_token_file),
    # which the front fills in.
    token_salt: str = ""


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_context: int
    default_max_tokens: int
    max_prompt_bytes: int = RouterConfig.max_prompt_bytes  # router.max_prompt_bytes
    max_chat_messages: int = RouterConfig.max_chat_messages  # router.max_chat_messages
    sampling: SamplingDefaults = SamplingDefaults()  # the model's generation_config.json's, for unset fields


@dataclass(frozen=True)
class Job:
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stop: StopParams
    stop_strings: list[str]
    cache_salt: str = ""  # the prefix-cache keys' salt (shared/kv/page_keys.py); "": none


def quoted(value: object) -> str:
    """A client's value in an error message, cut to MAX_ECHOED_CHARS: an answer must not echo
    megabytes, and str() of an integer of thousands of digits raises instead of returning."""
    if isinstance(value, int) and abs(value) >= 10 ** MAX_ECHOED_CHARS:
        return f"an integer of {value.bit_length()} bits"
    shown = value if isinstance(value, str) else str(value)
    return shown if len(shown) <= MAX_ECHOED_CHARS else shown[:MAX_ECHOED_CHARS] + "…"


def _sampling(request: GenerateInput, limits: ModelLimits) -> SamplingParams:
    defaults = limits.sampling
    temperature = defaults.temperature if request.temperature is None else request.temperature
    top_p = defaults.top_p if request.top_p is None else request.top_p
    top_k = defaults.top_k if request.top_k is None else request.top_k
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidRequest(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if not (0 < top_p <= 1):  # also refuses NaN
        raise InvalidRequest(f"top_p must be in (0, 1], got {top_p}")
    if not 0 <= top_k <= limits.vocab_size:
        raise InvalidRequest(f"top_k must be in [0, {limits.vocab_size}] (0 is off, at most the vocabulary), "
                             f"got {quoted(top_k)}")
    if request.seed is not None and not 0 <= request.seed <= MAX_SEED:
        raise InvalidRequest(f"seed must be in [0, 2^64 - 1], got {quoted(request.seed)}")
    seed = secrets.randbits(64) if request.seed is None else request.seed
    return SamplingParams(float(temperature), float(top_p), top_k, seed)


def _stop_strings(request: GenerateInput) -> list[str]:
    stops = list(request.stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise InvalidRequest(f"stop strings must be non-empty and at most {MAX_STOP_CHARS} characters")
    return stops


def cache_salt(request: GenerateInput) -> str:
    """The salt of the job's prefix-cache keys: the token's and the request's own, the first
    length-prefixed so that no two pairs make one salt; "" when neither is set, so that unsalted
    prompts share their pages as before."""
    own = request.cache_salt or ""
    if len(own) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequest(f"cache_salt is longer than {MAX_CACHE_SALT_CHARS} characters")
    return f"{len(request.token_salt)}:{request.token_salt}{own}" if request.token_salt or own else ""


def _prompt_bytes(request: GenerateInput) -> int:
    """What the input weighs before tokenizing: its text's UTF-8 bytes (a message's role too), or
    4 per token id (an int32)."""
    if request.prompt is not None:
        return len(request.prompt.encode())
    if request.messages:
        return sum(len(m.role) + len(m.content.encode()) for m in request.messages)
    return 4 * len(request.prompt_token_ids)


def check_request_shape(request: GenerateInput, limits: ModelLimits) -> None:
    """The checks that need no tokenizer: run before tokenizing, so bad input costs nothing."""
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters")
    given = [name for name, present in (
        ("prompt", request.prompt is not None),
        ("messages", len(request.messages) > 0),
        ("prompt_token_ids", len(request.prompt_token_ids) > 0),
    ) if present]
    if not given:
        raise InvalidRequest("no input: set one of prompt, messages or prompt_token_ids")
    if len(given) > 1:
        raise InvalidRequest(f"give exactly one input, got {' and '.join(given)}")
    if len(request.messages) > limits.max_chat_messages:
        raise InvalidRequest(f"{len(request.messages)} chat messages, above router.max_chat_messages "
                             f"({limits.max_chat_messages})")
    size = _prompt_bytes(request)
    if size > limits.max_prompt_bytes:
        raise InvalidRequest(f"{given[0]}: {size} bytes, above router.max_prompt_bytes ({limits.max_prompt_bytes}); "
                             "text counts in UTF-8 bytes, a prompt token id as 4")
    if request.prompt == "":
        raise InvalidRequest("prompt is empty")
    for message in request.messages:
        if message.role not in CHAT_ROLES:
            raise InvalidRequest(f"unknown chat role {quoted(message.role)!r}; use one of {sorted(CHAT_ROLES)}")
    _check_max_tokens(request.max_tokens, limits)
    _sampling(request, limits)
    _stop_strings(request)
    cache_salt(request)


def _check_max_tokens(max_tokens: int | None, limits: ModelLimits) -> None:
    if max_tokens is not None and max_tokens < 1:
        raise InvalidRequest("max_tokens must be at least 1")
    if max_tokens is not None and max_tokens > limits.max_context:
        raise InvalidRequest(f"max_tokens {quoted(max_tokens)} exceeds the model's context of {limits.max_context}")


def build_job(request: GenerateInput, prompt_token_ids: list[int], limits: ModelLimits) -> Job:
    check_request_shape(request, limits)
    if not prompt_token_ids:
        raise InvalidRequest("the prompt tokenizes to no tokens")
    bad = next((t for t in prompt_token_ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"token id {quoted(bad)} is outside the vocabulary [0, {limits.vocab_size})")
    room = limits.max_context - len(prompt_token_ids)
    if room < 1:
        raise InvalidRequest(f"prompt has {len(prompt_token_ids)} tokens; the model's context is "
                             f"{limits.max_context}, leaving no room to generate")
    wanted = limits.default_max_tokens if request.max_tokens is None else request.max_tokens
    return Job(
        prompt_token_ids=prompt_token_ids,
        sampling=_sampling(request, limits),
        stop=StopParams(max_tokens=min(wanted, room), ignore_eos=request.ignore_eos),
        stop_strings=_stop_strings(request),
        cache_salt=cache_salt(request),
    )
