"""services/router/validation.py: every malformed GenerateRequest is an InvalidRequest, and the
defaults of the unset fields are applied."""

import dataclasses
import math

import pytest

from pdserve.v1 import generation_pb2 as pb
from services.router.api.generation import generate_input
from services.router.validation import (
    MAX_SEED,
    GenerateInput,
    InvalidRequest,
    ModelLimits,
    build_job,
    check_request_shape,
)
from shared.control import wire
from shared.control.messages import PrefillTask
from shared.config.schema import RouterConfig
from shared.model.generation_config import SamplingDefaults

LIMITS = ModelLimits(vocab_size=1000, max_context=64, default_max_tokens=256)
PROMPT_IDS = [5, 6, 7, 8]


def request(**fields) -> GenerateInput:
    """As the gRPC front fills it from a GenerateRequest."""
    messages = fields.pop("messages", [])
    return generate_input(pb.GenerateRequest(messages=[pb.ChatMessage(role=r, content=c) for r, c in messages],
                                             **fields))


def job(**fields):
    """A request given as token ids unless it says otherwise; the ids double as the tokenized prompt."""
    prompt_ids = fields.pop("tokens", PROMPT_IDS)
    if not {"prompt", "messages", "prompt_token_ids"} & set(fields):
        fields["prompt_token_ids"] = prompt_ids
    return build_job(request(**fields), prompt_ids, LIMITS)


SHAPE_ERRORS = {
    "no input": dict(),
    "prompt and token ids": dict(prompt="hi", prompt_token_ids=[1, 2]),
    "prompt and messages": dict(prompt="hi", messages=[("user", "hi")]),
    "messages and token ids": dict(messages=[("user", "hi")], prompt_token_ids=[1]),
    "empty prompt": dict(prompt=""),
    "max_tokens 0": dict(prompt="hi", max_tokens=0),
    "negative temperature": dict(prompt="hi", temperature=-0.5),
    "NaN temperature": dict(prompt="hi", temperature=math.nan),
    "infinite temperature": dict(prompt="hi", temperature=math.inf),
    "top_p 0": dict(prompt="hi", top_p=0.0),
    "top_p 1.5": dict(prompt="hi", top_p=1.5),
    "NaN top_p": dict(prompt="hi", top_p=math.nan),
    "negative top_k": dict(prompt="hi", top_k=-1),
    "unknown chat role": dict(messages=[("user", "hi"), ("robot", "beep")]),
    "empty stop string": dict(prompt="hi", stop=[""]),
    "too many stop strings": dict(prompt="hi", stop=[str(i) for i in range(17)]),
    "request id too long": dict(prompt="hi", request_id="r" * 257),
    "too many chat messages": dict(messages=[("user", "")] * (RouterConfig().max_chat_messages + 1)),
    "cache salt too long": dict(prompt="hi", cache_salt="s" * 257),
}


@pytest.mark.parametrize("fields", SHAPE_ERRORS.values(), ids=SHAPE_ERRORS.keys())
def test_shape_errors(fields):
    with pytest.raises(InvalidRequest):
        check_request_shape(request(**fields), LIMITS)
    with pytest.raises(InvalidRequest):  # build_job runs the same checks
        build_job(request(**fields), PROMPT_IDS, LIMITS)


@pytest.mark.parametrize("fields", [
    dict(prompt="hi"),
    dict(messages=[("system", "be brief"), ("user", "hi"), ("assistant", "hello"), ("tool", "{}")]),
    dict(prompt_token_ids=[1, 2]),
    dict(prompt="hi", temperature=0.0, top_p=1.0, top_k=0, max_tokens=1, stop=["x"] * 16),
])
def test_valid_shapes_pass(fields):
    check_request_shape(request(**fields), LIMITS)


@pytest.mark.parametrize(("fields", "words"), [
    (dict(), "no input"),
    (dict(prompt="hi", prompt_token_ids=[1]), "prompt and prompt_token_ids"),
    (dict(prompt="hi", top_p=1.5), "top_p"),
    (dict(messages=[("robot", "beep")]), "robot"),
])
def test_messages_say_what_is_wrong(fields, words):
    with pytest.raises(InvalidRequest, match=words):
        check_request_shape(request(**fields), LIMITS)


def test_max_tokens_above_the_context():
    with pytest.raises(InvalidRequest, match="max_tokens"):
        job(max_tokens=LIMITS.max_context + 1)


