"""Every message that crosses a ZeroMQ socket, declared once.

Topology: each worker (prefill or decode) connects a DEALER socket to the router's ROUTER
socket; workers never talk to each other. A request's journey:

    router --PrefillTask--> prefill --KvReady--> router --DecodeTask--> decode
    decode --KvPulled--> router --ReleaseKv--> prefill   (prefill frees its pages only now)
    decode --TokenBatch (every step)--> router --> gRPC stream
    router --Abort--> worker        (client gone, stop string hit, or shutdown)
    worker --Failed--> router       (the request cannot go on)

A request whose decode fails goes round again under a new id (request migration): its PrefillTask
carries the prompt and the tokens already streamed, and `generated` says how many of those there are.

Draining a worker (SIGTERM, or the router's Drain): it sends Draining and takes no new work; once
it holds nothing the router still owes it, the router sends Drained, and it deregisters and exits 0.

Request ids on this wire are made by the router, unique per router incarnation; the client's own
request_id is only a label (logs and responses). A worker registers with a handshake (Register ->
Registered or Refused); the router's epoch in Registered tells it the router it serves, and a
worker that registers again (the router restarted, or dropped it) first drops every request it held.

No clock reading crosses a process: a worker reports durations on its own clock, and the router
subtracts only its own stamps (services/router/control/request.py, StageTimings), so the timings
hold across hosts whose clocks disagree.

KV bytes never travel here: the prefill exports its pool once (one KvPoolHandle per way of
reaching it), the router passes the handles to every decode (PoolAvailable), and per request only
page ids move.
On the wire each message is a msgpack array [kind, field, ...] (shared/control/wire.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum, StrEnum


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


class FinishReason(StrEnum):
    STOP = "stop"      # EOS token or a stop string
    LENGTH = "length"  # max_tokens or the model's context reached


class ErrorCode(StrEnum):
    """Mirrors the gRPC status the router returns for a failed request."""
    UNAVAILABLE = "UNAVAILABLE"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    INTERNAL = "INTERNAL"


# Bumped on any change to the messages below: the router refuses a worker of another version.
PROTOCOL_VERSION = 8

# Exit status of a service refused (EX_CONFIG), by the router or at its own start (an address or
# the runtime folder taken, a checkpoint it cannot serve): restarting it would be refused again,
# so neither the supervisor nor systemd (RestartPreventExitStatus=) restarts it.
EXIT_REFUSED = 78


class MsgKind(IntEnum):
    REGISTER = 1
    REGISTERED = 2
    HEARTBEAT = 3
    REREGISTER = 4
    POOL_AVAILABLE = 5
    POOL_GONE = 6
    PREFILL_TASK = 10
    KV_READY = 11
    DECODE_TASK = 12
    KV_PULLED = 13
    RELEASE_KV = 14
    TOKEN_BATCH = 15
    ABORT = 16
    FAILED = 17
    DEREGISTER = 18
    REFUSED = 19
    DRAIN = 20
    DRAINING = 21
    DRAINED = 22
    KV_CACHE_EVENTS = 23
    POOL_UNREACHABLE = 24


@dataclass(frozen=True)
class SamplingParams:
    temperature: float  # 0 means greedy
    top_p: float
    top_k: int          # 0 means off
    seed: int           # always set: the router draws one when the client gives none


@dataclass(frozen=True)
class StopParams:
    """What ends a request inside a worker; stop strings are the router's (it owns the text)."""
    max_tokens: int        # already cut so that prompt + max_tokens fits the context
    ignore_eos: bool


@dataclass(frozen=True)
class KvLayout:
    """Shape of a paged pool: per layer a K and a V shard of [pages, page_size, kv_heads, head_dim],
    interleaved K0 V0 K1 V1 ..., each shard starting shard_stride_bytes after the last (a
    multiple of 256, so every shard is 256-byte aligned). An MLA model's pool has one shard per
    layer (shards_per_layer 1): the latent and the RoPE key of each token, one "head" of
    kv_lora_rank + qk_rope_head_dim. A quantized dtype (int8, float8_e4m3fn) implies scale shards
    after them, whose place follows from these fields (shared/kv/pool.py)."""
    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    shard_stride_bytes: int
    shards_per_layer: int = 2


