"""Discrete-event simulation of one replica or a cluster of replicas behind a router.

Each replica runs the step loop of ``sloserve.replica`` (``schedule -> execute -> update``, with its
fast path of stretches) with the cost model's executor. Events are ordered by time; ties go to
arrivals first, then to the replica with the lowest index, so a run is deterministic.
"""

from __future__ import annotations

import functools
import gc
import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sloserve.core.outputs import SchedulerOutput
from sloserve.core.request import Request
from sloserve.cost.base import CostModel
from sloserve.metrics.timeline import Timeline
from sloserve.replica import Replica
from sloserve.router import Router, make_router
from sloserve.sched.base import Scheduler
from sloserve.sim.executor import SimExecutor
from sloserve.sim.stretch import StretchPlanner

# on_progress is called about this often (in steps run).
PROGRESS_EVERY_STEPS = 256


def _run_solo(
    replica: Replica, pending: list[tuple[float, int, Request]], on_progress: Callable[[int], None] | None
) -> int:
    """Serve the ``pending`` arrivals (the next one last) on one replica with no chained batches:
    nothing but its own clock moves the next event, so after each arrival it steps on until the next
    one is due (or it runs dry) without choosing again. Returns the requests finished."""
    completed = steps = 0
    next_progress = PROGRESS_EVERY_STEPS
    while pending:
        arrival, _, request = pending.pop()
        replica.add(request, arrival)
        next_arrival = pending[-1][0] if pending else math.inf
        # NOTE: arrivals due by the replica's clock are all added before it steps (ties: arrivals
        # first), and it has unfinished requests here: the one just added at least.
        if replica.now < next_arrival:
            num_finished, num_steps = _run_until(replica, next_arrival)
            completed += num_finished
            steps += num_steps
            if on_progress is not None and steps >= next_progress:
                on_progress(completed)
                next_progress = steps + PROGRESS_EVERY_STEPS
    return completed


def _run_until(replica: Replica, next_event: float) -> tuple[int, int]:
    """Step ``replica`` until ``next_event`` is due or nothing is left to run: (requests finished,
    steps).

    NOTE: only for a solo replica, whose steps nothing else reacts to in between.
    """
    has_unfinished = replica.scheduler.has_unfinished
    step = replica.step
    num_finished = num_steps = 0
    while True:
        finished = step(next_event)
        num_steps += 1
        # NOTE: a solo replica's requests leave only by finishing (no hand-off), so it can run
        # dry only in a step that finished some: has_unfinished() is asked only then.
        if finished:
            num_finished += len(finished)
            if not has_unfinished():
                return num_finished, num_steps
        if replica.now >= next_event:
            return num_finished, num_steps


def _latest_first(arrival: tuple[float, int, Request]) -> tuple[float, int]:
    """Sort key of the pending arrivals: the earliest (ties: the lowest request id) sorts last."""
    return -arrival[0], -arrival[1]


