"""What a load test sends and when: prompts, the Mooncake trace, rate curves, Poisson arrivals, bursts.

Pure functions with no gevent or locust import (importing locust monkey-patches the whole process,
and the GPU image has neither), shared by the locust load test and the serving benchmark. Every
schedule is computed up front from its input alone: an arrival time never depends on how fast the
server answered earlier requests (open loop).
"""

from __future__ import annotations

import csv
import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "conversation_trace.jsonl"
# Token ids from the middle of the embedded SmolLM2's 49,152-token vocabulary: ordinary
# word pieces, clear of the special and byte tokens at the low end.
TOKEN_ID_LOW, TOKEN_ID_HIGH = 1000, 40000
TRACE_BLOCK_TOKENS = 512  # one Mooncake hash id stands for this many prompt tokens
MODEL_CONTEXT = 8192  # the embedded SmolLM2-135M's context


@dataclass(frozen=True)
class RequestSpec:
    """One Generate call: `name` is the workload class, the row of locust's stats table."""

    name: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    seed: int


@dataclass(frozen=True)
class Arrival:
    at_s: float  # seconds after the replay starts
    spec: RequestSpec


def random_tokens(seed: int | str, length: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(TOKEN_ID_LOW, TOKEN_ID_HIGH) for _ in range(length))


@dataclass(frozen=True)
class Mix:
    """The synthetic long/short workload of the closed loop, the curve and the Poisson rates."""

    long_fraction: float = 0.7
    long_tokens: int = 1024
    short_tokens: int = 64
    max_tokens: int = 128
    seed: int = 0

    def request(self, index: int, salt: str = "") -> RequestSpec:
        """The index-th request: its class depends only on (seed, index), its tokens also on salt, so
        that two workloads of the same mix (two rates) send equal lengths but share no prefix."""
        key = f"{self.seed}/{index}"
        is_long = random.Random(key).random() < self.long_fraction
        length = self.long_tokens if is_long else self.short_tokens
        return RequestSpec("long" if is_long else "short", random_tokens(f"{salt}/{key}", length), self.max_tokens,
                           seed=self.seed * 1_000_003 + index)


# ---- the Mooncake trace -------------------------------------------------------------------------

@dataclass(frozen=True)
class TraceRecord:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class TraceScaling:
    """How a production trace is shrunk to fit a small model on a CPU.

    time_scale multiplies arrival times (0.1 replays 10x faster); rate_scale keeps every k-th
    request below 1 (0.25: every 4th) and repeats each request above 1 (2: twice); length_scale
    multiplies input and output lengths and the 512-token block; the max_* bounds and the model's
    context then clamp them. Only arrivals before replay_seconds (scaled time) are kept.

    whole_conversations: below 1, rate_scale keeps that share of the conversations, each with all
    its requests, instead of every k-th request. A later turn repeats the blocks of the turns before
    it, so thinning by request drops the turn whose prefix the next one would find cached
    (docs/BENCHMARKS.md, the prefix cache on the production trace, says how many blocks each keeps).
    """

    time_scale: float = 1.0
    rate_scale: float = 1.0
    length_scale: float = 1.0
    max_input_tokens: int = MODEL_CONTEXT - 1
    max_output_tokens: int = MODEL_CONTEXT - 1
    context_tokens: int = MODEL_CONTEXT
    replay_seconds: float = 60.0
    whole_conversations: bool = False

    @property
    def block_tokens(self) -> int:
        return max(1, round(TRACE_BLOCK_TOKENS * self.length_scale))


def read_trace(path: Path | str = DEFAULT_TRACE) -> list[TraceRecord]:
    records = []
    with open(path) as file:
        for line in file:
            if line.strip():
                row = json.loads(line)
                records.append(TraceRecord(int(row["timestamp"]), int(row["input_length"]),
                                           int(row["output_length"]), tuple(row["hash_ids"])))
    return records


@lru_cache(maxsize=4096)
def block_tokens(block_id: int, length: int, salt: str = "") -> tuple[int, ...]:
    """Equal hash ids give equal blocks, so requests sharing leading ids share a prefix; a block of
    another salt differs, so two replays of one trace share nothing (neither warms the other's cache)."""
    return random_tokens(f"block/{salt}/{block_id}", length)


def trace_prompt(hash_ids: Iterable[int], input_length: int, block_length: int, salt: str = "") -> tuple[int, ...]:
    """The blocks of hash_ids in order, the last one cut so the prompt has input_length tokens."""
    tokens: list[int] = []
    for block_id in hash_ids:
        if len(tokens) >= input_length:
            break
        tokens.extend(block_tokens(block_id, block_length, salt))
    if len(tokens) < input_length:
        raise ValueError(f"{len(tokens)} tokens of blocks cannot make a prompt of {input_length}")
    return tuple(tokens[:input_length])


