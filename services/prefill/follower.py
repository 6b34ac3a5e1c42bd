"""A prefill rank other than 0 (shared/worker/ranks.py): runs each prompt rank 0 runs, on its shard.

It exports its own pool (its KV heads; decodes read them from it directly), hands its handles to
rank 0 for the Register, then runs rank 0's commands until told to stop: a prompt's forward pass
into the same page ids, going on or giving up between chunks as rank 0 decides. It talks to no
router; what it computes reaches the decodes through its pool alone.
"""

from __future__ import annotations

import structlog

from services.prefill.rank_pools import export_rank_pool
from services.prefill.worker import PREFILL, PromptAbandoned, prefill_layout
from shared.control import wire
from shared.control.dispatch import FatalError
from shared.kernels.device import on_stream, worker_stream
from shared.worker.main import WorkerProcess
from shared.worker.ranks import STOP

log = structlog.get_logger()


def follow(worker: WorkerProcess) -> None:
    config, model, ranks = worker.config, worker.model, worker.ranks
    exported, _ = export_rank_pool(config, model, ranks, prefill_layout(config, model))

    def after_chunk() -> None:
        if not ranks.decide():
            raise PromptAbandoned("rank 0 gave the prompt up")

    log.info("prefill rank following", rank=ranks.tp.rank)
    try:
        with on_stream(worker_stream(model.device, high_priority=False)):
            while True:
                name, args = ranks.follow()
                if name == STOP:
                    return
                if name == PREFILL:
                    packed, pages, start = args
                    prompt = wire.unpack_token_ids(packed)
                    try:
                        model.prefill(prompt, exported.pool, pages, config.prefill.chunk_tokens, after_chunk, start)
                    except PromptAbandoned:
                        pass
                    except FatalError:
                        raise
                    except Exception:  # as on rank 0, whose same inputs fail the same way: the request's failure
                        log.exception("prefill failed", rank=ranks.tp.rank)
    finally:
        exported.close()
        ranks.close()