class _Cluster:
    """Replicas behind a router (or one replica with closed-loop batches), run event by event, as
    SimPy's ``Environment.step``: the events that come from outside the replicas, arrivals and KV
    transfers, wait in one heap of (time, kind, request id, request); each turn the earliest of them is
    handled or, when the replica furthest behind is earlier, that replica steps once.

    NOTE: at one time a KV transfer lands before an arrival is routed, arrivals go by request id, and
    both go before a replica steps (replicas by index): a run is deterministic.
    """

    TRANSFER, ARRIVAL = 0, 1  # event kinds, in the order they are handled at one time

    def __init__(
        self,
        replicas: list[Replica],
        decoders: list[Replica],
        router: Router,
        decode_router: Router,
        chains: Sequence[Sequence[Sequence[Request]]],
        link_bandwidth: float,
    ) -> None:
        self.replicas, self.decoders, self.everyone = replicas, decoders, replicas + decoders
        self.router, self.decode_router = router, decode_router
        self.events: list[tuple[float, int, int, Request]] = []
        self.num_finished = self.num_steps = 0
        # Disaggregated serving: when each prefill replica's link is idle again, and the bytes sent.
        self.link_bandwidth = link_bandwidth
        self.link_free = [0.0] * len(replicas)
        self.transferred_bytes = 0
        # Closed-loop batches: id(request) -> (chain, index of its batch), and requests left per batch.
        self.chains = chains
        self.batch_of: dict[int, tuple[int, int]] = {}
        self.left_in_batch: dict[tuple[int, int], int] = {}
        for c, chain in enumerate(chains):
            for b, batch in enumerate(chain):
                self.left_in_batch[(c, b)] = len(batch)
                for r in batch:
                    self.batch_of[id(r)] = (c, b)

    def arrive(self, request: Request, at: float) -> None:
        """``request`` arrives at ``at``: it is routed then."""
        heapq.heappush(self.events, (at, self.ARRIVAL, request.request_id, request))

    def run(self, on_progress: Callable[[int], None] | None) -> None:
        """Handle every event and step every replica until nothing is left."""
        next_progress = PROGRESS_EVERY_STEPS
        while True:
            next_event = self.events[0][0] if self.events else math.inf
            busy = [rep for rep in self.everyone if rep.scheduler.has_unfinished()]
            replica = min(busy, key=lambda rep: (rep.now, rep.index)) if busy else None
            if replica is None and next_event == math.inf:
                return
            if replica is None or next_event <= replica.now:
                at, kind, _, request = heapq.heappop(self.events)
                if kind == self.TRANSFER:
                    self.deliver_kv(request, at)
                else:
                    self.route_arrival(request, at)
                continue
            self.step(replica, next_event)
            if on_progress is not None and self.num_steps >= next_progress:
                on_progress(self.num_finished)
                next_progress = self.num_steps + PROGRESS_EVERY_STEPS

    def earliest_news(self, replica: Replica) -> float:
        """The earliest time another replica's step may send ``replica`` a request that is not among the
        events yet: a prefill replica's KV hand-off for a decode replica, a finished request's next
        batch in its chain for any replica. Such a request comes at the end of the sender's next step at
        the soonest, so the sender's clock bounds what ``replica`` may run as one stretch (the fast path
        stops there, as the step by step run would see the request at its next step)."""
        if self.chains:
            senders = self.everyone
        elif replica in self.decoders:
            senders = self.replicas
        else:
            return math.inf  # only arrivals reach it: they are all among the events
        return min((r.now for r in senders if r is not replica and r.scheduler.has_unfinished()), default=math.inf)

    def route_arrival(self, request: Request, at: float) -> None:
        self.router.route(request, self.replicas).add(request, at)

    def deliver_kv(self, request: Request, at: float) -> None:
        """A prefilled request's KV has reached the decode side: a decode replica takes it."""
        self.decode_router.route(request, self.decoders).add(request, at)

    def step(self, replica: Replica, next_event: float) -> None:
        """One step of ``replica``; then the next batch of a chain whose batch it finished arrives, and
        the requests it prefilled for a decode replica start their KV transfer."""
        finished = replica.step(next_event, self.earliest_news(replica))
        self.num_finished += len(finished)
        self.num_steps += 1
        for request in finished if self.chains else ():
            self.release_next_batch(request)
        for request in replica.scheduler.take_handoff() if replica.scheduler.handoff else ():
            self.send_kv(replica, request)

    def release_next_batch(self, request: Request) -> None:
        """Closed loop: when the last request of a batch finishes, the chain's next batch arrives."""
        key = self.batch_of.get(id(request))
        if key is None:
            return
        self.left_in_batch[key] -= 1
        c, b = key
        if self.left_in_batch[key] == 0 and b + 1 < len(self.chains[c]):
            for r in self.chains[c][b + 1]:
                r.arrival_time = request.finish_time + r.think_time_s
                self.arrive(r, r.arrival_time)

    def send_kv(self, replica: Replica, request: Request) -> None:
        """A prefill replica sends a request's KV over its link, one transfer at a time."""
        replica.outstanding -= 1
        num_bytes = request.num_computed_tokens * replica.scheduler.kv.kv_bytes_per_token
        start = max(request.first_token_time, self.link_free[replica.index])
        self.link_free[replica.index] = start + num_bytes / self.link_bandwidth
        self.transferred_bytes += num_bytes
        heapq.heappush(self.events, (self.link_free[replica.index], self.TRANSFER, request.request_id, request))


@dataclass
class SimResult:
    """Everything a run produced: the requests (with their timestamps) and the per-step timeline."""

    requests: list[Request]
    timeline: Timeline
    kv_capacity_tokens: int  # per replica
    num_replicas: int
    num_allocation_failures: int
    swapped_bytes: int
    num_preemptions: int
    sim_wall_s: float
    extra: dict = field(default_factory=dict)
    # Scheduler.policy_metrics of the replicas, merged (merge_policy_metrics).
    policy_metrics: dict = field(default_factory=dict)


