"""The OpenAI-compatible HTTP API (FastAPI) over an ``AsyncLLMEngine``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream: true`` as
server-sent events ending in ``data: [DONE]``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``.
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
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from sloserve.core.errors import ConfigError
from sloserve.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    QueueFullError,
    ServedRequest,
    ShuttingDownError,
)
from sloserve.engine.sampler import SamplingParams
from sloserve.server.chat_template import ChatTemplate
from sloserve.server.metrics import ServerMetrics
from sloserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ParameterError,
    SamplingRequest,
    error_body,
    now_unix,
    usage,
)

# Seconds a client is told to wait after a 429 (Retry-After).
RETRY_AFTER_S = 1
# Seconds the lifespan's shutdown waits for running requests when no signal drained them first.
DRAIN_AT_EXIT_S = 5.0


@dataclass
class ServerConfig:
    """What the HTTP layer needs besides the engine."""

    model_name: str  # the name clients must send as ``model``
    rt_ttft_ms: float | None = None  # default SLOs of RT requests
    rt_tpot_ms: float | None = None


class ModelNotFoundError(ConfigError):
    pass


def _error(status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:  # fmt: skip
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


def _sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class ResponseObjects:
    """The OpenAI objects of one response: its id, the streamed chunks, the usage chunk, the whole body."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                     "object": "chat.completion.chunk" if chat else "text_completion", "created": now_unix(),
                     "model": model}  # fmt: skip
        # NOTE: a token chunk differs from the next only in its text, so it is formatted around the
        # JSON of the text rather than serialized whole (that was a fifth of the event loop's time).
        empty = json.dumps(self.chunk("", None))
        marker = '"content": ""' if chat else '"text": ""'
        before, after = empty.split(marker)
        self._text_event = (f"data: {before}{marker[:-2]}", f"{after}\n\n")

    def chunk(self, text: str, finish_reason: str | None, role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text or finish_reason is None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self.head, "choices": [choice]}

    def text_event(self, text: str) -> str:
        """The SSE event of a chunk of ``text`` that does not finish the response."""
        before, after = self._text_event
        return f"{before}{json.dumps(text)}{after}"

    def usage_chunk(self, counts: dict[str, int]) -> dict[str, Any]:
        return {**self.head, "choices": [], "usage": counts}

    def whole(self, text: str, finish_reason: str, counts: dict[str, int]) -> dict[str, Any]:
        """The non-streamed response."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}  # fmt: skip
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self.head, "object": obj, "choices": [choice], "usage": counts}


def build_app(engine: AsyncLLMEngine, config: ServerConfig, chat_template: ChatTemplate,
              metrics: ServerMetrics) -> FastAPI:  # fmt: skip
    """The FastAPI app over a started ``engine``; its lifespan drains the engine at shutdown."""
    tokenizer = engine.tokenizer
    max_model_len = engine.max_model_len

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(engine.drain, 0.0 if engine.error is not None else DRAIN_AT_EXIT_S)
        metrics.close()

    app = FastAPI(title="sloserve", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics

    # --- errors ---------------------------------------------------------------------------------
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.rejected.labels("invalid").inc()
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return _error(400, f"the request body is not valid JSON: {first.get('msg')}", "invalid_request_error")
        param = ".".join(loc) or None
        return _error(400, f"{param + ': ' if param else ''}{first.get('msg')}", "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), "invalid_request_error" if exc.status_code < 500 else "server_error",
                      headers=getattr(exc, "headers", None))  # fmt: skip

    @app.exception_handler(ModelNotFoundError)
    async def _no_model(request: Request, exc: ModelNotFoundError) -> JSONResponse:
        metrics.rejected.labels("invalid").inc()
        return _error(404, str(exc), "invalid_request_error", "model", "model_not_found")

    @app.exception_handler(ConfigError)
    async def _bad(request: Request, exc: ConfigError) -> JSONResponse:
        metrics.rejected.labels("invalid").inc()
        param = exc.param if isinstance(exc, ParameterError) else None
        code = "context_length_exceeded" if param == "max_tokens" else None
        return _error(400, str(exc), "invalid_request_error", param, code)

    @app.exception_handler(QueueFullError)
    async def _full(request: Request, exc: QueueFullError) -> JSONResponse:
        metrics.rejected.labels("queue_full").inc()
        return _error(429, str(exc), "rate_limit_error", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(ShuttingDownError)
    async def _closing(request: Request, exc: ShuttingDownError) -> JSONResponse:
        metrics.rejected.labels("shutting_down").inc()
        return _error(503, str(exc), "service_unavailable", code="shutting_down")

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return _error(500, str(exc), "server_error", code="engine_failed")

    # --- requests -------------------------------------------------------------------------------
    def check_model(name: str) -> None:
        if name != config.model_name:
            raise ModelNotFoundError(f"The model {name!r} does not exist; this server serves {config.model_name!r}")

    def encode(text: str, add_special_tokens: bool = True) -> list[int]:
        if tokenizer is None:
            raise ParameterError("prompt", "this model has no tokenizer: send the prompt as a list of token ids")
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def submit(body: SamplingRequest, prompt_ids: list[int], max_tokens: int | None) -> ServedRequest:
        if not prompt_ids:
            raise ParameterError("prompt", "the prompt is empty")
        room = max_model_len - len(prompt_ids)
        if max_tokens is not None and max_tokens > room:
            raise ParameterError(
                "max_tokens",
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, {max_tokens} in the "
                "completion). Please reduce the prompt or the completion length.",
            )
        if room < 1:
            raise ParameterError("prompt", f"the prompt has {len(prompt_ids)} tokens: the model's context is "
                                           f"{max_model_len} tokens, which leaves none to generate")  # fmt: skip
        params = SamplingParams(max_tokens=max_tokens or room, temperature=body.temperature, top_p=body.top_p,
                                seed=body.seed, ignore_eos=body.ignore_eos)  # fmt: skip
        cls = body.request_class()
        return engine.submit(prompt_ids, params, request_class=cls, stop=body.stop_strings(),
                             slo=body.slo_for(cls, config.rt_ttft_ms, config.rt_tpot_ms))  # fmt: skip

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
            return ended_early(reason)
        return JSONResponse(objects.whole(text, reason, usage(served.num_prompt_tokens, served.num_output_tokens)))

    def ended_early(reason: str) -> JSONResponse:
        if reason == "abort":
            return _error(503, "the request was aborted: the server shut down before it finished", "service_unavailable",
                          code="shutting_down")  # fmt: skip
        return _error(500, f"the engine failed while serving this request: {engine.error}", "server_error",
                      code="engine_failed")  # fmt: skip

    async def stream(served: ServedRequest, objects: ResponseObjects, include_usage: bool) -> AsyncIterator[str]:
        try:
            if objects.chat:
                yield _sse(objects.chunk("", None, role=True))
            async for delta in served:
                if delta.finish_reason in ("abort", "error"):
                    yield _sse(ended_early(delta.finish_reason).body.decode())
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

        async def collect() -> tuple[str, str]:
            parts, reason = [], "error"
            async for delta in served:
                parts.append(delta.text)
                reason = delta.finish_reason or reason
            return "".join(parts), reason

        async def disconnected() -> None:
            while (await raw.receive())["type"] != "http.disconnect":
                pass

        work, watch = asyncio.ensure_future(collect()), asyncio.ensure_future(disconnected())
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
        check_model(body.model)
        body.check_supported()
        prompt = body.single_prompt()
        prompt_ids = encode(prompt) if isinstance(prompt, str) else list(prompt)
        served = submit(body, prompt_ids, body.max_tokens)
        return await respond(raw, body, served, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        check_model(body.model)
        body.check_supported()
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in body.messages]
        prompt = chat_template.render(messages)
        served = submit(body, encode(prompt, add_special_tokens=not chat_template.from_model), body.output_cap)
        return await respond(raw, body, served, "chat")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": now_unix(),
                                            "owned_by": "sloserve", "max_model_len": max_model_len}]}  # fmt: skip

    @app.get("/health")
    async def health() -> Response:
        if engine.error is not None:
            return _error(503, f"the engine failed: {engine.error}", "service_unavailable", code="engine_failed")
        if engine.draining:
            return _error(503, "the server is shutting down", "service_unavailable", code="shutting_down")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app

