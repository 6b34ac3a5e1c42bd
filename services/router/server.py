"""The router process: two fronts, gRPC (Generation, health, reflection) and the OpenAI-compatible
HTTP API, over one request path (frontend.py) and the token router, all on one event loop.

Health is SERVING only while at least one prefill and one decode are registered. Shutdown goes
the gRPC way: health NOT_SERVING, both fronts stop taking calls and let in-flight streams finish
for the grace period, then the token router stops and fails the rest explicitly. A stop signal
starts it, and so does a background task that dies (shared/runtime/tasks.py): then serve()
returns 1, so that the process exits non-zero and its supervisor restarts it. A router that cannot
start, because another router holds its runtime folder or another process an address it binds, or
its checkpoint cannot be served, exits EXIT_REFUSED with the reason: a restart would meet it again.
"""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.v1 import generation_pb2, generation_pb2_grpc
from services.router.api.admin import AdminService
from services.router.api.auth import bearer_token, interceptors, tls_credentials
from services.router.api.generation import GenerationService
from services.router.api.http_server import HttpServer
from services.router.api.internal_errors import HideInternalErrors
from services.router.api.openai_api import create_app
from services.router.api.request_slots import RequestSlots
from services.router.control.token_router import TokenRouter
from services.router.frontend import Frontend
from services.router.prompt_tokenizer import PromptTokenizer
from services.router.validation import ModelLimits
from shared.config.schema import Config, RouterConfig
from shared.model.fingerprint import checkpoint_fingerprint
from shared.model.generation_config import sampling_defaults
from shared.model.loader import config_dict, resolve_checkpoint
from shared.model.tokenizer import load_tokenizer
from shared.runtime import metrics
from shared.runtime.binding import bind_or_refuse
from shared.runtime.process import SystemdNotify, raise_open_files_limit
from shared.runtime.runtime_dir import claim_runtime_dir
from shared.runtime.tasks import ServiceStop, spawn

log = structlog.get_logger()

# Open files the router needs beside its HTTP connections: gRPC connections, the model's files, the
# workers' socket, the metrics endpoint.
FILES_BESIDE_HTTP = 1024

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
ADMIN_SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Admin"].full_name


def _check_open_files(router: RouterConfig) -> None:
    limit = raise_open_files_limit()
    if limit < router.http_max_connections + FILES_BESIDE_HTTP:
        log.warning("the open-file limit is below what router.http_max_connections needs: connections "
                    "beyond it will fail; raise LimitNOFILE= (deploy/systemd/pdserve-router.service) or "
                    "lower router.http_max_connections", open_files=limit,
                    http_max_connections=router.http_max_connections)


async def serve(config: Config) -> int:
    """Serves until a stop signal or a failed background task; returns the process's exit code.
    Raises a FatalError when it cannot start (a taken runtime folder or address, a checkpoint it
    cannot serve)."""
    claim = claim_runtime_dir(config.router.runtime_dir)  # before anything binds: one router per folder
    checkpoint = resolve_checkpoint(config.model.path, config.model.cache_dir)
    tokenizer = load_tokenizer(checkpoint)
    model_config = config_dict(checkpoint)
    limits = ModelLimits(model_config["vocab_size"], model_config["max_position_embeddings"], config.defaults.max_tokens,
                         config.router.max_prompt_bytes, config.router.max_chat_messages, sampling_defaults(checkpoint))
    _check_open_files(config.router)
    # The config made the folder and checked its owner; ipc:// sockets inside: nobody else may even enter.
    os.chmod(config.router.runtime_dir, 0o700)

    health_servicer = health.aio.HealthServicer()
    stop = ServiceStop()

    def on_workers_changed(serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            spawn(health_servicer.set(name, status), "health", stop.fail)

    router = TokenRouter(config, checkpoint_fingerprint(checkpoint), on_workers_changed, stop.fail)
    on_workers_changed(False)
    # No maximum_concurrent_rpcs: gRPC's would count health checks, and hold a cancelled stream's
    # slot until its unread chunks are gone (request_slots.py counts instead).
    server = grpc.aio.server(interceptors=[HideInternalErrors(), *interceptors(config.router)], options=[
        ("grpc.max_receive_message_length", config.router.max_request_bytes),
        ("grpc.so_reuseport", 0),
        ("grpc.server_handshake_timeout_ms", int(config.router.connection_idle_timeout_s * 1000)),
    ])
    slots = RequestSlots(config.router.max_concurrent_rpcs)
    prompts = PromptTokenizer(tokenizer, limits, config.router.max_concurrent_tokenizations,
                              config.router.admission_timeout_s)
    frontend = Frontend(router, prompts, config.router.stall_timeout_s)
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationService(frontend, slots,
                                                                           bearer_token(config.router)), server)
    generation_pb2_grpc.add_AdminServicer_to_server(AdminService(router), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, ADMIN_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    credentials = tls_credentials(config.router)
    address = config.router.grpc_address
    bind_or_refuse("router.grpc_address", address, lambda: server.add_insecure_port(address) if credentials is None
                   else server.add_secure_port(address, credentials))
    http = None
    if config.router.http_address:
        app = create_app(frontend, config.router.served_model_name or config.model.path,
                         bearer_token(config.router), config.router.max_request_bytes, slots)
        http = HttpServer(app, config.router)
    await router.start()
    await server.start()
    if http is not None:
        bind_or_refuse("router.http_address", config.router.http_address, lambda: http.start(stop.fail))
    metrics.serve(config.router.metrics_address, metrics.ROUTER)
    log.info("router serving", grpc=config.router.grpc_address, http=config.router.http_address,
             zmq=config.router.zmq_endpoint())

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.request)
    notify = SystemdNotify()
    notify.ready()
    while not stop.requested.is_set():  # the watchdog pings stop if the event loop hangs
        notify.watchdog()
        try:
            await asyncio.wait_for(stop.requested.wait(), timeout=1.0)
        except TimeoutError:
            pass

    notify.stopping()
    log.info("router stopping", grace_s=config.router.grace_period_s, failed=stop.failure is not None)
    await health_servicer.enter_graceful_shutdown()
    # Both fronts drain at once, each within the grace period; the token router goes last, so that
    # no front hands it a request after it stopped.
    await asyncio.gather(server.stop(config.router.grace_period_s), *([http.stop()] if http else []))
    await router.stop()
    claim.close()
    log.info("router stopped", exit_code=stop.exit_code)
    return stop.exit_code
