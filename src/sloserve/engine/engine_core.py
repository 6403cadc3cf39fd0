"""The engine's side of the online engine: an ``LLMEngine`` stepping in its own process.

``run_core`` is the process: it builds the engine from an ``EngineSpec``, then applies commands
between steps, runs the steps on the wall clock and sends one message per step with every request's
new tokens. ``AsyncLLMEngine`` (``async_engine.py``) is the other side, in the server: it turns them
into text and finds stop strings there, off the steps' path (as vLLM v1's output processor).

NOTE: a process, not a thread: the server's event loop and the engine's Python would otherwise share
one GIL, and every microsecond the loop spends on a token would be taken from the engine's steps.

Messages over the pipe (pickled tuples):

    server -> core   ("add", AddRequest) | ("abort", request_id) | ("abort_all",) | ("reset_prefix_cache",)
                     | ("stop",)
    core -> server   ("ready", EngineInfo) | ("failed", message) | ("step", Output columns, EngineStats)
                     | ("reset_prefix_cache", done, EngineStats) | ("stopped",)
"""

from __future__ import annotations

import math
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from sloserve.checkpoint.config import RANDOM_PREFIX
from sloserve.core.errors import ConfigError, SloserveError
from sloserve.core.request import SLO, Request, RequestClass, RequestStatus
from sloserve.engine.gc_heap import FullCollections, freeze_switch, frozen_heap
from sloserve.engine.logprobs import Logprobs
from sloserve.engine.sampler import SamplingParams
from sloserve.engine.step_log import StepLog
from sloserve.engine.switches import switch
from sloserve.engine.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

# The replica's timeline (one row per step) is started afresh after this many steps: a server runs
# for days, and nothing reads the rows of a served run.
MAX_TIMELINE_STEPS = 100_000
# Seconds between two reports of the prefix cache's keys (a fleet's router reads them).
CACHE_KEYS_PERIOD_S = 0.1
# Seconds the core waits for a command at a time when it has nothing to step but grammars compiling.
GRAMMAR_WAIT_S = 0.005
# Steps a prefix cache reset runs at most to drop the requests that ended but still hold KV (one does it).
MAX_DROP_STEPS = 8


@dataclass(frozen=True)
class EngineSpec:
    """Everything needed to build the engine in another process (``LLMEngine``'s arguments)."""

    model: str  # a local HF directory or random:NAME
    scheduler: str = "vllm"
    device: str = "cpu"
    dtype: str = "auto"
    seed: int = 0
    attention_backend: str = "auto"
    cuda_graphs: bool | None = None  # None: on wherever supported (load_model)
    kv_capacity_tokens: int | None = None
    max_model_len: int | None = None
    cost_model: str | None = None
    scheduler_options: dict[str, Any] = field(default_factory=dict)
    enable_prefix_caching: bool | None = None  # None: wherever the scheduler supports it (LLMEngine)
    # Report what a fleet's router reads (EngineStats' queue, free KV and cache keys) after each step:
    # a fleet's replica does; one engine has no router to tell
    report_routing_stats: bool = False
    # Publish each step's tokens during the next step's forward pass (EngineCore); None: on CUDA unless
    # SLOSERVE_OVERLAP_PUBLISH=0 (engine/switches.py)
    overlap_publish: bool | None = None
    # Launch each step before the step before's tokens are on the host (LLMEngine); None: on CUDA unless
    # SLOSERVE_ASYNC_SCHEDULING=0
    async_scheduling: bool | None = None
    # Write each step's shape, measured time and the loop's parts around it here (``step_log.py``)
    step_log: str | None = None

    def build(self):
        """The engine (loads the model: in the core process)."""
        from sloserve.engine.llm_engine import LLMEngine
        from sloserve.engine.loader import load_model

        loaded = load_model(
            self.model,
            device=self.device,
            dtype=self.dtype,
            seed=self.seed,
            attention_backend=self.attention_backend,
            cuda_graphs=self.cuda_graphs,
        )
        return LLMEngine(
            loaded,
            self.scheduler,
            kv_capacity_tokens=self.kv_capacity_tokens,
            max_model_len=self.max_model_len,
            cost_model=self.cost_model,
            seed=self.seed,
            scheduler_options=self.scheduler_options,
            enable_prefix_caching=self.enable_prefix_caching,
            async_scheduling=self.async_scheduling,
        )

    def tokenizer(self) -> ByteTokenizer | HFTokenizer | None:
        """The model's tokenizer, without loading the model (the server side encodes prompts)."""
        if self.model.startswith(RANDOM_PREFIX):
            return ByteTokenizer()
        return load_tokenizer(Path(self.model).expanduser())