@dataclass(frozen=True)
class KvPoolHandle:
    """One way for a decode to reach a prefill's pool, exported once per process lifetime."""
    backend: str        # "shm" (POSIX shared memory), "cuda_ipc" or "nixl" (shared/kv/transfer)
    locator: bytes      # shm: the segment name; cuda_ipc: the IPC handle; nixl: the agent's metadata and the buffer
    layout: KvLayout
    # A tensor-parallel rank's pool holds some of the model's KV heads: global heads first_kv_head
    # .. first_kv_head + layout.num_kv_heads - 1, so that a decode rank finds the ranks holding its own.
    first_kv_head: int


@dataclass(frozen=True)
class ModelFingerprint:
    """What makes one worker's KV usable by another (shared/model/fingerprint.py): a prefill and a
    decode of different models must never pair. Hashes are sha256 hex digests."""
    config_sha: str     # the model's config, all of it
    weights_sha: str    # the weight files: names, sizes and their first and last MiB
    tokenizer_sha: str  # the tokenizer's files (the router tokenizes for every worker)
    dtype: str          # the activations' dtype (an unquantized KV cache's too)
    kv_layout: str      # layers, KV heads, head size, page size, the KV cache's format (kv.dtype)


@dataclass(frozen=True)
class Register:
    worker_id: str
    role: Role
    protocol_version: int      # PROTOCOL_VERSION of the worker's code; the third field in every version
    incarnation: str           # random per process start: a pid repeats across containers
    pid: int                   # for operators' logs only
    total_pages: int
    page_size: int
    # A decode's decode.max_batch_size: the router places no more requests on it at once, so that
    # none waits for a batch slot with the handoff's timeout running; 0 for a prefill.
    max_batch_size: int
    # A decode's model's sliding window, where every layer has one (0: its requests attend to every
    # earlier token): the router reserves a request's decode pages by it (kv/pages.py); 0 for a prefill.
    window: int
    # A prefill's pool, by each kind of transfer it offers, best first, each kind with every
    # tensor-parallel rank's handle (shared/kv/transfer/choice.py); empty for a decode.
    pool_handles: list[KvPoolHandle]
    fingerprint: ModelFingerprint


@dataclass(frozen=True)
class Registered:
    router_epoch: str  # random per router start; the worker's heartbeats carry it back


@dataclass(frozen=True)
class Refused:
    """The router will not take this worker (another protocol version, page size, ...): it exits."""
    reason: str


@dataclass(frozen=True)
class Heartbeat:
    worker_id: str
    router_epoch: str  # the router this worker registered with; another epoch means: register again
    free_pages: int
    running: int
    waiting: int
    # Seconds since the worker's main loop last came round: a stuck loop whose heartbeat thread
    # still beats shows here, and the router drops it past router.progress_timeout_s.
    stalled_s: float
    # The requests whose pages the worker holds: the router aborts those it no longer knows, so
    # pages can never stay held by a request the router forgot.
    holding: list[str]


@dataclass(frozen=True)
class Deregister:
    """The worker is stopping: fail what it holds now, without waiting for missed heartbeats."""
    worker_id: str


@dataclass(frozen=True)
class Drain:
    """Router to worker: drain (an operator's `pdserve drain`), as SIGTERM does."""


@dataclass(frozen=True)
class Draining:
    """Worker to router: place nothing new here; what is here finishes."""
    worker_id: str


@dataclass(frozen=True)
class Drained:
    """Router to a draining worker: nothing of yours is in flight any more; you may go."""


@dataclass(frozen=True)
class Reregister:
    """The router does not know the sender (it restarted): register again."""


@dataclass(frozen=True)
class PoolAvailable:
    prefill_worker_id: str
    pool_handles: list[KvPoolHandle]  # Register.pool_handles, as the prefill sent them


@dataclass(frozen=True)
class PoolGone:
    prefill_worker_id: str


@dataclass(frozen=True)
class PoolUnreachable:
    """Decode to router: it cannot pull from this prefill's pool (no backend, no peer access, another
    layout), so the router pairs them no more until the prefill announces a pool again."""
    prefill_worker_id: str
    reason: str


@dataclass(frozen=True)
class KvCacheEvents:
    """A prefill's prefix cache changed (shared/kv/page_keys.py keys): sent in batches, at most
    every few milliseconds, so the router routes by what each prefill really holds."""
    worker_id: str
    stored: list[str]   # page keys now cached
    evicted: list[str]  # page keys no longer cached
    cleared: bool       # the cache was emptied first (a restart, a new router): forget all its keys


