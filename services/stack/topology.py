"""Where `python -m services.stack` puts each of its workers on this node: id, port, cores, GPU.

- ids: prefill-0 .. prefill-(N-1) and decode-0 .. decode-(M-1), stack.prefill and stack.decode.
- metrics: worker i of a role serves at its role's metrics port + i, the range moved up past ports
  already taken (the router's, the prefills' range for the decodes: the defaults 9401 and 9402
  would overlap with two prefills). Fixed ports rather than free ones, so that a Prometheus
  scrape config can name them; an empty metrics_address leaves that role's endpoints off.
- cores: a role whose cpu_cores is set splits those among its workers; the other workers split
  the allowed cores that no set role claims, in contiguous shares, prefills first (one prefill and
  one decode get the lower and upper half, as each worker alone takes). With fewer cores than
  workers, they share them one core each, round robin.
- GPUs: stack.devices places them by hand ("prefill=0,1 decode=2,3"); otherwise, with
  model.device = "cuda", one GPU each where there are enough; else every worker on model.device.
  A worker of tensor_parallel k takes the k GPUs from the one it is given (its ranks,
  shared/worker/ranks.py), so the automatic placement gives each worker k of them.
  decode.weights_from is refused unless each decode is on that prefill's GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from shared.config.loading import env_name, flag_name

from shared.config.schema import Config, ConfigError, parse_cores, parse_devices
from shared.control.messages import Role

ROLES = (Role.PREFILL, Role.DECODE)


@dataclass(frozen=True)
class WorkerPlan:
    role: Role
    index: int
    device: str
    cores: tuple[int, ...]  # empty: the worker takes its role's default half
    metrics_address: str

    @property
    def name(self) -> str:
        """The worker id, also its service name in the supervisor."""
        return f"{self.role.value}-{self.index}"

    def _settings(self) -> dict[tuple[str, str], str]:
        role = self.role.value
        settings = {(role, "worker_id"): self.name, (role, "metrics_address"): self.metrics_address,
                    ("model", "device"): self.device}
        if self.cores:
            settings[(role, "cpu_cores")] = format_cores(self.cores)
        return settings

    def env(self) -> dict[str, str]:
        return {env_name(*key): value for key, value in self._settings().items()}

    def args(self) -> list[str]:
        """As flags, which beat every other layer of the config (forwarded flags included)."""
        return [part for key, value in self._settings().items() for part in (flag_name(*key), value)]


def plan_workers(config: Config, allowed_cores: list[int] | None = None,
                 gpu_count: int | None = None) -> list[WorkerPlan]:
    """Every worker of config.stack, prefills first; ConfigError for a layout that cannot work.
    allowed_cores and gpu_count default to this process's."""
    allowed = sorted(os.sched_getaffinity(0)) if allowed_cores is None else allowed_cores
    gpus = visible_gpus(config.model.device) if gpu_count is None else gpu_count
    counts = {Role.PREFILL: config.stack.prefill, Role.DECODE: config.stack.decode}
    devices = _devices(config, counts, gpus)
    cores = _cores(config, counts, allowed)
    ports = _metrics_addresses(config, counts)
    plans = [WorkerPlan(role, i, devices[role][i], cores[role][i], ports[role][i])
             for role in ROLES for i in range(counts[role])]
    _check_weight_sharing(config, plans)
    return plans


def visible_gpus(device: str) -> int:
    return torch.cuda.device_count() if device.startswith("cuda") else 0


def format_cores(cores: tuple[int, ...]) -> str:
    """(0, 1, 2, 5) -> "0-2,5", as config.parse_cores reads it."""
    runs: list[list[int]] = []
    for core in cores:
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def split_cores(cores: list[int], n: int) -> list[tuple[int, ...]]:
    """n contiguous shares, the later ones a core larger where they do not divide evenly; one core
    each, round robin, when there are fewer cores than shares."""
    if len(cores) < n:
        return [(cores[i % len(cores)],) for i in range(n)]
    size, larger = divmod(len(cores), n) if n else (0, 0)
    shares, start = [], 0
    for i in range(n):
        end = start + size + (i >= n - larger)
        shares.append(tuple(cores[start:end]))
        start = end
    return shares


