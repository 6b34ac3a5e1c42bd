"""Security: CURVE on a tcp:// ZeroMQ socket, each key bound to its worker ids, TLS and a bearer
token on gRPC and HTTP, no pickle or eval.

The promises are checked against the real processes and sockets (tests.stack.ServiceStack): two
stacks (CURVE, TLS + token), a worker whose key does not grant its id, and two processes that
must refuse to start. Config checks, the key policy and the source scan run in-process.
"""

from __future__ import annotations

import ast
import asyncio
import http.client
import os
import re
import shutil
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
import zmq
import zmq.asyncio
import zmq.auth
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.v1 import generation_pb2, generation_pb2_grpc
from shared.config.loading import load_config
from shared.config.schema import ConfigError
from shared.control import wire
from shared.control.curve import KeyPolicy, secure_server
from shared.control.messages import (
    EXIT_REFUSED,
    PROTOCOL_VERSION,
    Heartbeat,
    ModelFingerprint,
    Register,
    Reregister,
    Role,
)
from shared.runtime.service_config import check_service, is_loopback
from tests.stack import REPO, SERVICES, ServiceStack, free_port

CACHE_DIR = os.environ.get("PDSERVE_MODEL_CACHE_DIR", "~/.cache/pdserve")
TOKEN = "s3cret-token-for-tests"


def _generate(stub, metadata=()) -> int:
    request = generation_pb2.GenerateRequest(prompt="Hello", max_tokens=3, ignore_eos=True, temperature=0)
    return sum(len(chunk.token_ids) for chunk in stub.Generate(request, timeout=60, metadata=metadata))


# ---- CURVE on tcp:// ----

# Admitted keys and what each may register as; intruder's key is made but not admitted.
GRANTS = {"prefill": ("prefill", "prefill-*"), "decode": ("decode", "decode-*"),
          "probe": ("decode", "probe-0, probe-1")}


def _authorize(public_key: Path, folder: Path, role: str, worker_ids: str) -> None:
    """The public-key certificate, with the metadata that binds it, into the authorized folder:
    what README.md's Security part does with sed."""
    grant = f"    role = {role}\n    worker_ids = {worker_ids}\n"
    text = public_key.read_text().replace("\nmetadata\n", f"\nmetadata\n{grant}")
    (folder / public_key.name).write_text(text)


def _curve_keys(folder: Path) -> dict[str, Path]:
    certs, admitted = folder / "certs", folder / "admitted"
    certs.mkdir(parents=True)
    admitted.mkdir()
    for name in ("router", *GRANTS, "intruder"):
        zmq.auth.create_certificates(certs, name)
    for name, (role, worker_ids) in GRANTS.items():
        _authorize(certs / f"{name}.key", admitted, role, worker_ids)
    return {"certs": certs, "admitted": admitted}


def _curve_settings(endpoint: str, keys: dict[str, Path]) -> dict[str, str]:
    """What every service gets; each worker's own key pair is _worker_key's."""
    certs = keys["certs"]
    return {"PDSERVE_ROUTER_ZMQ_ADDRESS": endpoint,
            "PDSERVE_ROUTER_ZMQ_SECRET_KEY_FILE": str(certs / "router.key_secret"),
            "PDSERVE_ROUTER_ZMQ_AUTHORIZED_KEYS_DIR": str(keys["admitted"]),
            "PDSERVE_WORKER_ZMQ_ROUTER_PUBLIC_KEY_FILE": str(certs / "router.key")}


def _worker_key(keys: dict[str, Path], name: str) -> dict[str, str]:
    return {"PDSERVE_WORKER_ZMQ_SECRET_KEY_FILE": str(keys["certs"] / f"{name}.key_secret")}


def _peer_replies(endpoint: str, frames: list[object], key_pair: Path | None, router_key: Path,
                  wait_s: float = 2.0) -> list[object]:
    """What the router answers a raw DEALER that sends frames, as a CURVE client with key_pair or plain."""
    context = zmq.Context()
    try:
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.IDENTITY, b"peer-0")
        if key_pair is not None:
            socket.curve_publickey, socket.curve_secretkey = zmq.auth.load_certificate(key_pair)
            socket.curve_serverkey = zmq.auth.load_certificate(router_key)[0]
        socket.connect(endpoint)
        for message in frames:
            socket.send(wire.encode(message))
        replies = []
        while socket.poll(int(wait_s * 1000)):
            replies.append(wire.decode(socket.recv()))
        socket.close(linger=0)
        return replies
    finally:
        context.term()


