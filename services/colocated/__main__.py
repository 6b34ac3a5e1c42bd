"""python -m services.colocated: a prefill and a decode worker in one process, on one model.

The baseline the disaggregated stack is measured against. The router sees the two workers as
always, each registered through its own RouterLink, but they share this process and one copy of
the weights, and run their loops in two threads: the decode's kernels on the device's
highest-priority stream, the prefill's on a normal one (shared/kernels/device.py; the current stream is
per thread), long prompts in chunks of prefill.chunk_tokens. The KV handoff still copies each
request's pages from the prefill's pool into the decode's; shared/kv/transfer/local_exports.py maps a pool of
this process without IPC. The process serves one metrics endpoint, at decode.metrics_address.
"""

from __future__ import annotations

import sys
from typing import Callable

import structlog
import torch

from services.colocated.notify import JointNotify
from services.colocated.threads import run_together
from services.decode.worker import DecodeWorker
from services.prefill.worker import PrefillWorker
from shared.runtime import metrics
from shared.runtime.log import configure_logging
from shared.runtime.process import SystemdNotify, die_with_parent, stop_signals
from shared.runtime.service_config import parse_service_config
from shared.worker.cores import pin_to_cores
from shared.worker.main import WorkerProcess, exit_on_error, load_model

log = structlog.get_logger()

# The two loops take turns on the GIL. A loop that waits on a socket or the device wakes up and
# then waits for the other to yield it, by default for up to 5 ms: longer than a KV handoff.
GIL_SWITCH_INTERVAL_S = 0.0005


def main() -> None:
    die_with_parent()
    config = parse_service_config("colocated")
    worker_ids = f"{config.prefill.worker_id},{config.decode.worker_id}"
    configure_logging("colocated", worker_ids, config.log.format, config.log.level)
    stop = stop_signals()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    model, finish, fingerprint = load_model(config)
    notify = JointNotify(SystemdNotify(), ("prefill", "decode"))
    # The decode first: the prefill's constructor exports its pool, which only its run() closes.
    decode = DecodeWorker(WorkerProcess(config, model, finish, fingerprint, stop, notify.member("decode")))
    prefill = PrefillWorker(WorkerProcess(config, model, finish, fingerprint, stop, notify.member("prefill")),
                            colocated=True)
    metrics.watch_workers([prefill.load, decode.load])
    if model.device.type == "cuda":  # the workers' own streams do not wait for the default one they were built on
        torch.cuda.synchronize(model.device)
    loops = {"prefill": in_own_thread(config.prefill.worker_id, config.prefill.cpu_cores, "lower", prefill.run),
             "decode": in_own_thread(config.decode.worker_id, config.decode.cpu_cores, "upper", decode.run)}
    sys.exit(run_together(loops, stop.now))


def in_own_thread(worker_id: str, cores: str, half: str, run: Callable[[], None]) -> Callable[[], None]:
    """A worker's loop as its thread runs it: on the worker's cores, logging under its id."""
    def loop() -> None:
        structlog.contextvars.bind_contextvars(worker_id=worker_id)
        log.info("pinned", cores=pin_to_cores(cores, half))
        run()
    return loop


if __name__ == "__main__":
    exit_on_error(main)