@dataclass(frozen=True)
class EngineInfo:
    """What the server needs to validate requests as the engine would."""

    max_model_len: int
    vocab_size: int
    kv_capacity_tokens: int
    swap_space_tokens: int
    kv_bytes_per_token: int
    block_size: int = 16
    prefix_caching: bool = False
    eos_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class AddRequest:
    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams  # max_tokens already cut to the context
    request_class: RequestClass
    slo: SLO
    arrival_time: float  # on the engine clock
    priority: int = 0  # vLLM's: the lower, the sooner (schedulers with waiting_order=priority)
    cache_salt: str | None = None  # vLLM's: its prompt's cached blocks are shared only under the same salt


class Output(NamedTuple):
    """One request's news from one step; the last has ``finish_reason``."""

    request_id: int
    # NOTE: None from the engine process, which sends tokens only: the server's process detokenizes them
    # and looks for stop strings (``AsyncLLMEngine``, as vLLM v1's output processor), off the step's path
    text: str | None
    token_ids: list[int]
    finish_reason: str | None
    first_token_time: float  # NaN until the first token
    last_token_time: float
    finish_time: float  # NaN until finished
    num_cached_tokens: int  # prompt tokens found in the prefix cache when first admitted
    # Where the request's params ask for them: its new tokens' log-probabilities; and with its first
    # token, its prompt's (from the second prompt token on)
    logprobs: list[Logprobs] | None = None
    prompt_logprobs: list[Logprobs] | None = None
    first_scheduled_time: float = float("nan")  # when it first ran (NaN until then)
    error: str | None = None  # why it ended with "error" while the engine goes on (it could not be added)
    stop_reason: int | str | None = None  # vLLM's: the stop token id or stop string it ended on


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
    # Prefix caching, since the start (vLLM's prefix_cache_queries and prefix_cache_hits): prompt
    # tokens looked up at admission, and of them found cached.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    device_idle_s: float = 0.0  # since the start: a GPU's waits for the host between steps (``DeviceIdleTime``)
    # The engine process's full garbage collections since it started serving (``gc_heap.FullCollections``)
    gc_full_collections: int = 0
    gc_full_collection_s: float = 0.0  # their seconds in all
    # What a fleet's router reads (``router.ReplicaLoad``, as the simulator's replicas report it), where
    # EngineSpec.report_routing_stats asks for it
    queued_prompt_tokens: int = 0  # prompt tokens still to compute
    kv_free_tokens: int = 0  # an allocation could take them now, cached blocks nobody uses included
    kv_empty_tokens: int = 0  # holding nothing, not even a cached prefix
    # Requests the engine was given ("add"), since the start: the figures above include them, so a router
    # knows which of those it sent since are not in them yet
    num_requests_added: int = 0
    # The keys of the blocks the prefix cache holds (None: no prefix cache); sent at most every
    # CACHE_KEYS_PERIOD_S, else the last ones sent stand
    cached_block_keys: np.ndarray | None = None  # sorted (PrefixCache.cached_keys)


def output_columns(outputs: list[Output]) -> tuple[list, ...]:
    """``outputs`` as one list per field, for the pipe: pickling a step's hundreds of named tuples costs
    the engine process 4x what their fields as lists do (benchmarks/RESULTS.md, issue 43)."""
    return tuple(map(list, zip(*outputs)))


def outputs_of(columns: tuple[list, ...]) -> list[Output]:
    """``output_columns``'s ``outputs`` back (in the server's process)."""
    return [Output(*fields) for fields in zip(*columns)]


