"""Answering a sampling request (completions and chat alike): server-sent events as the engine
delivers deltas, or one JSON object at the end; the request is aborted when its client goes away."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sloserve.engine.async_engine import AsyncLLMEngine, ServedRequest, StreamDelta
from sloserve.server.protocol import usage
from sloserve.server.serving import (
    ErrorResponse,
    Generated,
    OpenAIServing,
    ResponseObjects,
    Submission,
    collect,
    ended_early,
)

T = TypeVar("T")


def json_error(error: ErrorResponse) -> JSONResponse:
    """An OpenAI error object as a response, with its status and headers."""
    return JSONResponse(error.body, status_code=error.status, headers=error.headers)


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def respond(serving: OpenAIServing, raw: Request, submission: Submission, kind: str) -> Response:
    """Stream the choices' deltas as SSE, or wait for all of them; abort them if the client leaves."""
    engine = serving.engine
    body = submission.body
    objects = ResponseObjects(
        kind == "chat", serving.config.model_name, submission.service_tier, body.response_id(raw.headers)
    )
    if body.stream:
        return StreamingResponse(stream(engine, submission, objects), media_type="text/event-stream")
    results = await until_done_or_gone(engine, raw, submission)
    if results is None:  # the client left: nobody reads this
        return Response(status_code=499)
    for served, result in zip(submission.served, results, strict=True):
        if result.finish_reason in ("abort", "error"):
            return json_error(ended_early(result.finish_reason, served.error or engine.error))
    return JSONResponse(submission.whole(objects, results))


async def stream(engine: AsyncLLMEngine, submission: Submission, objects: ResponseObjects) -> AsyncIterator[str]:
    """The choices' deltas as SSE chunks (each with its choice's index), then usage (when asked) and
    ``[DONE]``."""
    served = submission.served
    parsers = [submission.output_parser() for _ in served] if submission.parses_output else None
    body = submission.body
    plain = (len(served) == 1 and body.num_logprobs is None and not submission.echo and parsers is None
             and not body.continuous_usage and not body.return_token_ids)  # fmt: skip
    ids = body.return_token_ids  # vLLM's: each chunk's token ids, and the prompt's first
    offsets = [0] * len(served)  # each choice's text_offset: the characters of the token strings sent
    started = [False] * len(served)
    num_sent = [0] * len(served)  # each choice's tokens sent

    def event(i: int, chunk: dict[str, Any]) -> str:
        if body.continuous_usage:  # vLLM's: the choice's prompt and its tokens so far
            # NOTE: its cached tokens are known with its first token (a role chunk comes before)
            cached = served[i].num_cached_tokens if num_sent[i] else None
            chunk["usage"] = usage(served[i].num_prompt_tokens, num_sent[i], cached)
        return sse(chunk)

    try:
        if objects.chat:
            for i in range(len(served)):
                yield event(i, objects.chunk("", None, role=True, index=i,
                                             prompt_token_ids=served[i].prompt_token_ids if ids else None))  # fmt: skip
                if submission.chat_echo:
                    yield event(i, objects.chunk(submission.chat_echo, None, index=i))
        async for i, delta in _merged(served):
            if delta.finish_reason in ("abort", "error"):
                yield sse(ended_early(delta.finish_reason, served[i].error or engine.error).body)
                break
            # NOTE: a chunk per delta that has tokens, even when their text is held back (an
            # incomplete character, a possible stop string): clients time tokens by chunks.
            if plain and delta.finish_reason is None:
                yield objects.text_event(delta.text)
                continue
            text, logprobs = submission.shown(
                i, delta.text, delta.token_ids, delta.logprobs, offsets[i], first=not started[i]
            )
            token_ids = prompt_token_ids = None
            if ids:
                token_ids = [] if submission.echo_only else delta.token_ids
                prompt_token_ids = served[i].prompt_token_ids if not started[i] and not objects.chat else None
            started[i] = True
            num_sent[i] += len(delta.token_ids)
            if logprobs is not None and "tokens" in logprobs:
                offsets[i] += sum(len(t) for t in logprobs["tokens"])
            if parsers is None:
                yield event(i, objects.chunk(text, delta.finish_reason, index=i, logprobs=logprobs,
                                             stop_reason=delta.stop_reason, token_ids=token_ids,
                                             prompt_token_ids=prompt_token_ids))  # fmt: skip
                continue
            reason = delta.finish_reason
            found = parsers[i].feed(text, finished=reason is not None)
            if reason is not None:
                reason = parsers[i].finish_reason(reason)
            yield event(i, objects.chunk(found.content, reason, index=i, logprobs=logprobs, tool_calls=found.calls,
                                         stop_reason=delta.stop_reason,
                                         reasoning=found.reasoning if body.include_reasoning else "",
                                         token_ids=token_ids))  # fmt: skip
        if body.include_usage:
            yield sse(objects.usage_chunk(submission.usage()))
        yield sse("[DONE]")
    finally:  # NOTE: also when the client disconnects (the response task is cancelled)
        submission.abort(engine)


async def _merged(served: list[ServedRequest]) -> AsyncIterator[tuple[int, StreamDelta]]:
    """(choice, delta) of every choice as they come, until each has its last delta."""
    if len(served) == 1:
        async for delta in served[0]:
            yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, StreamDelta]] = asyncio.Queue()

    async def pump(i: int) -> None:
        async for delta in served[i]:
            queue.put_nowait((i, delta))

    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(served))]
    try:
        for _ in range(len(served)):
            while True:
                i, delta = await queue.get()
                yield i, delta
                if delta.finish_reason is not None:
                    break
    finally:
        for task in tasks:
            task.cancel()


async def until_done_or_gone(engine: AsyncLLMEngine, raw: Request, submission: Submission) -> list[Generated] | None:
    """What each choice gave, once all have ended; None if the client disconnects first (then they
    are aborted)."""
    results = await unless_gone(raw, asyncio.gather(*(collect(s) for s in submission.served)))
    if results is None:
        submission.abort(engine)
    return results


async def unless_gone(raw: Request, work: Awaitable[T]) -> T | None:
    """``work``'s result, or None if the client disconnects first (then ``work`` is cancelled)."""

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    # NOTE: a cancelled gather ends with a CancelledError as its exception, which asyncio logs (with a
    # traceback) unless something reads it
    task.add_done_callback(_read_exception)
    return None


def _read_exception(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()
