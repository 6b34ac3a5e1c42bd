"""A worker's link to the router (shared/control/router_link.py) waiting for messages, in-process."""

from __future__ import annotations

from shared.config.schema import WorkerConfig
from shared.control.messages import PROTOCOL_VERSION, Register, Role
from shared.control.router_link import RouterLink, WorkerLoad
from shared.model.fingerprint import ModelFingerprint


def test_an_idle_wait_sleeps_in_whole_milliseconds_rather_than_spinning(tmp_path, monkeypatch):
    """zmq's poll takes whole milliseconds: a wait's remainder cut to 0 ms returned at once, so every
    idle round of a worker's loop spun through its last millisecond (about 8 ms of CPU a second)."""
    registration = Register("decode-0", Role.DECODE, PROTOCOL_VERSION, "a", 1, 8, 16, 4, 0, [],
                            ModelFingerprint("c", "w", "t", "float32", "layers=1"))
    link = RouterLink(f"ipc://{tmp_path}/router", registration, lambda: WorkerLoad(8, 0, 0, []), lambda: None,
                      WorkerConfig())
    link._socket.connect(f"ipc://{tmp_path}/router")  # nothing listens: Register waits in the queue
    waits = []
    poll = link._poller.poll
    monkeypatch.setattr(link._poller, "poll", lambda ms: waits.append(ms) or poll(ms))
    try:
        for wait_s in (0.0505, 0.0999, 0.2):
            waits.clear()
            assert link.receive(wait_s) == []
            assert all(isinstance(ms, int) for ms in waits), waits
            assert 1 <= len(waits) <= 2, f"{len(waits)} polls for one wait of {wait_s} s: {waits[:8]}"
    finally:
        link.close(linger_s=0)
