"""The ways of serving that the serving benchmark compares, and how each is started and stopped.

- disaggregated: router, prefill and decode as three processes;
- colocated: the router and one process that runs prefill and decode (decode on a high-priority
  stream);
- mps (GPU only): the disaggregated stack under our own MPS daemon, each worker limited to its
  share of the SMs;
- transformers: `generate` served one request at a time (loadtest/stack/transformers_server.py), the floor.

Only the disaggregated mode has a layout to choose: laid out (Mode.laid_out) it runs N prefills and
M decodes (services/stack/topology.py places them), under a name of its own ("disaggregated-2P1D"),
so that several layouts sit side by side in one report. The others are one prefill and one decode
by nature (colocated and mps: the pair they share a GPU between; transformers: no workers at all).

A mode with a prefill can also be run as variants (Mode.variants), each under a name of its own and
with variant_of naming the mode they vary, so that the report can pair them: with the prefix cache
on and off ("disaggregated-cache-off", prefill.prefix_cache), and where it has prefills to choose
from, routed by prefix or by load alone ("disaggregated-2P1D-cache-on-route-load",
routing.prefix_aware).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from loadtest.lib.mps_daemon import MpsDaemon, find_mps_control
from services.stack.local import LocalStack
from services.stack.supervisor import REPO
from shared.config.loading import env_name

CACHE_SETTINGS = {"on": True, "off": False}   # --prefix-cache: prefill.prefix_cache
ROUTINGS = {"prefix": True, "load": False}     # --routing: routing.prefix_aware


@dataclass(frozen=True)
class Topology:
    """How many prefill and decode workers the disaggregated mode runs."""

    prefill: int
    decode: int

    @classmethod
    def parse(cls, text: str) -> "Topology":
        """'2x1' -> two prefills, one decode."""
        prefill, sep, decode = text.strip().lower().partition("x")
        if not (sep and prefill.isdigit() and decode.isdigit() and int(prefill) >= 1 and int(decode) >= 1):
            raise ValueError(f"a topology is PREFILLSxDECODES, each at least 1 (e.g. 2x1), got {text!r}")
        return cls(int(prefill), int(decode))

    @property
    def label(self) -> str:
        return f"{self.prefill}P{self.decode}D"


@dataclass(frozen=True)
class Mode:
    name: str
    services: tuple[str, ...]   # as LocalStack names them: under services/, or a dotted module
    sends_timings: bool         # whether the last chunk carries StageTimings
    mps: bool = False
    topology: Topology | None = None  # set: the workers laid out as it says; None: one of each, as by nature
    prefix_cache: bool | None = None    # prefill.prefix_cache of this variant; None: as configured
    prefix_routing: bool | None = None  # routing.prefix_aware of this variant; None: as configured
    variant_of: str | None = None       # the name of the mode this one is a variant of

    def missing_modules(self) -> list[str]:
        """The services whose module is not in this checkout (one being written elsewhere, say)."""
        return [name for name in self.services if not module_exists(name)]

    def laid_out(self, topology: Topology) -> "Mode":
        if self.name not in LAYOUT_MODES:
            raise ValueError(f"the {self.name} mode has no layout to choose: it is one prefill and one decode")
        return replace(self, name=f"{self.name}-{topology.label}", topology=topology)

    @property
    def prefills(self) -> int:
        return self.topology.prefill if self.topology else 1

    def variants(self, caches: list[bool], routings: list[bool]) -> list["Mode"]:
        """One run per prefix cache setting given; where the cache is on and there are prefills to
        choose from, one per routing given. Neither given: this mode alone, as configured."""
        runs = []
        for cache in caches or [None]:
            mode = self if cache is None else self._varied(f"cache-{'on' if cache else 'off'}", prefix_cache=cache)
            if routings and cache is not False and self.prefills > 1:
                runs += [mode._varied(f"route-{'prefix' if r else 'load'}", prefix_routing=r) for r in routings]
            else:
                runs.append(mode)
        return runs

    def _varied(self, suffix: str, **setting: bool) -> "Mode":
        return replace(self, name=f"{self.name}-{suffix}", variant_of=self.variant_of or self.name, **setting)

    def settings(self) -> dict[str, str]:
        """The PDSERVE_* variables of its variant."""
        chosen = {("prefill", "prefix_cache"): self.prefix_cache, ("routing", "prefix_aware"): self.prefix_routing}
        return {env_name(*key): str(value).lower() for key, value in chosen.items() if value is not None}


MODES = {mode.name: mode for mode in (
    Mode("disaggregated", ("router", "prefill", "decode"), sends_timings=True),
    Mode("colocated", ("router", "colocated"), sends_timings=True),
    Mode("mps", ("router", "prefill", "decode"), sends_timings=True, mps=True),
    Mode("transformers", ("loadtest.stack.transformers_server",), sends_timings=False),
)}


LAYOUT_MODES = ("disaggregated",)
CACHED_MODES = ("disaggregated", "colocated", "mps")  # those with a prefill, so a prefix cache


def module_exists(service: str) -> bool:
    if "." in service:
        return importlib.util.find_spec(service) is not None
    return (REPO / "services" / service / "__main__.py").is_file()


@dataclass(frozen=True)
class MpsSplit:
    """SM percent of each worker under MPS; 100 leaves CUDA_MPS_ACTIVE_THREAD_PERCENTAGE unset."""

    decode_percent: int = 100
    prefill_percent: int = 30

    @classmethod
    def parse(cls, text: str) -> "MpsSplit":
        decode, prefill = (int(part) for part in text.split(","))
        if not (1 <= decode <= 100 and 1 <= prefill <= 100):
            raise ValueError(f"SM percents must be within 1-100, got {text!r}")
        return cls(decode, prefill)

    def service_env(self) -> dict[str, dict[str, str]]:
        percents = {"decode": self.decode_percent, "prefill": self.prefill_percent}
        return {name: {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(p)} if p < 100 else {} for name, p in percents.items()}


@contextmanager
def serving(mode: Mode, workdir: Path, cache_dir: str, settings: dict[str, str], mps_split: MpsSplit,
            start_timeout_s: float, devices: str = "") -> Iterator[tuple[LocalStack, dict]]:
    """The mode's processes, SERVING; yields the stack and facts for the report (the MPS check).
    devices: stack.devices, for a laid-out mode's workers."""
    if not mode.mps:
        layout = {} if mode.topology is None else {"prefill": mode.topology.prefill, "decode": mode.topology.decode,
                                                   "devices": devices}
        with LocalStack(workdir, cache_dir, services=mode.services, start_timeout_s=start_timeout_s,
                        **layout, **settings) as stack:
            yield stack, {}
        return
    daemon = MpsDaemon(find_mps_control(), workdir / "mps")
    try:
        daemon.start()
        with LocalStack(workdir, cache_dir, services=mode.services, start_timeout_s=start_timeout_s,
                        service_env=mps_split.service_env(), **settings, **daemon.env) as stack:
            yield stack, {"mps": mps_check(daemon, stack, mps_split)}
    finally:
        daemon.stop()


def mps_check(daemon: MpsDaemon, stack: LocalStack, split: MpsSplit) -> dict:
    """Both workers must be clients of our daemon's server, or the mode is not what it claims."""
    clients = {pid for pids in daemon.clients().values() for pid in pids}
    workers = {name: stack.processes[name].pid for name in ("prefill", "decode")}
    return {"decode_sm_percent": split.decode_percent, "prefill_sm_percent": split.prefill_percent,
            "workers_are_clients": set(workers.values()) <= clients}
