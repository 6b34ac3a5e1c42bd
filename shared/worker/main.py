"""What every worker process does around its own loop: config, logging, pinning, model, link.

The prefill and decode `__main__` modules differ only in the worker class they run; the
colocated one (both workers in one process) reuses `load_model`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import structlog

from shared.config.schema import Config
from shared.control.dispatch import FatalError
from shared.control.messages import ModelFingerprint, Role
from shared.kernels import flashinfer_prefill
from shared.kernels.device import select_device
from shared.model import attention
from shared.model.fingerprint import model_fingerprint
from shared.model.from_checkpoint import load_paged_llama
from shared.model.llama import PagedLlama
from shared.model.tensor_parallel import SINGLE, TensorParallel, check_shardable
from shared.model.loader import eos_token_ids, load_hf_config, resolve_checkpoint
from shared.model.sampling import FinishCheck
from shared.model.weight_share import map_weights, weights_file
from shared.runtime.log import configure_logging
from shared.runtime.process import StopSignals, SystemdNotify, die_with_parent, stop_signals
from shared.runtime.service_config import parse_service_config
from shared.worker.cores import pin_to_cores
from shared.worker.ranks import RankGroup, join_ranks, own_rank, rank_device, solo

log = structlog.get_logger()

WEIGHTS_WAIT_S = 600.0  # the prefill may still be loading a large model


@dataclass
class WorkerProcess:
    """What a started worker process holds, for the prefill or decode worker built on it."""
    config: Config
    model: PagedLlama
    finish: FinishCheck
    fingerprint: ModelFingerprint
    stop: StopSignals
    notify: SystemdNotify
    ranks: RankGroup = field(default_factory=solo)  # this process's rank of the worker


def start_worker(role: Role) -> WorkerProcess:
    """The role's config section names the worker id, cores and tensor-parallel size."""
    die_with_parent()
    config = parse_service_config(role.value)
    section = getattr(config, role.value)
    rank = own_rank()
    configure_logging(role.value, section.worker_id if rank == 0 else f"{section.worker_id}.rank{rank}",
                      config.log.format, config.log.level)
    stop = stop_signals()
    cores = pin_to_cores(section.cpu_cores, "lower" if role == Role.PREFILL else "upper")
    # "cuda" resolved to "cuda:N" and made current before anything touches a GPU (shared/kernels/device.py).
    device = select_device(rank_device(config.model.device, rank))
    config.model.device = str(device)
    if section.tensor_parallel > 1:
        _check_shardable(config, section.tensor_parallel)
    ranks = join_ranks(section.tensor_parallel, device, config.router.progress_timeout_s)
    model, finish, fingerprint = load_model(config, getattr(section, "weights_from", ""), ranks.tp)
    log.info("model ready", cores=cores)
    return WorkerProcess(config, model, finish, fingerprint, stop, SystemdNotify(), ranks)


class Unshardable(FatalError):
    """A tensor_parallel size that does not fit the model: a setting to change, like a bad config value."""
    exit_code = 2


def _check_shardable(config: Config, size: int) -> None:
    """Before any other rank is started."""
    hf_config = load_hf_config(resolve_checkpoint(config.model.path, config.model.cache_dir))
    try:
        check_shardable(hf_config, size)
    except ValueError as exc:
        raise Unshardable(str(exc)) from None


class KernelsMissing(FatalError):
    """A setting that asks for kernels this machine lacks: a setting to change, like a bad config value."""
    exit_code = 2


def load_model(config: Config, weights_from: str = "",
               tp: TensorParallel = SINGLE) -> tuple[PagedLlama, FinishCheck, ModelFingerprint]:
    """The model, loaded from its checkpoint (tp: this rank's shard of it) or mapped from the weights
    prefill `weights_from` publishes, the check that ends its requests, and its fingerprint (what a
    peer's KV must match). The prefill's attention is held as prefill.attention says."""
    config.model.device = str(select_device(config.model.device))
    checkpoint = resolve_checkpoint(config.model.path, config.model.cache_dir)
    hf_config = load_hf_config(checkpoint)
    if weights_from:
        path = weights_file(config.router.runtime_dir, weights_from)
        model, owner_pid = map_weights(hf_config, path, config.model.device, WEIGHTS_WAIT_S)
        log.info("mapped shared weights", prefill=weights_from, owner_pid=owner_pid)
    else:
        model = load_paged_llama(checkpoint, config.model.dtype, config.model.device, config.model.quantization, tp)
    quantization = model.weights.quantization
    log.info("model loaded", checkpoint=str(checkpoint), layers=model.num_layers, quantization=quantization)
    _hold_prefill_attention(config.prefill.attention, model)
    fingerprint = model_fingerprint(checkpoint, str(model.embed.dtype).removeprefix("torch."), quantization,
                                    model.num_layers, model.total_kv_heads, model.head_dim, config.kv.page_size,
                                    config.kv.dtype)
    return model, FinishCheck(frozenset(eos_token_ids(hf_config)), model.max_context), fingerprint


def _hold_prefill_attention(way: str, model: PagedLlama) -> None:
    """prefill.attention; flashinfer is refused where its kernel cannot run this model."""
    if way == "flashinfer" and not (flashinfer_prefill.runs_on(model.device)
                                    and flashinfer_prefill.builds(model.embed.dtype, model.head_dim)):
        raise KernelsMissing("prefill.attention = flashinfer needs FlashInfer installed (pyproject's hopper extra), "
                             f"a Hopper GPU and its kernel built for {model.embed.dtype} heads of {model.head_dim}; "
                             f"{model.device} has not all three")
    attention.hold_prefill_to(None if way == "auto" else way)


def exit_on_error(main) -> None:
    """Runs a worker process's main: a FatalError exits with its code, any other error with 1."""
    try:
        main()
    except FatalError as exc:
        log.error("worker stopped", reason=str(exc), exit_code=exc.exit_code)
        sys.exit(exc.exit_code)
    except Exception:
        log.exception("worker crashed")
        sys.exit(1)
