"""Request migration: a request whose decode dies goes on, on another decode, and its stream with it.

What makes a request move: its decode is lost (dropped by membership: killed, silent, stopped),
says Failed UNAVAILABLE about it, or lets its handoff or a token overstay its timeout, while the
request is at the prefill, in the handoff or decoding. The token router then tells the old
placement's workers (Abort to a live holder, ReleaseKv for a handoff not pulled) and calls move():

    its reservations go back; a decode still registered joins failed_on (never chosen again for it)
    a new request_id (request.py says why), stage ADMITTING, first in admission's line
    placed: PrefillTask of the prompt followed by the tokens already streamed, generated = their
            count; the prefix cache holds the prompt's pages, so mostly those tokens are computed
    KvReady: its token is the stream's next (sampled with the seed and output index the decode
            would have used, shared/model/sampling.py, and counted against max_tokens), then the
            usual DecodeTask to the new decode

The front reads one stream throughout: no token is lost (what the dead decode made but never
sent is made again) and none is repeated (the prefix is what the front was handed). The request
ends UNAVAILABLE, as without migration, when it moved router.migration_limit times already,
when no other decode serves (with a prefill it can pull from), when its prefix outgrew every
pool, or when no decode has room for it within router.admission_timeout_s.
"""

from __future__ import annotations

from services.router.control.admission import Admission
from services.router.control.request import InflightRequest, Stage
from services.router.control.routing import RoutingPolicy
from services.router.control.worker_records import WorkerRecord, WorkerRegistry
from shared.config.schema import RouterConfig
from shared.control.messages import Role
from shared.runtime import metrics


class Migration:
    def __init__(self, registry: WorkerRegistry, admission: Admission, settings: RouterConfig):
        self.registry = registry
        self.admission = admission
        self.settings = settings

    def refusal(self, request: InflightRequest, decode: WorkerRecord) -> str | None:
        """Why the request cannot move off this decode, or None when it may."""
        if request.timings.migrations >= self.settings.migration_limit:
            return f"router.migration_limit ({self.settings.migration_limit}) reached"
        decodes = [d for d in self.registry.serving(Role.DECODE)
                   if d is not decode and d.worker_id not in request.failed_on]
        prefills = RoutingPolicy.reachable(self.registry.serving(Role.PREFILL), decodes)
        if not prefills:
            return "no other decode serves" if not decodes else "no prefill that another decode can pull from"
        needed = self.admission.pages_needed(request)
        if needed[Role.PREFILL] > max(p.total_pages for p in prefills) or (
                needed[Role.DECODE] > max(d.total_pages for d in decodes)):
            return f"its prefix of {request.prefix_len()} tokens needs more KV pages than any other pool holds"
        return None

    def move(self, request: InflightRequest, decode: WorkerRecord) -> str:
        """Readies the request for its next placement and puts it first in admission's line, where it
        may be placed at once; returns its old request_id. The caller has told the old placement's
        workers already, so that they hear of the old id before any task under the new one."""
        if self.registry.workers.get(decode.worker_id) is decode:  # alive but failing: not this one again
            request.failed_on.add(decode.worker_id)
        for worker in (request.prefill, request.decode):
            Admission.release(worker, request)
        request.prefill = request.decode = None
        request.timings.migrations += 1
        metrics.REQUEST_MIGRATIONS.inc()
        old_id = request.rekey()
        request.enter(Stage.ADMITTING, self.settings.admission_timeout_s)
        self.admission.readmit(request)
        return old_id
