"""Our own NVIDIA MPS control daemon, for benchmarks that share one GPU between processes.

It runs in fresh pipe and log folders, so no other daemon's clients mix in; a process becomes its
client by having `env` (the two CUDA_MPS_* folders) in its environment when it creates its CUDA
context. `stop` quits it and ends whatever of it is left, by pid.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_quiet(command: list[str], stdin: str | None = None, env: dict | None = None,
              timeout: float = 15) -> subprocess.CompletedProcess | None:
    """None when the program is missing or hangs (a control pipe with no daemon behind it can)."""
    try:
        return subprocess.run(command, input=stdin, env=env, capture_output=True, text=True, timeout=timeout,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None


class MpsDaemon:
    """Our own control daemon, in fresh pipe and log folders: no other daemon's clients mix in."""

    def __init__(self, control: str | None, root: Path):
        self.control = control
        self.pipe_dir, self.log_dir = root / "pipe", root / "log"
        self.pipe_dir.mkdir(parents=True)
        self.log_dir.mkdir()
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}
        self.started = False
        self.pids: set[int] = set()

    def ask(self, command: str) -> subprocess.CompletedProcess | None:
        if self.control is None:
            return None
        return run_quiet([self.control], stdin=command + "\n", env={**os.environ, **self.env}, timeout=10)

    def is_up(self) -> bool:
        answer = self.ask("get_server_list")
        return answer is not None and answer.returncode == 0

    def start(self) -> None:
        if self.control is None:
            raise RuntimeError("nvidia-cuda-mps-control not found on PATH")
        with open(self.log_dir / "start.out", "w") as out:  # a file, not a pipe: the daemon keeps its fds
            code = subprocess.run([self.control, "-d"], stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                  env={**os.environ, **self.env}, timeout=30, check=False).returncode
        self.started = True
        deadline = time.monotonic() + 15
        while not self.is_up():
            if code != 0 or time.monotonic() > deadline:
                raise RuntimeError(f"`{self.control} -d` (exit code {code}) gives no daemon that answers:\n"
                                   f"{tail(self.log_dir / 'start.out')}\n{self.log_tail()}")
            time.sleep(0.2)
        self.pids |= self._processes()

    def clients(self) -> dict[int, list[int]]:
        """server pid -> its client pids, as the daemon reports them."""
        servers = self.ask("get_server_list")
        result = {}
        for server in map(int, re.findall(r"\d+", servers.stdout if servers else "")):
            self.pids.add(server)
            answer = self.ask(f"get_client_list {server}")
            result[server] = [int(p) for p in re.findall(r"\d+", answer.stdout if answer else "")]
        return result

    def stop(self) -> dict:
        """`quit`, then wait for the daemon and its servers to go; any left are ended by pid."""
        if not self.started:
            return {"started": False}
        self.pids |= self._processes()
        quit_answer = self.ask("quit")
        deadline = time.monotonic() + 20
        while (self.is_up() or self._alive()) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = sorted(self._alive())
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in self._alive():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            if self._alive():
                time.sleep(2)
        self.started = False
        return {"started": True, "quit_exit_code": quit_answer.returncode if quit_answer else None,
                "killed_after_quit": left, "still_running": sorted(self._alive())}

    def _alive(self) -> set[int]:
        return {pid for pid in self.pids if running(pid)}

    def _processes(self) -> set[int]:
        """Our daemon (its pid file) and the nvidia-cuda-mps-* processes whose environment names our pipe folder."""
        pid_file = self.pipe_dir / "nvidia-cuda-mps-control.pid"
        pids = {int(pid_file.read_text())} if pid_file.is_file() and pid_file.read_text().strip().isdigit() else set()
        marker = f"CUDA_MPS_PIPE_DIRECTORY={self.pipe_dir}".encode()
        for proc in filter(lambda p: p.name.isdigit(), Path("/proc").iterdir()):
            try:
                program = (proc / "cmdline").read_bytes().split(b"\0")[0]
                if b"nvidia-cuda-mps" in program and marker in (proc / "environ").read_bytes().split(b"\0"):
                    pids.add(int(proc.name))
            except OSError:
                continue
        return pids

    def log_tail(self) -> str:
        return "\n".join(f"{name}:\n{tail(self.log_dir / name)}" for name in ("control.log", "server.log"))


def running(pid: int) -> bool:
    """Exists and is not a zombie waiting to be reaped by whoever adopted it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def find_mps_control() -> str | None:
    return shutil.which("nvidia-cuda-mps-control") or next(
        (p for p in ("/usr/local/nvidia/bin/nvidia-cuda-mps-control", "/usr/bin/nvidia-cuda-mps-control")
         if os.access(p, os.X_OK)), None)