class _Live:
    """A request in the engine: what its client has been sent."""

    __slots__ = ("request", "num_sent", "ended", "first_sent_time", "last_sent_time")

    def __init__(self, request: Request) -> None:
        self.request = request
        self.num_sent = 0  # output tokens sent
        # Its last Output went out (an abort, or a finish found before its policy ended it): the engine
        # drops it when scheduled, or releases it when it returns it
        self.ended = False
        self.first_sent_time = math.nan  # when its first token went out (the times of async scheduling)
        self.last_sent_time = math.nan


class EngineCore:
    """Applies commands, steps the engine and reports each step over its pipe: the core process's loop."""

    def __init__(
        self,
        engine,
        clock_start: float,
        conn: Connection,
        report_routing_stats: bool = False,
        overlap_publish: bool | None = None,
        step_log: str | None = None,
    ) -> None:
        self.engine = engine
        self.report_routing_stats = report_routing_stats
        self.clock_start = clock_start
        self.conn = conn
        self.live: dict[int, _Live] = {}
        self.stopping = False
        self.num_steps = 0
        self.num_added = 0  # "add" commands taken (EngineStats.num_requests_added)
        self._pending: list[Output] = []  # last outputs of aborted requests, sent with the next message
        self._keys_sent_at = -math.inf
        # With overlap_publish, a step's news goes out during the next step's forward pass, where the
        # host's work hides behind the GPU's (vLLM v1 takes its outputs off the step's path too). On
        # the CPU the forward pass is the host's own work: waiting for it would only add a step to
        # every token's latency, so None (the default) overlaps on CUDA only, unless switched off (an H200,
        # 2026-12-04: served / in-process throughput 0.891 with, 0.858 without; benchmarks/RESULTS.md).
        if overlap_publish is None:
            overlap_publish = switch("SLOSERVE_OVERLAP_PUBLISH", default=True) and engine.loaded.device.type == "cuda"
        self.overlap_publish = overlap_publish
        self._unpublished: list[Request] | None = None  # the finished requests of a step not yet published
        if overlap_publish:
            engine.executor.during_forward = self.flush
        # Requests whose grammar compiles in a thread (vLLM's WAITING_FOR_FSM): the engine steps the others
        # meanwhile (llguidance lets go of the GIL), and each joins the policy's queue once compiled
        self._compiling: dict[int, tuple[AddRequest, _Live, Future]] = {}
        self._grammar_thread = ThreadPoolExecutor(1, thread_name_prefix="sloserve-grammar")
        self.freeze_heap = freeze_switch()  # (``run`` freezes the process's start-up heap: gc_heap.py)
        self.full_collections: FullCollections | None = None  # the process's, while ``run`` serves
        self.step_log = None if step_log is None else StepLog(step_log, engine.executor)
        self._last_step_end = time.perf_counter()  # or the end of the last idle wait (StepLog's between_s)

    def clock(self) -> float:
        """The server's engine clock (``time.perf_counter`` is system-wide on Linux)."""
        return time.perf_counter() - self.clock_start

    def run(self) -> None:
        """Serve commands until "stop", with the heap the process started with frozen (``gc_heap``)."""
        with frozen_heap(self.freeze_heap):
            self.full_collections = FullCollections()
            try:
                self._serve()
            finally:
                self.full_collections.close()
                if self.step_log is not None:
                    self.step_log.close()

    def _serve(self) -> None:
        engine, conn = self.engine, self.conn
        while True:
            self.add_compiled()
            if not engine.has_unfinished():
                self.flush()  # no forward pass follows to publish the last step during
                if self.step_log is not None:
                    self.step_log.flush()
                if self._compiling:  # nothing to step until a grammar compiles; a command may come meanwhile
                    waited = conn.poll(GRAMMAR_WAIT_S)
                    self._last_step_end = time.perf_counter()  # (a wait, as an idle one)
                    if waited:
                        self.apply(conn.recv())
                    continue
                if self.stopping:
                    self._grammar_thread.shutdown(wait=False)
                    conn.send(("stopped",))
                    return
                command = conn.recv()  # idle: wait for a command
                self._last_step_end = time.perf_counter()
                self.apply(command)
            while conn.poll():
                self.apply(conn.recv())
            if engine.has_unfinished():
                self.run_step()

    def run_step(self) -> None:
        """One served step: the engine's step from the wall clock's now, then its news published, or
        with ``overlap_publish`` kept for the next step's forward pass (``flush``)
        (``engine.profile.measure_host`` times this)."""
        started = time.perf_counter()
        self.engine.replica.now = self.clock()
        finished = self.engine.step()
        stepped = time.perf_counter()
        self.flush()  # the step before, where this one ran no forward pass to publish it during
        if self.overlap_publish:
            self._unpublished = finished
        else:
            self.publish(finished)
        ended = time.perf_counter()
        if self.step_log is not None:
            start_s = started - self.clock_start  # (the engine's clock)
            self.step_log.record(start_s, stepped - started, ended - stepped, started - self._last_step_end)
        self._last_step_end = ended

    def flush(self) -> None:
        """Publish the last step's news if it is still kept (``overlap_publish``), with the requests
        whose last token has come back since (async scheduling)."""
        if self._unpublished is not None:
            finished, self._unpublished = self._unpublished, None
            self.publish(finished + self.engine.take_finished())

    def apply(self, command: tuple) -> None:
        kind = command[0]
        if kind != "add":
            # NOTE: the last step's news first: an abort must not end a request before the tokens (or
            # the finish) that step gave it
            self.flush()
        if kind == "add":
            add: AddRequest = command[1]
            self.num_added += 1
            request = Request(
                add.request_id,
                add.arrival_time,
                len(add.prompt_token_ids),
                add.params.max_tokens,
                add.params.max_tokens,
                add.request_class,
                add.slo,
                priority=add.priority,
            )
            live = _Live(request)
            if not self._compiles_first(add, live):
                self._add(add, live)
        elif kind == "abort":
            live = self.live.get(command[1])
            if live is not None:
                self.abort(live)
            elif command[1] in self._compiling:
                self._abort_compiling(command[1])
        elif kind == "abort_all":
            for live in list(self.live.values()):
                self.abort(live)
            for request_id in list(self._compiling):
                self._abort_compiling(request_id)
        elif kind == "reset_prefix_cache":
            done = self.reset_prefix_cache()
            self.conn.send(("reset_prefix_cache", done, self.stats()))
        elif kind == "stop":
            self.stopping = True
        if kind != "add":
            self.publish([])  # the aborted requests' last outputs go now, not after a step

    def reset_prefix_cache(self) -> bool:
        """The engine's ``reset_prefix_cache``, once the requests that ended but still hold KV (aborted, or ended
        on a stop string the server found) are dropped, which their scheduler does in its next step: a client
        that has its answer finds the reset done. False while a request is still served."""
        for _ in range(MAX_DROP_STEPS):
            if not self.engine.has_unfinished() or not all(live.ended for live in self.live.values()):
                break
            self.run_step()
        self.flush()
        done = self.engine.reset_prefix_cache()
        if done:
            self._keys_sent_at = -math.inf  # (a fleet's router hears of the empty cache at once: stats() sends it)
        return done

    def _add(self, add: AddRequest, live: _Live) -> None:
        """``add`` into the engine; a request it cannot take ends alone, with "error" and the reason."""
        try:
            self.engine.add_request(
                add.prompt_token_ids, add.params, add.arrival_time, request=live.request, cache_salt=add.cache_salt
            )
        except Exception as e:  # noqa: BLE001 - one request the engine cannot take must not stop it
            # NOTE: the server checked it as the engine does; this is for what only the engine can find
            # (a model without the tokenizer a grammar needs), or a bug (its traceback goes to the log):
            # this request ends with the reason, the engine and its requests go on
            self._refuse(live, e)
            return
        self.live[add.request_id] = live

    def _refuse(self, live: _Live, error: BaseException) -> None:
        if not isinstance(error, SloserveError):
            traceback.print_exception(error)
        self.engine.executor.remove(live.request)
        self.flush()
        live.ended = True
        reason = str(error) if isinstance(error, SloserveError) else f"{type(error).__name__}: {error}"
        self._pending.append(self._output(live, [], "error")._replace(error=reason))
        self.publish([])

    def _compiles_first(self, add: AddRequest, live: _Live) -> bool:
        """Whether ``add`` waits for its grammar, compiling in a thread (one compiled before is copied at once)."""
        grammar = add.params.grammar
        if grammar is None:
            return False
        try:
            matchers = self.engine.grammar_matchers()
        except ConfigError:
            return False  # NOTE: refused by ``_add``, with the reason
        if matchers.has_compiled(grammar):
            return False
        self._compiling[add.request_id] = (add, live, self._grammar_thread.submit(matchers.matcher, grammar))
        return True

    @property
    def num_compiling(self) -> int:
        """Requests waiting for their grammar to compile."""
        return len(self._compiling)

    def add_compiled(self) -> None:
        """Add the requests whose grammar has compiled since; one llguidance could not build ends with "error"."""
        for request_id, (add, live, compiling) in list(self._compiling.items()):
            if compiling.done():
                del self._compiling[request_id]
                error = compiling.exception()
                if error is None:
                    self._add(add, live)  # NOTE: its matcher is a copy of the one just compiled
                else:
                    self._refuse(live, error)

    def _abort_compiling(self, request_id: int) -> None:
        _, live, compiling = self._compiling.pop(request_id)
        compiling.cancel()  # NOTE: a compilation under way runs on, and its grammar stays compiled
        live.ended = True
        self._pending.append(self._output(live, [], "abort"))

    def abort(self, live: _Live) -> None:
        self.engine.abort(live.request)
        if not live.ended:
            live.ended = True
            self._pending.append(self._output(live, [], "abort"))

    def _output(
        self,
        live: _Live,
        token_ids: list[int],
        finish_reason: str | None,
        logprobs: list[Logprobs] | None = None,
        prompt_logprobs: list[Logprobs] | None = None,
        stop_reason: int | None = None,
    ) -> Output:
        r = live.request
        if self.engine.executor.async_scheduling:
            # NOTE: the policy's token times are the host's when a step returns, on a GPU a step before
            # its tokens exist: the times its tokens reached the host (and went out) are the served ones
            first, last = live.first_sent_time, live.last_sent_time
            finish = self.clock() if finish_reason else math.nan
        else:
            first, last = r.first_token_time, r.last_token_time
            finish = self._finish_time(r) if finish_reason else math.nan
        return Output(
            r.request_id,
            None,
            token_ids,
            finish_reason,
            first,
            last,
            finish,
            r.num_cached_tokens,
            logprobs,
            prompt_logprobs,
            r.first_scheduled_time,
            stop_reason=stop_reason,
        )

    def _finish_time(self, request: Request) -> float:
        """The end of the step ``request`` finished in (its news may go out during the next one), or
        now for a request the engine ends between steps (aborted, or one it could not add) or whose
        policy has not ended it yet (async scheduling: a stop token found a step late)."""
        return request.finish_time if request.is_finished else self.clock()

    def publish(self, finished: list[Request]) -> None:
        """Send every live request the tokens this step gave it; release finished ones."""
        engine = self.engine
        outputs, self._pending = self._pending, []
        ended = {r.request_id for r in finished}
        now = self.clock()
        for request_id, live in self.live.items():
            if live.ended:
                continue
            request = live.request
            seq = engine.executor.sequences[request]
            new_ids = seq.token_ids[seq.num_prompt_tokens + live.num_sent :]
            # NOTE: with async scheduling a token found a step late ends a request before its policy
            # does: its finish goes out with that token, and the engine returns it a step later
            done = request_id in ended or seq.finish_reason is not None
            if not new_ids and not done:
                continue
            if new_ids:
                if live.num_sent == 0:
                    live.first_sent_time = now
                live.last_sent_time = now
            logprobs = None if seq.logprobs is None else seq.logprobs[live.num_sent : live.num_sent + len(new_ids)]
            # NOTE: the prompt is scored whole once its first output token is sampled
            first = live.num_sent == 0 and new_ids
            prompt_logprobs = seq.prompt_logprobs if first else None
            live.num_sent += len(new_ids)
            reason = (seq.finish_reason or "length") if done else None
            stop_reason = seq.stop_reason if done else None
            outputs.append(self._output(live, new_ids, reason, logprobs, prompt_logprobs, stop_reason))
            live.ended = done
        for request in finished:
            engine.release(request)
            del self.live[request.request_id]
        if finished or outputs:
            self.num_steps += 1
            if self.num_steps % MAX_TIMELINE_STEPS == 0:
                from sloserve.metrics.timeline import Timeline

                engine.replica.timeline = Timeline()
            self.conn.send(("step", output_columns(outputs), self.stats()))

    def stats(self) -> EngineStats:
        counts = {RequestStatus.WAITING: 0, RequestStatus.RUNNING: 0, RequestStatus.SWAPPED: 0}
        for live in self.live.values():
            if live.request.status in counts:
                counts[live.request.status] += 1
        counts[RequestStatus.WAITING] += self.num_compiling  # NOTE: as vLLM counts WAITING_FOR_FSM
        scheduler, replica = self.engine.scheduler, self.engine.replica
        cache = scheduler.kv.prefix_cache
        collections = self.full_collections
        stats = EngineStats(
            counts[RequestStatus.WAITING],
            counts[RequestStatus.RUNNING],
            counts[RequestStatus.SWAPPED],
            scheduler.kv_used_tokens(),
            scheduler.kv.allocated_tokens,
            scheduler.kv.capacity_tokens,
            scheduler.num_preemptions,
            cache.num_queried_tokens if cache is not None else 0,
            cache.num_hit_tokens if cache is not None else 0,
            self.engine.executor.device_idle.seconds,
            collections.count if collections is not None else 0,
            collections.seconds if collections is not None else 0.0,
        )
        if not self.report_routing_stats:
            return stats
        keys = None
        # NOTE: also when the engine goes idle: no step follows to report what its last ones cached
        due = self.clock() - self._keys_sent_at >= CACHE_KEYS_PERIOD_S or not self.engine.has_unfinished()
        if cache is not None and due:
            keys, self._keys_sent_at = cache.cached_keys(), self.clock()
        return replace(
            stats,
            queued_prompt_tokens=replica.queued_prompt_tokens(),
            kv_free_tokens=replica.kv_free_tokens(),
            kv_empty_tokens=replica.kv_empty_tokens(),
            num_requests_added=self.num_added,
            cached_block_keys=keys,
        )


