"""Which KV heads each rank of a tensor-parallel group holds: the model shards attention by heads
(shared/model/tensor_parallel.py), so a rank's KV pool holds its own heads only, and whatever moves
or matches pages between ranks must agree on whose heads they are."""

from __future__ import annotations


def check_tensor_parallel(size: int, num_heads: int, num_kv_heads: int) -> None:
    """Refuses a group size the model's heads cannot be split over."""
    if size < 1:
        raise ValueError(f"tensor_parallel {size} must be at least 1")
    if num_heads % size:
        raise ValueError(f"tensor_parallel {size} does not divide the model's {num_heads} attention heads")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(f"tensor_parallel {size} and the model's {num_kv_heads} KV heads: neither divides the other")


def kv_heads_of(rank: int, size: int, num_kv_heads: int) -> range:
    """The global KV head ids rank `rank` holds: an equal run of consecutive heads each, or, with more
    ranks than KV heads, one head each, replicated over size // num_kv_heads ranks (as vLLM does),
    the one its query heads read."""
    if size <= num_kv_heads:
        per_rank = num_kv_heads // size
        return range(rank * per_rank, (rank + 1) * per_rank)
    head = rank * num_kv_heads // size
    return range(head, head + 1)