def merge_policy_metrics(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One ``policy_metrics`` dict from several replicas': ``num_*`` counters and ``*_s`` times
    summed, lists concatenated, other values kept when all replicas that report them agree."""
    merged: dict[str, Any] = {}
    disagree: set[str] = set()
    for report in reports:
        for key, value in report.items():
            if key not in merged:
                merged[key] = list(value) if isinstance(value, (list, tuple)) else value
            elif isinstance(value, (list, tuple)):
                merged[key].extend(value)
            elif key.startswith("num_") or key.endswith("_s"):
                merged[key] += value
            elif merged[key] != value:
                disagree.add(key)
    return {k: v for k, v in merged.items() if k not in disagree}


def _cyclic_gc_paused(run: Callable[..., SimResult]) -> Callable[..., SimResult]:
    """Run ``run`` with Python's cyclic garbage collector paused, as ``timeit`` does, and restore it.

    NOTE: a simulation creates no reference cycles (a test checks it leaves no cyclic garbage), so
    the collector would only walk the live requests again and again: that cost about 3% of a 10k-
    request run's instructions, and pausing it leaks nothing.
    """

    @functools.wraps(run)
    def paused(*args: Any, **kwargs: Any) -> SimResult:
        enabled = gc.isenabled()
        gc.disable()
        try:
            return run(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()

    return paused


@_cyclic_gc_paused
def simulate(
    requests: Sequence[Request],
    make_scheduler: Callable[[], Scheduler],
    cost_model: CostModel,
    *,
    num_replicas: int = 1,
    router: str = "round-robin",
    fast_path: bool = True,
    on_progress: Callable[[int], None] | None = None,
    on_step: Callable[[int, SchedulerOutput], None] | None = None,
    make_decode_scheduler: Callable[[], Scheduler] | None = None,
    num_decode_replicas: int = 0,
    link_bandwidth: float = 100e9 / 8,
    chains: Sequence[Sequence[Sequence[Request]]] = (),
) -> SimResult:
    """Simulate ``requests`` (their arrival times set) on ``num_replicas`` replicas.

    ``make_scheduler`` builds one fresh scheduler per replica. Requests are mutated in place (their
    progress and timestamps) and returned in ``SimResult.requests``. ``on_step(replica, output)``
    sees every output before it runs (use ``fast_path=False`` to see every step).

    Disaggregated serving (DistServe): with ``num_decode_replicas`` > 0, the ``num_replicas``
    replicas only prefill (their schedulers have role ``prefill``) and hand each request off after
    its first token; its KV (prompt tokens x bytes per token) crosses the prefill replica's link, one
    transfer at a time at ``link_bandwidth`` bytes/s (default 100 Gb/s Ethernet), and the router
    gives it to one of the ``num_decode_replicas`` built by ``make_decode_scheduler``.

    Closed-loop batches: each chain is a list of batches of ``requests``; a batch after the first
    arrives (its ``arrival_time`` is set) when every request of the batch before it has finished,
    each request ``think_time_s`` later (a conversation's turns).
    """
    routers = (make_router(router, cost_model), make_router(router, cost_model))  # arrivals, KV hand-offs
    if num_replicas < 1 or num_decode_replicas < 0:
        raise ValueError(f"need >= 1 replica and >= 0 decode replicas, got {num_replicas}, {num_decode_replicas}")
    if num_decode_replicas and (make_decode_scheduler is None or not link_bandwidth > 0):
        raise ValueError("disaggregated serving needs make_decode_scheduler and a link bandwidth > 0")
    wall0 = time.perf_counter()
    solo = num_replicas == 1 and not num_decode_replicas and not chains

    def new_replica(index: int, scheduler: Scheduler) -> Replica:
        executor = SimExecutor(cost_model)
        return Replica(index, scheduler, executor, StretchPlanner(executor, solo) if fast_path else None)

    replicas = [new_replica(i, make_scheduler()) for i in range(num_replicas)]
    decoders = [new_replica(num_replicas + i, make_decode_scheduler()) for i in range(num_decode_replicas)]  # type: ignore[misc]
    everyone = replicas + decoders
    for rep in everyone:
        rep.on_step = on_step
    for r in requests:
        everyone[-1].scheduler.check_fits(r, r.num_prompt_tokens + r.true_output_tokens - 1)
    chained = {id(r) for chain in chains for batch in chain[1:] for r in batch}
    arrivals = [r for r in requests if id(r) not in chained]
    if solo:
        # Arrivals, the next one last: a list popped from its end costs O(1) (a heap's pops took 1-2%
        # of a 30k-request run).
        pending = sorted(((r.arrival_time, r.request_id, r) for r in arrivals), key=_latest_first)
        completed, transferred_bytes = _run_solo(replicas[0], pending, on_progress), 0
    else:
        cluster = _Cluster(replicas, decoders, *routers, chains, link_bandwidth)
        for r in arrivals:
            cluster.arrive(r, r.arrival_time)
        cluster.run(on_progress)
        completed, transferred_bytes = cluster.num_finished, cluster.transferred_bytes
    if on_progress is not None:
        on_progress(completed)
    timeline = everyone[0].timeline if len(everyone) == 1 else Timeline.concat([r.timeline for r in everyone])
    kvs = [rep.scheduler.kv for rep in everyone]
    return SimResult(
        requests=list(requests),
        timeline=timeline,
        kv_capacity_tokens=kvs[0].capacity_tokens,
        num_replicas=len(everyone),
        num_allocation_failures=sum(kv.num_allocation_failures for kv in kvs),
        swapped_bytes=sum(kv.swapped_bytes for kv in kvs),
        num_preemptions=sum(rep.scheduler.num_preemptions for rep in everyone),
        sim_wall_s=time.perf_counter() - wall0,
        extra={"kv_transferred_bytes": transferred_bytes} if num_decode_replicas else {},
        policy_metrics=merge_policy_metrics([rep.scheduler.policy_metrics() for rep in everyone]),
    )
