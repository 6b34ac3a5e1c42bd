"""python -m services.stack: router, prefill and decode as three processes, in the foreground.

Ctrl-C or SIGTERM stops all three (SIGTERM, then SIGKILL after the grace period); if one of
them dies the others are stopped too, and the exit code says so. Each service dies with its
parent (shared.process.die_with_parent), so none is orphaned even if this one is killed.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time


SERVICES = ("router", "prefill", "decode")


def main() -> int:
    args = sys.argv[1:]  # passed through: --config, --model-path, ...
    children = {name: subprocess.Popen([sys.executable, "-m", f"services.{name}", *args]) for name in SERVICES}
    stop_requested = False

    def request_stop(*_):
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    failed = None
    while not stop_requested and failed is None:
        time.sleep(0.2)
        failed = next((name for name, child in children.items() if child.poll() is not None), None)
    for child in children.values():
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 15
    for child in children.values():
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    if failed is not None:
        print(f"pdserve: {failed} exited with code {children[failed].returncode}; stopped the others",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