@pytest.mark.parametrize("length", [LIMITS.max_context, LIMITS.max_context + 10])
def test_prompt_that_leaves_no_room(length):
    with pytest.raises(InvalidRequest, match="context"):
        job(tokens=[1] * length)
    assert job(tokens=[1] * (LIMITS.max_context - 1)).stop.max_tokens == 1  # one token of room is enough


@pytest.mark.parametrize("bad", [LIMITS.vocab_size, LIMITS.vocab_size + 5, -1])
def test_token_ids_outside_the_vocabulary(bad):
    with pytest.raises(InvalidRequest, match="vocabulary"):
        job(tokens=[1, 2, bad, 3])


def test_prompt_that_tokenizes_to_nothing():
    with pytest.raises(InvalidRequest):
        build_job(request(prompt=" "), [], LIMITS)


def test_defaults():
    built = job()
    assert built.prompt_token_ids == PROMPT_IDS
    # The default of 256 is cut to what the context leaves after the prompt.
    assert built.stop.max_tokens == LIMITS.max_context - len(PROMPT_IDS)
    assert built.stop.ignore_eos is False
    assert (built.sampling.temperature, built.sampling.top_p, built.sampling.top_k) == (1.0, 1.0, 0)
    assert built.stop_strings == []


def test_default_max_tokens_when_it_fits():
    roomy = ModelLimits(vocab_size=1000, max_context=2048, default_max_tokens=256)
    built = build_job(request(prompt_token_ids=PROMPT_IDS), PROMPT_IDS, roomy)
    assert built.stop.max_tokens == 256


def test_the_models_sampling_defaults_fill_only_the_unset_fields():
    tuned = ModelLimits(vocab_size=1000, max_context=64, default_max_tokens=256,
                        sampling=SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20))
    unset = build_job(request(prompt_token_ids=PROMPT_IDS), PROMPT_IDS, tuned).sampling
    assert (unset.temperature, unset.top_p, unset.top_k) == (0.6, 0.9, 20)
    given = build_job(request(prompt_token_ids=PROMPT_IDS, temperature=0.0, top_k=0), PROMPT_IDS, tuned).sampling
    assert (given.temperature, given.top_p, given.top_k) == (0.0, 0.9, 0)


def test_explicit_values_are_kept():
    built = job(max_tokens=10, temperature=0.0, top_p=0.5, top_k=3, seed=77, stop=["\n\n"], ignore_eos=True)
    assert built.stop.max_tokens == 10 and built.stop.ignore_eos is True
    assert (built.sampling.temperature, built.sampling.top_p, built.sampling.top_k) == (0.0, 0.5, 3)
    assert built.sampling.seed == 77
    assert built.stop_strings == ["\n\n"]


def test_max_tokens_within_context_is_cut_to_the_room():
    assert job(max_tokens=LIMITS.max_context).stop.max_tokens == LIMITS.max_context - len(PROMPT_IDS)


def test_seed_is_drawn_when_unset():
    seeds = {job().sampling.seed for _ in range(20)}
    assert len(seeds) > 1
    assert all(0 <= s <= MAX_SEED for s in seeds)  # fits torch's generator seed


def test_seed_zero_is_kept():
    assert {job(seed=0).sampling.seed for _ in range(5)} == {0}


def test_chat_and_prompt_inputs_build_jobs():
    """The tokenized prompt comes from the caller; build_job validates it the same way."""
    assert build_job(request(prompt="hi"), [9, 10], LIMITS).prompt_token_ids == [9, 10]
    assert build_job(request(messages=[("user", "hi")]), [9], LIMITS).prompt_token_ids == [9]


@pytest.mark.parametrize(("fields", "size"), [
    (dict(prompt="é" * 6), 12),  # UTF-8 bytes, not characters
    (dict(messages=[("user", "abc"), ("assistant", "de")]), 4 + 3 + 9 + 2),  # roles and content
    (dict(prompt_token_ids=[1, 2, 3]), 12),  # 4 per id
])
def test_prompt_bytes_are_capped_before_tokenizing(fields, size):
    exact = ModelLimits(vocab_size=1000, max_context=64, default_max_tokens=256, max_prompt_bytes=size)
    check_request_shape(request(**fields), exact)  # at the cap: taken
    capped = ModelLimits(vocab_size=1000, max_context=64, default_max_tokens=256, max_prompt_bytes=size - 1)
    with pytest.raises(InvalidRequest, match=rf": {size} bytes, above router.max_prompt_bytes \({size - 1}\)"):
        check_request_shape(request(**fields), capped)
    with pytest.raises(InvalidRequest, match="router.max_prompt_bytes"):  # build_job runs the same check
        build_job(request(**fields), PROMPT_IDS, capped)


