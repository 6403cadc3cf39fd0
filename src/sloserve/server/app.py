"""The OpenAI-compatible HTTP API (FastAPI) over an ``AsyncLLMEngine``.

Routes, a router each: ``POST /v1/completions`` (completions_api.py), ``POST /v1/chat/completions``
(chat_api.py), both with ``stream: true`` as server-sent events ending in ``data: [DONE]``
(responses.py); OpenAI's Responses API, ``POST /v1/responses``, through the chat path, and its
stored responses (responses_api.py); ``GET /v1/models`` and ``/version`` (models_api.py); vLLM's ``POST /tokenize`` and ``/detokenize``
(tokenize_api.py); ``GET /health`` and ``GET /metrics`` (metrics_api.py); vLLM's ``POST /reset_prefix_cache``
(prefix_cache_api.py); and with a data dir the Files and Batches routes (batch_api.py).
With ``--api-key``, every route but /health and /metrics needs the key (401 without it), and files and
batches are their key's own (auth.py). Errors are OpenAI's error object (``{"error": {"message", "type", "param", "code"}}``): 400 for a bad
body or parameter or a prompt that does not fit, 404 for an unknown model or route, 429 with
Retry-After when the queue is full, 503 while shutting down.

Classes: ``service_tier: "flex"`` makes a request best-effort (BE); anything else is real-time (RT),
with the request's ``slo`` (``ttft_ms``, ``tpot_ms``) or the server's RT defaults. The scheduler sees
them as in the simulator.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sloserve.core.errors import SloserveError
from sloserve.server.auth import ApiKeyAuth
from sloserve.server.batch_api import BatchService
from sloserve.server.bodies import add_body_schemas
from sloserve.server.chat_api import chat_router
from sloserve.server.completions_api import completions_router
from sloserve.server.metrics import ServerMetrics
from sloserve.server.metrics_api import metrics_router
from sloserve.server.models_api import models_router
from sloserve.server.prefix_cache_api import prefix_cache_router
from sloserve.server.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest, error_body
from sloserve.server.response_store import ResponseStore
from sloserve.server.responses import json_error
from sloserve.server.responses_api import ResponsesRequest, responses_router
from sloserve.server.serving import OpenAIServing, error_response, validation_error
from sloserve.server.tokenize_api import tokenize_router

# Seconds the lifespan's shutdown waits for running requests when no signal drained them first.
DRAIN_AT_EXIT_S = 5.0
# Seconds the shutdown waits for the Batch API's runner to put its lines back to pending.
BATCH_STOP_TIMEOUT_S = 15.0


def build_app(
    serving: OpenAIServing,
    metrics: ServerMetrics,
    batches: BatchService | None = None,
    api_keys: Sequence[str] = (),
    stored_responses: ResponseStore | None = None,
) -> FastAPI:
    """The FastAPI app over ``serving``'s started engine: a router per endpoint family, errors as
    OpenAI's error object; its lifespan drains the engine at shutdown. ``batches`` adds the Files and
    Batches routes and runs their batches while the app runs. With ``api_keys``, every route but
    /health and /metrics needs one of them (``auth.py``). ``stored_responses``: where the Responses
    API keeps its responses (None: in memory)."""
    engine = serving.engine
    stored_responses = stored_responses if stored_responses is not None else ResponseStore()

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
        serving.close()
        metrics.close()
        stored_responses.close()
        if batches is not None:
            batches.close()

    app = FastAPI(title="sloserve", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.batches = batches
    _add_error_handlers(app, metrics)
    add_body_schemas(app, [CompletionRequest, ChatCompletionRequest, ResponsesRequest, TokenizeRequest])
    app.include_router(completions_router(serving))
    app.include_router(chat_router(serving))
    app.include_router(responses_router(serving, stored_responses))
    app.include_router(models_router(serving))
    app.include_router(tokenize_router(serving))
    app.include_router(metrics_router(engine, metrics))
    app.include_router(prefix_cache_router(engine))
    if batches is not None:
        app.include_router(batches.router())
    if api_keys:
        app.add_middleware(ApiKeyAuth, keys=api_keys, on_refused=metrics.rejected.labels("unauthorized").inc)
    return app


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """A bad body, an HTTP error and sloserve's own refusals answer with OpenAI's error object."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.rejected.labels("invalid").inc()
        return JSONResponse(validation_error(exc.errors(), exc.body), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(
            error_body(str(exc.detail), type_), status_code=exc.status_code, headers=getattr(exc, "headers", None)
        )

    @app.exception_handler(SloserveError)
    async def _refused(request: Request, exc: SloserveError) -> JSONResponse:
        error = error_response(exc)
        if error is None:
            raise exc
        if error.rejected is not None:
            metrics.rejected.labels(error.rejected).inc()
        return json_error(error)
