"""Prefix caching: chained block keys, shared reference-counted blocks, LRU eviction of cached blocks,
and the schedulers that find cached prompts."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import Driver, llama7b_cost, reset_prefix_cache_and_check
from sloserve.core.errors import ConfigError
from sloserve.core.prefix import SegmentedPrompt, TokenPrompt, salted_root_key, segment_hash_ids
from sloserve.core.request import Request, RequestClass
from sloserve.kv.manager import ExactReservationKVManager, PagedKVManager
from sloserve.sim import simulate
from sloserve.sim.executor import SimExecutor


def _request(rid: int, prompt: TokenPrompt | SegmentedPrompt, output: int = 4) -> Request:
    return Request(rid, 0.0, prompt.num_tokens, output, output, prompt_blocks=prompt)


# --- keys ----------------------------------------------------------------------------------------
def test_same_tokens_after_different_parents_have_different_keys():
    a = TokenPrompt([1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = TokenPrompt([9, 9, 9, 9, 5, 6, 7, 8])
    c = TokenPrompt([1, 2, 3, 4, 5, 6, 7, 8, 0, 0])
    assert len(a.block_keys(4)) == 2 and len(b.block_keys(4)) == 2  # the partial last block has none
    assert a.block_keys(4)[1] != b.block_keys(4)[1]  # tokens 5..8 equal, parents differ
    assert a.block_keys(4) == c.block_keys(4)[:2]  # same tokens and parents: same keys
    assert a.block_keys(3) != a.block_keys(4)[:2]


def test_segment_keys_match_a_chain_over_every_token_before():
    """A block's key is shared exactly when the segments up to its end and its offset agree: the
    reference is the tuple of everything before, not a hash."""
    rng = np.random.default_rng(0)
    prompts = []
    for _ in range(40):
        n_segments = int(rng.integers(1, 5))
        ids = tuple(int(x) for x in rng.integers(0, 3, n_segments))
        num_tokens = int(rng.integers(1, n_segments * 8 + 1))
        prompts.append(SegmentedPrompt.uniform(ids, 8, max(num_tokens, (n_segments - 1) * 8 + 1)))
    for block_size in (2, 3, 8, 12):
        reference = {}
        for p in prompts:
            for j, key in enumerate(p.block_keys(block_size)):
                end = (j + 1) * block_size
                content = (p.segment_ids[: -(-end // 8)], j * block_size)
                assert reference.setdefault(content, key) == key
        assert len(set(reference.values())) == len(reference)  # different content: different keys


def test_a_group_holds_its_blocks_at_the_same_places_in_every_prompt():
    """The cache finds a segment's blocks through its group: a group key names the same blocks, at the
    same offsets, in every prompt holding it (segments of any lengths, prompts clipped anywhere), and
    a clipped prompt's blocks fit in the group's full extent."""
    rng = np.random.default_rng(1)
    lengths = {i: int(rng.integers(1, 20)) for i in range(4)}  # a segment id's tokens
    for block_size in (2, 3, 8):
        seen = {}
        for _ in range(60):
            ids = tuple(int(x) for x in rng.integers(0, 4, int(rng.integers(1, 6))))
            ends = tuple(np.cumsum([lengths[i] for i in ids]).tolist())
            prompt = SegmentedPrompt(ids, ends, int(rng.integers(ends[-1] - lengths[ids[-1]] + 1, ends[-1] + 1)))
            index = prompt.block_index(block_size)
            assert index.keys.tolist() == prompt.block_keys(block_size)
            assert index.num_blocks == prompt.num_tokens // block_size
            for j in range(index.num_blocks):
                g = index.group_of(j)
                assert 0 <= j - index.group_starts[g] < index.group_sizes[g]
                extent = (index.group_starts[g], index.group_sizes[g])
                assert seen.setdefault(index.group_keys[g], extent) == extent


@settings(max_examples=100, deadline=None)
@given(
    ids=st.lists(st.integers(0, 3), min_size=1, max_size=6),
    segment_tokens=st.sampled_from([4, 6, 8, 16]),
    clip=st.integers(0, 15),
    block_size=st.sampled_from([1, 2, 3, 4, 8]),
)
def test_uniform_segments_are_indexed_as_any_segments_are(ids, segment_tokens, clip, block_size):
    """A trace's prompt (``SegmentedPrompt.uniform``, indexed without a loop over its segments where they
    hold whole blocks) has the index of the same segments given one by one."""
    num_tokens = len(ids) * segment_tokens - clip % segment_tokens
    uniform = SegmentedPrompt.uniform(tuple(ids), segment_tokens, num_tokens)
    general = SegmentedPrompt(uniform.segment_ids, uniform.segment_ends, num_tokens)
    a, b = uniform.block_index(block_size), general.block_index(block_size)
    assert (a.num_blocks, a.group_keys, a.group_starts, a.group_sizes) == (
        b.num_blocks,
        b.group_keys,
        b.group_starts,
        b.group_sizes,
    )
    assert a.keys.tolist() == b.keys.tolist() == uniform.block_keys(block_size)


def test_namespaces_keep_two_traces_apart():
    a, b = SegmentedPrompt.uniform((1, 2), 512, 1000), SegmentedPrompt.uniform((1, 2), 512, 1000, namespace=7)
    assert not set(a.block_keys(16)) & set(b.block_keys(16))


def test_a_cache_salt_keys_a_prompts_blocks_apart_from_every_other_salts():
    """vLLM's ``cache_salt``: the same tokens under two salts, or one salt and none, share no block key (nor
    the request log's hash ids); under one salt, as unsalted, they do, in every process (sha256, not hash())."""
    tokens = list(range(40))
    keys = {salt: TokenPrompt(tokens, salted_root_key(salt)).block_keys(8) for salt in (None, "tenant-a", "tenant-b")}
    assert keys[None] == TokenPrompt(tokens).block_keys(8)
    assert keys["tenant-a"] == TokenPrompt(tokens, salted_root_key("tenant-a")).block_keys(8)
    assert all(
        not set(keys[x]) & set(keys[y]) for x, y in [(None, "tenant-a"), (None, "tenant-b"), ("tenant-a", "tenant-b")]
    )
    assert salted_root_key("tenant-a") == -2198100225488869504  # fixed: a router and a replica must agree
    assert segment_hash_ids(tokens, 8, salted_root_key("tenant-a"))[0] != segment_hash_ids(tokens, 8)[0]


