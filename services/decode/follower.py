"""A decode rank other than 0 (shared/worker/ranks.py): mirrors rank 0's device work on its shard.

It holds its own pool (its KV heads, at the page ids rank 0 allocates) and runs rank 0's commands
(services/decode/rank_engine.py) until told to stop: it maps the pools that hold its heads, pulls
each request's heads into its pool and waits for them to land before it answers (so rank 0 tells
the prefill KvPulled only once every rank has its pages), and runs each step on the inputs rank 0
broadcasts. It talks to no router and samples nothing: rank 0 gathers the logits.
"""

from __future__ import annotations

import time

import structlog

from services.decode.kv_pull import HandoffError, KvPuller
from services.decode.rank_engine import MAP_POOL, PULL, STEP, UNMAP_POOL, build_rank_engine, follow_step
from shared.control import wire
from shared.kernels.device import on_stream
from shared.kv.transfer import Transfer, TransferState
from shared.worker.main import WorkerProcess
from shared.worker.ranks import STOP

log = structlog.get_logger()

LANDING_POLL_S = 0.001


def follow(worker: WorkerProcess) -> None:
    config, model, ranks = worker.config, worker.model, worker.ranks
    engine = build_rank_engine(config, model, ranks, lambda pages: None)  # rank 0's allocator owns the page ids
    puller = engine.puller
    log.info("decode rank following", rank=ranks.tp.rank)
    try:
        with on_stream(engine.stream):
            while True:
                name, args = ranks.follow()
                if name == STOP:
                    return
                if name == MAP_POOL:
                    message = wire.decode(args[0])
                    ranks.all_agree(_attempt(puller.map_pool, message.prefill_worker_id, message.pool_handles))
                elif name == UNMAP_POOL:
                    puller.unmap_pool(args[0])
                elif name == PULL:
                    task, pages = wire.decode(args[0]), args[1]
                    ranks.all_agree(_pulled(puller, task, pages))
                elif name == STEP:
                    engine.step(follow_step(ranks, *args, model.device))
    finally:
        puller.close()
        ranks.close()


def _attempt(action, *args) -> bool:
    try:
        action(*args)
    except HandoffError as exc:
        log.error("KV handoff failed on this rank", error=str(exc))
        return False
    return True


def _pulled(puller: KvPuller, task, pages: list[int]) -> bool:
    """The request's heads in this rank's pool, waited for: True once they have landed."""
    try:
        transfer = puller.pull(task, pages)
    except HandoffError as exc:
        log.error("KV pull failed on this rank", request_id=task.request_id, error=str(exc))
        return False
    if _landed(puller, transfer):
        return True
    puller.failed()  # reported here once; rank 0 says what became of the request
    puller.drop(task.request_id, pages)  # a failed read that may still write is let go once settled
    return False


def _landed(puller: KvPuller, transfer: Transfer) -> bool:
    """Waits until the transfer is DONE (a copy on the device: once the device has run it) or has
    failed (the puller cancels one that outlives kv.transfer_timeout_s)."""
    while transfer not in puller.landed():
        if transfer.state is TransferState.FAILED:
            return False
        time.sleep(LANDING_POLL_S)
    return True
