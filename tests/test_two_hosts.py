"""Two hosts on one machine: the prefill on host A, the router and the decode on host B.

Each host is a network namespace of this test's own (joined by one veth pair, addresses in
198.18.0.0/30, a range kept for benchmarks, with no route anywhere else) and a mount namespace
with a /dev/shm of its own, so neither host sees the other's memory. The control plane is
tcp:// with CURVE and kv.transfer is auto: the router offers the decode the prefill's
shared-memory segment, which it cannot find on its host, and then NIXL, by which it reads the
pages, UCX on TCP over the veth: the interface each worker reaches the router's host by, where the
agents listen (kv.nixl_net_devices unset, and no UCX_NET_DEVICES). A client on host B
checks the answers token for token against transformers. The namespaces are removed at the end,
also on failure. Needs root, `ip` and `unshare`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest

from services.stack.supervisor import Service, Supervisor
from shared.kv.transfer.nixl_agent import nixl_module
from tests.conftest import CACHE_DIR
from tests.listeners import listening_sockets
from tests.reference import assert_matches_reference, reference_greedy
from tests.stack import REPO
from tests.test_security import _curve_keys, _curve_settings, _worker_key

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

HOST_A, HOST_B = "198.18.0.1", "198.18.0.2"
PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "List three prime numbers:"]
MAX_TOKENS = 10


def _cannot_run() -> str:
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "unshare", "mount") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not found"
    try:
        nixl_module()
    except RuntimeError as exc:
        return str(exc)
    return ""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@contextmanager
def two_hosts():
    """Two namespaces joined by a veth pair; yields {name: (namespace, veth, address)}; removes them."""
    tag = uuid.uuid4().hex[:6]
    hosts = {"a": (f"pdserve-{tag}-a", f"pdv{tag}a", HOST_A), "b": (f"pdserve-{tag}-b", f"pdv{tag}b", HOST_B)}
    made = []
    try:
        for namespace, _, _ in hosts.values():
            _ip("netns", "add", namespace)
            made.append(namespace)
        _ip("link", "add", hosts["a"][1], "type", "veth", "peer", "name", hosts["b"][1])
        for namespace, veth, address in hosts.values():
            _ip("link", "set", veth, "netns", namespace)  # the pair goes with its namespaces
            _ip("-n", namespace, "addr", "add", f"{address}/30", "dev", veth)
            _ip("-n", namespace, "link", "set", veth, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
        yield hosts
    finally:
        for namespace in made:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)


def on_host(namespace: str) -> tuple[str, ...]:
    """Runs a command in the host's network namespace with a /dev/shm of its own, exec'ing it."""
    return ("ip", "netns", "exec", namespace, "unshare", "--mount", "--propagation", "private",
            "sh", "-c", 'mount -t tmpfs tmpfs /dev/shm && exec "$0" "$@"')


_CLIENT = textwrap.dedent("""
    import json, sys, threading, time
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from pdserve.v1 import generation_pb2, generation_pb2_grpc
    address, max_tokens, prompts = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    channel = grpc.insecure_channel(address)
    health, stub = health_pb2_grpc.HealthStub(channel), generation_pb2_grpc.GenerationStub(channel)
    deadline = time.monotonic() + 300
    while True:
        try:
            if health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status == 1:
                break
        except grpc.RpcError:
            pass
        assert time.monotonic() < deadline, "the stack did not serve"
        time.sleep(0.5)
    answers = {}
    def generate(i, ids):
        request = generation_pb2.GenerateRequest(max_tokens=max_tokens, temperature=0)
        request.prompt_token_ids.extend(ids)
        answers[i] = [t for chunk in stub.Generate(request, timeout=120) for t in chunk.token_ids]
    threads = [threading.Thread(target=generate, args=(i, ids)) for i, ids in enumerate(prompts)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    time.sleep(2)  # heartbeats report the freed pages
    workers = stub.ListWorkers(generation_pb2.ListWorkersRequest(), timeout=5).workers
    pools = {w.worker_id: [w.free_pages, w.total_pages, w.reserved_pages] for w in workers}
    print(json.dumps({"answers": answers, "pools": pools}))
""")


@pytest.mark.skipif(bool(_cannot_run()), reason=_cannot_run() or "runs")
def test_a_prefill_on_another_host_hands_kv_over_by_nixl_token_exact(tmp_path, checkpoint, tokenizer,
                                                                     reference_model):
    keys = _curve_keys(tmp_path / "keys")
    endpoint = f"tcp://{HOST_B}:5555"
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    supervisor = Supervisor(grace_s=20.0)
    with two_hosts() as hosts:
        try:
            for name, host in (("router", "b"), ("decode", "b"), ("prefill", "a")):
                namespace, veth, _ = hosts[host]
                env = {**os.environ, **_curve_settings(endpoint, keys),
                       **(_worker_key(keys, name) if name != "router" else {}),
                       "PDSERVE_ROUTER_GRPC_ADDRESS": "127.0.0.1:50051", "PDSERVE_ROUTER_RUNTIME_DIR": str(tmp_path / host),
                       "PDSERVE_MODEL_CACHE_DIR": CACHE_DIR, "PDSERVE_LOG_FORMAT": "json", "PYTHONUNBUFFERED": "1",
                       "PDSERVE_KV_TRANSFER": "auto", "UCX_TLS": "tcp"}
                env.pop("UCX_NET_DEVICES", None)
                supervisor.start(Service(name, f"services.{name}", (), env, tmp_path / f"{name}.log",
                                         wrapper=on_host(namespace)))
            client = subprocess.run([*on_host(hosts["b"][0]), sys.executable, "-c", _CLIENT, "127.0.0.1:50051",
                                     str(MAX_TOKENS), json.dumps(prompts)],
                                    cwd=REPO, capture_output=True, text=True, timeout=600)
            assert client.returncode == 0, client.stderr[-3000:] + _tails(tmp_path)
            for name, host in (("prefill", HOST_A), ("decode", HOST_B)):  # metrics on loopback, NIXL on the veth
                sockets = listening_sockets(supervisor.processes[name].pid)
                assert {str(address) for address, _ in sockets} == {"127.0.0.1", host}, (name, sockets)
        finally:
            codes = supervisor.stop(20.0)
    report = json.loads(client.stdout.strip().splitlines()[-1])
    for i, prompt in enumerate(prompts):
        expected, logits = reference_greedy(reference_model, prompt, MAX_TOKENS)
        assert_matches_reference(report["answers"][str(i)], expected, logits, f"prompt {i} across hosts")
    assert all(free == total and reserved == 0 for free, total, reserved in report["pools"].values()), report
    decode_log = [json.loads(line) for line in (tmp_path / "decode.log").read_text().splitlines()
                  if line.startswith("{")]
    pools = [(e["event"], e.get("backend")) for e in decode_log if "prefill pool" in e["event"]]
    assert pools == [("cannot map prefill pool", None), ("mapped prefill pool", "nixl")], pools
    assert '"offering NIXL' in (tmp_path / "router.log").read_text()
    assert codes == {"router": 0, "decode": 0, "prefill": 0}, codes


def _tails(folder: Path) -> str:
    return "".join(f"\n--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:])
                   for log in sorted(folder.glob("*.log")))