# --- the manager ----------------------------------------------------------------------------------
def _admit(kv: PagedKVManager, request: Request) -> int:
    """Admit ``request`` with what the cache holds; its prompt computed and registered. Tokens found."""
    cached = kv.find_cached_prefix(request)
    assert kv.allocate_slots(request, request.num_prompt_tokens, cached)
    kv.cache_blocks(request, request.num_prompt_tokens)
    return len(cached) * kv.block_size


def test_a_second_request_finds_the_first_ones_full_blocks():
    kv = PagedKVManager(20, 4, enable_prefix_caching=True)
    first = _request(0, TokenPrompt(list(range(10))))
    second = _request(1, TokenPrompt(list(range(8)) + [50, 51, 52]))
    assert _admit(kv, first) == 0
    free = kv.num_free_blocks
    assert _admit(kv, second) == 8  # two full blocks shared; the third differs
    assert kv.block_tables[second][:2] == kv.block_tables[first][:2]
    assert kv.num_free_blocks == free - 1  # only its own third block is new
    kv.free(first)  # its two shared blocks stay with the second
    assert all(kv.prefix_cache.ref_counts[b] == 1 for b in kv.block_tables[second][:2])
    kv.check_integrity()


def test_a_lookup_repeated_sees_what_was_registered_or_evicted_since():
    """``match`` remembers its answers only until the cached content changes."""
    kv = PagedKVManager(20, 4, enable_prefix_caching=True)
    waiting = _request(9, TokenPrompt(list(range(13))))
    assert kv.find_cached_prefix(waiting) == []
    first = _request(0, TokenPrompt(list(range(9))))
    _admit(kv, first)  # registers two blocks waiting's prompt starts with
    assert kv.find_cached_prefix(waiting) == kv.block_tables[first][:2]
    assert kv.find_cached_prefix(waiting) == kv.block_tables[first][:2]  # (remembered)
    kv.free(first)
    kv.prefix_cache.evict_to_pool(1)  # the tail first: its second block
    assert kv.find_cached_prefix(waiting) == kv.prefix_cache.evictable.blocks()
    assert len(kv.find_cached_prefix(waiting)) == 1
    kv.check_integrity()