@pytest.fixture(scope="module")
def curve_keys(tmp_path_factory) -> dict[str, Path]:
    return _curve_keys(tmp_path_factory.mktemp("curve-keys"))


@pytest.fixture(scope="module")
def curve_stack(tmp_path_factory, checkpoint, curve_keys):
    """The stack on tcp:// with CURVE: the prefill and the decode each with a key of its own."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with ServiceStack(tmp_path_factory.mktemp("curve"), CACHE_DIR,
                      service_env={name: _worker_key(curve_keys, name) for name in ("prefill", "decode")},
                      PDSERVE_ROUTER_ADMIN_TOKEN_FILE="",  # Admin off
                      **_curve_settings(endpoint, curve_keys)) as stack:
        yield stack
        stack.assert_pools_drained()
        codes = stack.stop()
    assert {name: codes[name] for name in SERVICES} == {name: 0 for name in SERVICES}


@pytest.mark.e2e
@pytest.mark.slow
def test_curve_admits_only_authorized_workers(curve_stack, curve_keys):
    stack, certs = curve_stack, curve_keys["certs"]
    endpoint, router_key = stack.env["PDSERVE_ROUTER_ZMQ_ADDRESS"], certs / "router.key"
    # Valid frames: without CURVE the router would register this peer as a decode and answer.
    register = Register("intruder-0", Role.DECODE, PROTOCOL_VERSION, "intruder", os.getpid(), 64, 16, 8, 0, [],
                        ModelFingerprint("c", "w", "t", "float32", "layers=30"))
    heartbeat = Heartbeat("intruder-0", "", 64, 0, 0, 0.0, [])
    assert _generate(stack.stub) == 3  # the workers registered over CURVE with admitted keys

    # Control: an admitted key's heartbeat reaches the router, which asks the unknown peer to register.
    assert _peer_replies(endpoint, [heartbeat], certs / "probe.key_secret", router_key) == [Reregister()]
    # No keys, or a key pair not in the admitted folder: the handshake fails, nothing arrives.
    assert _peer_replies(endpoint, [register, heartbeat], None, router_key) == []
    assert _peer_replies(endpoint, [register, heartbeat], certs / "intruder.key_secret", router_key) == []

    assert sorted(w.worker_id for w in stack.workers()) == ["decode-0", "prefill-0"]
    assert _generate(stack.stub) == 3
    log = stack.log_path("router").read_text()
    assert "intruder-0" not in log and log.count('"worker registered"') == 2


@pytest.mark.e2e
@pytest.mark.slow
def test_a_decode_key_cannot_register_a_prefill(curve_stack, curve_keys):
    """The decode's key is admitted, but its certificate grants decode-* only. A second prefill-0
    that connects with it is refused: it exits EXIT_REFUSED (a restart would be refused again),
    and the router keeps, and serves with, the prefill-0 whose key grants it."""
    stack, rogue = curve_stack, "services.prefill"  # a name of its own beside the stack's prefill
    stack.service_env[rogue] = {**_worker_key(curve_keys, "decode"), "PDSERVE_PREFILL_METRICS_ADDRESS": ""}
    stack.start(rogue)
    assert stack.processes[rogue].wait(timeout=240) == EXIT_REFUSED, stack.tail(rogue)
    assert "refused" in stack.tail(rogue)
    assert sorted((w.worker_id, w.role) for w in stack.workers()) == [("decode-0", "decode"), ("prefill-0", "prefill")]
    assert stack.log_path("router").read_text().count('"worker registered"') == 2
    assert _generate(stack.stub) == 3


@pytest.mark.e2e
@pytest.mark.slow
def test_a_decode_gets_the_nixl_handle_only_once_it_cannot_open_the_pool_on_its_host(curve_stack, curve_keys,
                                                                                     checkpoint):
    """On tcp:// with kv.transfer auto the prefill offers shared memory and NIXL, whose data plane has
    no authentication. A decode (here a peer with an admitted key) is offered shared memory alone;
    NIXL only once it says it cannot open that (it runs on another host); past that, the pair is avoided."""
    from shared.control.messages import Deregister, PoolAvailable, PoolUnreachable, Registered
    from tests.protocol_peer import ProtocolPeer
    from tests.test_control_plane import _fingerprint

    stack, certs = curve_stack, curve_keys["certs"]
    peer = ProtocolPeer(stack.env["PDSERVE_ROUTER_ZMQ_ADDRESS"], "probe-0", Role.DECODE, _fingerprint(checkpoint),
                        curve=(certs / "probe.key_secret", certs / "router.key"))
    try:
        peer.register()
        peer.receive(Registered)
        first = peer.receive(PoolAvailable)
        assert (first.prefill_worker_id, [h.backend for h in first.pool_handles]) == ("prefill-0", ["shm"])
        peer.send(PoolUnreachable("prefill-0", "no such shared-memory segment on this host"))
        second = peer.receive(PoolAvailable)
        assert (second.prefill_worker_id, [h.backend for h in second.pool_handles]) == ("prefill-0", ["nixl"])
        peer.send(PoolUnreachable("prefill-0", "NIXL refused"))
        with pytest.raises(TimeoutError):
            peer.receive(PoolAvailable, timeout_s=1.0)
        assert '"event": "pair avoided' in stack.log_path("router").read_text()
        peer.send(Deregister("probe-0"))
    finally:
        peer.close()
    mapped = [line for line in stack.log_path("decode").read_text().splitlines() if "mapped prefill pool" in line]
    assert mapped and all('"backend": "shm"' in line and '"passed_over": []' in line for line in mapped), mapped
    assert _generate(stack.stub) == 3


@pytest.mark.e2e
@pytest.mark.slow
def test_router_and_worker_refuse_tcp_without_keys(tmp_path):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    stack = ServiceStack(tmp_path, CACHE_DIR, services=(), PDSERVE_ROUTER_ZMQ_ADDRESS=endpoint)
    try:
        for name in ("router", "prefill"):
            stack.start(name)
        for name, process in stack.processes.items():
            assert process.wait(timeout=120) == 2, stack.tail(name)
            assert f"router.zmq_address {endpoint} is open to the network" in stack.tail(name)
        assert "set router.zmq_secret_key_file and router.zmq_authorized_keys_dir" in stack.tail("router")
        assert "set worker.zmq_secret_key_file and worker.zmq_router_public_key_file" in stack.tail("prefill")
    finally:
        stack.stop()


@pytest.mark.e2e
@pytest.mark.slow
def test_a_router_open_to_the_network_without_tls_and_token_refuses_to_start(tmp_path):
    stack = ServiceStack(tmp_path, CACHE_DIR, services=(), PDSERVE_ROUTER_GRPC_ADDRESS=f"0.0.0.0:{free_port()}")
    try:
        stack.start("router")
        assert stack.processes["router"].wait(timeout=120) == 2, stack.tail("router")
        assert "router.allow_insecure_network = true" in stack.tail("router")
    finally:
        stack.stop()


def _config(**environ: str):
    return load_config(None, environ={"PDSERVE_ROUTER_RUNTIME_DIR": "/nonexistent", **environ})


def test_config_checks_keys_per_service(tmp_path):
    keys = _curve_keys(tmp_path)
    for service in ("router", "prefill", "decode"):
        check_service(_config(), service)  # ipc:// needs no keys
        both = {**_curve_settings("tcp://127.0.0.1:5555", keys), **_worker_key(keys, "decode")}
        check_service(_config(**both), service)
    router_only = {k: v for k, v in _curve_settings("tcp://127.0.0.1:5555", keys).items() if "_WORKER_" not in k}
    check_service(_config(**router_only), "router")  # the router needs no worker's key, and back
    with pytest.raises(ConfigError, match="set worker.zmq_secret_key_file and worker.zmq_router_public_key_file"):
        check_service(_config(**router_only), "decode")
    public_only = {**router_only, "PDSERVE_ROUTER_ZMQ_SECRET_KEY_FILE": str(keys["certs"] / "router.key")}
    with pytest.raises(ConfigError, match="holds only a public key"):
        check_service(_config(**public_only), "router")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no public-key certificate"):
        empty = {**router_only, "PDSERVE_ROUTER_ZMQ_AUTHORIZED_KEYS_DIR": str(tmp_path / "empty")}
        check_service(_config(**empty), "router")


@pytest.mark.parametrize(("metadata", "words"), [
    ("", "does not say which worker it admits: add `role = prefill`"),  # as zmq.auth writes a .key
    ("    role = decode\n", "does not say which worker it admits"),
    ("    role = router\n    worker_ids = decode-*\n", "role 'router' must be prefill or decode"),
    ("    role = decode\n    worker_ids = ,\n", "worker_ids names no worker"),
])
def test_router_refuses_a_certificate_that_grants_no_worker(tmp_path, metadata, words):
    keys = _curve_keys(tmp_path)
    zmq.auth.create_certificates(tmp_path, "vague")
    text = (tmp_path / "vague.key").read_text().replace("\nmetadata\n", f"\nmetadata\n{metadata}")
    (keys["admitted"] / "vague.key").write_text(text)
    with pytest.raises(ConfigError, match=f"router.zmq_authorized_keys_dir: .*vague.key.* {re.escape(words)}"):
        check_service(_config(**_curve_settings("tcp://127.0.0.1:5555", keys)), "router")


def test_router_refuses_one_key_under_two_certificates(tmp_path):
    keys = _curve_keys(tmp_path)
    shutil.copy(keys["admitted"] / "decode.key", keys["admitted"] / "decode-again.key")
    with pytest.raises(ConfigError, match="hold the same public key"):
        check_service(_config(**_curve_settings("tcp://127.0.0.1:5555", keys)), "router")


def test_key_policy_permits_only_the_granted_role_and_ids(tmp_path):
    policy = KeyPolicy.from_folder(_curve_keys(tmp_path)["admitted"])
    assert sorted(policy.grants) == ["decode.key", "prefill.key", "probe.key"]
    assert policy.permits("decode.key", "decode-0", Role.DECODE)
    assert policy.permits("decode.key", "decode-east-12", Role.DECODE)  # a glob
    assert policy.permits("probe.key", "probe-1", Role.DECODE)  # a list
    assert policy.permits("prefill.key", "prefill-0", Role.PREFILL)
    assert not policy.permits("decode.key", "prefill-0", Role.PREFILL)  # another key's id
    assert not policy.permits("decode.key", "decode-0", Role.PREFILL)  # its ids, in another role
    assert not policy.permits("decode.key", "my-decode-0", Role.DECODE)  # a glob matches the whole id
    assert not policy.permits("probe.key", "probe-2", Role.DECODE)
    assert not policy.permits("intruder.key", "decode-0", Role.DECODE)  # not admitted
    assert not policy.permits(None, "decode-0", Role.DECODE)  # a frame without a User-Id


def test_each_connection_is_named_by_its_certificate(tmp_path):
    """What the router reads per frame: the ZAP User-Id, which secure_server's authenticator sets
    to the admitted certificate's file name, and which the returned policy takes."""
    keys = _curve_keys(tmp_path)
    router = _config(**_curve_settings(f"tcp://127.0.0.1:{free_port()}", keys)).router

    async def user_ids() -> list[str]:
        context = zmq.asyncio.Context()
        server = context.socket(zmq.ROUTER)
        security = secure_server(server, router)
        server.bind(router.zmq_address)
        seen = []
        for name in ("decode", "probe"):
            client = context.socket(zmq.DEALER)
            client.curve_publickey, client.curve_secretkey = zmq.auth.load_certificate(
                keys["certs"] / f"{name}.key_secret")
            client.curve_serverkey = zmq.auth.load_certificate(keys["certs"] / "router.key")[0]
            client.connect(router.zmq_address)
            await client.send(b"hello")
            frames = await asyncio.wait_for(server.recv_multipart(copy=False), timeout=10)
            seen.append(frames[-1].get("User-Id"))
            client.close(linger=0)
        assert security.permits(seen[0], "decode-0", Role.DECODE)
        assert not security.permits(seen[0], "prefill-0", Role.PREFILL)
        server.close(linger=0)
        security.stop()
        context.term()
        return seen

    assert asyncio.run(user_ids()) == ["decode.key", "probe.key"]


