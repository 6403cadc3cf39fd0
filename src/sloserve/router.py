"""Routing requests across replicas: the policies the simulator's cluster uses (``simulate --replicas N
--router NAME``, ``plan``), written against what a replica reports (``ReplicaLoad``) so that a fleet's
router can call the same ones.

    round-robin        in turn
    least-outstanding  the fewest requests routed and not finished (ties: the lowest index)
    prefix-affinity    the replica whose prefix cache holds the longest start of the prompt (Ray Serve
                       LLM's PrefixCacheAffinityRouter, SGLang's cache-aware router), see ``PrefixAffinity``
    slo                an RT request to the replica that would give its first token soonest, a BE
                       request to the one with the most idle KV, see ``SloRouter``

Every policy is deterministic: ties go to the fewest outstanding requests, then the lowest index.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar, Protocol, TypeVar

from sloserve.core.errors import ConfigError, UnknownNameError
from sloserve.core.request import Request, RequestClass
from sloserve.cost.base import BatchShape, CostModel


class ReplicaLoad(Protocol):
    """What a replica reports to the router (as Ray Serve's routing stats carry a replica's queue)."""

    index: int
    outstanding: int  # requests routed to it and not finished

    def queued_prompt_tokens(self) -> int:
        """Prompt tokens it has yet to compute: its waiting requests' and its prefills' in progress."""
        ...

    def kv_free_tokens(self) -> int:
        """KV token slots an allocation could take now (cached blocks nobody uses included)."""
        ...

    def kv_empty_tokens(self) -> int:
        """KV token slots holding nothing, not even a cached prefix."""
        ...

    def cached_prefix_tokens(self, request: Request) -> int | None:
        """Tokens of ``request``'s prompt its prefix cache holds now (None: it has no prefix cache)."""
        ...


R = TypeVar("R", bound=ReplicaLoad)


def _least_outstanding(replicas: Sequence[R]) -> R:
    return min(replicas, key=lambda r: (r.outstanding, r.index))


class Router(ABC):
    """A routing policy: ``route`` picks the replica a request goes to."""

    name: ClassVar[str]

    @abstractmethod
    def route(self, request: Request, replicas: Sequence[R]) -> R:
        """The replica ``request`` goes to (``replicas`` is not empty)."""


class RoundRobin(Router):
    name = "round-robin"

    def __init__(self) -> None:
        self.num_routed = 0

    def route(self, request: Request, replicas: Sequence[R]) -> R:
        replica = replicas[self.num_routed % len(replicas)]
        self.num_routed += 1
        return replica


class LeastOutstanding(Router):
    name = "least-outstanding"

    def route(self, request: Request, replicas: Sequence[R]) -> R:
        return _least_outstanding(replicas)


class PrefixAffinity(Router):
    """Cache locality while the load stays balanced, as Ray Serve LLM's PrefixCacheAffinityRouter:

    1. imbalance: when the replicas' outstanding requests differ by ``imbalance_threshold`` or more,
       the least loaded one (cache locality must not pile requests on one replica);
    2. match: else the replica whose cache holds the largest share of the prompt, when that share is
       ``match_rate_threshold`` or more (Ray's 10%);
    3. no match: else the replica holding the least KV, used or cached (the most room for a new
       prefix: Ray's lowest prefix-cache utilization, SGLang's smallest tree).

    Ours: the match is the replica's real cache (the simulator's replicas, or a replica's report),
    not a tree of what the router sent; the imbalance threshold is in requests, 8 by default (Ray's
    is a knob without a documented value). Replicas without a prefix cache: a hash of the prompt's first
    block picks one, so that prompts starting alike (a conversation's turns) meet on one replica.
    """

    name = "prefix-affinity"

    def __init__(self, imbalance_threshold: int = 8, match_rate_threshold: float = 0.1) -> None:
        if imbalance_threshold < 1 or not 0 < match_rate_threshold <= 1:
            raise ConfigError(
                f"prefix-affinity needs imbalance_threshold >= 1 and 0 < match_rate_threshold <= 1, "
                f"got {imbalance_threshold}, {match_rate_threshold}"
            )
        self.imbalance_threshold = imbalance_threshold
        self.match_rate_threshold = match_rate_threshold

    def route(self, request: Request, replicas: Sequence[R]) -> R:
        loads = [r.outstanding for r in replicas]
        if max(loads) - min(loads) >= self.imbalance_threshold:
            return _least_outstanding(replicas)
        cached = [r.cached_prefix_tokens(request) for r in replicas]
        if any(c is None for c in cached):
            prompt = request.prompt_blocks
            keys = prompt.block_keys(16) if prompt is not None else []
            return replicas[keys[0] % len(replicas)] if keys else _least_outstanding(replicas)
        best = max(cached)
        if best >= self.match_rate_threshold * request.num_prompt_tokens and best > 0:
            return _least_outstanding([r for r, c in zip(replicas, cached) if c == best])
        return min(replicas, key=lambda r: (-r.kv_empty_tokens(), r.outstanding, r.index))


class SloRouter(Router):
    """SLO-aware routing. A replica's TTFT for a request is estimated from its queue: the prompt
    tokens queued before it plus its own uncached ones, at the cost model's prefill rate (the time
    of a ``chunk_tokens`` prefill per token: prompts queue behind one another in chunks of about
    that size). An RT request goes to the replica with the smallest estimate, the one that meets its
    TTFT SLO soonest; a BE request to the one with the most idle KV (free KV less what its queue will
    take), leaving the quick replicas to RT requests.

    Ours: the issue's rule, made concrete; the estimate ignores the decodes a step carries beside
    the prefills (a few percent of a prefill-bound step)."""

    name = "slo"

    def __init__(self, cost_model: CostModel, chunk_tokens: int = 2048) -> None:
        shape = BatchShape(num_prefill=1, prefill_tokens=chunk_tokens, prefill_attention_work=chunk_tokens**2)
        self.prefill_s_per_token = cost_model.batch_time(shape).total_s / chunk_tokens

    def ttft_estimate_s(self, request: Request, replica: ReplicaLoad) -> float:
        own = request.num_prompt_tokens - (replica.cached_prefix_tokens(request) or 0)
        return (replica.queued_prompt_tokens() + own) * self.prefill_s_per_token

    def route(self, request: Request, replicas: Sequence[R]) -> R:
        if request.request_class is RequestClass.BE:
            return min(replicas, key=lambda r: (r.queued_prompt_tokens() - r.kv_free_tokens(), r.outstanding, r.index))
        return min(replicas, key=lambda r: (self.ttft_estimate_s(request, r), r.outstanding, r.index))


ROUTERS: dict[str, type[Router]] = {cls.name: cls for cls in (RoundRobin, LeastOutstanding, PrefixAffinity, SloRouter)}


def make_router(name: str, cost_model: CostModel | None = None) -> Router:
    """A fresh router of policy ``name`` (``slo`` prices queues with ``cost_model``)."""
    if name not in ROUTERS:
        raise UnknownNameError("router", name, list(ROUTERS))
    if name == SloRouter.name:
        if cost_model is None:
            raise ConfigError("the slo router estimates TTFTs and needs a cost model")
        return SloRouter(cost_model)
    return ROUTERS[name]()
