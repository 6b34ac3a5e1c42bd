"""The Admin service: what operators do to a running stack (`pdserve drain WORKER_ID`)."""

from __future__ import annotations

import time

import grpc
import structlog

from pdserve.v1 import generation_pb2, generation_pb2_grpc
from services.router.control.token_router import TokenRouter
from services.router.control.worker_records import WorkerRegistry

log = structlog.get_logger()


class AdminService(generation_pb2_grpc.AdminServicer):
    def __init__(self, router: TokenRouter):
        self.router = router

    async def Drain(self, request, context: grpc.aio.ServicerContext):
        if not self.router.drain(request.worker_id):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no worker {request.worker_id!r} is registered")
        log.info("drain requested", worker=request.worker_id)
        return generation_pb2.DrainResponse()


def list_workers(registry: WorkerRegistry) -> generation_pb2.ListWorkersResponse:
    """Each worker as it reported itself, and as the router sees it: promised pages, routed load."""
    now = time.monotonic()
    return generation_pb2.ListWorkersResponse(workers=[
        generation_pb2.WorkerInfo(
            worker_id=w.worker_id, role=w.role.value, total_pages=w.total_pages, free_pages=w.free_pages,
            reserved_pages=w.reserved_pages, running_requests=w.running, waiting_requests=w.waiting,
            seconds_since_heartbeat=now - w.last_seen, pending_prompt_tokens=w.pending_prompt_tokens,
            assigned_requests=len(w.reservations), draining=w.draining)
        for w in registry.workers.values()
    ])
