"""The online engine, server side: requests arrive, stream their tokens and leave at any time, while
the engine steps in its own process (``engine_core.run_core``). ``sloserve serve`` runs on it.

Threads of the server process: the caller's event loop submits and aborts (``submit`` validates the
request as the engine would, then sends it over the pipe); a reader thread receives one message per
engine step, detokenizes each request's new tokens (its stop strings end it here, and the engine is
told to drop it) and hands the text to its asyncio queue, one wake-up of the loop per step.

Every accepted request ends with exactly one last delta (``finish_reason`` set): "stop" (EOS or a
stop string), "length" (max_tokens), "abort" (aborted, or still unfinished when a shutdown's grace
period ended) or "error" (the engine process failed). Its KV is freed in the next step the policy
schedules it in (``LLMEngine.abort``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import multiprocessing
import signal
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from sloserve.core.errors import ConfigError, SloserveError
from sloserve.core.request import SLO, Request, RequestClass
from sloserve.engine.detokenizer import Detokenizer
from sloserve.engine.engine_core import (
    AddRequest,
    EngineInfo,
    EngineSpec,
    EngineStats,
    Output,
    outputs_of,
    run_core,
)
from sloserve.engine.llm_engine import check_request, engine_cost_model
from sloserve.engine.logprobs import Logprobs
from sloserve.engine.sampler import SamplingParams
from sloserve.sched import make_scheduler

log = logging.getLogger("sloserve.engine")

# Seconds the engine process gets to start (load the model) and to stop.
START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0
# How long a dead engine process is waited for, to say how it ended.
EXIT_CODE_WAIT_S = 5.0


class QueueFullError(SloserveError):
    """``max_queued_requests`` requests are waiting for their first token already."""


class ShuttingDownError(SloserveError):
    """The engine admits nothing more: it is draining for a shutdown."""


class EngineDeadError(SloserveError):
    """The engine process failed; the message says how."""


@dataclass(frozen=True)
class StreamDelta:
    """What one step gave one request: its new text and tokens (with their log-probabilities where its
    params ask for them); the last delta has ``finish_reason``."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[Logprobs] | None = None
    stop_reason: int | str | None = None  # the last delta's: the stop token id or string it ended on (vLLM's)

    @staticmethod
    def joined(deltas: list[StreamDelta]) -> StreamDelta:
        """Consecutive deltas as one (their texts, tokens and log-probabilities in order; the last one's end)."""
        held = _HeldDeltas()
        for delta in deltas[:-1]:
            held.add(delta)
        return held.before(deltas[-1])


class ServedRequest:
    """One request from ``submit`` to its last delta. Iterate it (``async for``) for its deltas.

    Timestamps are on the engine's clock (``AsyncLLMEngine.clock``: seconds since it started; token
    times are ends of engine steps), so TTFT and TPOT mean what they mean in the simulator.

    ``stream_interval``: how its deltas are handed over (``release``): 1, each step's at once; n > 1, its
    first token at once, then at least n tokens at a time, and the last delta with whatever is left (vLLM's
    ``--stream-interval``); None, the last delta only, the whole output as one (vLLM's FINAL_ONLY: a request
    that is not streamed). The timestamps are the engine's whichever it is.
    """

    def __init__(
        self,
        request_id: int,
        arrival_time: float,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_class: RequestClass,
        slo: SLO,
        loop: asyncio.AbstractEventLoop,
        priority: int = 0,
        cache_salt: str | None = None,
        stream_interval: int | None = 1,
    ) -> None:
        self.request_id = request_id
        self.priority = priority
        self.cache_salt = cache_salt
        self.arrival_time = arrival_time
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.request_class = request_class
        self.slo = slo
        self.submitted_unix_s = time.time()
        self.num_output_tokens = 0  # tokens the engine gave it (handed over, or held: ``release``)
        self.num_cached_tokens = 0  # prompt tokens the engine found in its prefix cache
        self.prompt_logprobs: list[Logprobs] | None = None  # with params.prompt_logprobs, once it has a token
        self.first_scheduled_time = math.nan  # when the engine first ran it (NaN until then)
        self.first_token_time = math.nan
        self.last_token_time = math.nan
        self.finish_time = math.nan
        self.finish_reason: str | None = None
        # Why it ended with "error" while its engine runs on (a fleet's replica died, or the engine
        # could not take it)
        self.error: str | None = None
        self._loop = loop
        self._queue: asyncio.Queue[StreamDelta] = asyncio.Queue()
        self.detokenizer: Detokenizer | None = None  # its text from its tokens, and its stop strings
        self.stream_interval = stream_interval
        self._held: _HeldDeltas | None = None  # what came and was not handed over yet (``release``)
        self._handed_a_token = False

    def release(self, delta: StreamDelta) -> StreamDelta | None:
        """What to hand over now that ``delta`` came (from the reader thread): ``delta`` joined to those
        held before it, or None while ``stream_interval`` holds it."""
        interval, held = self.stream_interval, self._held
        if interval != 1 and delta.finish_reason is None:
            num_held = len(delta.token_ids) + (0 if held is None else len(held.token_ids))
            if interval is None:
                hold = True
            else:  # NOTE: a stream's first token goes at once (the client's TTFT is the engine's), as in vLLM
                first = bool(delta.token_ids) and not self._handed_a_token
                hold = not first and num_held < interval
            if hold:
                self._held = held = held or _HeldDeltas()
                held.add(delta)
                return None
        if held is not None:
            delta = held.before(delta)
            self._held = None
        self._handed_a_token = self._handed_a_token or bool(delta.token_ids)
        return delta

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    async def __aiter__(self) -> AsyncIterator[StreamDelta]:
        """The deltas; those that are ready together come as one, their texts and tokens joined (as
        vLLM's output collector does when its consumer falls behind: fewer, larger chunks)."""
        queue = self._queue
        while True:
            ready = [await queue.get()]
            while ready[-1].finish_reason is None and not queue.empty():
                ready.append(queue.get_nowait())
            delta = ready[0] if len(ready) == 1 else StreamDelta.joined(ready)
            yield delta
            if delta.finish_reason is not None:
                return