def test_a_prompt_entirely_cached_still_computes_its_last_token():
    kv = PagedKVManager(20, 4, enable_prefix_caching=True)
    _admit(kv, _request(0, TokenPrompt(list(range(8)))))
    assert _admit(kv, _request(1, TokenPrompt(list(range(8))))) == 4  # the last block is computed again


def test_cached_blocks_count_as_free_and_go_least_recently_released_first_tail_first():
    kv = PagedKVManager(6, 2, enable_prefix_caching=True)
    a, b = _request(0, TokenPrompt([1, 2, 3, 4, 5, 6])), _request(1, TokenPrompt([7, 8, 9, 10]))
    _admit(kv, a)
    _admit(kv, b)
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 6 and kv.allocated_tokens == 0
    order = kv.prefix_cache.evictable.blocks()
    assert order == kv_blocks_released(a_blocks=[0, 1, 2], b_blocks=[3, 4])
    c = _request(2, TokenPrompt(list(range(20, 30))))  # 5 blocks: the never-used one, a's 3, b's tail
    _admit(kv, c)
    assert kv.prefix_cache.evictable.blocks() == [3]  # b's head survives
    kv.free(c)
    assert _admit(kv, _request(3, TokenPrompt([7, 8, 0, 0, 0]))) == 2
    kv.check_integrity()


def test_the_index_rebuilt_from_the_cached_blocks_finds_what_it_found_before():
    """The index's places outgrow the pool (a group per new content) and are rebuilt from the cached
    blocks alone: a prompt still cached is found whole, one evicted is not, and a trace's segments
    (groups of several blocks) come back at their places."""
    kv = PagedKVManager(8, 4, enable_prefix_caching=True)
    cache = kv.prefix_cache
    kept = SegmentedPrompt.uniform((1, 2), 8, 16)  # 2 segments of 2 blocks of 4
    request = _request(0, kept)
    _admit(kv, request)
    for rid in range(1, 2200):  # 2 new one-block groups each: > 2 x 8 + 4096 groups
        other = _request(rid, TokenPrompt([rid, rid, rid, rid, 0, 0, 0, 0, 9]))
        _admit(kv, other)
        kv.free(other)
    assert cache.num_places < 1000  # rebuilt once (2 x 2199 places otherwise), then grew again
    assert _admit(kv, _request(5000, SegmentedPrompt.uniform((1, 2, 7), 8, 17))) == 16
    assert _admit(kv, _request(5001, TokenPrompt([2199] * 4 + [0] * 4 + [5]))) == 8
    assert kv.find_cached_prefix(_request(5002, TokenPrompt([5] * 4 + [0] * 4 + [5]))) == []  # long evicted
    kv.check_integrity()


