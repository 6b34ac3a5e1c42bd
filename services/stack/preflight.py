"""What must be free before `python -m services.stack` starts anything: the runtime folder, which
one router at a time holds, and every address the stack's services bind. A second stack started
beside a running one (a second `make run`) stops here at once, naming what is taken, instead of
starting a router that cannot bind and workers that, through the shared runtime folder, would
reach the first stack's router.
"""

from __future__ import annotations

from services.stack.topology import WorkerPlan
from shared.config.schema import Config
from shared.runtime.binding import bind_error
from shared.runtime.runtime_dir import FolderInUse, claim_runtime_dir


def bound_addresses(config: Config, workers: list[WorkerPlan]) -> dict[str, str]:
    """Each address the stack's services bind over TCP, by who binds it; empty ones are off."""
    router = config.router
    addresses = {"router.grpc_address": router.grpc_address, "router.http_address": router.http_address,
                 "router.metrics_address": router.metrics_address,
                 **{f"{plan.name}'s {plan.role.value}.metrics_address": plan.metrics_address for plan in workers}}
    if router.zmq_endpoint().startswith("tcp://"):
        addresses["router.zmq_address"] = router.zmq_endpoint()
    return {name: address for name, address in addresses.items() if address}


def obstacles(config: Config, workers: list[WorkerPlan]) -> list[str]:
    """Why the stack cannot start here now: its runtime folder held, each address taken; [] if none."""
    found = []
    try:
        claim_runtime_dir(config.router.runtime_dir).close()
    except FolderInUse as exc:
        found.append(str(exc))
    for name, address in bound_addresses(config, workers).items():
        error = bind_error(address)
        if error is not None:
            found.append(f"{name} {address}: {error}")
    return found