def test_config_checks_tls_and_token(tmp_path):
    with pytest.raises(ConfigError, match="set both or neither"):
        _config(PDSERVE_ROUTER_TLS_CERT_FILE="cert.pem")
    with pytest.raises(ConfigError, match="set one"):
        _config(PDSERVE_ROUTER_AUTH_TOKEN_FILE="token", PDSERVE_ROUTER_AUTH_TOKEN="x")
    with pytest.raises(ConfigError, match="router.tls_cert_file: cannot read"):
        check_service(_config(PDSERVE_ROUTER_TLS_CERT_FILE=str(tmp_path / "no.pem"),
                              PDSERVE_ROUTER_TLS_KEY_FILE=str(tmp_path / "no.key")), "router")
    (tmp_path / "token").write_text("\n")
    with pytest.raises(ConfigError, match="the token is empty"):
        check_service(_config(PDSERVE_ROUTER_AUTH_TOKEN_FILE=str(tmp_path / "token")), "router")
    (tmp_path / "token").write_text(f"{TOKEN}\n")
    assert _config(PDSERVE_ROUTER_AUTH_TOKEN_FILE=str(tmp_path / "token")).router.bearer_tokens() == {TOKEN: ""}
    assert _config(PDSERVE_ROUTER_AUTH_TOKEN=TOKEN).router.bearer_tokens() == {TOKEN: ""}


