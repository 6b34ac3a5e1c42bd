"""What every worker process does around its own loop: config, logging, pinning, model, link.

The prefill and decode `__main__` modules differ only in the worker class they run.
"""

from __future__ import annotations

import sys
import threading

import structlog

from shared.config import Config, parse_service_config
from shared.log import configure_logging
from shared.model.llama import PagedLlama, load_paged_llama
from shared.model.loader import eos_token_ids, load_hf_config, resolve_checkpoint
from shared.process import pin_to_cores, stop_event_on_signals
from shared.sampling import FinishCheck

log = structlog.get_logger()


def start_worker(service: str, worker_id_of, cores_of, half: str) -> tuple[Config, PagedLlama, FinishCheck, threading.Event]:
    config = parse_service_config(service)
    configure_logging(service, worker_id_of(config), config.log.format, config.log.level)
    stopping = stop_event_on_signals()
    cores = pin_to_cores(cores_of(config), half)
    checkpoint = resolve_checkpoint(config.model.path, config.model.cache_dir)
    hf_config = load_hf_config(checkpoint)
    model = load_paged_llama(checkpoint, config.model.dtype, config.model.device)
    finish = FinishCheck(frozenset(eos_token_ids(hf_config)), model.max_context)
    log.info("model loaded", checkpoint=str(checkpoint), cores=cores, layers=model.num_layers)
    return config, model, finish, stopping


def exit_on_error(main) -> None:
    try:
        main()
    except Exception:
        log.exception("worker crashed")
        sys.exit(1)
