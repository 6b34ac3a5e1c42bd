"""A tiny service for tests/test_supervisor.py: `python -m tests.supervised_child [--exit-code N --after S]`.

It appends when it started to --starts (so the test can time the restarts), then exits with N
after S seconds, or with --after omitted runs until SIGTERM and exits 0, as the services do.
--ignore-sigterm makes it a laggard that ignores SIGTERM and SIGINT, which the supervisor must SIGKILL.
--shared-memory NAME creates a POSIX shared-memory segment as a prefill's pool export does (its
resource tracker unlinks it if the process is killed); --sleeper PIDFILE starts a child of its own
that ignores SIGTERM and writes that child's pid there.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from multiprocessing import shared_memory
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--starts", required=True)
    parser.add_argument("--exit-code", type=int, default=0)
    parser.add_argument("--after", type=float)
    parser.add_argument("--ignore-sigterm", action="store_true")
    parser.add_argument("--shared-memory")
    parser.add_argument("--sleeper")
    args = parser.parse_args()
    if args.shared_memory:
        segment = shared_memory.SharedMemory(args.shared_memory, create=True, size=4096)  # noqa: F841 (kept open)
    if args.sleeper:
        sleeper = subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 1000"])
        Path(args.sleeper).write_text(str(sleeper.pid))
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with open(args.starts, "a") as starts:  # once its handler is in place: a SIGTERM from now on exits 0
        starts.write(f"{time.monotonic()}\n")
    if args.after is None:
        while True:
            time.sleep(1)
    time.sleep(args.after)
    return args.exit_code


if __name__ == "__main__":
    sys.exit(main())
