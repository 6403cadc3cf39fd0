"""One engine replica of a fleet: the body of the Ray Serve deployment that ``FleetEngine`` deploys.

A replica is the single server's engine (``AsyncLLMEngine``: the engine in its own process, the
scheduler of ``serve --scheduler``) inside a Ray Serve replica actor. Ray Serve places it (one GPU
each on CUDA, ``num_cpus`` cores on the CPU), checks its health (``check_health``: a failed engine
makes Ray Serve replace the replica) and routes to it (``FleetRequestRouter``, from what
``record_routing_stats`` reports).

Calls, through Ray Serve (``FleetEngine`` makes them):

    admit(request, ingress_id)  a routed request: submit it to the engine; returns this replica's key
    outputs(target)             one stream per replica (``target`` names it): the deltas of all its
                                requests, those of one step or more in one item
    abort(target, ingress_ids)  end these requests ("abort")
    reset_prefix_cache(every)   the engine's prefix cache reset, unless ``every`` says it was asked
                                before; returns this replica's key and whether it reset (None: asked before)

NOTE: one stream per replica, not one per request: a Ray Serve stream carries ~1,700 items a second
on a 2-core machine, fewer than the tokens one small engine makes; a replica's stream sends whatever
piled up since its last item, so its items never outnumber the engine's steps.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass

import numpy as np
from ray import serve

from sloserve.engine.async_engine import AsyncLLMEngine, EngineInfo, EngineStats, ServedRequest, StreamDelta
from sloserve.engine.engine_core import EngineSpec
from sloserve.engine.logprobs import Logprobs
from sloserve.fleet.routing import EveryReplica, ReplicaTarget, RoutedRequest

# Seconds between two items of a replica's output stream at least: a Ray Serve stream item costs
# ~0.6 ms of CPU, and an engine of a small model steps every 1-2 ms (a GPU step of an 8B model takes
# 10-50 ms: there it changes nothing).
MIN_ITEM_INTERVAL_S = 0.005


def local_replica_pids() -> list[int]:
    """The processes of the replicas of every sloserve fleet on this machine: Ray names a replica's actor
    process after its application and deployment (``ray::ServeReplica:sloserve-<id>:engine``). Tests and
    benchmarks/fleet_fault.py kill them; Linux only (it reads /proc)."""
    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:  # gone meanwhile
                continue
            if cmdline.startswith(b"ray::ServeReplica:sloserve-") and b":engine" in cmdline:
                pids.append(int(pid))
    return pids


@dataclass(frozen=True)
class ReplicaDelta:
    """One request's news: its new text and tokens, and on the last one the finish reason; the prompt
    tokens its replica's prefix cache held; log-probabilities as in ``engine_core.Output``."""

    ingress_id: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_cached_tokens: int
    logprobs: list[Logprobs] | None = None
    prompt_logprobs: list[Logprobs] | None = None
    queued_s: float = float("nan")  # first scheduled - arrival, on the replica's engine (NaN: not yet)
    error: str | None = None  # why it ended with "error" (the engine could not take it)
    stop_reason: int | str | None = None


@dataclass(frozen=True)
class ReplicaNews:
    """An item of a replica's ``outputs`` stream: the deltas since the last item, and the replica's
    engine after its last step (the ingress's per-replica metrics)."""

    rank: int
    deltas: list[ReplicaDelta]
    stats: EngineStats | None


class _Stats:
    """The engine's last step (``EngineObserver``), for routing reports and metrics."""

    def __init__(self) -> None:
        self.last: EngineStats | None = None  # without the cache's keys (they go to the router only)
        self.cached_keys: np.ndarray | None = None  # sorted, as of the engine's last report of them

    def on_step(self, stats: EngineStats, replica: str = "0") -> None:
        if stats.cached_block_keys is not None:
            self.cached_keys = stats.cached_block_keys
            stats = dataclasses.replace(stats, cached_block_keys=None)
        self.last = stats

    def on_finish(self, served: ServedRequest) -> None:
        pass


class _ReplicaEngine(AsyncLLMEngine):
    """The engine of a replica: a step's deltas go to the replica's outbox, with one wake-up of its
    event loop per step (not to each request's queue: the replica streams them all on one call)."""

    def __init__(self, spec: EngineSpec, max_queued_requests: int, stats: _Stats) -> None:
        spec = dataclasses.replace(spec, report_routing_stats=True)
        super().__init__(spec, max_queued_requests=max_queued_requests, observer=stats)
        # Each request from admit to its last delta: the ingress's id of it, and it by that id
        self.ingress_id: dict[int, int] = {}  # engine request id -> the ingress's
        self.by_ingress_id: dict[int, ServedRequest] = {}
        self.outbox: list[ReplicaDelta] = []
        self.news: asyncio.Event | None = None  # set when the outbox has deltas; made on the replica's loop
        self.loop: asyncio.AbstractEventLoop | None = None

    def _hand_over(self, outbox: list[tuple[ServedRequest, StreamDelta]]) -> None:
        if outbox and self.loop is not None:
            self.loop.call_soon_threadsafe(self._post, outbox)

    def _post(self, outbox: list[tuple[ServedRequest, StreamDelta]]) -> None:
        """On the replica's loop, where ``admit`` has mapped each request to its ingress id."""
        for served, delta in outbox:
            ingress_id = self.ingress_id[served.request_id]
            if delta.finish_reason is not None:
                del self.ingress_id[served.request_id], self.by_ingress_id[ingress_id]
            # NOTE: the prompt's logprobs go once, with the first delta after they came
            prompt_logprobs, served.prompt_logprobs = served.prompt_logprobs, None
            self.outbox.append(
                ReplicaDelta(
                    ingress_id,
                    delta.text,
                    delta.token_ids,
                    delta.finish_reason,
                    served.num_cached_tokens,
                    delta.logprobs,
                    prompt_logprobs,
                    served.first_scheduled_time - served.arrival_time,
                    served.error,
                    delta.stop_reason,
                )
            )
        self.news.set()