def test_a_rebuilt_index_finds_the_newest_block_of_a_key_computed_twice():
    """Two requests computed the same prompt side by side: the key names the later one's blocks, before
    and after the index is rebuilt (the earlier ones stay cached, found by no one)."""
    kv = PagedKVManager(9, 4, enable_prefix_caching=True)
    later, earlier = _request(0, TokenPrompt(list(range(9)))), _request(1, TokenPrompt(list(range(9))))
    for r in (later, earlier):  # both allocated before either registers: neither finds the other's
        assert kv.allocate_slots(r, r.num_prompt_tokens)
    for r in (earlier, later):  # NOTE: the later-registered blocks have the lower ids
        kv.cache_blocks(r, r.num_prompt_tokens)
    probe = _request(2, TokenPrompt(list(range(13))))
    assert kv.find_cached_prefix(probe) == kv.block_tables[later][:2]
    for rid in range(3, 2200):  # new one-block groups until the index is rebuilt
        other = _request(rid, TokenPrompt([rid] * 4 + [0] * 4 + [9]))
        _admit(kv, other)
        kv.free(other)
    assert kv.prefix_cache.num_places < 1000  # (rebuilt)
    shared = kv.block_tables[later][:2]
    assert kv.find_cached_prefix(probe) == shared
    kv.free(later)
    kv.free(earlier)  # its blocks stay cached too, but are never found again
    assert kv.find_cached_prefix(probe) == shared
    kv.check_integrity()


def kv_blocks_released(a_blocks: list[int], b_blocks: list[int]) -> list[int]:
    """Eviction order of two requests released one after the other: each one's table tail first."""
    return a_blocks[::-1] + b_blocks[::-1]


def test_swap_out_leaves_a_shared_block_with_its_other_user():
    kv = PagedKVManager(20, 4, kv_bytes_per_token=2, num_cpu_blocks=10, enable_prefix_caching=True)
    a, b = _request(0, TokenPrompt(list(range(9)))), _request(1, TokenPrompt(list(range(9))))
    _admit(kv, a)
    _admit(kv, b)
    shared = kv.block_tables[a][:2]
    copies = kv.swap_out(b)
    assert copies is not None and len(copies) == 3  # its whole table is copied, shared blocks too
    assert kv.block_tables[a][:2] == shared and all(kv.prefix_cache.ref_counts[s] == 1 for s in shared)
    assert kv.swap_in(b) is not None
    assert not set(kv.block_tables[b]) & set(kv.block_tables[a])  # back in fresh blocks
    kv.check_integrity()


