"""The online engine: an ``LLMEngine`` stepping in a background thread while requests arrive, stream
their tokens and leave at any time. ``sloserve serve`` runs on it.

Threads: the caller's event loop submits and aborts (``submit``, ``abort``: they only validate and
queue a command); the engine thread applies the commands between steps, runs the steps on the wall
clock, and sends each request's new text to its asyncio queue. The HTTP side never waits for a step.

Every accepted request ends with exactly one last delta (``finish_reason`` set): "stop" (EOS or a
stop string), "length" (max_tokens), "abort" (aborted, or still unfinished when a shutdown's grace
period ended) or "error" (the engine thread failed). Its KV is freed in the next step the policy
schedules it in (``LLMEngine.abort``), and its tokens are released then.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from sloserve.core.errors import SloserveError
from sloserve.core.request import SLO, Request, RequestClass, RequestStatus
from sloserve.engine.detokenizer import Detokenizer
from sloserve.engine.llm_engine import LLMEngine
from sloserve.engine.sampler import SamplingParams
from sloserve.metrics.timeline import Timeline

log = logging.getLogger("sloserve.engine")

# The replica's timeline (one row per step) is started afresh after this many steps: a server runs
# for days, and nothing reads the rows of a served run.
MAX_TIMELINE_STEPS = 100_000


class QueueFullError(SloserveError):
    """``max_queued_requests`` requests are waiting for their first token already."""


class ShuttingDownError(SloserveError):
    """The engine admits nothing more: it is draining for a shutdown."""


class EngineDeadError(SloserveError):
    """The engine thread failed; the message says how."""


@dataclass(frozen=True)
class StreamDelta:
    """What one step gave one request: its new text and tokens; the last delta has ``finish_reason``."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass(frozen=True)
class EngineStats:
    """The engine after a step (for metrics): requests by state and KV in tokens."""

    num_waiting: int
    num_running: int
    num_swapped: int
    kv_used_tokens: int  # tokens holding KV
    kv_allocated_tokens: int  # slots allocated to requests
    kv_capacity_tokens: int
    num_preemptions: int  # since the start


class ServedRequest:
    """One request from ``submit`` to its last delta. Iterate it (``async for``) for its deltas.

    Timestamps are on the engine's clock (``AsyncLLMEngine.clock``: seconds since it started, step
    ends for tokens), so TTFT and TPOT mean what they mean in the simulator.
    """

    def __init__(self, request: Request, prompt_token_ids: list[int], params: SamplingParams,
                 detokenizer: Detokenizer, loop: asyncio.AbstractEventLoop) -> None:  # fmt: skip
        self.request = request
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.detokenizer = detokenizer
        self.submitted_unix_s = time.time()
        self.num_output_tokens = 0  # tokens sent to the client
        self.first_token_time = math.nan
        self.finish_time = math.nan
        self.finish_reason: str | None = None
        self._loop = loop
        self._queue: asyncio.Queue[StreamDelta] = asyncio.Queue()

    @property
    def request_id(self) -> int:
        return self.request.request_id

    @property
    def arrival_time(self) -> float:
        return self.request.arrival_time

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def _send(self, delta: StreamDelta) -> None:
        """From the engine thread: hand ``delta`` to the request's event loop."""
        _deliver([(self, delta)])

    async def __aiter__(self) -> AsyncIterator[StreamDelta]:
        """The deltas; those that are ready together come as one, their texts and tokens joined (as
        vLLM's output collector does when its consumer falls behind: fewer, larger chunks)."""
        queue = self._queue
        while True:
            delta = await queue.get()
            while delta.finish_reason is None and not queue.empty():
                later = queue.get_nowait()
                delta = StreamDelta(delta.text + later.text, delta.token_ids + later.token_ids, later.finish_reason)
            yield delta
            if delta.finish_reason is not None:
                return