def scaled_lengths(record: TraceRecord, scaling: TraceScaling) -> tuple[int, int]:
    """(input, output) tokens after length scaling, within the blocks, the bounds and the context."""
    blocks_room = len(record.hash_ids) * scaling.block_tokens
    input_length = min(max(1, round(record.input_length * scaling.length_scale)), blocks_room,
                       scaling.max_input_tokens, scaling.context_tokens - 1)
    output_length = min(max(1, round(record.output_length * scaling.length_scale)),
                        scaling.max_output_tokens, scaling.context_tokens - input_length)
    return input_length, output_length


def copies(index: int, rate_scale: float) -> int:
    """How many times the index-th request is sent: over the trace this keeps rate_scale of them."""
    return int((index + 1) * rate_scale) - int(index * rate_scale)


def conversation_kept(record: TraceRecord, share: float) -> bool:
    """Whether a request's conversation is among the `share` kept. A conversation is the requests
    that share their first two blocks (the first is a system prompt every request of the trace shares)."""
    return random.Random(f"conversation/{record.hash_ids[:2]}").random() < share


def kept_copies(index: int, record: TraceRecord, scaling: TraceScaling) -> int:
    if scaling.whole_conversations and scaling.rate_scale < 1:
        return int(conversation_kept(record, scaling.rate_scale))
    return copies(index, scaling.rate_scale)


def trace_schedule(records: list[TraceRecord], scaling: TraceScaling, salt: str = "") -> list[Arrival]:
    arrivals = []
    for index, record in enumerate(records):
        at_s = record.timestamp_ms / 1000 * scaling.time_scale
        if at_s >= scaling.replay_seconds:
            break
        input_length, output_length = scaled_lengths(record, scaling)
        for copy in range(kept_copies(index, record, scaling)):
            prompt = trace_prompt(record.hash_ids, input_length, scaling.block_tokens, salt)
            arrivals.append(Arrival(at_s, RequestSpec("trace", prompt, output_length, seed=index * 1009 + copy)))
    return sorted(arrivals, key=lambda a: a.at_s)


# ---- rate curves --------------------------------------------------------------------------------

def read_curve(path: Path | str) -> list[tuple[float, float]]:
    """Rows of (t_seconds, requests_per_second), '#' lines are comments; a header row is allowed.

    The rate is a step function: each row's rate holds until the next row's time, and the last
    row's time ends the curve.
    """
    points = []
    with open(path) as file:
        for row in csv.reader(line for line in file if not line.lstrip().startswith("#")):
            if not row or row[0].strip() == "t_seconds":
                continue
            t, rate = float(row[0]), float(row[1])
            if rate < 0 or (points and t <= points[-1][0]):
                raise ValueError(f"{path}: times must increase and rates be >= 0, got {row}")
            points.append((t, rate))
    if len(points) < 2:
        raise ValueError(f"{path}: a curve needs at least two rows")
    return points


def curve_arrival_times(curve: list[tuple[float, float]], limit_s: float = float("inf")) -> list[float]:
    """Evenly paced arrivals: the k-th comes when the integral of the rate reaches k - 1/2."""
    times, expected, next_arrival = [], 0.0, 0.5
    for (start, rate), (end, _) in zip(curve, curve[1:]):
        end = min(end, limit_s)
        while rate > 0 and start < end and expected + rate * (end - start) >= next_arrival:
            times.append(start + (next_arrival - expected) / rate)
            next_arrival += 1
        if start < end:
            expected += rate * (end - start)
    return times


def curve_schedule(curve: list[tuple[float, float]], mix: Mix, limit_s: float = float("inf"),
                   salt: str = "") -> list[Arrival]:
    return [Arrival(at_s, mix.request(index, salt)) for index, at_s in enumerate(curve_arrival_times(curve, limit_s))]


# ---- Poisson arrivals and bursts ------------------------------------------------------------------

def poisson_arrival_times(rate: float, seed: int | str, duration_s: float | None = None,
                          count: int | None = None) -> list[float]:
    """Exponential gaps of mean 1/rate from t=0: the first `count` arrivals, else those before duration_s."""
    if rate <= 0 or (duration_s is None) == (count is None):
        raise ValueError("a positive rate and exactly one of duration_s and count are needed")
    rng, times, at = random.Random(seed), [], 0.0
    while True:
        at += rng.expovariate(rate)
        if (count is not None and len(times) == count) or (duration_s is not None and at >= duration_s):
            return times
        times.append(at)


def poisson_schedule(rate: float, mix: Mix, duration_s: float | None = None, count: int | None = None,
                     salt: str = "") -> list[Arrival]:
    times = poisson_arrival_times(rate, f"{mix.seed}/poisson/{rate}", duration_s, count)
    return [Arrival(at_s, mix.request(index, salt)) for index, at_s in enumerate(times)]


def burst(at_s: float, count: int, prompt_tokens: int, max_tokens: int, seed: int = 0) -> list[Arrival]:
    """`count` long prompts all arriving at at_s, to lay on top of another schedule."""
    return [Arrival(at_s, RequestSpec("burst", random_tokens(f"burst/{seed}/{index}", prompt_tokens), max_tokens,
                                      seed=seed * 1_000_003 + index)) for index in range(count)]
