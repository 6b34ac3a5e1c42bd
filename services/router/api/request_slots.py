"""The bound on generation requests in flight, gRPC and HTTP together (router.max_concurrent_rpcs).

gRPC's own `maximum_concurrent_rpcs` counts every call until gRPC has closed it: health checks too,
and a stream cancelled because its client stopped reading, whose status waits behind the chunks the
client never took. A few such clients would refuse every other call, health checks included. So the
router counts its own: a Generate call or an OpenAI /v1 request takes a slot when it arrives and
gives it back when the router is done with it, before any status or last byte waits on the client.
"""

from __future__ import annotations

from shared.runtime.metrics import RequestTimer


class RequestSlots:
    def __init__(self, limit: int):
        self.limit = limit
        self.taken = 0

    def take(self) -> bool:
        """A slot for one request; False when all are taken, the refusal counted (pdserve:request_failure_total,
        not a log line each: a flood of them would flood the log)."""
        if self.taken >= self.limit:
            RequestTimer().failed("RESOURCE_EXHAUSTED")
            return False
        self.taken += 1
        return True

    def give_back(self) -> None:
        self.taken -= 1

    def refusal(self) -> str:
        return (f"{self.limit} requests in flight, the most this router takes at once "
                "(router.max_concurrent_rpcs); try again later")