def run_core(spec: EngineSpec, conn: Connection, clock_start: float) -> None:
    """The core process: build the engine, say "ready" (or "failed" with the reason), serve commands."""
    try:
        engine = spec.build()
        core = EngineCore(engine, clock_start, conn, spec.report_routing_stats, spec.overlap_publish, spec.step_log)
    except SloserveError as e:
        conn.send(("failed", str(e)))
        return
    except BaseException:  # noqa: BLE001 - the server must hear why, whatever it is
        conn.send(("failed", traceback.format_exc()))
        return
    kv = engine.scheduler.kv
    conn.send(
        (
            "ready",
            EngineInfo(
                engine.max_model_len,
                engine.loaded.config.vocab_size,
                kv.capacity_tokens,
                kv.cpu.num_blocks * kv.block_size,
                _bytes_per_token(engine),
                kv.block_size,
                kv.prefix_cache is not None,
                tuple(engine.loaded.config.eos_token_ids),
            ),
        )
    )
    try:
        core.run()
    except (EOFError, BrokenPipeError):  # the server went away
        return
    except BaseException:  # noqa: BLE001
        try:
            conn.send(("failed", traceback.format_exc()))
        except (EOFError, BrokenPipeError, OSError):
            pass


def _bytes_per_token(engine) -> int:
    from sloserve.engine.llm_engine import kv_bytes_per_token

    return kv_bytes_per_token(engine.loaded)