_OPS = st.lists(
    st.tuples(
        st.sampled_from(["admit", "grow", "free", "swap_out", "swap_in", "evict_all", "free_some", "reset"]),
        st.integers(0, 7),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=_OPS,
    manager=st.sampled_from([PagedKVManager, ExactReservationKVManager]),
    block_size=st.sampled_from([1, 2, 4]),
)
def test_shared_blocks_are_never_freed_under_a_live_user(ops, manager, block_size):
    """Random arrivals, growth, finishes, swaps and evictions of the whole cache over prompts that share prefixes: the
    reference counts always equal the tables holding each block (never negative), no block a table
    holds is free or evictable, and free + used + evictable = capacity (``check_integrity``). Freeing
    several requests frees what ``num_blocks_released`` said (a block they share once, one another
    request holds not at all)."""
    kv = manager(24, block_size, kv_bytes_per_token=1, num_cpu_blocks=16, enable_prefix_caching=True)
    requests = [_request(i, TokenPrompt([0, 1, 2, 3] + [i % 3] * (2 + i))) for i in range(8)]
    swapped: set[Request] = set()
    for op, i in ops:
        r = requests[i]
        held = r in kv.block_tables
        if op == "admit" and not held and r not in swapped:
            cached = kv.find_cached_prefix(r)
            if kv.can_allocate(r, r.num_prompt_tokens, 0, cached):
                assert kv.allocate_slots(r, r.num_prompt_tokens, cached)
                kv.cache_blocks(r, r.num_prompt_tokens)
        elif op == "grow" and held:
            kv.allocate_slots(r, len(kv.block_tables[r]) * block_size + 1)
        elif op == "free":
            kv.free(r)
            swapped.discard(r)
        elif op == "swap_out" and held and kv.swap_out(r) is not None:
            swapped.add(r)
        elif op == "swap_in" and r in swapped and kv.swap_in(r) is not None:
            swapped.discard(r)
        elif op == "free_some":  # what a policy that evicts several requests counts on freeing, exactly
            victims = [q for j, q in enumerate(requests) if (i >> (j % 3)) & 1 and q in kv.block_tables]
            released, free = kv.num_blocks_released(victims), kv.num_free_blocks
            for victim in victims:
                kv.free(victim)
            assert kv.num_free_blocks == free + released
        elif op == "evict_all":
            kv.prefix_cache.evict_to_pool(len(kv.prefix_cache.evictable))  # every cached block nobody uses
        elif op == "reset":
            reset_prefix_cache_and_check(kv, requests)
        kv.check_integrity()
        live = {b for table in kv.block_tables.values() for b in table}
        assert not live & set(kv.gpu.free_ids()) and not live & set(kv.prefix_cache.evictable.blocks())
        assert (kv.prefix_cache.ref_counts >= 0).all()


def _segmented_prompts(uniform: bool) -> list[SegmentedPrompt]:
    """Ten prompts that share prefixes: segments of 4 tokens, or of 1 to 9 (some hold no block's last
    token), some clipped inside their last segment."""
    shapes = [
        (0, 1, 2),
        (0, 1, 3),
        (0, 1, 2, 4),
        (0, 5),
        (0, 1, 2, 4, 6),
        (7,),
        (0, 1, 3, 8),
        (9, 1, 2),
        (0, 1, 2, 4, 6, 10),
    ]
    shapes.append((0,))
    prompts = []
    for i, ids in enumerate(shapes):
        if uniform:
            prompts.append(SegmentedPrompt.uniform(ids, 4, len(ids) * 4 - i % 3))
        else:
            ends = tuple(np.cumsum([1 + (5 * x) % 9 for x in ids]).tolist())
            prompts.append(SegmentedPrompt(ids, ends, max(ends[-1] - i % 2, 1)))
    return prompts


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["admit", "admit", "free", "evict_all"]), st.integers(0, 9), st.integers(1, 40)),
        max_size=50,
    ),
    uniform=st.booleans(),
    rebuild_often=st.booleans(),
)
def test_a_lookup_finds_the_newest_cached_block_of_each_key_up_to_the_first_miss(ops, uniform, rebuild_often):
    """The index (groups, places, lazy cleaning, rebuilds) against a dict of the newest cached block of
    each block key: prompts of segments registered in two chunks, finished and evicted in random order.
    Every prompt finds exactly the dict's blocks up to its first key not there, and ``cached_keys`` (what
    a fleet's router sees) are the dict's keys."""
    from sloserve.kv import prefix_cache

    slack = prefix_cache.INDEX_SLACK
    prefix_cache.INDEX_SLACK = -120 if rebuild_often else slack  # (-120: a rebuild at most admissions)
    try:
        kv = PagedKVManager(16, 2, enable_prefix_caching=True)
        cache = kv.prefix_cache
        prompts = _segmented_prompts(uniform)
        requests = [_request(i, p) for i, p in enumerate(prompts)]
        newest: dict[int, int] = {}  # block key -> the block registered last under it
        key_of: dict[int, int] = {}  # block -> the key it was registered under last
        for op, i, chunk in ops:
            r, index = requests[i], prompts[i].block_index(2)
            if op == "admit" and r not in kv.block_tables:
                cached = kv.find_cached_prefix(r)
                if not kv.allocate_slots(r, r.num_prompt_tokens, cached):
                    continue
                kv.cache_blocks(r, min(chunk, r.num_prompt_tokens))  # (a chunk may end inside a group)
                kv.cache_blocks(r, r.num_prompt_tokens)
                table, keys = kv.block_tables[r], index.keys.tolist()
                for j in range(len(cached), min(r.num_prompt_tokens // 2, index.num_blocks)):
                    newest[keys[j]], key_of[table[j]] = table[j], keys[j]
            elif op == "free":
                kv.free(r)
            elif op == "evict_all":
                cache.evict_to_pool(len(cache.evictable))
            newest = {
                k: b for k, b in newest.items() if key_of[b] == k and cache.place_of[b] != prefix_cache.NOT_CACHED
            }
            kv.check_integrity()
            for prompt in prompts:
                index = prompt.block_index(2)
                keys = index.keys.tolist()
                expected = []
                for key in keys:
                    if key not in newest:
                        break
                    expected.append(newest[key])
                assert cache.match(index, index.num_blocks) == expected
            assert cache.cached_keys().tolist() == sorted(newest)
    finally:
        prefix_cache.INDEX_SLACK = slack


# --- schedulers -------------------------------------------------------------------------------
def _shared_prefix_requests(n: int = 30) -> list[Request]:
    """A system prompt of three 512-token segments shared by all, a fourth segment shared by a third
    of them, then each its own; every other request best-effort."""
    requests = []
    for i in range(n):
        prompt = 1600 + 37 * (i % 7)
        blocks = SegmentedPrompt.uniform((0, 1, 2, 100 + i % 3, 200 + i), 512, prompt)
        cls = RequestClass.BE if i % 2 else RequestClass.RT
        requests.append(Request(i, 0.02 * i, prompt, 20 + i % 5, 40, cls, prompt_blocks=blocks))
    return requests


def _scheduler(name: str, capacity: int, enable_prefix_caching: bool):
    from sloserve.sched import make_scheduler

    return make_scheduler(
        name,
        kv_capacity_tokens=capacity,
        max_model_len=4096,
        kv_bytes_per_token=524288,
        cost_model=llama7b_cost(),
        enable_prefix_caching=enable_prefix_caching,
    )


@pytest.mark.parametrize(
    "name",
    [
        "vllm",
        "sarathi",
        "infermax",
        "vllm_ef",
        "bros",
        "bros_nobicache",
        "rr",
        "econoserve",
        "econoserve-d",
        "synccoupled",
        "srtf",
        "fastserve",
        "multires",
        "rank_i",
    ],
)
def test_schedulers_skip_cached_prompts_and_keep_their_invariants(name):
    """Under memory pressure (preemptions), with and without caching: every request finishes, the
    KV invariants hold every step (the driver checks), and caching computes fewer prompt tokens."""
    computed = {}
    for caching in (False, True):
        requests = _shared_prefix_requests()
        driver = Driver(_scheduler(name, 6000, caching), executor=SimExecutor(llama7b_cost()))
        driver.run(requests)
        assert all(r.is_finished for r in requests)
        computed[caching] = sum(c for step in driver.log for _, c in step.chunks)
        found = sum(r.num_cached_tokens for r in requests)
        assert (found > 0) == caching
    assert computed[True] < computed[False]


def test_hit_rate_with_an_unlimited_cache_is_the_traces_own_bound():
    """Mooncake's conversation trace: with a cache that never evicts, the tokens found equal what the
    hash_ids alone allow: every full 16-token block whose segments up to its end appeared, at the
    same offset, in an earlier prompt (at least one token of each prompt left to compute)."""
    from sloserve.workload import workload_from_trace

    workload = workload_from_trace("mooncake-conv", num_requests=400, seed=1, context_len=8192, trace_arrivals=True)
    requests = workload.requests
    seen: set[tuple[tuple[int, ...], int]] = set()
    bound = 0
    for r in requests:  # arrival order
        ids, n = r.prompt_blocks.segment_ids, r.num_prompt_tokens
        contents = [(ids[: -(-(start + 16) // 512)], start) for start in range(0, n - 15, 16)]
        hits = 0
        for content in contents[: (n - 1) // 16]:
            if content not in seen:
                break
            hits += 1
        bound += hits * 16
        seen.update(contents)
    prompt_tokens = sum(r.num_prompt_tokens for r in requests)
    assert bound / prompt_tokens > 0.1  # the trace does share (15% of these clipped prompts)

    def factory():
        from sloserve.sched import make_scheduler

        return make_scheduler(
            "vllm",
            kv_capacity_tokens=2**24,
            max_model_len=8192,
            enable_prefix_caching=True,
            options={"max_num_seqs": 4096},
        )

    result = simulate(requests, factory, llama7b_cost())
    assert all(r.is_finished for r in result.requests)
    assert sum(r.num_cached_tokens for r in result.requests) == bound


def test_prefix_caching_needs_a_policy_that_looks_the_cache_up(monkeypatch):
    """Every bundled policy looks the cache up; one registered without it is refused with caching."""
    from sloserve.sched import registry, scheduler_names, supports_prefix_caching
    from sloserve.sched.srtf import SrtfScheduler

    assert all(supports_prefix_caching(name) for name in scheduler_names())

    class Blind(SrtfScheduler):
        supports_prefix_caching = False

    spec = registry.get_spec("srtf")
    monkeypatch.setitem(registry.SCHEDULERS, "blind", dataclasses.replace(spec, name="blind", scheduler_cls=Blind))
    assert _scheduler("blind", 6000, False).name == "blind"
    with pytest.raises(ConfigError, match="scheduler blind does not support prefix caching"):
        _scheduler("blind", 6000, True)


def test_longest_prefix_match_admits_the_request_that_finds_most_first():
    """SGLang's lpm: of two waiting requests of which one fits, the later one whose prompt is cached
    goes first; FCFS admits the earlier one."""
    from sloserve.sched import make_scheduler

    admitted = {}
    for order in ("fcfs", "lpm"):
        sched = make_scheduler(
            "vllm",
            kv_capacity_tokens=80,  # 20 blocks of 4: the first request holds 11 after its first step
            max_model_len=64,
            enable_prefix_caching=True,
            options={"block_size": 4, "waiting_order": order, "watermark": 0, "max_num_seqs": 8},
        )
        shared = list(range(40))
        first = Request(0, 0.0, 40, 30, 30, prompt_blocks=TokenPrompt(shared))
        sched.add_request(first)
        driver = Driver(sched, executor=SimExecutor(llama7b_cost()))
        driver.step()  # the first request computes the shared prompt and keeps decoding
        other = Request(1, 0.0, 48, 2, 2, prompt_blocks=TokenPrompt(list(range(100, 148))))
        hitting = Request(2, 0.0, 48, 2, 2, prompt_blocks=TokenPrompt([*shared, 7, 7, 7, 7, 7, 7, 7, 7]))
        sched.add_request(other)
        sched.add_request(hitting)
        out = driver.step()
        admitted[order] = [r.request_id for r, _ in out.chunks]
    assert admitted == {"fcfs": [], "lpm": [2]}


def test_segment_ids_become_the_same_tokens_wherever_they_appear():
    """A trace's prefix structure as token ids (an engine or a server replaying it): prompts share
    exactly the full blocks their ids say, so caching by tokens finds what caching by ids finds."""
    a = SegmentedPrompt.uniform((5, 6, 7), 32, 80)
    b = SegmentedPrompt.uniform((5, 6, 9), 32, 90)
    c = SegmentedPrompt.uniform((5, 6), 32, 50, namespace=3)
    ta, tb, tc = a.token_ids(1000), b.token_ids(1000), c.token_ids(1000)
    assert len(ta) == 80 and len(tb) == 90 and ta[:64] == tb[:64] and ta[64:] != tb[64:80]
    assert tc[:32] != ta[:32]  # another trace's ids
    for block_size in (4, 16):
        by_tokens = [TokenPrompt(t).block_keys(block_size) for t in (ta, tb)]
        by_ids = [p.block_keys(block_size) for p in (a, b)]
        shared_tokens = sum(x == y for x, y in zip(*by_tokens))
        shared_ids = sum(x == y for x, y in zip(*by_ids))
        assert shared_tokens == shared_ids == 64 // block_size
