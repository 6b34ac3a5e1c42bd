"""A tensor-parallel worker's ranks (shared/worker/ranks.py), two gloo processes without a model:
rank 0's commands reach the follower as sent, and a rank that hangs or dies fails the other's next
collective within the group's timeout instead of leaving it waiting forever."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shared.model.tensor_parallel import RankLost, TensorParallel
from shared.worker.ranks import STOP, RankGroup
from tests.stack import free_port

pytestmark = pytest.mark.e2e

LONG_S = 120.0  # for the processes to start and meet, and answer, on a loaded machine too
TIMEOUT_S = 3.0  # the group's collective timeout where a rank hangs (router.progress_timeout_s in a worker)


def _join(rank: int, port: int, timeout_s: float) -> RankGroup:
    """The ranks' group with that timeout, in a world that had long enough to come together."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=LONG_S))
    group = dist.new_group(timeout=timedelta(seconds=timeout_s))
    return RankGroup(TensorParallel(rank, 2, group), timeout_s)


def _commands(rank: int, port: int, results) -> None:
    ranks = _join(rank, port, LONG_S)
    if ranks.leads:
        ranks.lead("prefill", [1, 2, 3], [7], 16)
        decided = ranks.decide(False)
        agreed = ranks.all_agree(True)
        table = ranks.broadcast(torch.arange(6, dtype=torch.int32).view(2, 3).t().contiguous())
        gathered = ranks.gather_bytes(b"rank zero")
        ranks.lead(STOP)
    else:
        command = ranks.follow()
        decided = ranks.decide()
        agreed = ranks.all_agree(False)
        table = ranks.broadcast(torch.empty(3, 2, dtype=torch.int32))
        gathered = ranks.gather_bytes(b"rank one")
        results.put(("follower", command, ranks.follow()[0]))
    results.put((rank, decided, agreed, table.tolist(), gathered))
    dist.destroy_process_group()


def test_commands_decisions_and_tensors_reach_every_rank_as_rank_0_sent_them():
    results = mp.get_context("spawn").Queue()
    mp.spawn(_commands, args=(free_port(), results), nprocs=2)
    got = [results.get(timeout=LONG_S) for _ in range(3)]
    follower = next(r for r in got if r[0] == "follower")
    assert follower[1] == ("prefill", [[1, 2, 3], [7], 16]) and follower[2] == STOP
    by_rank = {r[0]: r[1:] for r in got if r[0] != "follower"}
    assert by_rank[0] == by_rank[1] == (False, False, [[0, 3], [1, 4], [2, 5]], [b"rank zero", b"rank one"])


def _hang_or_die(rank: int, port: int, fate: str, results) -> None:
    ranks = _join(rank, port, TIMEOUT_S)
    if not ranks.leads:
        if fate == "dies":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10 * LONG_S)  # hangs, past any wait of the test: never follows
        return
    try:
        ranks.lead("step", 1, 1)
        ranks.all_agree(True)
    except RankLost as error:
        results.put(str(error))
    else:
        results.put("no error")


@pytest.mark.parametrize("fate", ["hangs", "dies"])
def test_a_rank_that_hangs_or_dies_fails_rank_0s_next_collective_within_the_timeout(fate):
    results = mp.get_context("spawn").Queue()
    context = mp.spawn(_hang_or_die, args=(free_port(), fate, results), nprocs=2, join=False)
    # Ended by the group's timeout: the hung rank sleeps far longer than this wait.
    assert "rank 0 of 2: a rank broke off" in results.get(timeout=LONG_S)
    for process in context.processes:
        process.kill()
        process.join()
