"""Ray Serve's request router for sloserve's replicas: it calls the routing policies of ``sloserve.router``
(the simulator's), with each replica seen through what it last reported (``record_routing_stats``) and
what this router sent it since.

A replica reports (``ReplicaReport``'s fields): its requests not finished, the prompt tokens it has
yet to compute, its free and empty KV, its block size and the keys of the blocks its prefix cache
holds, all as of its engine's last step, with the number of requests its engine had been given by
then. Reports come every ``STATS_PERIOD_S``; between two, the router adds what it routed itself (a
request's prompt to the replica's queue, its count to its outstanding requests), so a burst that
arrives between reports does not all go to the replica that looked idlest. A report reaches the router
through Ray Serve's controller, 0.1-0.3 s after its step: what the router sent the replica that its
engine had not been given by then, the router adds to the report again (``SentRequests``).

A call whose first argument is a ``ReplicaTarget`` (a replica's output stream, an abort) goes to the
replica it names; one with an ``EveryReplica`` (a prefix cache reset) to a replica it has not reached yet.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from sloserve.core.prefix import TokenPrompt, salted_root_key
from sloserve.core.request import SLO, Request, RequestClass
from sloserve.engine.llm_engine import engine_cost_model
from sloserve.engine.sampler import SamplingParams
from sloserve.router import Router, make_router

# Seconds between two routing reports of a replica (Ray Serve's request_routing_stats_period_s).
STATS_PERIOD_S = 0.1
# Seconds a routed request counts in its replica's reports that do not include it yet, at most: one the
# replica never admitted (it died, or another router's requests filled its count) counts no longer.
SENT_HORIZON_S = 2.0


@dataclass(frozen=True)
class ReplicaTarget:
    """A call for one replica: the one whose Ray Serve replica id is ``key``."""

    key: str


@dataclass(frozen=True)
class EveryReplica:
    """A call for each replica in turn (a prefix cache reset): one not in ``asked`` (replica keys), or any
    replica once each was asked."""

    asked: frozenset[str]


@dataclass
class RoutedRequest:
    """What the ingress sends a replica: an accepted request, as ``AsyncLLMEngine.submit`` takes it.
    It is the call's one argument, so the router reads it from ``PendingRequest.args``."""

    prompt_token_ids: list[int]
    params: SamplingParams
    request_class: RequestClass = RequestClass.RT
    slo: SLO = field(default_factory=SLO)
    priority: int = 0  # vLLM's (AsyncLLMEngine.submit)
    cache_salt: str | None = None  # vLLM's (AsyncLLMEngine.submit): the router keys its blocks as the replica does

    def as_request(self) -> Request:
        """The request as a policy sees it: its prompt by its tokens, ``max_tokens`` for its length."""
        n = self.params.max_tokens
        request = Request(
            0, 0.0, len(self.prompt_token_ids), n, n, self.request_class, self.slo, priority=self.priority
        )
        request.prompt_blocks = TokenPrompt(self.prompt_token_ids, salted_root_key(self.cache_salt))
        return request


@dataclass(eq=False)
class ReplicaReport:
    """A replica as a routing policy sees it (``router.ReplicaLoad``): its last report plus what this
    router routed to it since."""

    index: int
    outstanding: int = 0
    queued_tokens: int = 0
    free_tokens: int = 0
    empty_tokens: int = 0
    block_size: int = 16
    cached_keys: np.ndarray | None = None  # sorted (PrefixCache.cached_keys); None: no prefix cache
    report_id: int = -1  # the replica's count of reports: a new one replaces what the router added

    def add_routed(self, prompt_tokens: int, uncached_tokens: int) -> None:
        """A request routed to this replica since its report: its count to the outstanding requests, its
        prompt to the queue and the KV it will take, its uncached tokens taken from the empty KV (a burst's
        prompts spread by prefix-affinity's no-match rule)."""
        self.outstanding += 1
        self.queued_tokens += prompt_tokens
        self.free_tokens -= prompt_tokens
        self.empty_tokens -= uncached_tokens

    def queued_prompt_tokens(self) -> int:
        return self.queued_tokens

    def kv_free_tokens(self) -> int:
        return self.free_tokens

    def kv_empty_tokens(self) -> int:
        return self.empty_tokens

    def cached_prefix_tokens(self, request: Request) -> int | None:
        if self.cached_keys is None:
            return None
        # NOTE: as the replica's own lookup (``find_cached_prefix``): one token is always left to compute
        limit = (request.num_prompt_tokens - 1) // self.block_size
        keys = request.prompt_blocks.block_index(self.block_size).keys[:limit]
        if not len(keys) or not len(self.cached_keys):
            return 0
        at = np.searchsorted(self.cached_keys, keys).clip(max=len(self.cached_keys) - 1)
        cached = self.cached_keys[at] == keys
        return (len(keys) if cached.all() else int(cached.argmin())) * self.block_size  # up to the first miss


