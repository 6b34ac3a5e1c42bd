"""python -m services.stack: router, prefill and decode as three processes under one supervisor.

Every service gets this command's arguments (--config, --model-path, ...). One that dies is
restarted with a backoff, and one that crash-loops or is refused by the router stops the stack
with exit code 1 (services/supervisor.py). Ctrl-C or SIGTERM stops all three (SIGTERM, then
SIGKILL after the grace period) and exits 0. Each service dies with its parent
(shared.process.die_with_parent), so none is orphaned even if this one is killed.
"""

from __future__ import annotations

import signal
import sys

from services.supervisor import RestartPolicy, Service, Supervisor
from shared.config import parse_service_config
from shared.log import configure_logging

SERVICES = ("router", "prefill", "decode")


def main() -> int:
    # A bad flag or config stops here with its reason, before three services crash-loop on it.
    config = parse_service_config("stack")
    configure_logging("stack", "stack", config.log.format, config.log.level)
    supervisor = Supervisor()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: supervisor.request_stop())
    for name in SERVICES:
        supervisor.start(Service(name, f"services.{name}", tuple(sys.argv[1:])))
    return 0 if supervisor.supervise(RestartPolicy()) is None else 1


if __name__ == "__main__":
    sys.exit(main())
