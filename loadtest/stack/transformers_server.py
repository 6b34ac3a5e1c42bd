"""python -m loadtest.stack.transformers_server: the serving benchmark's floor, plain transformers.

The same gRPC Generate API as the router, answered by transformers' own `generate` on the same
model, one request at a time (others wait their turn), tokens streamed as they come. It reads the
same settings as the services (model.path/device/dtype, router.grpc_address) and validates input
with the router's own rules, so the benchmark drives both the same way. It sends no StageTimings.
"""

from __future__ import annotations

import asyncio
import signal
import threading

import grpc
import structlog
import torch
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from transformers import StoppingCriteria, StoppingCriteriaList

from pdserve.v1 import generation_pb2, generation_pb2_grpc
from services.router.api.generation import generate_input
from services.router.detokenizer import IncrementalText
from services.router.prompt_tokenizer import PromptTokenizer
from services.router.validation import InvalidRequest, Job, ModelLimits, build_job, check_request_shape
from shared.config.schema import Config
from shared.model import presets
from shared.model.generation_config import sampling_defaults
from shared.model.loader import eos_token_ids, load_hf_config, resolve_checkpoint
from shared.model.tokenizer import load_tokenizer
from shared.runtime.log import configure_logging
from shared.runtime.process import die_with_parent
from shared.runtime.service_config import parse_service_config

log = structlog.get_logger()


class TokenStream:
    """A transformers streamer that hands each new token id to the event loop's queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
        self._loop, self._queue = loop, queue
        self._prompt_seen = False
        self.cancelled = threading.Event()  # set by the caller: generate stops at its next step

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate() first passes the prompt
            self._prompt_seen = True
            return
        for token_id in value.flatten().tolist():
            self._loop.call_soon_threadsafe(self._queue.put_nowait, token_id)

    def end(self) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, None)


class StopWhenCancelled(StoppingCriteria):
    def __init__(self, stream: TokenStream):
        self.stream = stream

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.stream.cancelled.is_set(), device=input_ids.device)


class TransformersGeneration(generation_pb2_grpc.GenerationServicer):
    def __init__(self, model, tokenizer, limits: ModelLimits, eos: set[int]):
        self.model, self.tokenizer, self.limits, self.eos = model, tokenizer, limits, eos
        self.prompts = PromptTokenizer(tokenizer, limits, at_once=1, wait_s=0)  # encodes in this thread only
        self.turn = asyncio.Lock()  # one request at a time: the floor

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        try:
            given = generate_input(request)
            check_request_shape(given, self.limits)
            job = build_job(given, self.prompts.encode(given), self.limits)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        async with self.turn:
            async for chunk in self._stream(request.request_id, job):
                yield chunk

    async def _stream(self, request_id: str, job: Job):
        queue: asyncio.Queue = asyncio.Queue()
        stream = TokenStream(asyncio.get_running_loop(), queue)
        running = asyncio.create_task(asyncio.to_thread(self._generate, job, stream))
        text = IncrementalText(self.tokenizer, job.stop_strings)
        generated = 0
        try:
            while (token_id := await queue.get()) is not None:
                generated += 1
                piece, stopped = text.push(token_id)
                last = stopped or generated == job.stop.max_tokens or (
                    token_id in self.eos and not job.stop.ignore_eos)
                if not last:
                    yield generation_pb2.GenerateResponse(request_id=request_id, token_ids=[token_id], text=piece)
                    continue
                reason = "stop" if stopped or token_id in self.eos and not job.stop.ignore_eos else "length"
                usage = generation_pb2.Usage(prompt_tokens=len(job.prompt_token_ids), completion_tokens=generated)
                yield generation_pb2.GenerateResponse(request_id=request_id, token_ids=[token_id],
                                                      text=piece if stopped else piece + text.flush(),
                                                      finish_reason=reason, usage=usage)
                return
            await running  # raises what stopped generate() early
            raise RuntimeError("generate() ended before the request did")
        finally:
            stream.cancelled.set()  # a stop string, or the client went away: free the model
            await asyncio.gather(running, return_exceptions=True)

    @torch.inference_mode()
    def _generate(self, job: Job, stream: TokenStream) -> None:
        sampling = job.sampling
        torch.manual_seed(sampling.seed)
        ids = torch.tensor([job.prompt_token_ids], device=self.model.device)
        options = dict(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                       top_k=sampling.top_k) if sampling.temperature > 0 else dict(do_sample=False)
        try:
            self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=job.stop.max_tokens,
                                min_new_tokens=job.stop.max_tokens if job.stop.ignore_eos else 0, streamer=stream,
                                stopping_criteria=StoppingCriteriaList([StopWhenCancelled(stream)]), **options)
        finally:
            stream.end()  # also when generate() raised: the stream must not wait forever


def load_model(config: Config, checkpoint):
    dtype = getattr(torch, config.model.dtype)
    if presets.is_random(str(checkpoint)):
        return presets.random_hf_model(str(checkpoint), dtype, config.model.device)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=dtype, device_map=config.model.device).eval()


async def serve(config: Config) -> None:
    checkpoint = resolve_checkpoint(config.model.path, config.model.cache_dir)
    hf_config = load_hf_config(checkpoint)
    model = load_model(config, checkpoint)
    limits = ModelLimits(hf_config.vocab_size, hf_config.max_position_embeddings, config.defaults.max_tokens,
                         sampling=sampling_defaults(checkpoint))  # as the router serves it
    servicer = TransformersGeneration(model, load_tokenizer(checkpoint), limits, set(eos_token_ids(hf_config)))
    server = grpc.aio.server()
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(config.router.grpc_address)
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info("transformers floor serving", grpc=config.router.grpc_address, model=str(checkpoint))
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stopping.set)
    await stopping.wait()
    await server.stop(config.router.grace_period_s)


def main() -> None:
    die_with_parent()
    config = parse_service_config("router")
    configure_logging("transformers-floor", "transformers-floor", config.log.format, config.log.level)
    uvloop.run(serve(config))


if __name__ == "__main__":
    main()