@dataclass
class SentRequests:
    """What a router sent one replica: how many requests in all, and the last ones (those of the last
    ``SENT_HORIZON_S``) as (when, prompt tokens, uncached tokens)."""

    count: int = 0
    recent: deque[tuple[float, int, int]] = field(default_factory=deque)

    def add(self, now: float, prompt_tokens: int, uncached_tokens: int) -> None:
        self.count += 1
        self.recent.append((now, prompt_tokens, uncached_tokens))
        while self.recent[0][0] < now - SENT_HORIZON_S:
            self.recent.popleft()

    def not_in(self, num_admitted: int, now: float) -> list[tuple[int, int]]:
        """The (prompt, uncached) tokens of the requests sent since the ``num_admitted`` first: those a
        report that counts ``num_admitted`` does not include (within the horizon).

        NOTE: the count is exact, the tokens nearly so: requests reach the engine about in the order they
        were sent (two sent at once may swap, and then each one's tokens stand for the other's). With the
        routers of other ingresses, the replica's count is theirs too, and fewer of this router's count as
        not included."""
        unseen = max(0, self.count - num_admitted)
        last = list(self.recent)[-unseen:] if unseen else []
        return [(prompt, uncached) for when, prompt, uncached in last if when >= now - SENT_HORIZON_S]


class FleetRequestRouter(RequestRouter):
    """Routes each request with one of ``sloserve.router``'s policies (``request_router_kwargs``:
    ``policy``, and ``cost_model`` for ``slo``)."""

    def initialize_state(self, policy: str = "least-outstanding", cost_model: str | None = None) -> None:
        # NOTE: the engine's cost model (``serve --cost-model``, as BROS uses it): the slo policy's prefill rate
        self.policy: Router = make_router(policy, engine_cost_model(cost_model))
        self.reports: dict[ReplicaID, ReplicaReport] = {}
        self.sent: dict[ReplicaID, SentRequests] = {}

    def _report(self, replica: RunningReplica, now: float) -> ReplicaReport:
        """The replica's view: its newest report with what was sent it that the report does not include,
        or the one the router has kept adding to."""
        stats: dict[str, Any] = replica.routing_stats or {}
        known = self.reports.get(replica.replica_id)
        if known is None or stats.get("report_id", -1) > known.report_id:
            known = ReplicaReport(
                index=stats.get("rank", len(self.reports)),
                outstanding=stats.get("outstanding", 0),
                queued_tokens=stats.get("queued_prompt_tokens", 0),
                free_tokens=stats.get("kv_free_tokens", 0),
                empty_tokens=stats.get("kv_empty_tokens", 0),
                block_size=stats.get("block_size", 16),
                cached_keys=stats.get("cached_keys"),
                report_id=stats.get("report_id", -1),
            )
            sent = self.sent.setdefault(replica.replica_id, SentRequests())
            for prompt_tokens, uncached_tokens in sent.not_in(stats.get("num_admitted", 0), now):
                known.add_routed(prompt_tokens, uncached_tokens)
            self.reports[replica.replica_id] = known
        return known

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        first = pending_request.args[0] if pending_request is not None and pending_request.args else None
        if isinstance(first, ReplicaTarget):
            named = [r for r in candidate_replicas if r.replica_id.unique_id == first.key]
            return [named] if named else [candidate_replicas]  # NOTE: gone: another one says it is not it
        if isinstance(first, EveryReplica):
            left = [r for r in candidate_replicas if r.replica_id.unique_id not in first.asked]
            return [left or candidate_replicas]
        if not isinstance(first, RoutedRequest):
            return [candidate_replicas]
        request = first.as_request()
        now = time.monotonic()
        reports = [self._report(r, now) for r in candidate_replicas]
        chosen = self.policy.route(request, reports)
        # NOTE: counted here, where it is chosen: Ray Serve calls on_request_routed only under its
        # rejection protocol. Until a report of the replica includes it, what was routed to it counts.
        prompt_tokens = len(first.prompt_token_ids)
        uncached_tokens = prompt_tokens - (chosen.cached_prefix_tokens(request) or 0)
        chosen.add_routed(prompt_tokens, uncached_tokens)
        replica = candidate_replicas[next(i for i, r in enumerate(reports) if r is chosen)]
        self.sent.setdefault(replica.replica_id, SentRequests()).add(now, prompt_tokens, uncached_tokens)
        rest = [r for r in candidate_replicas if r is not replica]
        return [[replica], rest] if rest else [[replica]]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.reports.pop(replica_id, None)
        self.sent.pop(replica_id, None)