def _deliver(outbox: list[tuple[ServedRequest, StreamDelta]]) -> None:
    """From the engine thread: hand each delta to its request's event loop, one wake-up per loop.

    NOTE: ``call_soon_threadsafe`` writes to the loop's wake-up pipe: once per step, not once per
    request, or a step of hundreds of decodes makes as many system calls."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[ServedRequest, StreamDelta]]] = {}
    for served, delta in outbox:
        by_loop.setdefault(served._loop, []).append((served, delta))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


def _put_all(items: list[tuple[ServedRequest, StreamDelta]]) -> None:
    for served, delta in items:
        served._queue.put_nowait(delta)


class EngineObserver(Protocol):
    """Told what happens in the engine thread (the server's metrics and request log)."""

    def on_step(self, stats: EngineStats) -> None: ...

    def on_finish(self, served: ServedRequest) -> None: ...


class AsyncLLMEngine:
    """An ``LLMEngine`` served online. ``start()`` starts its thread; ``shutdown()`` drains and stops it.

    ``max_queued_requests`` bounds the requests accepted and not yet given a first token (``submit``
    raises ``QueueFullError`` beyond it).
    """

    def __init__(self, engine: LLMEngine, *, max_queued_requests: int = 1024, observer: EngineObserver | None = None,
                 tokenizer=None) -> None:  # fmt: skip
        if max_queued_requests < 1:
            raise SloserveError(f"max_queued_requests must be >= 1, got {max_queued_requests}")
        self.engine = engine
        self.tokenizer = tokenizer if tokenizer is not None else engine.loaded.tokenizer
        self.max_queued_requests = max_queued_requests
        self.observer = observer
        self.draining = False
        self.error: BaseException | None = None
        self._start = time.perf_counter()
        self._commands: queue.SimpleQueue[tuple[str, ServedRequest]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._lock = threading.Lock()  # guards the counters below and _next_id
        self._all_done = threading.Condition(self._lock)
        self._num_queued = 0  # accepted, no token yet, not finished
        self._num_unfinished = 0  # accepted, no last delta yet
        self._next_id = 0
        self._live: dict[Request, ServedRequest] = {}  # in the engine (engine thread only)
        self._num_steps = 0
        self._thread = threading.Thread(target=self._run, name="sloserve-engine", daemon=True)

    # --- the caller's side ---------------------------------------------------------------------
    def clock(self) -> float:
        """Seconds since the engine was made: arrivals, tokens and finishes are on this clock."""
        return time.perf_counter() - self._start

    def start(self) -> None:
        self._thread.start()

    @property
    def num_queued(self) -> int:
        return self._num_queued

    @property
    def num_unfinished(self) -> int:
        return self._num_unfinished

    def submit(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        request_class: RequestClass = RequestClass.RT,
        slo: SLO = SLO(),
        stop: tuple[str, ...] = (),
    ) -> ServedRequest:
        """Accept a request (call from a running event loop: its deltas go to that loop). Raises
        ConfigError for a request that can never run (the message names why), QueueFullError,
        ShuttingDownError or EngineDeadError; nothing is queued then."""
        if self.error is not None:
            raise EngineDeadError(f"the engine failed: {self.error!r}")
        if self.draining:
            raise ShuttingDownError("the server is shutting down and accepts no new requests")
        prompt = list(prompt_token_ids)
        params = self.engine.check_request(prompt, params)
        with self._lock:
            if self._num_queued >= self.max_queued_requests:
                raise QueueFullError(
                    f"{self._num_queued} requests are waiting for their first token (max_queued_requests "
                    f"{self.max_queued_requests}); retry later"
                )
            request_id, self._next_id = self._next_id, self._next_id + 1
            request = Request(request_id, self.clock(), len(prompt), params.max_tokens, params.max_tokens,
                              request_class, slo)  # fmt: skip
            # NOTE: the engine cannot know the output length: max_tokens stands for it, and only an
            # oracle predictor would read it (``sloserve serve`` refuses those).
            self.engine.scheduler.check_fits(request, len(prompt) + params.max_tokens - 1)
            self._num_queued += 1
            self._num_unfinished += 1
        served = ServedRequest(request, prompt, params, Detokenizer(self.tokenizer, stop), asyncio.get_running_loop())
        self._command("add", served)
        return served

    def abort(self, served: ServedRequest) -> None:
        """The client went away: end ``served`` ("abort") and free its KV (no-op once it has ended)."""
        self._command("abort", served)

    def begin_shutdown(self) -> None:
        """Admit nothing more (``submit`` raises ShuttingDownError); running work goes on."""
        self.draining = True

    def drain(self, timeout_s: float) -> bool:
        """Block until every accepted request has ended, at most ``timeout_s``; then abort what is
        left and stop the engine thread. True when everything finished by itself."""
        self.begin_shutdown()
        with self._all_done:
            drained = self._all_done.wait_for(lambda: self._num_unfinished == 0, timeout_s)
        self._command("abort_all", None)  # type: ignore[arg-type]
        self.stop()
        return drained

    def stop(self) -> None:
        """Stop the engine thread once nothing in it is unfinished (aborted requests end at once)."""
        self._stop = True
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    def _command(self, kind: str, served: ServedRequest) -> None:
        self._commands.put((kind, served))
        self._wake.set()

    # --- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                self._wake.clear()  # NOTE: before reading the commands, so none is missed
                self._apply_commands()
                if not engine.has_unfinished():
                    if self._stop:
                        return
                    self._wake.wait()
                    continue
                engine.replica.now = self.clock()
                finished = engine.step()
                self._publish(finished)
        except BaseException as exc:  # noqa: BLE001 - every accepted request must still end
            log.exception("engine thread failed")
            self.error = exc
            for served in list(self._live.values()):
                self._end(served, "error", "")
            self._live.clear()
            self._fail_pending()

    def _fail_pending(self) -> None:
        while True:
            try:
                kind, served = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._end(served, "error", "")

    def _apply_commands(self) -> None:
        while True:
            try:
                kind, served = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                request = served.request
                if self._stop:  # arrived after the shutdown's last call: it never runs
                    self._end(served, "abort", "")
                    continue
                self.engine.add_request(served.prompt_token_ids, served.params, request.arrival_time, request=request)
                self._live[request] = served
            elif kind == "abort":
                self._abort(served)
            else:  # abort_all
                for live in list(self._live.values()):
                    self._abort(live)

    def _abort(self, served: ServedRequest) -> None:
        if served.finish_reason is None:
            self._end(served, "abort", "")
        self.engine.abort(served.request)

    def _publish(self, finished: list[Request]) -> None:
        """Send every live request the tokens and text this step gave it; release finished ones."""
        engine = self.engine
        ended = set(finished)
        outbox: list[tuple[ServedRequest, StreamDelta]] = []
        for request, served in self._live.items():
            if served.finish_reason is not None:
                continue  # ended for its client (stop string, abort): the engine drops it when scheduled
            seq = engine.executor.sequences[request]
            new_ids = seq.token_ids[seq.num_prompt_tokens + served.num_output_tokens :]
            done = request in ended
            if not new_ids and not done:
                continue
            if served.num_output_tokens == 0 and new_ids:
                served.first_token_time = request.first_token_time if request.num_output_tokens else self.clock()
                with self._lock:
                    self._num_queued -= 1
            served.num_output_tokens += len(new_ids)
            text = served.detokenizer.push(new_ids, finished=done)
            if served.detokenizer.stopped:
                if not done:
                    engine.abort(request)  # NOTE: the stop string ended it: nothing more is computed
                self._end(served, "stop", text, new_ids, outbox)
            elif done:
                self._end(served, seq.finish_reason or "length", text, new_ids, outbox)
            else:
                outbox.append((served, StreamDelta(text, new_ids)))
        _deliver(outbox)
        for request in finished:
            engine.release(request)
            del self._live[request]
        self._num_steps += 1
        if self._num_steps % MAX_TIMELINE_STEPS == 0:
            engine.replica.timeline = Timeline()
        if self.observer is not None:
            self.observer.on_step(self.stats())

    def _end(self, served: ServedRequest, reason: str, text: str, token_ids: list[int] | None = None,
             outbox: list[tuple[ServedRequest, StreamDelta]] | None = None) -> None:  # fmt: skip
        """The last delta of ``served`` (into ``outbox`` when given): exactly once per accepted request."""
        assert served.finish_reason is None, served.request
        served.finish_reason = reason
        served.finish_time = self.clock()
        delta = StreamDelta(text, token_ids or [], reason)
        if outbox is None:
            served._send(delta)
        else:
            outbox.append((served, delta))
        if self.observer is not None:
            try:
                self.observer.on_finish(served)
            except Exception:  # noqa: BLE001 - a metrics or log failure must not stop serving
                log.exception("observer failed on request %d", served.request_id)
        with self._all_done:
            if served.num_output_tokens == 0:
                self._num_queued -= 1
            self._num_unfinished -= 1
            self._all_done.notify_all()

    def stats(self) -> EngineStats:
        """Requests by state and KV use now (engine thread, or after it stopped)."""
        counts = {RequestStatus.WAITING: 0, RequestStatus.RUNNING: 0, RequestStatus.SWAPPED: 0}
        for request in self._live:
            if request.status in counts:
                counts[request.status] += 1
        scheduler = self.engine.scheduler
        return EngineStats(
            num_waiting=counts[RequestStatus.WAITING],
            num_running=counts[RequestStatus.RUNNING],
            num_swapped=counts[RequestStatus.SWAPPED],
            kv_used_tokens=scheduler.kv_used_tokens(),
            kv_allocated_tokens=scheduler.kv.allocated_tokens,
            kv_capacity_tokens=scheduler.kv.capacity_tokens,
            num_preemptions=scheduler.num_preemptions,
        )