class EngineReplica:
    """A Ray Serve deployment class: an engine of ``spec`` per replica."""

    def __init__(self, spec: EngineSpec, max_queued_requests: int, cores_per_replica: int | None = None) -> None:
        context = serve.get_replica_context()
        self.rank = context.rank.rank
        self.key = context.replica_id.unique_id
        self.stats = _Stats()
        self.engine = _ReplicaEngine(spec, max_queued_requests, self.stats)
        every_core = os.sched_getaffinity(0)
        if cores_per_replica:  # on the CPU: cores of its own for its engine process, which inherits them
            cores = sorted(every_core)
            first = context.rank.local_rank * cores_per_replica
            os.sched_setaffinity(0, {cores[(first + i) % len(cores)] for i in range(cores_per_replica)})
        try:
            self.info: EngineInfo = self.engine.start()
        finally:  # NOTE: this process (Ray's threads, the stream) shares the cores the engines leave
            os.sched_setaffinity(0, every_core)
        self.stats.cached_keys = np.empty(0, np.int64) if self.info.prefix_caching else None
        self.num_reports = 0
        self.last_sent = 0.0  # when ``outputs`` sent its last item (the event loop's clock)

    def engine_info(self) -> dict:
        return asdict(self.info)

    async def admit(self, routed: RoutedRequest, ingress_id: int) -> str:
        """Submit ``routed`` to the engine; its deltas go out on ``outputs``. Returns this replica's key."""
        engine = self.engine
        self._event()
        served = engine.submit(
            routed.prompt_token_ids,
            routed.params,
            request_class=routed.request_class,
            slo=routed.slo,
            priority=routed.priority,
            cache_salt=routed.cache_salt,
        )
        engine.ingress_id[served.request_id] = ingress_id
        engine.by_ingress_id[ingress_id] = served
        return self.key

    async def outputs(self, target: ReplicaTarget) -> AsyncIterator[ReplicaNews]:
        """This replica's deltas, as they come (nothing when ``target`` names another replica: the
        one it named is gone)."""
        if target.key != self.key:
            return
        engine, news = self.engine, self._event()
        loop = asyncio.get_running_loop()
        while True:
            await news.wait()
            wait = self.last_sent + MIN_ITEM_INTERVAL_S - loop.time()
            if wait > 0:  # NOTE: what comes meanwhile goes in the same item
                await asyncio.sleep(wait)
            news.clear()
            self.last_sent = loop.time()
            deltas, engine.outbox = engine.outbox, []
            yield ReplicaNews(self.rank, deltas, self.stats.last)

    def abort(self, target: ReplicaTarget, ingress_ids: list[int]) -> None:
        for ingress_id in ingress_ids:
            served = self.engine.by_ingress_id.get(ingress_id)
            if served is not None and target.key == self.key:
                self.engine.abort(served)

    async def reset_prefix_cache(self, every: EveryReplica) -> tuple[str, bool | None]:
        if self.key in every.asked:
            return self.key, None
        return self.key, await self.engine.reset_prefix_cache()

    def _event(self) -> asyncio.Event:
        engine = self.engine
        if engine.news is None:
            engine.loop, engine.news = asyncio.get_running_loop(), asyncio.Event()
        return engine.news

    def record_routing_stats(self) -> dict:
        """What the router reads (``routing.ReplicaReport``), as of the engine's last step."""
        self.num_reports += 1
        report = {
            "rank": self.rank,
            "report_id": self.num_reports,
            "block_size": self.info.block_size,
            "cached_keys": self.stats.cached_keys,
        }
        stats = self.stats.last
        if stats is None:  # no step yet: all of it is free
            capacity = self.info.kv_capacity_tokens
            return {
                **report,
                "outstanding": 0,
                "queued_prompt_tokens": 0,
                "kv_free_tokens": capacity,
                "kv_empty_tokens": capacity,
                "num_admitted": 0,
            }
        # NOTE: each figure as of the engine's last step, with the requests it had been given by then (those
        # admitted since, the router adds back: FleetRequestRouter._report)
        return {
            **report,
            "outstanding": stats.num_waiting + stats.num_running + stats.num_swapped,
            "queued_prompt_tokens": stats.queued_prompt_tokens,
            "kv_free_tokens": stats.kv_free_tokens,
            "kv_empty_tokens": stats.kv_empty_tokens,
            "num_admitted": stats.num_requests_added,
        }

    def check_health(self) -> None:
        """Raises once the engine failed: Ray Serve then replaces this replica."""
        if self.engine.error is not None:
            raise RuntimeError(f"the engine failed: {self.engine.error}")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None and engine.error is None:
            engine.drain(0.0)
