"""gRPC's answer to an exception that escapes a handler: INTERNAL, "internal error" and an id.

Left to itself, grpc.aio answers UNKNOWN "Unexpected <class ...>: <the exception's text>", handing a
client whatever the exception says of the router's insides. This interceptor wraps every handler of
the server (Generation, Admin, health, reflection) so that the client hears only the id, and the log
line with the same id carries the exception and its traceback (control/request.py, internal_error).
Statuses a handler sets on purpose (context.abort) pass through untouched.
"""

from __future__ import annotations

import inspect

import grpc

from services.router.control.request import internal_error

_BEHAVIORS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


async def _abort_internal(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    await context.abort(grpc.StatusCode.INTERNAL, str(internal_error(exc)))


def _hiding(behavior):
    """The handler, its unexpected exceptions answered as INTERNAL."""
    if inspect.isasyncgenfunction(behavior):
        async def streaming(request, context):
            try:
                async for response in behavior(request, context):
                    yield response
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await _abort_internal(context, exc)
        return streaming

    async def awaiting(request, context):
        try:
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort_internal(context, exc)
    return awaiting


def _is_async(behavior) -> bool:
    return inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)


class HideInternalErrors(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        return handler._replace(**{name: _hiding(getattr(handler, name)) for name in _BEHAVIORS
                                   if _is_async(getattr(handler, name))})
