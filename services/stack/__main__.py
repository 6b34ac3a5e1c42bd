"""python -m services.stack [--prefill N] [--decode M] [--devices "prefill=0,1 decode=2,3"]: the
router and N prefill and M decode workers (stack.* in the config; one of each by default), each a
process of its own under one supervisor.

Every service gets this command's arguments (--config, --model-path, ...), and each worker its
own id, metrics port, cores and GPU on top (services/stack/topology.py). A runtime folder or an
address already taken (another stack on this host) stops it before anything starts, exit code 2,
naming each (services/stack/preflight.py). One that dies is restarted with a backoff, and one that
crash-loops or is refused stops the stack with exit code 1; Ctrl-C or SIGTERM stops them all
(Supervisor.stop) and exits 0. Each service
dies with its parent (shared.runtime.process.die_with_parent), so none is orphaned even if this one is
killed.

Admin calls (`pdserve drain`) need router.admin_token_file: when it is unset, the router gets the
runtime folder's admin token, made here if missing (shared/runtime/admin_token.py), which
`pdserve drain` reads from there by default.
"""

from __future__ import annotations

import signal
import sys

import structlog

from services.stack.preflight import obstacles
from services.stack.supervisor import RestartPolicy, Service, Supervisor
from services.stack.topology import plan_workers
from shared.config.loading import flag_name
from shared.config.schema import Config, ConfigError
from shared.runtime.admin_token import ensure_local_admin_token
from shared.runtime.log import configure_logging
from shared.runtime.service_config import parse_service_config

log = structlog.get_logger()


def _admin_token_args(config: Config) -> tuple[str, ...]:
    if config.router.admin_token_file:
        return ()
    path = ensure_local_admin_token(config.router.runtime_dir)
    log.info("admin token for pdserve drain", path=str(path))
    return (flag_name("router", "admin_token_file"), str(path))


def main() -> int:
    # A bad flag or config stops here with its reason, before the services crash-loop on it.
    config = parse_service_config("stack")
    configure_logging("stack", "stack", config.log.format, config.log.level)
    try:
        workers = plan_workers(config)
    except ConfigError as exc:
        print(f"python -m services.stack: error: {exc}", file=sys.stderr)
        return 2
    taken = obstacles(config, workers)
    if taken:
        print("python -m services.stack: error: taken, by another stack on this host?\n  " + "\n  ".join(taken),
              file=sys.stderr)
        return 2
    supervisor = Supervisor()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: supervisor.request_stop())
    args = tuple(sys.argv[1:])
    supervisor.start(Service("router", "services.router", (*args, *_admin_token_args(config))))
    for worker in workers:
        log.info("starting worker", worker=worker.name, device=worker.device, cores=list(worker.cores),
                 metrics=worker.metrics_address)
        supervisor.start(Service(worker.name, f"services.{worker.role.value}", (*args, *worker.args())))
    return 0 if supervisor.supervise(RestartPolicy()) is None else 1


if __name__ == "__main__":
    sys.exit(main())
