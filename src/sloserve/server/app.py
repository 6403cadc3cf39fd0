"""The OpenAI-compatible HTTP API (FastAPI) over an ``AsyncLLMEngine``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream: true`` as
server-sent events ending in ``data: [DONE]``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``,
and with a data dir the Files and Batches routes (``batch_api``).
Errors are OpenAI's error object (``{"error": {"message", "type", "param", "code"}}``): 400 for a bad
body or parameter or a prompt that does not fit, 404 for an unknown model or route, 429 with
Retry-After when the queue is full, 503 while shutting down.

Classes: ``service_tier: "flex"`` makes a request best-effort (BE); anything else is real-time (RT),
with the request's ``slo`` (``ttft_ms``, ``tpot_ms``) or the server's RT defaults. The scheduler sees
them as in the simulator.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from sloserve.core.errors import SloserveError
from sloserve.engine.async_engine import ServedRequest
from sloserve.server.batch_api import BatchService
from sloserve.server.metrics import ServerMetrics
from sloserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    error_body,
    now_unix,
    usage,
)
from sloserve.server.serving import (
    ErrorResponse,
    OpenAIServing,
    ResponseObjects,
    collect,
    ended_early,
    error_response,
    validation_error,
)

# Seconds the lifespan's shutdown waits for running requests when no signal drained them first.
DRAIN_AT_EXIT_S = 5.0
# Seconds the shutdown waits for the Batch API's runner to put its lines back to pending.
BATCH_STOP_TIMEOUT_S = 15.0


def _json(error: ErrorResponse) -> JSONResponse:
    return JSONResponse(error.body, status_code=error.status, headers=error.headers)


def _sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def build_app(serving: OpenAIServing, metrics: ServerMetrics, batches: BatchService | None = None) -> FastAPI:
    """The FastAPI app over ``serving``'s started engine; its lifespan drains the engine at shutdown.
    ``batches`` adds the Files and Batches routes and runs their batches while the app runs."""
    engine, config = serving.engine, serving.config

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if batches is not None:
            batches.start()
        yield
        if batches is not None:
            with contextlib.suppress(TimeoutError):  # NOTE: a stuck runner must not keep the process up
                async with asyncio.timeout(BATCH_STOP_TIMEOUT_S):
                    await batches.stop()
        await asyncio.to_thread(engine.drain, 0.0 if engine.error is not None else DRAIN_AT_EXIT_S)
        metrics.close()
        if batches is not None:
            batches.close()

    app = FastAPI(title="sloserve", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.batches = batches

    # --- errors ---------------------------------------------------------------------------------
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.rejected.labels("invalid").inc()
        return JSONResponse(validation_error(exc.errors()), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), type_), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))  # fmt: skip

    @app.exception_handler(SloserveError)
    async def _refused(request: Request, exc: SloserveError) -> JSONResponse:
        error = error_response(exc)
        if error is None:
            raise exc
        if error.rejected is not None:
            metrics.rejected.labels(error.rejected).inc()
        return _json(error)

    # --- requests -------------------------------------------------------------------------------
    async def respond(raw: Request, body: SamplingRequest, served: ServedRequest, kind: str) -> Response:
        """Stream the request's deltas as SSE, or wait for all of them; abort it if the client leaves."""
        objects = ResponseObjects(kind == "chat", config.model_name)
        if body.stream:
            return StreamingResponse(stream(served, objects, body.include_usage), media_type="text/event-stream")
        result = await until_done_or_gone(raw, served)
        if result is None:  # the client left: nobody reads this
            return Response(status_code=499)
        text, reason = result
        if reason in ("abort", "error"):
            return _json(ended_early(reason, engine.error))
        return JSONResponse(objects.whole(text, reason, usage(served.num_prompt_tokens, served.num_output_tokens)))

    async def stream(served: ServedRequest, objects: ResponseObjects, include_usage: bool) -> AsyncIterator[str]:
        try:
            if objects.chat:
                yield _sse(objects.chunk("", None, role=True))
            async for delta in served:
                if delta.finish_reason in ("abort", "error"):
                    yield _sse(ended_early(delta.finish_reason, engine.error).body)
                    break
                # NOTE: a chunk per delta that has tokens, even when their text is held back (an
                # incomplete character, a possible stop string): clients time tokens by chunks.
                if delta.finish_reason is None:
                    yield objects.text_event(delta.text)
                else:
                    yield _sse(objects.chunk(delta.text, delta.finish_reason))
            if include_usage:
                yield _sse(objects.usage_chunk(usage(served.num_prompt_tokens, served.num_output_tokens)))
            yield _sse("[DONE]")
        finally:  # NOTE: also when the client disconnects (the response task is cancelled)
            if served.finish_reason is None:
                engine.abort(served)

    async def until_done_or_gone(raw: Request, served: ServedRequest) -> tuple[str, str] | None:
        """(text, finish reason) when the request ends; None if the client disconnects first (then
        the request is aborted)."""

        async def disconnected() -> None:
            while (await raw.receive())["type"] != "http.disconnect":
                pass

        work, watch = asyncio.ensure_future(collect(served)), asyncio.ensure_future(disconnected())
        try:
            done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if work in done:
            return work.result()
        work.cancel()
        engine.abort(served)
        return None

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await respond(raw, body, serving.submit_completion(body), "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await respond(raw, body, serving.submit_chat(body), "chat")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": now_unix(),
                                            "owned_by": "sloserve", "max_model_len": engine.max_model_len}]}  # fmt: skip

    @app.get("/health")
    async def health() -> Response:
        if engine.error is not None:
            return _json(ErrorResponse(503, error_body(f"the engine failed: {engine.error}", "service_unavailable",
                                                       code="engine_failed")))  # fmt: skip
        if engine.draining:
            return _json(ErrorResponse(503, error_body("the server is shutting down", "service_unavailable",
                                                       code="shutting_down")))  # fmt: skip
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    if batches is not None:
        app.include_router(batches.router())
    return app