class _HeldDeltas:
    """Consecutive deltas of a request as their parts, in lists that grow in place, until ``before`` joins them to
    a last one: those ``ServedRequest.release`` holds back, and ``StreamDelta.joined``'s.

    NOTE: not a list of the deltas: held deltas (each with its token list) outlive the young garbage
    collections, and a burst of held streams then costs the server's process full collections, its loop
    stopped (benchmarks/RESULTS.md); the strings and ints kept here are not tracked by the collector."""

    __slots__ = ("texts", "token_ids", "logprobs")

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[Logprobs] | None = None

    def add(self, delta: StreamDelta) -> None:
        self.texts.append(delta.text)
        self.token_ids += delta.token_ids
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += delta.logprobs

    def before(self, last: StreamDelta) -> StreamDelta:
        """The held deltas, then ``last``, as one."""
        self.add(last)
        return StreamDelta("".join(self.texts), self.token_ids, last.finish_reason, self.logprobs, last.stop_reason)


def _deliver(outbox: list[tuple[ServedRequest, StreamDelta]]) -> None:
    """From the reader thread: hand each delta to its request's event loop, one wake-up per loop.

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


def _answer(future: concurrent.futures.Future, result: object = None, error: BaseException | None = None) -> None:
    """Settle the future of an answer from the engine, unless its asker gave up (cancelled it: a client that
    left, a timeout)."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)


class EngineObserver(Protocol):
    """Told what happens in the engine (the server's metrics and request log), on the reader thread."""

    def on_step(self, stats: EngineStats, replica: str = "0") -> None: ...

    def on_finish(self, served: ServedRequest) -> None: ...