def test_prompt_bytes_default_to_the_configs():
    limit = RouterConfig().max_prompt_bytes
    check_request_shape(request(prompt="x" * limit), LIMITS)
    with pytest.raises(InvalidRequest, match=f"above router.max_prompt_bytes \\({limit}\\)"):
        check_request_shape(request(prompt="x" * (limit + 1)), LIMITS)
    assert LIMITS.max_prompt_bytes == limit


def test_a_negative_max_tokens_gets_the_message_of_zero():
    """The OpenAI front's JSON can carry what GenerateRequest's unsigned field cannot."""
    with pytest.raises(InvalidRequest, match="max_tokens must be at least 1"):
        check_request_shape(GenerateInput(prompt="hi", max_tokens=-5), LIMITS)


# What the OpenAI front's JSON can carry and GenerateRequest's fixed-size fields cannot: every
# integer must be refused here, by name, before msgpack, the proto or torch meet it.
HUGE = 10 ** 4000  # a JSON integer Python still parses
OUT_OF_RANGE = {
    "top_k above the vocabulary": (dict(top_k=LIMITS.vocab_size + 1), "top_k"),
    "top_k of 2^63": (dict(top_k=1 << 63), "top_k"),
    "top_k of 2^64": (dict(top_k=1 << 64), "top_k"),
    "huge top_k": (dict(top_k=HUGE), "top_k"),
    "negative seed": (dict(seed=-1), "seed"),
    "seed of 2^64": (dict(seed=1 << 64), "seed"),
    "huge seed": (dict(seed=-HUGE), "seed"),
    "max_tokens of 2^64": (dict(max_tokens=1 << 64), "max_tokens"),
    "huge max_tokens": (dict(max_tokens=HUGE), "max_tokens"),
}


@pytest.mark.parametrize("case", OUT_OF_RANGE, ids=OUT_OF_RANGE.keys())
def test_integers_beyond_what_the_wire_and_torch_take_are_refused_by_name(case):
    fields, name = OUT_OF_RANGE[case]
    with pytest.raises(InvalidRequest, match=f"^{name} ") as error:  # before tokenizing
        check_request_shape(GenerateInput(prompt="hi", **fields), LIMITS)
    assert len(str(error.value)) < 200, "the value is quoted back cut short"


def test_a_huge_token_id_is_refused_by_its_size():
    """str() of a 4,000-digit integer raises: the message gives its size instead."""
    with pytest.raises(InvalidRequest, match=r"^token id an integer of 13288 bits is outside the vocabulary"):
        build_job(GenerateInput(prompt_token_ids=(1, HUGE)), [1, HUGE], LIMITS)


def test_the_largest_values_taken_are_kept_whole_and_go_over_the_wire():
    """The bounds are the wire's and the sampler's own: at each of them the job still encodes, and the
    seed is the client's, not masked to 63 bits."""
    built = job(top_k=LIMITS.vocab_size, seed=MAX_SEED, max_tokens=LIMITS.max_context)
    assert (built.sampling.top_k, built.sampling.seed) == (LIMITS.vocab_size, MAX_SEED)
    task = PrefillTask("r", wire.pack_token_ids(built.prompt_token_ids), built.cache_salt, built.sampling, built.stop)
    assert wire.decode(wire.encode(task)) == task


def test_the_cache_salt_is_the_tokens_and_the_requests_own_told_apart():
    """Neither: no salt, so unsalted prompts share pages as ever. Both: the token's length-prefixed,
    so a client cannot make its own salt equal another token's ("ab" + "c" is not "a" + "bc")."""
    def salt(token_salt: str, **fields) -> str:
        given = dataclasses.replace(request(prompt_token_ids=PROMPT_IDS, **fields), token_salt=token_salt)
        return build_job(given, PROMPT_IDS, LIMITS).cache_salt

    assert salt("") == salt("", cache_salt="") == ""
    assert salt("", cache_salt="s" * 256) == "0:" + "s" * 256
    assert salt("team-a") == "6:team-a"
    assert len({salt("ab", cache_salt="c"), salt("a", cache_salt="bc"), salt("", cache_salt="abc"), salt("abc")}) == 4
