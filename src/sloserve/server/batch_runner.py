"""Runs the Batch API's batches on the served engine, beside online traffic.

Every batch line is a best-effort (BE) request, whatever its body's ``service_tier``: BROS packs
them into the real-time requests' slack, ``vllm_priority`` and the other class-aware policies run
them after RT ones, class-blind policies in arrival order. At most ``max_lines_in_engine`` lines are
in the engine at once (admission), oldest batch first, each batch's lines in file order, so a
million-line batch never floods the queue online requests wait in.

A line is answered as the same body sent online would be (``OpenAIServing``): its response, or the
error object that request would get, goes in the batch's output or error file. A line the engine did
not finish (the server is stopping, its batch was cancelled or expired) is not answered: it goes
back to pending (``BatchStore.requeue_line``) and runs after a restart, unless its batch ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from sloserve.core.errors import SloserveError
from sloserve.core.request import RequestClass
from sloserve.server.batch_store import BatchStore, Line, new_id
from sloserve.server.beam_search_api import beam_search
from sloserve.server.metrics import ServerMetrics
from sloserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ParameterError,
)
from sloserve.server.responses_api import ResponsesRequest, submit_response, whole_response
from sloserve.server.serving import (
    OpenAIServing,
    ResponseObjects,
    Submission,
    collect,
    error_response,
    validation_error,
)

log = logging.getLogger("uvicorn.error")

BODY_MODELS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
               "/v1/responses": ResponsesRequest}  # fmt: skip
# Seconds between checks for expired batches when nothing else wakes the runner.
POLL_S = 1.0
# Seconds admission pauses after the engine's queue refused a line (429): online traffic first.
QUEUE_FULL_BACKOFF_S = 0.5
EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."


@dataclass
class InFlight:
    line: Line
    task: asyncio.Task
    submission: Submission | None = None  # its engine requests, once submitted
    search: asyncio.Task | None = None  # a beam search line's search, once begun

    def abort(self, engine) -> None:
        """End its engine requests (a search's step too); it goes back to pending."""
        if self.submission is not None:
            self.submission.abort(engine)
        if self.search is not None:
            self.search.cancel()


def output_line(custom_id: str, status_code: int, body: dict[str, Any]) -> dict[str, Any]:
    """One line of a batch's output or error file, as OpenAI writes it."""
    request_id = body.get("id") or new_id("req_")
    return {
        "id": new_id("batch_req_"),
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": request_id, "body": body},
        "error": None,
    }


def expired_line(custom_id: str) -> dict[str, Any]:
    return {
        "id": new_id("batch_req_"),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": "batch_expired", "message": EXPIRED_MESSAGE},
    }


class BatchRunner:
    """The asyncio task that moves batches through their statuses and feeds their lines to the engine."""

    def __init__(
        self, store: BatchStore, serving: OpenAIServing, max_lines_in_engine: int, metrics: ServerMetrics | None = None
    ) -> None:
        self.store = store
        self.serving = serving
        self.metrics = metrics
        self.max_lines_in_engine = max_lines_in_engine
        self._in_flight: dict[tuple[str, int], InFlight] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False  # admit no more lines
        self._closed = False  # end the loop
        self._paused_until = 0.0

    def start(self) -> None:
        """Start on the running event loop (the server's)."""
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._run(), name="sloserve-batches")

    def wake(self) -> None:
        """Something changed (a batch created or cancelled): look now."""
        self._wake.set()

    def stop_admitting(self) -> None:
        """The server is stopping: admit no more lines and abort those in the engine (they go back to
        pending and run after a restart), so they do not hold the shutdown's drain."""
        self._stopping = True
        for flight in list(self._in_flight.values()):
            flight.abort(self.serving.engine)
        self._wake.set()

    def stop_admitting_threadsafe(self) -> None:
        """``stop_admitting`` from any thread (a signal handler)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.stop_admitting)

    async def stop(self) -> None:
        self.stop_admitting()
        if self._in_flight:
            await asyncio.wait([f.task for f in self._in_flight.values()], timeout=10)
        self._closed = True
        self._wake.set()
        if self._task is not None:
            await self._task

    # --- the loop ------------------------------------------------------------------------------
    async def _run(self) -> None:
        requeued = await asyncio.to_thread(self.store.requeue_running)
        if requeued:
            log.info("batches: %d lines that were running when the server stopped run again", requeued)
        while not self._closed:
            self._wake.clear()
            try:
                await self._advance()
            except Exception:  # a bug must not stop the batches for good: log it and go on
                log.exception("batch runner failed; retrying")
            # NOTE: asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancellation
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_S):
                    await self._wake.wait()

    async def _advance(self) -> None:
        store, now = self.store, time.time()
        for batch in store.batches_in("validating"):
            store.set_status(batch["id"], "in_progress", only_from=("validating",))
        for batch in store.batches_in("cancelling"):
            if self._abort_batch(batch["id"]) == 0:
                await asyncio.to_thread(store.finish_batch, batch["id"], "cancelled", ("cancelling",))
        for batch in store.batches_in("in_progress"):
            batch_id = batch["id"]
            if now >= batch["expires_at"]:
                if self._abort_batch(batch_id) == 0:
                    await asyncio.to_thread(store.fail_unanswered, batch_id, expired_line)
                    await asyncio.to_thread(store.finish_batch, batch_id, "expired", ("in_progress",))
            elif store.count_lines(batch_id, "pending", "running") == 0:
                store.set_status(batch_id, "finalizing", only_from=("in_progress",))
        for batch in store.batches_in("finalizing"):  # also one a crash interrupted
            await asyncio.to_thread(store.finish_batch, batch["id"], "completed", ("finalizing",))
        self._admit(now)

    def _admit(self, now: float) -> None:
        engine = self.serving.engine
        if self._stopping or engine.draining or engine.error is not None or now < self._paused_until:
            return
        for batch in self.store.batches_in("in_progress"):
            room = self.max_lines_in_engine - len(self._in_flight)
            if room <= 0:
                return
            if now >= batch["expires_at"]:
                continue
            for line in self.store.start_lines(batch["id"], room):
                task = asyncio.get_running_loop().create_task(self._serve(line, batch["endpoint"]))
                self._in_flight[(line.batch_id, line.line_no)] = InFlight(line, task)
            self._count_in_engine()

    def _count_in_engine(self) -> None:
        if self.metrics is not None:
            self.metrics.batch_lines_in_engine.set(len(self._in_flight))

    def _abort_batch(self, batch_id: str) -> int:
        """Abort ``batch_id``'s lines in the engine; the number still in flight."""
        flights = [f for f in self._in_flight.values() if f.line.batch_id == batch_id]
        for flight in flights:
            flight.abort(self.serving.engine)
        return len(flights)

    # --- one line ------------------------------------------------------------------------------
    async def _serve(self, line: Line, endpoint: str) -> None:
        key = (line.batch_id, line.line_no)
        try:
            result, failed = await self._answer(line, endpoint, self._in_flight[key])
            if result is None:
                self.store.requeue_line(line)
            else:
                tokens = (result["response"]["body"].get("usage") or {}) if result["response"] else {}
                answered = self.store.finish_line(
                    line, result, failed, tokens.get("prompt_tokens", 0), tokens.get("completion_tokens", 0)
                )
                if answered and self.metrics is not None:
                    self.metrics.batch_lines.labels("failed" if failed else "completed").inc()
        except Exception:  # a bug: log it; the line runs again after a restart
            log.exception("batch %s line %d failed", line.batch_id, line.line_no)
            self.store.requeue_line(line)
        finally:
            del self._in_flight[key]
            self._count_in_engine()
            self._wake.set()

    async def _answer(self, line: Line, endpoint: str, flight: InFlight) -> tuple[dict[str, Any] | None, bool]:
        """(the output line, whether it is an error); (None, _) when the line was not answered."""
        chat = endpoint == "/v1/chat/completions"
        try:
            # NOTE: beside the event loop, as the routes validate theirs (bodies.py): online requests go on
            body = await self.serving.off_loop(BODY_MODELS[endpoint].model_validate_json, line.body)
            if body.stream:
                raise ParameterError("stream", "stream is not supported in a batch: each line gets one response")
            if getattr(body, "use_beam_search", False):
                return await self._beam_search(line, body, flight)
            if isinstance(body, ResponsesRequest):
                if body.previous_response_id is not None:
                    raise ParameterError("previous_response_id", "a batch line cannot continue a stored response: "
                                         "send the conversation in input")  # fmt: skip
                body = body.model_copy(update={"store": False})  # NOTE: a batch's responses are its output file
                submission = await submit_response(self.serving, body, request_class=RequestClass.BE)
            else:
                submit = self.serving.submit_chat if chat else self.serving.submit_completion
                submission = await submit(body, RequestClass.BE)
            flight.submission = submission
        except ValidationError as e:
            return output_line(line.custom_id, 400, validation_error(e.errors(), json.loads(line.body))), True
        except SloserveError as e:
            error = error_response(e)
            if error is None:
                raise
            if error.status in (429, 503) or error.status >= 500:  # not the line's fault: it runs later
                if error.status == 429:
                    self._paused_until = time.time() + QUEUE_FULL_BACKOFF_S
                return None, False
            return output_line(line.custom_id, error.status, error.body), True
        if self._stopping:  # the server began stopping while this line was submitted
            submission.abort(self.serving.engine)
        results = await asyncio.gather(*(collect(s) for s in submission.served))
        if any(r.finish_reason not in ("stop", "length") for r in results):
            submission.abort(self.serving.engine)
            return None, False
        if isinstance(body, ResponsesRequest):
            return output_line(line.custom_id, 200, whole_response(self.serving, body, submission, results[0])), False
        objects = ResponseObjects(chat, self.serving.config.model_name, submission.service_tier, body.response_id())
        return output_line(line.custom_id, 200, submission.whole(objects, results)), False

    async def _beam_search(self, line: Line, body, flight: InFlight) -> tuple[dict[str, Any] | None, bool]:
        """A line with ``use_beam_search``, searched as online (``beam_search_api``) in BE requests;
        its refusals and failures raise as a submission's do. (None, _) when it was aborted."""
        flight.search = search = asyncio.ensure_future(beam_search(self.serving, body, RequestClass.BE))
        if self._stopping:  # the server began stopping while this line was admitted
            search.cancel()
        try:
            response = await search
        except asyncio.CancelledError:
            if not search.cancelled() or asyncio.current_task().cancelling():
                raise  # the runner itself is cancelled
            return None, False
        return output_line(line.custom_id, 200, response), False
