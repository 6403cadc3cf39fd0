"""Ray Serve's request router for sloserve's replicas: it calls the routing policies of ``sloserve.router``
(the simulator's), with each replica seen through what it last reported (``record_routing_stats``) and
what this router sent it since.

A replica reports (``ReplicaReport``'s fields): its requests not finished, the prompt tokens it has
yet to compute, its free and empty KV, its block size and the keys of the blocks its prefix cache
holds. Reports come every ``STATS_PERIOD_S``; between two, the router adds what it routed itself (a
request's prompt to the replica's queue, its count to its outstanding requests), so a burst that
arrives between reports does not all go to the replica that looked idlest.

A call whose first argument is a ``ReplicaTarget`` (a replica's output stream, an abort) goes to the
replica it names; one with an ``EveryReplica`` (a prefix cache reset) to a replica it has not reached yet.
"""

from __future__ import annotations

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


class FleetRequestRouter(RequestRouter):
    """Routes each request with one of ``sloserve.router``'s policies (``request_router_kwargs``:
    ``policy``, and ``cost_model`` for ``slo``)."""

    def initialize_state(self, policy: str = "least-outstanding", cost_model: str | None = None) -> None:
        # NOTE: the engine's cost model (``serve --cost-model``, as BROS uses it): the slo policy's prefill rate
        self.policy: Router = make_router(policy, engine_cost_model(cost_model))
        self.reports: dict[ReplicaID, ReplicaReport] = {}

    def _report(self, replica: RunningReplica) -> ReplicaReport:
        """The replica's view: its newest report, or the one the router has kept adding to."""
        stats: dict[str, Any] = replica.routing_stats or {}
        known = self.reports.get(replica.replica_id)
        if known is None or stats.get("report_id", -1) > known.report_id:
            keys = stats.get("cached_keys")
            known = ReplicaReport(
                index=stats.get("rank", len(self.reports)),
                outstanding=stats.get("outstanding", 0),
                queued_tokens=stats.get("queued_prompt_tokens", 0),
                free_tokens=stats.get("kv_free_tokens", 0),
                empty_tokens=stats.get("kv_empty_tokens", 0),
                block_size=stats.get("block_size", 16),
                cached_keys=keys,
                report_id=stats.get("report_id", -1),
            )
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
        reports = [self._report(r) for r in candidate_replicas]
        chosen = self.policy.route(request, reports)
        # NOTE: counted here, where it is chosen: Ray Serve calls on_request_routed only under its
        # rejection protocol. Until the replica's next report, what was routed to it counts.
        prompt_tokens = len(first.prompt_token_ids)
        chosen.outstanding += 1
        chosen.queued_tokens += prompt_tokens
        chosen.free_tokens -= prompt_tokens
        # (the uncached tokens take empty slots: a burst's prompts spread by prefix-affinity's no-match rule)
        chosen.empty_tokens -= prompt_tokens - (chosen.cached_prefix_tokens(request) or 0)
        replica = candidate_replicas[next(i for i, r in enumerate(reports) if r is chosen)]
        rest = [r for r in candidate_replicas if r is not replica]
        return [[replica], rest] if rest else [[replica]]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.reports.pop(replica_id, None)