@pytest.mark.parametrize("address", ["127.0.0.1:1", "127.8.0.1:1", "[::1]:1", "localhost:1", "unix:/run/x.sock"])
def test_loopback_addresses_need_no_tls_or_token(address):
    assert is_loopback(address)
    check_service(_config(PDSERVE_ROUTER_GRPC_ADDRESS=address), "stack")


def test_serving_beyond_loopback_needs_tls_and_a_token_or_the_explicit_setting(tmp_path):
    for name in ("cert.pem", "key.pem", "token"):
        (tmp_path / name).write_text("x\n")
    tls = {"PDSERVE_ROUTER_TLS_CERT_FILE": str(tmp_path / "cert.pem"), "PDSERVE_ROUTER_TLS_KEY_FILE": str(tmp_path / "key.pem")}
    token = {"PDSERVE_ROUTER_AUTH_TOKEN_FILE": str(tmp_path / "token")}
    for exposed, named in (({"PDSERVE_ROUTER_GRPC_ADDRESS": "0.0.0.0:50051"}, "router.grpc_address 0.0.0.0:50051"),
                           ({"PDSERVE_ROUTER_HTTP_ADDRESS": "[::]:8000"}, "router.http_address [::]:8000"),
                           ({"PDSERVE_ROUTER_GRPC_ADDRESS": "192.0.2.7:50051"}, "router.grpc_address 192.0.2.7"),
                           ({"PDSERVE_ROUTER_GRPC_ADDRESS": "myhost:50051"}, "router.grpc_address myhost")):
        for service in ("router", "stack"):
            for partial, missing in (({}, "without TLS"), (tls, "without a bearer token"), (token, "without TLS")):
                with pytest.raises(ConfigError, match=f"{re.escape(named)}.*{missing}.*router.allow_insecure_network"):
                    check_service(_config(**exposed, **partial), service)
            check_service(_config(**exposed, **tls, **token), service)
            check_service(_config(**exposed, PDSERVE_ROUTER_ALLOW_INSECURE_NETWORK="true"), service)