class AsyncLLMEngine:
    """The engine of ``spec`` served online. ``start()`` starts its process (and raises ConfigError
    when the engine cannot be built); ``drain()`` ends it.

    ``max_queued_requests`` bounds the requests accepted and not yet given a first token (``submit``
    raises ``QueueFullError`` beyond it).
    """

    def __init__(
        self, spec: EngineSpec, *, max_queued_requests: int = 1024, observer: EngineObserver | None = None
    ) -> None:
        if max_queued_requests < 1:
            raise ConfigError(f"max_queued_requests must be >= 1, got {max_queued_requests}")
        self.spec = spec
        self.tokenizer = spec.tokenizer()
        self.max_queued_requests = max_queued_requests
        self.observer = observer
        self.info: EngineInfo | None = None
        self.last_stats: EngineStats | None = None  # as of the engine's last step
        self.draining = False
        self.error: str | None = None
        self._start = time.perf_counter()
        self._lock = threading.Lock()  # guards the counters, _served and _next_id
        # NOTE: sends on the pipe have their own lock, never held with _lock: the reader thread takes
        # _lock, and a send blocks while the pipe is full, until the engine reads it.
        self._send_lock = threading.Lock()
        self._all_done = threading.Condition(self._lock)
        self._num_queued = 0  # accepted, no token yet, not ended
        self._num_unfinished = 0  # accepted, no last delta yet
        self._next_id = 0
        self._served: dict[int, ServedRequest] = {}
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn = None
        self._reader: threading.Thread | None = None
        self._scheduler = None  # a scheduler like the engine's, for its admission check (check_fits)
        self._stopped = threading.Event()
        # The engine's answers to come (``reset_prefix_cache``), in the order asked: the pipe keeps it
        self._answers: deque[concurrent.futures.Future] = deque()
        self._ask_lock = threading.Lock()  # an answer's future is queued and its question sent together

    # --- lifecycle -----------------------------------------------------------------------------
    def clock(self) -> float:
        """Seconds since the engine was made: arrivals, tokens and finishes are on this clock."""
        return time.perf_counter() - self._start

    @property
    def max_model_len(self) -> int:
        assert self.info is not None, "start() first"
        return self.info.max_model_len

    def start(self) -> EngineInfo:
        """Start the engine process and wait until its model is loaded."""
        context = multiprocessing.get_context("spawn")  # NOTE: no fork of a process with threads
        parent, child = context.Pipe()
        self._process = context.Process(
            target=run_core, args=(self.spec, child, self._start), name="sloserve-engine", daemon=True
        )
        self._process.start()
        child.close()
        self._conn = parent
        if not parent.poll(START_TIMEOUT_S):
            self._process.kill()
            raise ConfigError(f"the engine process did not start within {START_TIMEOUT_S:.0f} s")
        try:
            kind, payload = parent.recv()
        except EOFError:
            raise ConfigError(f"{self._exit_reason()} while starting") from None
        if kind == "failed":
            self._process.join(timeout=STOP_TIMEOUT_S)
            raise ConfigError(payload)
        self._started(payload)
        self._reader = threading.Thread(target=self._read, name="sloserve-engine-reader", daemon=True)
        self._reader.start()
        return payload

    def _started(self, info: EngineInfo) -> None:
        """The engine is up: requests are checked against ``info`` from now on."""
        self.info = info
        self._eos_token_ids = frozenset(info.eos_token_ids)
        self._scheduler = make_scheduler(
            self.spec.scheduler,
            kv_capacity_tokens=info.kv_capacity_tokens,
            max_model_len=info.max_model_len,
            kv_bytes_per_token=info.kv_bytes_per_token,
            swap_space_tokens=info.swap_space_tokens,
            options=self.spec.scheduler_options,
            cost_model=engine_cost_model(self.spec.cost_model),
        )

    @property
    def num_queued(self) -> int:
        return self._num_queued

    @property
    def num_unfinished(self) -> int:
        return self._num_unfinished

    # --- requests ------------------------------------------------------------------------------
    def submit(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        request_class: RequestClass = RequestClass.RT,
        slo: SLO = SLO(),
        priority: int = 0,
        cache_salt: str | None = None,
        stream_interval: int | None = 1,
    ) -> ServedRequest:
        """Accept a request (call from a running event loop: its deltas go to that loop); ``priority``:
        vLLM's, for a scheduler that orders by it (the lower, the sooner); ``cache_salt``: vLLM's, its
        prompt's cached blocks are shared only with requests of the same salt; ``stream_interval``: how
        its deltas come (``ServedRequest``: 1 each step's, n at least n tokens at a time, None the last only). Raises
        ConfigError for a request that can never run (the message names why), QueueFullError,
        ShuttingDownError or EngineDeadError; nothing is queued then."""
        if self.error is not None:
            raise EngineDeadError(f"the engine failed: {self.error}")
        if self.draining:
            raise ShuttingDownError("the server is shutting down and accepts no new requests")
        assert self.info is not None, "start() first"
        if stream_interval is not None and not stream_interval >= 1:
            raise ConfigError(f"stream_interval must be >= 1 or None, got {stream_interval}")
        prompt = list(prompt_token_ids)
        params = check_request(
            prompt,
            params,
            max_model_len=self.info.max_model_len,
            vocab_size=self.info.vocab_size,
            kv_capacity_tokens=self.info.kv_capacity_tokens,
            eos_token_ids=self._eos_token_ids,
        )
        with self._lock:
            self.check_room(1)
            request_id, arrival = self._next_id, self.clock()
            # NOTE: the engine cannot know the output length: max_tokens stands for it, and only an
            # oracle predictor would read it (``sloserve serve`` refuses those).
            probe = Request(request_id, arrival, len(prompt), params.max_tokens, params.max_tokens, request_class, slo)
            self._scheduler.check_fits(probe, len(prompt) + params.max_tokens - 1)
            self._next_id += 1
            served = ServedRequest(
                request_id,
                arrival,
                prompt,
                params,
                request_class,
                slo,
                asyncio.get_running_loop(),
                priority,
                cache_salt,
                stream_interval,
            )
            served.detokenizer = Detokenizer.for_params(self.tokenizer, params)
            self._served[request_id] = served
            self._num_queued += 1
            self._num_unfinished += 1
        self._send(("add", AddRequest(request_id, prompt, params, request_class, slo, arrival, priority, cache_salt)))
        return served

    def check_room(self, num_requests: int) -> None:
        """Raise QueueFullError unless ``num_requests`` more requests can wait for their first token now
        (a request of several choices checks them all before submitting any)."""
        if self._num_queued + num_requests > self.max_queued_requests:
            raise QueueFullError(
                f"{self._num_queued} requests are waiting for their first token (max_queued_requests "
                f"{self.max_queued_requests}); retry later"
            )

    def abort(self, served: ServedRequest) -> None:
        """The client went away: end ``served`` ("abort") and free its KV (no-op once it has ended)."""
        self._send(("abort", served.request_id))

    async def reset_prefix_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache``: the engine forgets every cached prefix, once the requests that have
        ended are dropped (``EngineCore.reset_prefix_cache``). False while a request is still served. Raises
        EngineDeadError or ShuttingDownError when the engine is gone."""
        return await asyncio.wrap_future(self._ask(("reset_prefix_cache",)))

    def _ask(self, message: tuple) -> concurrent.futures.Future:
        """Send ``message``; the future of the engine's answer."""
        answer: concurrent.futures.Future = concurrent.futures.Future()
        with self._ask_lock:
            if self.error is not None:
                raise EngineDeadError(f"the engine failed: {self.error}")
            if self._stopped.is_set():
                raise ShuttingDownError("the engine has stopped")
            self._answers.append(answer)
            self._send(message)
        return answer

    def begin_shutdown(self) -> None:
        """Admit nothing more (``submit`` raises ShuttingDownError); running work goes on."""
        self.draining = True

    def drain(self, timeout_s: float) -> bool:
        """Block until every accepted request has ended, at most ``timeout_s``; then abort what is
        left and stop the engine process. True when everything finished by itself."""
        self.begin_shutdown()
        with self._all_done:
            drained = self._all_done.wait_for(lambda: self._num_unfinished == 0, timeout_s)
        self._send(("abort_all",))
        with self._all_done:
            self._all_done.wait_for(lambda: self._num_unfinished == 0, STOP_TIMEOUT_S)
        self._send(("stop",))
        self._stopped.wait(STOP_TIMEOUT_S)
        if self._process is not None:
            self._process.join(timeout=STOP_TIMEOUT_S)
            if self._process.is_alive():
                self._process.kill()
        return drained

    def _send(self, message: tuple) -> None:
        if self._conn is None or self._stopped.is_set():
            return
        with self._send_lock:
            try:
                self._conn.send(message)
            except (BrokenPipeError, OSError):  # the process is gone: the reader reports it
                pass

    # --- the reader thread ---------------------------------------------------------------------
    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                if message[0] == "step":
                    self._on_step(outputs_of(message[1]), message[2])
                elif message[0] == "reset_prefix_cache":
                    self._on_step([], message[2])
                    _answer(self._answers.popleft(), message[1])
                elif message[0] == "failed":
                    self._fail(message[1])
                    return
                else:  # stopped
                    return
        except (EOFError, OSError):
            if not self.draining:
                self._fail(self._exit_reason())
        finally:
            with self._ask_lock:
                self._stopped.set()
                while self._answers:  # (asked as the engine stopped)
                    gone = EngineDeadError(f"the engine failed: {self.error}") if self.error else None
                    _answer(self._answers.popleft(), error=gone or ShuttingDownError("the engine has stopped"))

    def _exit_reason(self) -> str:
        """Why the engine process's pipe closed: its exit code, or the signal that killed it (SIGKILL:
        the kernel's OOM killer, most often)."""
        # NOTE: the pipe closes as the process dies, a moment before it can be reaped: until then it
        # has no exit code
        self._process.join(timeout=EXIT_CODE_WAIT_S)
        code = self._process.exitcode
        if code is None:
            return "the engine process closed its pipe and is still running"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:  # a real-time signal: no name of its own
                name = f"signal {-code}"
            return f"the engine process was killed by {name}"
        return f"the engine process exited with code {code}"

    def _on_step(self, outputs: list[Output], stats: EngineStats | None, replica: str = "0") -> None:
        """Hand each request its news; ``stats`` (None: none new) are ``replica``'s engine after the step."""
        outbox: list[tuple[ServedRequest, StreamDelta]] = []
        ended: list[ServedRequest] = []
        for out in outputs:
            served = self._served.get(out.request_id)
            if served is None or served.finish_reason is not None:
                continue
            if out.text is None:  # tokens from the engine process: their text, and its stop strings, here
                out = self._detokenize(served, out)
            if out.token_ids and served.num_output_tokens == 0:
                served.first_token_time = out.first_token_time
                with self._lock:
                    self._num_queued -= 1
            served.num_output_tokens += len(out.token_ids)
            served.num_cached_tokens = out.num_cached_tokens
            served.last_token_time = out.last_token_time
            if out.prompt_logprobs is not None:
                served.prompt_logprobs = out.prompt_logprobs
            if not math.isnan(out.first_scheduled_time):
                served.first_scheduled_time = out.first_scheduled_time
            if out.finish_reason is not None:
                served.finish_reason, served.finish_time = out.finish_reason, out.finish_time
                served.error = out.error
                ended.append(served)
            delta = served.release(
                StreamDelta(out.text, out.token_ids, out.finish_reason, out.logprobs, out.stop_reason)
            )
            if delta is not None:
                outbox.append((served, delta))
        if stats is not None:
            self.last_stats = stats
            if self.observer is not None:
                self.observer.on_step(stats, replica)
        # NOTE: ended (metrics, request log) before the deltas go out: a client that has its answer
        # finds its request counted and logged.
        for served in ended:
            self._ended(served)
        self._hand_over(outbox)

    def _detokenize(self, served: ServedRequest, out: Output) -> Output:
        """``out`` with its text. A stop string ends the request here ("stop"; the text ends before it)
        and the engine is told to drop it: the tokens of at most the step under way are computed for
        nothing (vLLM v1 does the same), against detokenizing every request in the step's loop."""
        detokenizer = served.detokenizer
        assert detokenizer is not None
        stop_token = served.params.ended_on_stop_token(out.finish_reason, out.token_ids, self._eos_token_ids)
        text = detokenizer.push(out.token_ids, finished=out.finish_reason is not None, stop_token=stop_token)
        if not detokenizer.stopped:
            return out._replace(text=text)
        stop_reason = detokenizer.stop_reason
        if out.finish_reason is None:
            self._send(("abort", out.request_id))
            return out._replace(text=text, finish_reason="stop", finish_time=self.clock(), stop_reason=stop_reason)
        return out._replace(text=text, finish_reason="stop", stop_reason=stop_reason)

    def _hand_over(self, outbox: list[tuple[ServedRequest, StreamDelta]]) -> None:
        """Give each request its delta (from the reader thread): to its ``async for``."""
        _deliver(outbox)

    def _ended(self, served: ServedRequest) -> None:
        if self.observer is not None:
            try:
                self.observer.on_finish(served)
            except Exception:  # noqa: BLE001 - a metrics or log failure must not stop serving
                log.exception("observer failed on request %d", served.request_id)
        with self._all_done:
            del self._served[served.request_id]
            if served.num_output_tokens == 0:
                self._num_queued -= 1
            self._num_unfinished -= 1
            self._all_done.notify_all()

    def _fail(self, reason: str) -> None:
        """The engine process failed: every request still open ends with "error"."""
        log.error("engine failed: %s", reason)
        self.error = reason
        with self._lock:
            open_requests = [s for s in self._served.values() if s.finish_reason is None]
        now = self.clock()
        for served in open_requests:
            served.finish_reason, served.finish_time = "error", now
        self._hand_over([(s, StreamDelta("", [], "error")) for s in open_requests])
        for served in open_requests:
            self._ended(served)
