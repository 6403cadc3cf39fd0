"""Routing policies (router.py) on real replicas: a scheduler, its KV cache and the cost-model executor."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import llama7b_cost, scheduler, timestamps
from sloserve.core.errors import ConfigError, UnknownNameError
from sloserve.core.prefix import TokenPrompt
from sloserve.core.request import Request, RequestClass, RequestStatus
from sloserve.replica import Replica
from sloserve.router import PrefixAffinity, make_router
from sloserve.sim import SimExecutor, simulate
from sloserve.workload import build_workload, load_workload_spec


def _replicas(n: int, caching: bool = True, capacity: int = 8192) -> list[Replica]:
    return [
        Replica(i, scheduler("vllm", capacity, enable_prefix_caching=caching), SimExecutor(llama7b_cost()))
        for i in range(n)
    ]


def _request(rid: int, tokens: list[int], cls: RequestClass = RequestClass.RT) -> Request:
    return Request(rid, 0.0, len(tokens), 4, 4, prompt_blocks=TokenPrompt(tokens), request_class=cls)


def _serve(replica: Replica, request: Request) -> None:
    """``request`` runs to its end on ``replica`` (its prompt's blocks stay cached there)."""
    replica.add(request, replica.now)
    while request.status is not RequestStatus.FINISHED:
        replica.step(np.inf)


def test_prefix_affinity_follows_the_cache_until_the_load_is_imbalanced():
    replicas = _replicas(3)
    history = list(range(1, 161))  # 10 blocks
    _serve(replicas[1], _request(0, history))
    router = PrefixAffinity(imbalance_threshold=3)
    for rid in range(1, 3):  # the next turns find the history on replica 1, busy as it is
        turn = _request(rid, [*history, 500 + rid, 7, 7])
        assert router.route(turn, replicas) is replicas[1]
        replicas[1].add(turn, replicas[1].now)
    assert router.route(_request(9, [*history, 9]), replicas) is replicas[1]
    replicas[1].add(_request(10, list(range(900, 940))), replicas[1].now)  # 3 outstanding: imbalanced
    assert router.route(_request(11, [*history, 9]), replicas) is replicas[0]
    # a prompt no replica has seen: the replica holding the least KV, used or cached
    fresh = _replicas(3)
    _serve(fresh[0], _request(0, history))
    assert router.route(_request(1, list(range(2000, 2100))), fresh) is fresh[1]


def test_prefix_affinity_without_caches_keeps_prompts_that_start_alike_together():
    replicas = _replicas(4, caching=False)
    router = make_router("prefix-affinity")
    system = list(range(50, 82))  # two full blocks
    chosen = {router.route(_request(rid, [*system, rid, rid]), replicas).index for rid in range(6)}
    assert len(chosen) == 1
    others = {router.route(_request(rid, [rid] * 40), replicas).index for rid in range(20)}
    assert len(others) > 1


def test_slo_router_sends_rt_to_the_shortest_queue_and_be_to_the_most_idle_kv():
    replicas = _replicas(2, caching=False)
    router = make_router("slo", llama7b_cost())
    replicas[0].add(_request(0, list(range(3000))), 0.0)  # a long prompt queued on replica 0
    assert router.route(_request(1, list(range(100))), replicas) is replicas[1]
    replicas[1].add(_request(2, list(range(200))), 0.0)
    replicas[1].step(np.inf)  # replica 1 now holds KV, replica 0 still queues its prompt
    be = _request(3, list(range(100)), RequestClass.BE)
    assert router.route(be, replicas) is replicas[1]  # its free KV less its queue is larger
    with pytest.raises(ConfigError, match="needs a cost model"):
        make_router("slo")
    with pytest.raises(UnknownNameError):
        make_router("random")


def test_prefix_affinity_finds_more_of_conversations_than_round_robin():
    """Multi-turn chat sessions (each turn resends its history) on 4 replicas: routing by cached prefix
    (and by the SLO router's TTFT estimate, which counts only uncached tokens) finds far more of each
    turn's history than round-robin, which scatters a session's turns; every request completes."""
    found = {}
    for router in ("round-robin", "least-outstanding", "prefix-affinity", "slo"):
        workload = build_workload(load_workload_spec("chat-sessions"), seed=0, context_len=4096, num_requests=300)
        result = simulate(
            workload.requests,
            lambda: scheduler("vllm", 60_000, enable_prefix_caching=True),
            llama7b_cost(),
            num_replicas=4,
            router=router,
            chains=workload.chains,
        )
        assert all(r.status is RequestStatus.FINISHED for r in result.requests)
        found[router] = sum(r.num_cached_tokens for r in result.requests)
    assert min(found["prefix-affinity"], found["slo"]) > 1.2 * max(found["round-robin"], found["least-outstanding"])


@pytest.mark.parametrize("router", ["prefix-affinity", "slo"])
def test_fast_path_routes_as_step_by_step(router):
    """The routers read the replicas' queues and caches: stretches must leave them as steps do."""

    def run(fast):
        workload = build_workload(load_workload_spec("chat-sessions"), seed=4, context_len=4096, num_requests=200)
        simulate(
            workload.requests,
            lambda: scheduler("sarathi", 20_000, enable_prefix_caching=True),
            llama7b_cost(),
            num_replicas=3,
            router=router,
            fast_path=fast,
            chains=workload.chains,
        )
        return workload.requests

    slow, fast = run(False), run(True)
    assert [r.replica for r in slow] == [r.replica for r in fast]
    assert len({r.replica for r in slow}) == 3
    np.testing.assert_allclose(timestamps(fast), timestamps(slow), rtol=1e-9, atol=0, equal_nan=True)


def test_a_fleet_replica_report_matches_the_replica_own_cache():
    """What ``serve --replicas`` routes on: a replica's report (its cache's keys, sent as a list) tells the
    router as many cached prompt tokens as the replica itself finds, and the same loads."""
    pytest.importorskip("ray.serve", reason="the fleet extra (ray[serve]) is not installed")
    from sloserve.fleet.routing import ReplicaReport

    replica = _replicas(1)[0]
    history = list(range(1, 161))
    _serve(replica, _request(0, history))
    kv = replica.scheduler.kv
    report = ReplicaReport(
        0,
        queued_tokens=replica.queued_prompt_tokens(),
        free_tokens=replica.kv_free_tokens(),
        empty_tokens=replica.kv_empty_tokens(),
        block_size=kv.block_size,
        cached_keys=kv.prefix_cache.cached_keys(),
    )
    found = []
    for tokens in (history + [7, 7, 7], history, history[:100], [5] + history, history[:15]):
        request = _request(1, tokens)
        found.append(report.cached_prefix_tokens(request))
        assert found[-1] == replica.cached_prefix_tokens(request)
    assert found == [160, 144, 96, 0, 0]
    no_cache = ReplicaReport(0, cached_keys=None)
    assert no_cache.cached_prefix_tokens(_request(3, history)) is None


def test_a_fleet_router_adds_back_what_a_late_report_does_not_include():
    """A replica's report reaches the router 0.1-0.3 s after its engine's step: the requests sent the replica
    that its engine had not been given by then count again on top of it (not the ones it had), and a
    request never admitted stops counting after the horizon."""
    pytest.importorskip("ray.serve", reason="the fleet extra (ray[serve]) is not installed")
    from sloserve.fleet.routing import SENT_HORIZON_S, ReplicaReport, SentRequests

    sent = SentRequests()
    for i, (prompt, uncached) in enumerate([(200, 200), (220, 28), (100, 100)]):
        sent.add(10.0 + i * 0.01, prompt, uncached)
    assert sent.not_in(num_admitted=3, now=10.1) == []
    assert sent.not_in(num_admitted=1, now=10.1) == [(220, 28), (100, 100)]
    assert sent.not_in(num_admitted=5, now=10.1) == []  # (other routers' requests)
    report = ReplicaReport(0, outstanding=1, queued_tokens=50, free_tokens=4000, empty_tokens=3000)
    for prompt, uncached in sent.not_in(num_admitted=1, now=10.1):
        report.add_routed(prompt, uncached)
    assert (report.outstanding, report.queued_tokens, report.free_tokens, report.empty_tokens) == (
        3,
        370,
        3680,
        2872,
    )
    assert sent.not_in(num_admitted=0, now=10.02 + SENT_HORIZON_S + 0.001) == []
    sent.add(20.0, 16, 16)  # (the old ones go)
    assert sent.count == 4 and list(sent.recent) == [(20.0, 16, 16)]