def test_config_checks_the_admin_token(tmp_path):
    (tmp_path / "admin").write_text("\n")
    with pytest.raises(ConfigError, match="router.admin_token_file: the token is empty"):
        check_service(_config(PDSERVE_ROUTER_ADMIN_TOKEN_FILE=str(tmp_path / "admin")), "router")
    (tmp_path / "admin").write_text(f"{TOKEN}\n")
    with pytest.raises(ConfigError, match="give admin calls a token of their own"):
        check_service(_config(PDSERVE_ROUTER_ADMIN_TOKEN_FILE=str(tmp_path / "admin"), PDSERVE_ROUTER_AUTH_TOKEN=TOKEN),
                      "router")
    with pytest.raises(ConfigError, match="router.admin_token_file: cannot read"):
        check_service(_config(PDSERVE_ROUTER_ADMIN_TOKEN_FILE=str(tmp_path / "missing")), "router")
    check_service(_config(PDSERVE_ROUTER_ADMIN_TOKEN_FILE=str(tmp_path / "admin"), PDSERVE_ROUTER_AUTH_TOKEN="other"),
                  "router")


# ---- TLS and the bearer token on gRPC ----

def _self_signed_certificate(folder: Path) -> tuple[Path, Path]:
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory, checkpoint):
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is not installed: no way to make a test certificate")
    workdir = tmp_path_factory.mktemp("tls")
    cert, key = _self_signed_certificate(workdir)
    (workdir / "token").write_text(f"{TOKEN}\n")
    stack = ServiceStack(workdir, CACHE_DIR, PDSERVE_ROUTER_TLS_CERT_FILE=str(cert),
                         PDSERVE_ROUTER_TLS_KEY_FILE=str(key), PDSERVE_ROUTER_AUTH_TOKEN_FILE=str(workdir / "token"))
    try:  # ServiceStack's own __enter__ would open a plaintext channel
        for name in stack.services:
            stack.start(name)
        stack.channel = grpc.secure_channel(stack.address, grpc.ssl_channel_credentials(cert.read_bytes()))
        stack.wait_serving()  # health checks over TLS, without the token
        yield stack
    finally:
        codes = stack.stop()
    assert codes == {name: 0 for name in codes}, f"services did not exit cleanly: {codes}"