def _cores(config: Config, counts: dict[Role, int], allowed: list[int]) -> dict[Role, list[tuple[int, ...]]]:
    own = {role: parse_cores(getattr(config, role.value).cpu_cores) for role in ROLES}
    claimed = {core for cores in own.values() for core in cores}
    rest = [core for core in allowed if core not in claimed] or allowed
    shared = split_cores(rest, sum(counts[role] for role in ROLES if not own[role]))
    out = {}
    for role in ROLES:
        if own[role]:
            out[role] = split_cores(own[role], counts[role])
        else:
            out[role], shared = shared[:counts[role]], shared[counts[role]:]
    return out


def _metrics_addresses(config: Config, counts: dict[Role, int]) -> dict[Role, list[str]]:
    taken = {_port(config.router.metrics_address)} - {None}
    out = {}
    for role in ROLES:
        address = getattr(config, role.value).metrics_address
        if not address:
            out[role] = [""] * counts[role]
            continue
        host, _, port = address.rpartition(":")
        first = int(port)
        while taken & set(range(first, first + counts[role])):
            first += 1
        if first + counts[role] - 1 > 65535:
            raise ConfigError(f"{role.value}.metrics_address: no {counts[role]} free ports from {port} up")
        taken |= set(range(first, first + counts[role]))
        out[role] = [f"{host}:{first + i}" for i in range(counts[role])]
    return out


def _port(address: str) -> int | None:
    return int(address.rpartition(":")[2]) if address else None


def _devices(config: Config, counts: dict[Role, int], gpus: int) -> dict[Role, list[str]]:
    device = config.model.device
    given = parse_devices(config.stack.devices)
    if given and not device.startswith("cuda"):
        raise ConfigError(f"stack.devices places workers on GPUs, but model.device is {device!r}")
    ranks = {role: getattr(config, role.value).tensor_parallel for role in ROLES}
    out = {}
    if not given and device == "cuda" and sum(counts[role] * ranks[role] for role in ROLES) <= gpus:
        first = 0
        for role in ROLES:
            out[role] = [f"cuda:{first + i * ranks[role]}" for i in range(counts[role])]
            first += counts[role] * ranks[role]
        return out
    for role in ROLES:
        listed = given.get(role.value, [_indexed(device)])
        if len(listed) not in (1, counts[role]):
            raise ConfigError(f"stack.devices gives {role.value} {len(listed)} GPUs for {counts[role]} workers: "
                              "give one for all of them, or one each")
        out[role] = listed * counts[role] if len(listed) == 1 else listed
    for role, listed in out.items():
        for name in listed:
            last = int(name.removeprefix("cuda:")) + ranks[role] - 1 if name.startswith("cuda:") else -1
            if last >= gpus:
                ranks_need = f" (its {ranks[role]} ranks: up to cuda:{last})" if ranks[role] > 1 else ""
                raise ConfigError(f"{name}{ranks_need} is not among the {gpus} GPUs this process sees")
    return out


def _indexed(device: str) -> str:
    """"cuda" names the current device, which in a new process is CUDA's first."""
    return "cuda:0" if device == "cuda" else device


def _check_weight_sharing(config: Config, plans: list[WorkerPlan]) -> None:
    owner = next((p for p in plans if p.role == Role.PREFILL and p.name == config.decode.weights_from), None)
    if owner is None:
        return
    for plan in plans:
        if plan.role == Role.DECODE and plan.device != owner.device:
            raise ConfigError(f"decode.weights_from shares {owner.name}'s weights on its GPU only, {owner.device}, "
                              f"but {plan.name} is on {plan.device}: place them together (stack.devices) or unset it")
