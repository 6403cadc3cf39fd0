"""Answering a sampling request (completions and chat alike): server-sent events as the engine
delivers deltas, or one JSON object at the end; the request is aborted when its client goes away."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sloserve.engine.async_engine import AsyncLLMEngine, ServedRequest
from sloserve.server.protocol import SamplingRequest, usage
from sloserve.server.serving import ErrorResponse, OpenAIServing, ResponseObjects, collect, ended_early


def json_error(error: ErrorResponse) -> JSONResponse:
    """An OpenAI error object as a response, with its status and headers."""
    return JSONResponse(error.body, status_code=error.status, headers=error.headers)


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def respond(
    serving: OpenAIServing, raw: Request, body: SamplingRequest, served: ServedRequest, kind: str
) -> Response:
    """Stream the request's deltas as SSE, or wait for all of them; abort it if the client leaves."""
    engine = serving.engine
    objects = ResponseObjects(kind == "chat", serving.config.model_name)
    if body.stream:
        return StreamingResponse(stream(engine, served, objects, body.include_usage), media_type="text/event-stream")
    result = await until_done_or_gone(engine, raw, served)
    if result is None:  # the client left: nobody reads this
        return Response(status_code=499)
    text, reason = result
    if reason in ("abort", "error"):
        return json_error(ended_early(reason, served.error or engine.error))
    return JSONResponse(
        objects.whole(text, reason, usage(served.num_prompt_tokens, served.num_output_tokens, served.num_cached_tokens))
    )


async def stream(
    engine: AsyncLLMEngine, served: ServedRequest, objects: ResponseObjects, include_usage: bool
) -> AsyncIterator[str]:
    """The request's deltas as SSE chunks, then usage (when asked) and ``[DONE]``."""
    try:
        if objects.chat:
            yield sse(objects.chunk("", None, role=True))
        async for delta in served:
            if delta.finish_reason in ("abort", "error"):
                yield sse(ended_early(delta.finish_reason, served.error or engine.error).body)
                break
            # NOTE: a chunk per delta that has tokens, even when their text is held back (an
            # incomplete character, a possible stop string): clients time tokens by chunks.
            if delta.finish_reason is None:
                yield objects.text_event(delta.text)
            else:
                yield sse(objects.chunk(delta.text, delta.finish_reason))
        if include_usage:
            yield sse(
                objects.usage_chunk(usage(served.num_prompt_tokens, served.num_output_tokens, served.num_cached_tokens))
            )
        yield sse("[DONE]")
    finally:  # NOTE: also when the client disconnects (the response task is cancelled)
        if served.finish_reason is None:
            engine.abort(served)


async def until_done_or_gone(engine: AsyncLLMEngine, raw: Request, served: ServedRequest) -> tuple[str, str] | None:
    """(text, finish reason) when the request ends; None if the client disconnects first (then the
    request is aborted)."""

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
