"""Several prefills and decodes on one node behind the router: spread, retry, drain (real processes)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pdserve.v1 import generation_pb2, generation_pb2_grpc
from tests.conftest import CACHE_DIR
from tests.reference import assert_matches_reference, reference_greedy
from tests.stack import REPO, ServiceStack

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FAST_HEARTBEATS = {"PDSERVE_ROUTER_HEARTBEAT_TIMEOUT_S": "1.5", "PDSERVE_WORKER_HEARTBEAT_INTERVAL_S": "0.25"}
MAX_TOKENS = 16
PROMPTS = ["The three primary colors are", "Once upon a time, in a small village,", "def fibonacci(n):\n    ",
           "The capital of France is", "Water boils at", "My favourite book is", "The quick brown fox",
           "In the beginning"]


def _greedy(prompt: str | None = None, max_tokens: int = MAX_TOKENS, token_ids: list[int] | None = None,
            ignore_eos: bool = True):
    request = generation_pb2.GenerateRequest(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos)
    if token_ids is not None:
        request.prompt_token_ids.extend(token_ids)
    else:
        request.prompt = prompt
    return request


def _token_ids(stub, request, timeout: float = 300.0) -> list[int]:
    return [t for chunk in stub.Generate(request, timeout=timeout) for t in chunk.token_ids]


def _served_by(stack) -> dict[str, Counter]:
    """How many finished requests each prefill and each decode served, from the router's summary lines."""
    served = {"prefill": Counter(), "decode": Counter()}
    for line in stack.log_path("router").read_text().splitlines():
        event = json.loads(line) if line.startswith("{") else {}
        if event.get("event") == "request finished" and not event["aborted"]:
            served["prefill"][event["prefill"]] += 1
            served["decode"][event["decode"]] += 1
    return served


@pytest.fixture(scope="module")
def references(tokenizer, reference_model):
    return [reference_greedy(reference_model, tokenizer(p)["input_ids"], MAX_TOKENS) for p in PROMPTS]


def test_two_prefills_and_two_decodes_answer_concurrent_requests_token_exact(checkpoint, tmp_path, references):
    with ServiceStack(tmp_path, CACHE_DIR, prefill=2, decode=2) as stack:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(pool.map(lambda p: _token_ids(stack.stub, _greedy(p, ignore_eos=False)), PROMPTS))
        for prompt, got, (expected, logits) in zip(PROMPTS, results, references):
            assert_matches_reference(got, expected, logits, prompt)
        served = _served_by(stack)
        assert set(served["prefill"]) == {"prefill-0", "prefill-1"}, served
        assert set(served["decode"]) == {"decode-0", "decode-1"}, served
        workers = stack.workers()
        assert {w.worker_id for w in workers} == {"prefill-0", "prefill-1", "decode-0", "decode-1"}
        assert all(w.pending_prompt_tokens == 0 and w.assigned_requests == 0 and not w.draining for w in workers)
        stack.assert_pools_drained()


def test_a_killed_prefill_loses_none_of_its_queued_requests(checkpoint, tmp_path):
    """Prompts queue on both prefills; one is killed: each of its requests moves, once, to the other
    before its first token, and the client sees no error."""
    with ServiceStack(tmp_path, CACHE_DIR, prefill=2, decode=1, **FAST_HEARTBEATS) as stack:
        prompts = [[1000 + (i * 37 + j) % 5000 for j in range(600)] for i in range(4)]  # ~5 s each alone
        with ThreadPoolExecutor(len(prompts)) as pool:
            calls = [pool.submit(_token_ids, stack.stub, _greedy(token_ids=p, max_tokens=4)) for p in prompts]
            time.sleep(1.5)  # each prefill computes one and queues the others
            stack.signal("prefill-0", signal.SIGKILL)
            assert [len(call.result(timeout=300)) for call in calls] == [4] * len(prompts)
        assert stack.metric("pdserve:request_retries_total") >= 1
        assert "request moved to another prefill" in stack.log_path("router").read_text()
        assert "prefill-0" not in {w.worker_id for w in stack.workers()}
        stack.assert_pools_drained()


def test_draining_a_decode_under_load_loses_none(checkpoint, tmp_path):
    """`pdserve drain decode-0` while both decodes stream: every request finishes whole, decode-0
    exits 0 once nothing of it is in flight, and decode-1 takes the rest."""
    with ServiceStack(tmp_path, CACHE_DIR, prefill=1, decode=2) as stack:
        with ThreadPoolExecutor(8) as pool:
            calls = [pool.submit(_token_ids, stack.stub, _greedy(p, 48)) for p in PROMPTS]
            time.sleep(2.0)  # streams under way on both decodes
            drained = subprocess.run([sys.executable, "-m", "services.client", "--address", stack.address,
                                      "--admin-token-file", stack.config.router.admin_token_file,
                                      "drain", "decode-0"], cwd=REPO, capture_output=True, text=True, timeout=60)
            assert drained.returncode == 0, drained.stderr
            late = [pool.submit(_token_ids, stack.stub, _greedy(p, 8)) for p in PROMPTS[:4]]  # placed on decode-1
            assert [len(call.result(timeout=300)) for call in calls] == [48] * len(PROMPTS)
            assert [len(call.result(timeout=300)) for call in late] == [8] * 4
        assert stack.processes["decode-0"].wait(timeout=60) == 0
        assert "decode-0" not in {w.worker_id for w in stack.workers()}
        assert _served_by(stack)["decode"]["decode-1"] >= 4
        with pytest.raises(grpc.RpcError) as error:
            generation_pb2_grpc.AdminStub(stack.channel).Drain(generation_pb2.DrainRequest(worker_id="decode-9"),
                                                               metadata=stack.admin_bearer)
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
        stack.assert_pools_drained()


def test_a_prefill_whose_pool_the_decode_cannot_map_gets_no_request(checkpoint, tmp_path):
    """A prefill the decode cannot pull from (here a peer announcing a segment that does not exist,
    idle and roomy, so the cost alone would pick it): the decode says PoolUnreachable and the
    router routes every request to the prefill it can pull from."""
    from shared.control.messages import PrefillTask, Registered, Role
    from tests.protocol_peer import ProtocolPeer
    from tests.test_control_plane import _fingerprint

    with ServiceStack(tmp_path, CACHE_DIR) as stack:
        peer = ProtocolPeer(f"ipc://{tmp_path}/run/router.ipc", "prefill-9", Role.PREFILL, _fingerprint(checkpoint),
                            total_pages=100_000)
        try:
            peer.register()
            peer.receive(Registered)
            deadline = time.monotonic() + 30
            while "pair avoided" not in stack.log_path("router").read_text():
                assert time.monotonic() < deadline, "the decode never said it cannot reach prefill-9"
                time.sleep(0.1)
            with ThreadPoolExecutor(4) as pool:
                outputs = list(pool.map(lambda p: _token_ids(stack.stub, _greedy(p, 4)), PROMPTS[:4]))
            assert all(len(tokens) == 4 for tokens in outputs)
            with pytest.raises(TimeoutError):
                peer.receive(PrefillTask, timeout_s=0.5)
            assert _served_by(stack)["prefill"] == Counter({"prefill-0": 4})
        finally:
            peer.close()
        stack.assert_pools_drained()