BEARER = [("authorization", f"Bearer {TOKEN}")]


@pytest.mark.e2e
@pytest.mark.slow
def test_tls_with_token_serves(tls_stack):
    assert _generate(tls_stack.stub, BEARER) == 3
    workers = tls_stack.stub.ListWorkers(generation_pb2.ListWorkersRequest(), timeout=5, metadata=BEARER).workers
    assert sorted(w.role for w in workers) == ["decode", "prefill"]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("metadata", [[], [("authorization", "Bearer wrong-token")], [("authorization", TOKEN)],
                                      [("authorization", f"Bearer {TOKEN}x")]],
                         ids=["none", "wrong", "no-scheme", "longer"])
def test_calls_without_the_right_token_are_unauthenticated(tls_stack, metadata):
    stub = tls_stack.stub
    calls = {
        "Generate": lambda: _generate(stub, metadata),
        "ListWorkers": lambda: stub.ListWorkers(generation_pb2.ListWorkersRequest(), timeout=5, metadata=metadata),
        "reflection": lambda: list(reflection_pb2_grpc.ServerReflectionStub(tls_stack.channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5, metadata=metadata)),
    }
    for name, call in calls.items():
        with pytest.raises(grpc.RpcError) as error:
            call()
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
    assert _generate(stub, BEARER) == 3  # refused calls left nothing behind


def _drain_unknown_worker(stack: ServiceStack, metadata) -> grpc.RpcError:
    """What Admin.Drain answers for a worker that does not exist: NOT_FOUND only past the admin check,
    so no worker of the shared stack is drained."""
    with pytest.raises(grpc.RpcError) as error:
        generation_pb2_grpc.AdminStub(stack.channel).Drain(generation_pb2.DrainRequest(worker_id="decode-9"),
                                                           timeout=10, metadata=metadata)
    return error.value


@pytest.mark.e2e
@pytest.mark.slow
def test_admin_calls_take_the_admin_token_and_not_the_generation_token(tls_stack):
    for metadata in ([], BEARER, [("authorization", "Bearer wrong-token")]):
        refused = _drain_unknown_worker(tls_stack, metadata)
        assert refused.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
        assert "router.admin_token_file" in refused.details()
    assert _drain_unknown_worker(tls_stack, tls_stack.admin_bearer).code() == grpc.StatusCode.NOT_FOUND
    assert sorted(w.worker_id for w in tls_stack.workers()) == ["decode-0", "prefill-0"]


