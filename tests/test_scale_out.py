"""Many workers on one node, as real processes: `python -m services.stack --prefill 2 --decode 2`,
and a decode that joins a running stack under a new id. Where each worker goes is unit-tested in
tests/test_topology.py; the same on a GPU in tests/test_gpu.py."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from pdserve.v1 import generation_pb2

from services.stack.topology import plan_workers
from tests.conftest import CACHE_DIR
from tests.stack import ServiceStack

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

IDS = ["decode-0", "decode-1", "prefill-0", "prefill-1"]


def _generate(stack: ServiceStack) -> list[int]:
    request = generation_pb2.GenerateRequest(prompt="The capital of France is", max_tokens=6, temperature=0,
                                             ignore_eos=True)
    return [t for chunk in stack.stub.Generate(request, timeout=120) for t in chunk.token_ids]


def _events(stack: ServiceStack, name: str, event: str) -> dict[str, dict]:
    """The last line of each worker that logged `event` in `name`'s log, by worker id."""
    return {line["worker_id"]: line for line in _json_objects(stack.log_path(name).read_text())
            if line.get("event") == event}


def _json_objects(text: str):
    """Every JSON object in a log that several processes write: a line may hold two, since each
    process writes a line and its newline apart."""
    decoder, at = json.JSONDecoder(), text.find("{")
    while at != -1:
        try:
            line, end = decoder.raw_decode(text, at)
        except ValueError:
            at = text.find("{", at + 1)
            continue
        yield line
        at = text.find("{", end)


def _listed(stack: ServiceStack) -> set[str]:
    return {worker.worker_id for worker in stack.workers()}


def test_the_launcher_starts_two_of_each_with_their_own_ids_ports_and_cores(tmp_path, checkpoint):
    with ServiceStack(tmp_path, CACHE_DIR, services=("stack",), prefill=2, decode=2) as stack:
        assert sorted(_listed(stack)) == IDS  # the stack was SERVING only once all four registered
        planned = {plan.name: plan for plan in plan_workers(stack.config)}  # as the launcher planned them
        ready = _events(stack, "stack", "model ready")
        serving = {name: line for name, line in _events(stack, "stack", "metrics endpoint serving").items()
                   if name != "router"}
        assert sorted(ready) == sorted(serving) == IDS
        assert {name: line["cores"] for name, line in ready.items()} == {n: list(p.cores) for n, p in planned.items()}
        assert {name: line["address"] for name, line in serving.items()} == {
            name: plan.metrics_address for name, plan in planned.items()}
        assert len({plan.metrics_address for plan in planned.values()}) == 4
        if len(os.sched_getaffinity(0)) >= 4:  # else they share cores round robin, as planned
            cores = [core for plan in planned.values() for core in plan.cores]
            assert len(cores) == len(set(cores))
        assert len(_generate(stack)) == 6
        stack.assert_pools_drained()


def test_a_decode_started_later_with_a_new_id_joins_the_routing_and_serves(tmp_path, checkpoint):
    with ServiceStack(tmp_path, CACHE_DIR) as stack:
        expected = _generate(stack)
        stack.start("decode-1")
        deadline = time.monotonic() + 180
        while "decode-1" not in _listed(stack):
            assert time.monotonic() < deadline and stack.processes["decode-1"].poll() is None, stack.tail("decode-1")
            time.sleep(0.5)
        assert _generate(stack) == expected
        # With decode-0 gone (it drains and exits 0), only the newcomer can serve.
        stack.signal("decode", signal.SIGTERM)
        assert stack.processes["decode"].wait(timeout=60) == 0
        while "decode-0" in _listed(stack):
            time.sleep(0.1)
        assert _listed(stack) == {"prefill-0", "decode-1"}
        assert _generate(stack) == expected
        stack.assert_pools_drained()
