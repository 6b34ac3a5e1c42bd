"""The prefill's prefix cache through the real stack: greedy tokens with the cache equal those
without it and transformers', for every way prompts share pages; the cached prompt tokens each
request reports; the prefill's counters. The cache on its own: test_prefix_cache.py."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from pdserve.v1 import generation_pb2

from tests.conftest import CACHE_DIR
from tests.reference import assert_matches_reference, reference_greedy
from tests.stack import ServiceStack
from tests.test_metrics import scrape, value

pytestmark = pytest.mark.e2e

PAGE = 16  # kv.page_size's default
PREFILL_PAGES = 30  # small, so that a few prompts fill the pool and evict each other's pages
MAX_TOKENS = 12


def _stack(tmp_path_factory, name: str, **settings: str):
    with ServiceStack(tmp_path_factory.mktemp(name), CACHE_DIR, PDSERVE_KV_PREFILL_PAGES=str(PREFILL_PAGES),
                      **settings) as stack:
        yield stack
        stack.stop_drained()


@pytest.fixture(scope="module")
def cached(checkpoint, tmp_path_factory):
    yield from _stack(tmp_path_factory, "cached")


@pytest.fixture(scope="module")
def uncached(checkpoint, tmp_path_factory):
    yield from _stack(tmp_path_factory, "uncached", PDSERVE_PREFILL_PREFIX_CACHE="false")


def _chat(tokenizer, system: str, question: str) -> list[int]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])


def _text(tokenizer, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]


def _generate(stack, prompt: list[int]) -> tuple[list[int], int]:
    """Greedy tokens and the prompt tokens the prefill took from its cache, as the usage and the
    timings of the last chunk both say."""
    request = generation_pb2.GenerateRequest(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0)
    chunks = list(stack.stub.Generate(request, timeout=120))
    last = chunks[-1]
    assert last.usage.cached_prompt_tokens == last.timings.cached_prompt_tokens
    return [t for chunk in chunks for t in chunk.token_ids], last.usage.cached_prompt_tokens


def _reusable(prompt: list[int], earlier: list[list[int]]) -> int:
    """The cached tokens a prompt gets after `earlier` ran (all still cached): its longest common
    prefix with one of them, in full pages, short of the page of its last token."""
    def common(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    shared = max((common(prompt, e) for e in earlier), default=0)
    return min(shared // PAGE * PAGE, (len(prompt) - 1) // PAGE * PAGE)


def _check_in_turn(cached, uncached, reference_model, prompts: list[list[int]]) -> list[int]:
    """Each prompt in turn on both stacks: the same tokens as each other and as transformers, and
    as many cached tokens as the prompts before it can give. Returns those counts."""
    counts = []
    for i, prompt in enumerate(prompts):
        expected, logits = reference_greedy(reference_model, prompt, MAX_TOKENS)
        ids, from_cache = _generate(cached, prompt)
        plain, none = _generate(uncached, prompt)
        assert_matches_reference(ids, expected, logits, f"prompt #{i} with the cache")
        assert_matches_reference(plain, expected, logits, f"prompt #{i} without the cache")
        assert ids == plain, f"prompt #{i}: the cache changed the tokens"
        assert (from_cache, none) == (_reusable(prompt, prompts[:i]), 0), f"prompt #{i}"
        counts.append(from_cache)
    return counts


def test_a_shared_system_prompt_with_different_questions(cached, uncached, tokenizer, reference_model):
    system = ("Lighthouse keepers log the weather at dawn and at dusk, trim the wicks, polish the lens, wind "
              "the clockwork that turns it and write to the harbour master once a week. Reply as an old "
              "lighthouse keeper would, in one short sentence.")
    prompts = [_chat(tokenizer, system, q) for q in
               ("Is a storm coming tonight?", "What do you eat for breakfast?", "Why is the light red?")]
    counts = _check_in_turn(cached, uncached, reference_model, prompts)
    assert counts[0] == 0 and min(counts[1:]) >= 3 * PAGE


def test_the_same_prompt_twice(cached, uncached, tokenizer, reference_model):
    prompt = _text(tokenizer, "Beekeeping notes: the queen was seen on frame four, the brood pattern is tight, "
                              "and the colony has drawn out two new frames of comb since the last inspection. Next,")
    assert _check_in_turn(cached, uncached, reference_model, [prompt, prompt])[1] == (len(prompt) - 1) // PAGE * PAGE
    client = openai.OpenAI(base_url=cached.http_url, api_key="unused", max_retries=0, timeout=120)
    usage = client.completions.create(model="embedded", prompt=prompt, max_tokens=2, temperature=0).usage
    assert usage.prompt_tokens_details.cached_tokens == (len(prompt) - 1) // PAGE * PAGE  # the HTTP API says it too


def test_a_prompt_that_is_a_prefix_of_another(cached, uncached, tokenizer, reference_model):
    long = _text(tokenizer, "The tram network of the old city runs eleven lines through the valley, from the "
                            "harbour to the university hill, and the night service runs on lines two and seven "
                            "only, every twenty minutes until the morning. The busiest stop is")
    short, longer = long[:3 * PAGE], long + _text(tokenizer, " the market square, where")
    counts = _check_in_turn(cached, uncached, reference_model, [long, short, longer])
    assert counts == [0, 2 * PAGE, len(long) // PAGE * PAGE]  # short: its last page is computed


def test_a_prompt_that_diverges_inside_a_page(cached, uncached, tokenizer, reference_model):
    prompt = _text(tokenizer, "A recipe for rye bread: mix the starter with warm water and dark rye flour, leave "
                              "it overnight, then add salt, caraway and more flour, knead briefly and bake it in a "
                              "hot oven for an hour. The crust should be")
    other = list(prompt)
    other[2 * PAGE + 5] = _text(tokenizer, " barley")[0]  # inside the third page
    assert _check_in_turn(cached, uncached, reference_model, [prompt, other])[1] == 2 * PAGE


def _concurrently(stack, prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda prompt: _generate(stack, prompt), prompts))


def test_concurrent_requests_that_share_a_prefix(cached, uncached, tokenizer, reference_model):
    """The prefill runs them one after another: the first computes the system prompt, the others
    hold its pages at once, and the decode pulls them while they are shared."""
    system = ("You are the timetable office of a small ferry company that sails between four islands in "
              "summer and two in winter, weather permitting, with one boat for cars and one for people on "
              "foot. Answer the traveller's question in one sentence.")
    prompts = [_chat(tokenizer, system, q) for q in ("When is the first ferry?", "Can I bring a bicycle?",
                                                     "Is there a winter timetable?", "Where do I buy tickets?")]
    shared = _reusable(prompts[0], prompts[1:2])
    with_cache, without = _concurrently(cached, prompts), _concurrently(uncached, prompts)
    for i, (prompt, (ids, _), (plain, _)) in enumerate(zip(prompts, with_cache, without)):
        expected, logits = reference_greedy(reference_model, prompt, MAX_TOKENS)
        assert_matches_reference(ids, expected, logits, f"concurrent #{i} with the cache")
        assert ids == plain, f"concurrent #{i}: the cache changed the tokens"
    assert sorted(count for _, count in with_cache) == [0] + [shared] * 3 and shared >= 3 * PAGE


def test_eviction_under_memory_pressure_while_requests_run(cached, uncached, tokenizer, reference_model):
    """More prompts than the pool holds: the least recently used pages go, the prompt that owned
    them computes them again, and prompts that run together while pages are evicted under them get
    the same tokens as without the cache."""
    topics = ["glaciers", "violins", "tides", "compilers", "orchards", "comets", "bridges", "sourdough"]
    prompts = [_text(tokenizer, f"Field notes on {topic}, entry {n}: today we measured, sketched and wrote down "
                                f"everything we could about {topic}, then compared it with the old records of "
                                f"{topic} kept in the archive since the founding of the station. The weather "
                                "was mild, the instruments behaved, and the two of us who stayed behind cleaned "
                                "the equipment, labelled every sample and copied the measurements into the big "
                                "ledger by lamplight before supper. In short,")
               for n, topic in enumerate(topics)]
    assert sum(len(p) // PAGE for p in prompts[1:]) > PREFILL_PAGES  # the rest alone overflow the pool
    first, _ = _generate(cached, prompts[0])
    for prompt in prompts[1:]:
        _generate(cached, prompt)
    again, from_cache = _generate(cached, prompts[0])
    assert (again, from_cache) == (first, 0), "the first prompt's pages were the least recently used"
    # Pairs that share a page-aligned prefix, all at once: evictions go on while pages are held.
    mixed = [prompts[i // 2][:2 * PAGE + 3 * (i % 2)] + prompts[(i + 3) % 8][:60] for i in range(8)]
    for i, (prompt, (ids, _)) in enumerate(zip(mixed, _concurrently(cached, mixed))):
        expected, logits = reference_greedy(reference_model, prompt, MAX_TOKENS)
        assert_matches_reference(ids, expected, logits, f"under pressure #{i}")
    assert value(scrape(cached.metrics_url("prefill")), "prefix_cache_pages") <= PREFILL_PAGES


def test_the_prefill_counts_queries_and_hits_in_tokens(cached, uncached, tokenizer):
    prompt = _text(tokenizer, "Counting sheep at night: one jumps the fence, then another, then a third one "
                              "that stops to look at the moon before it jumps, and then")
    counters = ("prefix_cache_queries_total", "prefix_cache_hits_total")
    before = [value(scrape(cached.metrics_url("prefill")), name) for name in counters]
    _generate(cached, prompt)
    _, from_cache = _generate(cached, prompt)
    after = scrape(cached.metrics_url("prefill"))
    assert [value(after, name) - b for name, b in zip(counters, before)] == [2 * len(prompt), from_cache]
    assert from_cache == (len(prompt) - 1) // PAGE * PAGE and value(after, "prefix_cache_pages") >= len(prompt) // PAGE
    _generate(uncached, prompt)
    off = scrape(uncached.metrics_url("prefill"))
    assert [value(off, name) for name in (*counters, "prefix_cache_pages")] == [0, 0, 0]
