"""A prefill rank's KV pool, exported, and the handles of every rank's pool for rank 0's Register.

Each rank of a tensor-parallel prefill (shared/worker/ranks.py) holds its own KV heads in its own
pool, exported by the kinds kv.transfer calls for; page ids are the same on every rank. Rank 0
registers them all, in the order shared/kv/transfer/choice.py gives, so that each decode rank
opens the pools that hold its heads (services/decode/kv_pull.py).
"""

from __future__ import annotations

from shared.config.schema import Config
from shared.control import wire
from shared.control.messages import KvLayout, KvPoolHandle, PoolAvailable
from shared.kv.heads import kv_heads_of
from shared.kv.transfer import ExportedPool, export_pool, handles_of_ranks
from shared.kv.transfer.nixl_network import nixl_net_devices
from shared.model.llama import PagedLlama
from shared.worker.ranks import RankGroup


def export_rank_pool(config: Config, model: PagedLlama, ranks: RankGroup, layout: KvLayout,
                     colocated: bool = False) -> tuple[ExportedPool, list[KvPoolHandle]]:
    """This rank's pool exported, and every rank's handles (a collective: every rank calls it)."""
    rank = ranks.tp.rank
    # Decodes may be on other hosts only where the control plane is tcp:// (choice.py).
    cross_host = config.router.zmq_endpoint().startswith("tcp://") and not colocated
    name = config.prefill.worker_id if rank == 0 else f"{config.prefill.worker_id}.rank{rank}"
    exported = export_pool(layout, name, model.device, config.kv.transfer, cross_host,
                           nixl_net_devices(config.kv.nixl_net_devices, config.router.zmq_endpoint()),
                           kv_heads_of(rank, ranks.size, model.total_kv_heads).start)
    try:
        mine = wire.encode(PoolAvailable(name, exported.handles))
        by_rank = [wire.decode(frame).pool_handles for frame in ranks.gather_bytes(mine)]
    except BaseException:
        exported.close()
        raise
    return exported, handles_of_ranks(by_rank)
