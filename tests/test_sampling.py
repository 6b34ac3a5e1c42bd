"""shared/model/sampling.py: greedy and seeded sampling, top-k/top-p, the distribution, and FinishCheck."""

import pytest
import torch

from shared.control.messages import FinishReason, SamplingParams, StopParams
from shared.model.sampling import FinishCheck, sample

VOCAB = 50


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=0)


def seeded(seed: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)


def random_logits(rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_rows_take_the_argmax():
    logits = random_logits(6)
    assert sample(logits, [greedy()] * 6, [0] * 6) == logits.argmax(dim=-1).tolist()


def test_batch_mixing_greedy_and_sampled_rows():
    logits = random_logits(6, seed=1)
    params = [greedy(), seeded(11), greedy(), seeded(12, 0.8, 0.9, 10), seeded(13, 1.5), greedy()]
    indices = [0, 3, 1, 0, 7, 2]
    out = sample(logits, params, indices)
    argmax = logits.argmax(dim=-1).tolist()
    assert [out[i] for i in (0, 2, 5)] == [argmax[i] for i in (0, 2, 5)]
    for i in (1, 3, 4):  # each sampled row draws what it draws alone
        assert out[i] == sample(logits[i:i + 1], [params[i]], [indices[i]])[0]


def test_same_seed_and_index_give_the_same_token_in_any_batch():
    row = random_logits(1, seed=2)
    params = seeded(1234, temperature=1.3)
    alone = sample(row, [params], [5])[0]
    assert sample(row, [params], [5])[0] == alone

    others = random_logits(7, seed=3)
    other_params = [seeded(s) if s % 2 else greedy() for s in range(7)]
    for position in (0, 3, 7):
        batch = torch.cat([others[:position], row, others[position:]])
        params_in_batch = other_params[:position] + [params] + other_params[position:]
        indices = list(range(position)) + [5] + list(range(position, 7))
        assert sample(batch, params_in_batch, indices)[position] == alone
    reversed_batch = torch.cat([row, others]).flip(0)
    assert sample(reversed_batch, list(reversed([params] + other_params)), [0] * 7 + [5])[-1] == alone


def test_different_seeds_give_different_draws():
    row = torch.zeros(1, VOCAB)  # uniform: any fixed draw across seeds would stand out
    draws = [sample(row, [seeded(s)], [0])[0] for s in range(200)]
    assert len(set(draws)) > VOCAB // 2
    assert max(draws.count(t) for t in set(draws)) < 20


@pytest.mark.parametrize("bit", [32, 47, 63])
def test_every_bit_of_a_seed_counts(bit):
    """Seeds are uint64s, and torch's CPU generator takes 32 bits of its own seed: two request seeds
    that differ only in a high bit still draw apart, as any two others do."""
    row = torch.zeros(1, VOCAB)
    draws = [sample(row, [seeded(s)], [i])[0] for s in range(20) for i in range(5)]
    flipped = [sample(row, [seeded(s | 1 << bit)], [i])[0] for s in range(20) for i in range(5)]
    assert sum(a != b for a, b in zip(draws, flipped)) > len(draws) // 2


def test_output_index_changes_the_draw():
    row = torch.zeros(1, VOCAB)
    draws = [sample(row, [seeded(99)], [i])[0] for i in range(200)]
    assert len(set(draws)) > VOCAB // 2


def test_top_k_1_is_the_argmax():
    logits = random_logits(4, seed=4)
    argmax = logits.argmax(dim=-1).tolist()
    for seed in range(100):
        params = [seeded(seed * 4 + r, temperature=2.0, top_k=1) for r in range(4)]
        assert sample(logits, params, [seed] * 4) == argmax


def test_tiny_top_p_is_the_argmax():
    logits = random_logits(4, seed=5)
    argmax = logits.argmax(dim=-1).tolist()
    for seed in range(100):
        params = [seeded(seed * 4 + r, temperature=2.0, top_p=1e-6) for r in range(4)]
        assert sample(logits, params, [0] * 4) == argmax


def test_top_k_stays_in_the_k_most_likely():
    logits = random_logits(1, seed=6)
    allowed = set(logits[0].topk(5).indices.tolist())
    draws = {sample(logits, [seeded(s, temperature=3.0, top_k=5)], [0])[0] for s in range(500)}
    assert draws <= allowed
    assert len(draws) == 5  # at a high temperature each of the five shows up


def test_top_p_stays_in_the_nucleus():
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    logits = probs.log()[None, :]
    # Mass before each token: 0, .4, .7, .85, .95; top_p=0.75 keeps tokens 0, 1, 2.
    draws = {sample(logits, [seeded(s, top_p=0.75)], [0])[0] for s in range(500)}
    assert draws == {0, 1, 2}


def test_top_k_and_top_p_together():
    probs = torch.tensor([0.05, 0.4, 0.3, 0.15, 0.1])
    logits = probs.log()[None, :]
    draws = {sample(logits, [seeded(s, top_p=0.95, top_k=2)], [0])[0] for s in range(500)}
    assert draws == {1, 2}


def test_frequencies_match_the_softmax():
    target = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = (target.log() + 5.0)[None, :].repeat(4000, 1)  # a shift changes nothing after softmax
    out = sample(logits, [seeded(s) for s in range(4000)], [0] * 4000)
    freq = torch.bincount(torch.tensor(out), minlength=4).float() / 4000
    assert torch.allclose(freq, target, atol=0.025), freq


def test_temperature_sharpens_the_distribution():
    target = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = target.log()[None, :].repeat(2000, 1)
    cold = sample(logits, [seeded(s, temperature=0.25) for s in range(2000)], [0] * 2000)
    # At T=0.25 the probabilities go as p**4: 256 / (1 + 16 + 81 + 256) = 0.72 for the last token.
    assert abs(cold.count(3) / 2000 - 256 / 354) < 0.03


def test_tiny_positive_temperature_is_the_argmax():
    logits = torch.tensor([[10.0, 30.0, 20.0, 5.0]])
    assert sample(logits, [seeded(1, temperature=1e-38)], [0]) == [1]


EOS = 2
CHECK = FinishCheck(eos_token_ids=frozenset({EOS, 7}), max_context=100)


def test_eos_stops_unless_ignored():
    assert CHECK(EOS, 1, 11, StopParams(max_tokens=50, ignore_eos=False)) is FinishReason.STOP
    assert CHECK(7, 3, 13, StopParams(max_tokens=50, ignore_eos=False)) is FinishReason.STOP
    assert CHECK(EOS, 1, 11, StopParams(max_tokens=50, ignore_eos=True)) is None
    assert CHECK(5, 1, 11, StopParams(max_tokens=50, ignore_eos=False)) is None


def test_max_tokens_and_context_give_length():
    stop = StopParams(max_tokens=5, ignore_eos=False)
    assert CHECK(5, 4, 14, stop) is None
    assert CHECK(5, 5, 15, stop) is FinishReason.LENGTH
    long = StopParams(max_tokens=500, ignore_eos=True)
    assert CHECK(5, 40, 99, long) is None
    assert CHECK(5, 41, 100, long) is FinishReason.LENGTH
    assert CHECK(EOS, 41, 100, long) is FinishReason.LENGTH  # EOS ignored, context still ends it
    assert CHECK(EOS, 5, 15, stop) is FinishReason.STOP  # EOS on the last allowed token is a stop
