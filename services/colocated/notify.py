"""systemd's notify protocol for one process that runs several worker loops.

Each loop calls the same three methods as on a SystemdNotify of its own; the process's unit
(Type=notify, NotifyAccess=main) hears READY=1 once every loop is ready, WATCHDOG=1 only while
every loop still pings (one stuck loop gets the whole process restarted), and STOPPING=1 once.
"""

from __future__ import annotations

import threading

from shared.runtime.process import SystemdNotify


class JointNotify:
    def __init__(self, notify: SystemdNotify, loops: tuple[str, ...]):
        self._notify = notify
        self._loops = frozenset(loops)
        self._lock = threading.Lock()
        self._ready: set[str] = set()
        self._pinged: set[str] = set()  # loops heard from since the last full round
        self._stopping = False

    def member(self, loop: str) -> LoopNotify:
        return LoopNotify(self, loop)

    def ready(self, loop: str) -> None:
        with self._lock:
            if loop not in self._ready:
                self._ready.add(loop)
                if self._ready == self._loops:
                    self._notify.ready()

    def watchdog(self, loop: str) -> None:
        with self._lock:
            self._pinged.add(loop)
            if self._pinged == self._loops:
                self._pinged.clear()
                self._notify.watchdog()

    def stopping(self, loop: str) -> None:
        with self._lock:
            if not self._stopping:
                self._stopping = True
                self._notify.stopping()


class LoopNotify:
    """One loop's side of a JointNotify, in SystemdNotify's shape."""

    def __init__(self, joint: JointNotify, loop: str):
        self._joint = joint
        self._loop = loop

    def ready(self) -> None:
        self._joint.ready(self._loop)

    def watchdog(self) -> None:
        self._joint.watchdog(self._loop)

    def stopping(self) -> None:
        self._joint.stopping(self._loop)