@pytest.mark.e2e
@pytest.mark.slow
def test_admin_calls_are_refused_without_an_admin_token_configured(curve_stack):
    refused = _drain_unknown_worker(curve_stack, [])
    assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "set router.admin_token_file" in refused.details()


@pytest.mark.e2e
@pytest.mark.slow
def test_health_needs_no_token(tls_stack):
    health = health_pb2_grpc.HealthStub(tls_stack.channel)
    assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == \
        health_pb2.HealthCheckResponse.SERVING


@pytest.mark.e2e
@pytest.mark.slow
def test_plaintext_channel_to_the_tls_port_fails(tls_stack):
    with grpc.insecure_channel(tls_stack.address) as channel:
        with pytest.raises(grpc.RpcError) as error:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=3)
    assert error.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


@pytest.mark.e2e
@pytest.mark.slow
def test_client_flags_tls_ca_and_token_file(tls_stack):
    def client(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "services.client", "--address", tls_stack.address, *flags,
                               "generate", "Hi", "--max-tokens", "3", "--ignore-eos"],
                              cwd=REPO, capture_output=True, text=True, timeout=60)

    ca = ("--tls-ca", str(tls_stack.workdir / "cert.pem"))
    served = client(*ca, "--token-file", str(tls_stack.workdir / "token"))
    assert served.returncode == 0 and "3 generated" in served.stderr, served.stderr
    refused = client(*ca)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr, refused.stderr


@pytest.mark.e2e
@pytest.mark.slow
def test_the_openai_api_takes_the_same_tls_and_token(tls_stack):
    tls = ssl.create_default_context(cafile=str(tls_stack.workdir / "cert.pem"))
    url = f"https://{tls_stack.env['PDSERVE_ROUTER_HTTP_ADDRESS']}/v1/models"
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"}),
                                context=tls, timeout=10) as response:
        assert response.status == 200
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(url, context=tls, timeout=10)
    error.value.close()  # a TLS connection left open would hold the router's stop for its grace period
    assert error.value.code == 401
    with pytest.raises((OSError, http.client.HTTPException)):  # plaintext to the TLS port
        urllib.request.urlopen(url.replace("https://", "http://"), timeout=10)


# ---- no pickle, eval or exec ----

PICKLE_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill"}
# pyzmq's pickling calls, spelled in pieces so that a plain grep for them (the repo's pre-stop
# check) does not flag this scanner itself.
PICKLING_CALLS = {"send_" + "pyobj", "recv_" + "pyobj"}


def _offences(source: str, name: str) -> list[str]:
    """Imports of a pickle module, calls to eval/exec, and pyzmq's pickling send/recv calls."""
    found = []
    for node in ast.walk(ast.parse(source, filename=name)):
        modules = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        found += [f"{name}:{node.lineno} imports {m}" for m in modules if m.split(".")[0] in PICKLE_MODULES]
        if isinstance(node, ast.Call):
            func = node.func
            if (isinstance(func, ast.Name) and func.id in ("eval", "exec")) or \
                    (isinstance(func, ast.Attribute) and func.attr in PICKLING_CALLS):
                found.append(f"{name}:{node.lineno} calls {ast.unparse(func)}")
    return found


def test_the_scan_finds_what_it_looks_for():
    pickling = "sock.recv_" + "pyobj()"
    source = f"import pickle\nfrom dill import loads\neval('1')\nexec('x=1')\n{pickling}\nmodel.eval()\n"
    assert [o.split(" ", 1)[1] for o in _offences(source, "x.py")] == \
        ["imports pickle", "imports dill", "calls eval", "calls exec", f"calls {pickling[:-2]}"]


def test_no_pickle_eval_or_exec_in_services_or_shared():
    paths = sorted(p for folder in ("services", "shared") for p in (REPO / folder).rglob("*.py"))
    assert len(paths) > 20
    offences = [o for p in paths for o in _offences(p.read_text(), str(p.relative_to(REPO)))]
    assert not offences, offences
