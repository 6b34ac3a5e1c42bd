"""Process lifecycle: `make run`'s launcher stops cleanly, bad frames do not hurt the router, and a
router whose background loop dies exits non-zero instead of running on without it."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from pdserve.v1 import generation_pb2
from shared.config.loading import env_name
from shared.control.messages import EXIT_REFUSED
from shared.runtime.admin_token import local_admin_token_path
from shared.runtime.tasks import MAX_FAILURES_IN_A_ROW
from tests.stack import REPO, ServiceStack

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def test_launcher_stops_all_services_on_sigterm(tmp_path, checkpoint):
    cache_dir = os.environ.get("PDSERVE_MODEL_CACHE_DIR", "~/.cache/pdserve")
    # No admin token configured, as under `make run`: the launcher makes one in the runtime folder.
    with ServiceStack(tmp_path, cache_dir, services=("stack",), PDSERVE_ROUTER_ADMIN_TOKEN_FILE="") as stack:
        _pdserve_drain_finds_the_launchers_admin_token(stack)
        launcher = stack.processes["stack"]
        children = _children(launcher.pid)
        assert len(children) == 3
        segments = [n for n in os.listdir("/dev/shm") if n.startswith("pdserve-kv-")
                    and int(n.rsplit("-", 1)[-1]) in children]
        assert len(segments) == 1, "the prefill exports exactly one pool"
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=30) == 0
        assert not [pid for pid in children if _alive(pid)], "services outlived the launcher"
        assert not any(os.path.exists(f"/dev/shm/{name}") for name in segments), "shared memory left behind"


def _pdserve_drain_finds_the_launchers_admin_token(stack: ServiceStack) -> None:
    """The client reads the token from the runtime folder it shares with the stack; the answer for an
    unknown worker comes from past the admin check."""
    token = local_admin_token_path(stack.env["PDSERVE_ROUTER_RUNTIME_DIR"])
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    drain = subprocess.run([sys.executable, "-m", "services.client", "--address", stack.address, "drain", "decode-9"],
                           cwd=REPO, capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PDSERVE_ROUTER_RUNTIME_DIR": stack.env["PDSERVE_ROUTER_RUNTIME_DIR"]})
    assert drain.returncode == 1 and "NOT_FOUND: no worker 'decode-9' is registered" in drain.stderr, drain.stderr


def test_the_serving_router_has_neither_torch_nor_triton_mapped(stack):
    """After it has served (the session's stack has, by the time most tests ran), not only at import:
    the model's config and the tokenizer are read without transformers (shared/model/tokenizer.py)."""
    list(stack.stub.Generate(generation_pb2.GenerateRequest(prompt="Hello", max_tokens=2), timeout=120))
    maps = Path(f"/proc/{stack.processes['router'].pid}/maps").read_text()
    assert not [line for line in maps.splitlines() if "libtorch" in line or "triton" in line]


def test_zeromq_socket_sits_where_only_the_service_user_can_enter(stack):
    runtime_dir = Path(stack.env["PDSERVE_ROUTER_RUNTIME_DIR"])
    assert (runtime_dir / "router.ipc").exists()
    assert runtime_dir.stat().st_mode & 0o777 == 0o700


def test_router_survives_garbage_frames(stack):
    endpoint = f"ipc://{stack.env['PDSERVE_ROUTER_RUNTIME_DIR']}/router.ipc"
    context = zmq.Context()
    try:
        socket = context.socket(zmq.DEALER)
        socket.connect(endpoint)
        for frame in (b"", b"\xc1garbage", b"\x93\x01\x02", b"\x92\x63\xa1x", b"\xdd\xff\xff\xff\xff",
                      b"\x95\x03\xa2id\x01\x02\x03"):
            socket.send(frame)
        socket.send_multipart([b"a", b"b", b"c"])
        time.sleep(0.5)
        socket.close(linger=0)
    finally:
        context.term()
    request = generation_pb2.GenerateRequest(prompt="Hello", max_tokens=2, ignore_eos=True, temperature=0)
    chunks = list(stack.stub.Generate(request, timeout=60))
    assert sum(len(c.token_ids) for c in chunks) == 2
    assert "malformed" in stack.log_path("router").read_text()


# ---- a second stack on this host, on the first one's ports and runtime folder ----

def _same_place_as(stack) -> dict[str, str]:
    """The first stack's settings: its addresses and runtime folder, as a second `make run` takes the defaults."""
    return {name: value for name, value in stack.env.items() if name.startswith("PDSERVE_")}


def _served_unchanged(stack, registered_before: str) -> None:
    """The first stack serves on, and no worker of it registered again."""
    request = generation_pb2.GenerateRequest(prompt="Hello", max_tokens=2, ignore_eos=True, temperature=0)
    assert sum(len(c.token_ids) for c in stack.stub.Generate(request, timeout=60)) == 2
    assert {w.worker_id for w in stack.workers()} == {"prefill-0", "decode-0"}
    assert stack.log_path("router").read_text().count('"worker registered"') == registered_before.count(
        '"worker registered"')


def test_a_second_stack_on_the_first_ones_place_stops_at_once_naming_what_is_taken(stack, tmp_path):
    """A second `make run` beside a running one: its launcher starts nothing (no router that cannot
    bind, restarted until the supervisor gives up; no workers that reach the first's router through
    the shared runtime folder), exits 2 and names the folder and each address taken."""
    before = stack.log_path("router").read_text()
    second = ServiceStack(tmp_path, os.environ.get("PDSERVE_MODEL_CACHE_DIR", "~/.cache/pdserve"),
                          services=("stack",), **_same_place_as(stack))
    try:
        second.start("stack")
        assert second.processes["stack"].wait(timeout=120) == 2
        said = second.log_path("stack").read_text()
    finally:
        second.stop()
    folder, router_pid = stack.env["PDSERVE_ROUTER_RUNTIME_DIR"], stack.processes["router"].pid
    assert f"runtime folder {folder} is held by another router (pid {router_pid})" in said
    for setting in ("grpc_address", "http_address", "metrics_address"):
        assert f"router.{setting} {stack.env[env_name('router', setting)]}: Address already in use" in said
    assert "service started" not in said
    _served_unchanged(stack, before)


def test_a_second_router_on_a_held_runtime_folder_exits_refused_and_leaves_the_first_ones_socket(stack, tmp_path):
    """Started by hand or by systemd, without the launcher's check: ZeroMQ would bind over the first
    router's socket and draw its workers; the second router exits EXIT_REFUSED before it binds anything."""
    before = stack.log_path("router").read_text()
    second = ServiceStack(tmp_path, os.environ.get("PDSERVE_MODEL_CACHE_DIR", "~/.cache/pdserve"),
                          services=("router",), PDSERVE_ROUTER_RUNTIME_DIR=stack.env["PDSERVE_ROUTER_RUNTIME_DIR"])
    try:
        second.start("router")
        assert second.processes["router"].wait(timeout=120) == EXIT_REFUSED
    finally:
        second.stop()
    assert "is held by another router" in second.log_path("router").read_text()
    _served_unchanged(stack, before)


def test_a_router_whose_port_is_taken_exits_refused_naming_it(tmp_path, checkpoint):
    """Not a crash to restart: the supervisor and systemd leave EXIT_REFUSED alone."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        router = ServiceStack(tmp_path, os.environ.get("PDSERVE_MODEL_CACHE_DIR", "~/.cache/pdserve"),
                              services=("router",), PDSERVE_ROUTER_GRPC_ADDRESS=address)
        try:
            router.start("router")
            assert router.processes["router"].wait(timeout=120) == EXIT_REFUSED
        finally:
            router.stop()
    assert f"router.grpc_address {address} cannot be bound" in router.log_path("router").read_text()


# The router, with its liveness check made to raise: the token router's timeouts loop fails every tick,
# and gives up after MAX_FAILURES_IN_A_ROW of them (shared/runtime/tasks.py, LoopGuard).
ROUTER_WITH_A_DYING_LOOP = """
from services.router.control.membership import Membership
def drop_silent(self): raise RuntimeError("injected")
Membership.drop_silent = drop_silent
from services.router.__main__ import main
main()
"""


def test_a_dead_background_loop_stops_the_router_with_a_non_zero_exit(tmp_path, checkpoint):
    stack = ServiceStack(tmp_path, os.environ.get("PDSERVE_MODEL_CACHE_DIR", "~/.cache/pdserve"), services=("router",))
    log_path = stack.log_path("router")
    with log_path.open("w") as log:
        router = subprocess.run([sys.executable, "-c", ROUTER_WITH_A_DYING_LOOP], cwd=REPO, env=stack.env,
                                stdout=log, stderr=subprocess.STDOUT, timeout=120)
    lines = log_path.read_text()
    assert router.returncode == 1, lines
    assert "background task failed" in lines and "injected" in lines
    assert f"the timeouts loop failed {MAX_FAILURES_IN_A_ROW} iterations in a row" in lines


def test_services_speak_systemds_notify_protocol(tmp_path, checkpoint):
    """As under a Type=notify unit with WatchdogSec: each service says READY=1 once it serves,
    pings the watchdog from its main loop, and says STOPPING=1 on SIGTERM."""
    import socket as sockets
    import threading

    listener = sockets.socket(sockets.AF_UNIX, sockets.SOCK_DGRAM)
    listener.bind(str(tmp_path / "notify.sock"))
    listener.settimeout(0.2)
    cache_dir = os.environ.get("PDSERVE_MODEL_CACHE_DIR", "~/.cache/pdserve")
    settings = {"NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": "1000000"}
    messages: list[str] = []
    done = threading.Event()

    def drain() -> None:  # as systemd does, all the time
        while not done.is_set():
            try:
                messages.append(listener.recv(256).decode())
            except TimeoutError:
                pass

    drainer = threading.Thread(target=drain)
    drainer.start()
    try:
        with ServiceStack(tmp_path, cache_dir, **settings) as stack:
            seen = len(messages)
            time.sleep(2.5)
            assert messages.count("READY=1") == 3
            assert messages[seen:].count("WATCHDOG=1") >= 3 * 3  # every 0.5 s from each of the three
            stack.stop()
        time.sleep(0.5)
        assert messages.count("STOPPING=1") == 3
    finally:
        done.set()
        drainer.join()
        listener.close()


def test_notify_never_blocks_a_service_whose_notifications_nobody_reads(tmp_path, monkeypatch):
    """A full notification queue must not hang the caller: the notification is dropped."""
    import socket as sockets

    from shared.runtime.process import SystemdNotify

    listener = sockets.socket(sockets.AF_UNIX, sockets.SOCK_DGRAM)
    listener.bind(str(tmp_path / "notify.sock"))
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify.sock"))
    import threading

    notify = SystemdNotify()
    # Far beyond the kernel's datagram queue (net.unix.max_dgram_qlen), in a thread so that a
    # regression fails this test instead of hanging it.
    sender = threading.Thread(target=lambda: [notify.ready() for _ in range(1000)], daemon=True)
    sender.start()
    sender.join(timeout=5)
    assert not sender.is_alive(), "a notification blocked its caller"
    listener.close()
