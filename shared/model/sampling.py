"""Token sampling for a batch with per-request parameters, reproducible per seed.

Rows with temperature 0 (or below 1e-5) take the argmax. The others apply temperature, top-k and top-p, then
draw by the exponential race (argmax of p / E with E ~ Exp(1), equivalent to sampling from p).
E comes from a generator seeded by (request seed, output index), so a token depends only on
its request's seed and position: the same seed gives the same text whether the first token
was drawn by the prefill or the decode, alone or in any batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.control.messages import FinishReason, SamplingParams, StopParams

# Below this temperature the distribution is the argmax, and dividing by it would overflow.
GREEDY_BELOW_TEMPERATURE = 1e-5
_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads consecutive indices over the seed space
_UINT64 = (1 << 64) - 1


def _step_seed(seed: int, index: int) -> int:
    """splitmix64's finalizer of (seed, index): every bit of a request's uint64 seed reaches every
    bit of the result, the low 32 above all, which are all that torch's CPU generator (mt19937)
    takes of a seed."""
    z = (seed + (index + 1) * _MIX) & _UINT64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _UINT64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _UINT64
    return z ^ (z >> 31)


def sample(logits: torch.Tensor, params: list[SamplingParams], output_indices: list[int]) -> list[int]:
    """logits [B, V] float32; output_indices[i] is how many tokens request i has produced so far."""
    return sample_on_device(logits, params, output_indices).tolist()


def sample_on_device(logits: torch.Tensor, params: list[SamplingParams], output_indices: list[int]) -> torch.Tensor:
    """sample's tokens as an int64 [B] on logits' device, queued behind the step that made the logits
    without waiting for it: every host value goes over by a non-blocking copy."""
    greedy = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if p.temperature >= GREEDY_BELOW_TEMPERATURE]
    if not random_rows:
        return greedy
    rows = _to_device(random_rows, torch.int64, logits.device)
    probs = _filtered_probs(logits[rows], [params[i] for i in random_rows])
    noise = torch.empty_like(probs)
    for j, i in enumerate(random_rows):
        generator = torch.Generator(device=logits.device).manual_seed(_step_seed(params[i].seed, output_indices[i]))
        noise[j].exponential_(generator=generator)
    drawn = (probs / noise).argmax(dim=-1)
    out = greedy.clone()
    out[rows] = drawn
    return out


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on the device. To a GPU through pinned memory and a non-blocking copy: a
    blocking one would wait for the work already queued on the stream (the step in flight)."""
    pinned = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=pinned).to(device, non_blocking=pinned)


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    device = logits.device
    temperature = _to_device([p.temperature for p in params], torch.float32, device)
    top_k = _to_device([p.top_k for p in params], torch.int64, device)
    top_p = _to_device([p.top_p for p in params], torch.float32, device)
    logits = logits / temperature[:, None]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=device)[None, :]
    drop = (top_k[:, None] > 0) & (rank >= top_k[:, None])
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (always at least the first token).
    drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits).softmax(dim=-1)


@dataclass(frozen=True)
class FinishCheck:
    eos_token_ids: frozenset[int]
    max_context: int

    def __call__(self, token_id: int, num_generated: int, total_len: int, stop: StopParams) -> FinishReason | None:
        """num_generated includes token_id; total_len is prompt plus generated tokens."""
        if token_id in self.eos_token_ids and not stop.ignore_eos:
            return FinishReason.STOP
        if self.ends_by_length(num_generated, total_len, stop):
            return FinishReason.LENGTH
        return None

    def ends_by_length(self, num_generated: int, total_len: int, stop: StopParams) -> bool:
        """Whether the token that brings a request to these counts is its last, whichever it is."""
        return num_generated >= stop.max_tokens or total_len >= self.max_context
