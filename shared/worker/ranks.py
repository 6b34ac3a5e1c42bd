"""The ranks of a tensor-parallel worker (prefill.tensor_parallel, decode.tensor_parallel > 1).

One OS process per rank, each on its own device (rank k on model.device's GPU index + k; all on the
CPU there), joined by torch.distributed in one group: gloo for CPU tensors, NCCL for GPU ones.
Rank 0 is the worker the router knows: it registers, schedules, samples and speaks for every rank.
It starts the other ranks itself, as its children running its own command line with
PDSERVE_TP_RANK and PDSERVE_TP_STORE (rank 0's rendezvous) set, so that whatever starts a worker
(make run's supervisor, a systemd unit) starts and restarts its ranks as one: a rank that dies
fails rank 0's next collective, rank 0 exits, and its children die with it.

Rank 0 leads: before each piece of device work it broadcasts a command, msgpack [name, *args], and
the followers run the same work on their shards, so the model's collectives pair up; no rank
decides alone (a prompt abandoned between two chunks is rank 0's decision, broadcast per chunk).
Every collective times out after router.progress_timeout_s, the time the router gives a worker
to show progress: a rank that hangs ends the group within it instead of leaving the others
waiting forever. An idle rank 0 sends a tick now and then so that its followers' wait for the
next command does not time out.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import msgpack
import structlog
import torch
import torch.distributed as dist

from shared.model.tensor_parallel import SINGLE, RankLost, TensorParallel

log = structlog.get_logger()

RANK_VARIABLE = "PDSERVE_TP_RANK"
STORE_VARIABLE = "PDSERVE_TP_STORE"  # host:port of rank 0's TCPStore
STOP = "stop"
TICK = "tick"
# How long rank 0 waits for its followers, all of them together, to exit after telling them to stop:
# one deadline, so that a worker's way out stays within its supervisor's grace whatever its ranks.
CHILD_EXIT_S = 10.0


def own_rank() -> int:
    """0 in a worker started by anyone but its rank 0."""
    return int(os.environ.get(RANK_VARIABLE, "0"))


def rank_device(device: str, rank: int) -> str:
    """Rank k's device: model.device's GPU index + k; "cuda" counts from CUDA's first GPU."""
    if not device.startswith("cuda"):
        return device
    index = int(device.partition(":")[2] or 0)
    return f"cuda:{index + rank}"


class RankGroup:
    """This process's place in its worker's ranks; at size 1 every method costs nothing."""

    def __init__(self, tp: TensorParallel, timeout_s: float, children: list[subprocess.Popen] | None = None):
        self.tp = tp
        self.timeout_s = timeout_s
        self.children = children or []
        self.last_command = time.monotonic()

    @property
    def size(self) -> int:
        return self.tp.size

    @property
    def leads(self) -> bool:
        return self.tp.rank == 0

    def lead(self, name: str, *args) -> None:
        """Rank 0: every follower runs command `name` next."""
        if self.size > 1:
            self._broadcast_bytes(msgpack.packb([name, *args], use_bin_type=True))
            self.last_command = time.monotonic()

    def follow(self) -> tuple[str, list]:
        """A follower: the next command, waiting for it."""
        name, *args = msgpack.unpackb(self._broadcast_bytes(b""), raw=False)
        return name, args

    def keep_alive(self) -> None:
        """Rank 0, from its loop: a tick to followers that have heard nothing for a while."""
        if self.size > 1 and time.monotonic() - self.last_command > self.timeout_s / 4:
            self.lead(TICK)

    def decide(self, go_on: bool = False) -> bool:
        """Rank 0's yes or no, the same on every rank (a follower's argument is ignored)."""
        if self.size == 1:
            return go_on
        flag = torch.tensor([int(go_on)], dtype=torch.int32)
        self._collective(dist.broadcast, flag, 0)
        return bool(flag.item())

    def all_agree(self, ok: bool) -> bool:
        """True where every rank says ok: what one rank failed at (a pool it cannot map), all undo."""
        if self.size == 1:
            return ok
        flag = torch.tensor([int(ok)], dtype=torch.int32)
        self._collective(dist.all_reduce, flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's tensor into every rank's tensor of the same shape and dtype (in place)."""
        if self.size > 1:
            self._collective(dist.broadcast, tensor, 0)
        return tensor

    def gather_bytes(self, mine: bytes) -> list[bytes]:
        """Every rank's bytes, in rank order, on every rank."""
        if self.size == 1:
            return [mine]
        out = []
        for rank in range(self.size):
            out.append(self._broadcast_bytes(mine if rank == self.tp.rank else b"", root=rank))
        return out

    def close(self) -> None:
        """Rank 0: tells its followers to stop and waits for them (bounded); then leaves the group."""
        if self.size == 1:
            return
        if self.leads:
            try:
                self.lead(STOP)
            except RankLost:
                pass  # a follower is gone already: the others fail their next collective and exit
            deadline = time.monotonic() + CHILD_EXIT_S
            for child in self.children:
                try:
                    child.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
        dist.destroy_process_group()

    def _broadcast_bytes(self, payload: bytes, root: int = 0) -> bytes:
        size = torch.tensor([len(payload)], dtype=torch.int64)
        self._collective(dist.broadcast, size, root)
        buffer = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.tp.rank == root
                  else torch.empty(int(size.item()), dtype=torch.uint8))
        if len(buffer):
            self._collective(dist.broadcast, buffer, root)
        return buffer.numpy().tobytes()

    def _collective(self, collective, *args, **kwargs) -> None:
        RankLost.raised_by(collective, *args, group=self.tp.group, rank=self.tp.rank, size=self.size, **kwargs)


def solo() -> RankGroup:
    """A worker without tensor parallelism: one rank, no group."""
    return RankGroup(SINGLE, 0.0)


def join_ranks(size: int, device: torch.device, timeout_s: float) -> RankGroup:
    """This worker's ranks joined: rank 0 starts the others first. At size 1 nothing is started."""
    if size == 1:
        return solo()
    rank = own_rank()
    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=timeout, wait_for_workers=False)
        children = [_start_follower(k, f"127.0.0.1:{store.port}") for k in range(1, size)]
    else:
        host, _, port = os.environ[STORE_VARIABLE].rpartition(":")
        store = dist.TCPStore(host, int(port), size, is_master=False, timeout=timeout)
        children = []
        _follow_signals()
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    log.info("tensor-parallel ranks joined", rank=rank, size=size, device=str(device))
    return RankGroup(TensorParallel(rank, size, dist.group.WORLD), timeout_s, children)


def _start_follower(rank: int, store: str) -> subprocess.Popen:
    """Rank `rank` as a child running this process's command line (sys.orig_argv keeps `-m`)."""
    env = {**os.environ, RANK_VARIABLE: str(rank), STORE_VARIABLE: store}
    return subprocess.Popen([sys.executable, *sys.orig_argv[1:]], env=env)


def _follow_signals() -> None:
    """A follower stops when rank 0 says so, not at a signal: systemd and a terminal send theirs to
    every process of the worker, and rank 0 drains before it stops. SIGTERM after rank 0 died (the
    parent-death signal, shared/runtime/process.py) ends it."""
    parent = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(1) if os.getppid() != parent else None)