@dataclass(frozen=True)
class PrefillTask:
    request_id: str
    prompt_token_ids: bytes  # packed (wire.pack_token_ids)
    # Salts the prompt's prefix-cache keys (shared/kv/page_keys.py): pages are shared only between
    # prompts of one salt, so a client cannot tell from cached tokens what others sent. "": none.
    cache_salt: str
    sampling: SamplingParams
    stop: StopParams
    # Output tokens the request already streamed, the tail of prompt_token_ids: non-zero for a
    # request moved off a failed decode (request migration). The token sampled here is output
    # number generated + 1, seeded and counted against max_tokens as such.
    generated: int = 0


@dataclass(frozen=True)
class KvReady:
    request_id: str
    prefill_worker_id: str
    page_ids: bytes              # the pages holding the prompt's KV (wire.pack_page_ids)
    num_tokens: int              # tokens whose KV sits in the pages (the prompt)
    first_token_id: int          # sampled by the prefill, so TTFT does not wait for the decode
    finish_reason: FinishReason | None  # set when the first token already ends the request
    compute_s: float             # prompt forward pass and sampling, on the prefill's clock
    cached_tokens: int           # prompt tokens whose KV came from the prefix cache, not computed


@dataclass(frozen=True)
class DecodeTask:
    request_id: str
    prefill_worker_id: str
    src_page_ids: bytes  # KvReady.page_ids, passed on as they came
    num_tokens: int
    first_token_id: int
    sampling: SamplingParams
    stop: StopParams
    generated: int = 0  # PrefillTask.generated: output tokens before first_token_id, in the prompt's tail


@dataclass(frozen=True)
class KvPulled:
    request_id: str
    prefill_worker_id: str
    pull_s: float  # from the decode starting the copy to the pages in its pool


@dataclass(frozen=True)
class ReleaseKv:
    request_id: str


@dataclass(frozen=True)
class TokenOut:
    request_id: str
    token_id: int
    finish_reason: FinishReason | None


@dataclass(frozen=True)
class Joined:
    """A request whose first decode step a TokenBatch reports."""
    request_id: str
    # Its pages in the decode's pool -> this step began: on a GPU both dated on the device, so a
    # step launched before the copy ended (it waits for the copy there) does not count as a queue.
    queued_s: float


@dataclass(frozen=True)
class TokenBatch:
    """One decode step's new tokens, one entry per running request."""
    tokens: list[TokenOut] = field(default_factory=list)
    # For the requests this step was the first of (and only then, else 0 and empty): the step's
    # start (on the device) -> this batch sent, and each one's wait for the step, on the decode's
    # clock. The router takes them out of its own clock's time between a request's first and
    # second tokens; what remains is the handoff (services/router/control/request.py).
    step_s: float = 0.0
    joined: list[Joined] = field(default_factory=list)


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Failed:
    request_id: str
    code: ErrorCode
    message: str


MESSAGE_TYPES: dict[MsgKind, type] = {
    MsgKind.REGISTER: Register,
    MsgKind.REGISTERED: Registered,
    MsgKind.HEARTBEAT: Heartbeat,
    MsgKind.REREGISTER: Reregister,
    MsgKind.POOL_AVAILABLE: PoolAvailable,
    MsgKind.POOL_GONE: PoolGone,
    MsgKind.POOL_UNREACHABLE: PoolUnreachable,
    MsgKind.PREFILL_TASK: PrefillTask,
    MsgKind.KV_READY: KvReady,
    MsgKind.DECODE_TASK: DecodeTask,
    MsgKind.KV_PULLED: KvPulled,
    MsgKind.RELEASE_KV: ReleaseKv,
    MsgKind.TOKEN_BATCH: TokenBatch,
    MsgKind.ABORT: Abort,
    MsgKind.FAILED: Failed,
    MsgKind.DEREGISTER: Deregister,
    MsgKind.REFUSED: Refused,
    MsgKind.DRAIN: Drain,
    MsgKind.DRAINING: Draining,
    MsgKind.DRAINED: Drained,
    MsgKind.KV_CACHE_EVENTS: KvCacheEvents,
}
