"""What every rank of a decode computes with: its own pool, its puller, its graphed step; and the
commands rank 0 sends the other ranks (services/decode/follower.py) so that they do the same.

Rank 0 schedules; the others hold their shards of the weights and of the KV heads (the same page
ids as rank 0's) and mirror each piece of device work: mapping or forgetting a prefill's pools,
pulling a request's pages (a follower waits for its pages to land before it answers, so rank 0
acknowledges a pull only once every rank has it), and each step, whose inputs rank 0 broadcasts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from services.decode.cuda_graphs import GraphedDecode
from services.decode.kv_pull import KvPuller
from services.decode.step_inputs import StepInputs
from shared.config.schema import Config
from shared.kernels.device import on_stream, worker_stream
from shared.kv.heads import kv_heads_of
from shared.kv.pages import pages_for
from shared.kv.pool import PagedKvPool, allocate_local_pool
from shared.kv.transfer.nixl_network import nixl_net_devices
from shared.model.llama import PagedLlama
from shared.model.loader import attention_span
from shared.worker.ranks import RankGroup

MAP_POOL = "map_pool"      # [PoolAvailable, wire-encoded]; every rank answers all_agree
UNMAP_POOL = "unmap_pool"  # [prefill worker id]
PULL = "pull"              # [DecodeTask, wire-encoded; local page ids]; every rank answers all_agree
STEP = "step"              # [batch, page-table width]; the inputs follow by broadcast


@dataclass
class RankEngine:
    model: PagedLlama
    pool: PagedKvPool
    pool_buffer: torch.Tensor  # keeps the pool's memory alive
    scratch_page: int          # beyond the allocator's pages: graph padding and pool warm-ups write here
    max_pages: int             # a request's page table row: its whole context, within the pool but for a window's ring
    puller: KvPuller
    stream: torch.cuda.Stream | None
    graphs: GraphedDecode | None

    def step(self, inputs: StepInputs) -> torch.Tensor:
        """Logits [B, V]: one graph replay, or eagerly for a batch beyond every graph."""
        logits = self.graphs.step(inputs) if self.graphs is not None else None
        if logits is None:
            logits = self.model.decode(inputs.token_ids, inputs.positions, inputs.page_table, self.pool)
        return logits


def build_rank_engine(config: Config, model: PagedLlama, ranks: RankGroup,
                      free_pages: Callable[[list[int]], None]) -> RankEngine:
    """One page more than the allocator hands out: the CUDA graphs' padding rows write there, and
    the puller's copy of a newly mapped pool. free_pages: gives pages back to the allocator (rank 0's)."""
    layout = model.kv_layout(config.kv.decode_pages + 1, config.kv.page_size, config.kv.dtype)
    pool, buffer = allocate_local_pool(layout, model.device)
    scratch_page = config.kv.decode_pages
    puller = KvPuller(pool, scratch_page, free_pages, config.kv.transfer_timeout_s, config.kv.transfer,
                      nixl_net_devices(config.kv.nixl_net_devices, config.router.zmq_endpoint()),
                      kv_heads_of(ranks.tp.rank, ranks.size, model.total_kv_heads))
    stream = worker_stream(model.device, high_priority=True)
    max_pages = pages_for(model.max_context, layout.page_size)
    if not attention_span(model.windows):  # else a request's pages are a ring over its row (kv/pages.py)
        max_pages = min(max_pages, config.kv.decode_pages)
    graphs = None
    sizes = config.decode.graph_batch_sizes()
    if model.device.type == "cuda" and sizes:
        with on_stream(stream):
            graphs = GraphedDecode(model, pool, scratch_page, max_pages, sizes)
    return RankEngine(model, pool, buffer, scratch_page, max_pages, puller, stream, graphs)


def lead_step(ranks: RankGroup, inputs: StepInputs) -> None:
    """Rank 0: the step's inputs to every follower, before rank 0 runs it."""
    if ranks.size == 1:
        return
    ranks.lead(STEP, len(inputs.token_ids), inputs.page_table.shape[1])
    for tensor in (inputs.token_ids, inputs.positions, inputs.page_table):
        ranks.broadcast(tensor.contiguous())  # the page table is a slice of a wider buffer


def follow_step(ranks: RankGroup, batch: int, width: int, device: torch.device) -> StepInputs:
    """A follower: the step's inputs as rank 0 sent them."""
    inputs = StepInputs(torch.empty(batch, dtype=torch.int64, device=device),
                        torch.empty(batch, dtype=torch.int64, device=device),
                        torch.empty((batch, width), dtype=torch.int32, device=device))
    for tensor in (inputs.token_ids, inputs.positions, inputs.page_table):
        ranks.broadcast(tensor)
    return inputs
