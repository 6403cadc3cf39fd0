"""The decode cohort's tick clock: token runs of leaving members against a brute-force reference."""

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sloserve.sched.lockstep import TickTimes

# Runs of step durations: up to 64 steps are handed over as a list (single steps, short stretches),
# longer ones as an array (long stretches), as the executor does; each run's durations are drawn
# from its seed, some rising (KV grows along a stretch) and some not.
runs = st.lists(
    st.tuples(st.one_of(st.integers(1, 64), st.integers(65, 300)), st.integers(0, 2**31), st.booleans()),
    min_size=1,
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(runs=runs, queries=st.lists(st.integers(0, 10**6), min_size=1, max_size=20))
def test_tick_times_give_each_run_its_ends_and_largest_gap(runs, queries):
    times, ends = TickTimes(), []
    clock = 0.0
    for length, seed, rising in runs:
        durations = np.random.default_rng(seed).uniform(1e-3, 0.1, length)
        if rising:
            durations.sort()
        new = []
        for d in durations.tolist():
            clock += d
            new.append(clock)
        ends.extend(new)
        times.extend(np.array(new) if length > 64 else new)
        assert len(times) == len(ends)
        for q in queries:
            first = 1 + q % len(ends)  # a member that joined after tick first - 1
            start, last, gap = times.run(first)
            assert start == ends[first - 1] and last == ends[-1]
            gaps = [b - a for a, b in zip(ends[first - 1 :], ends[first:])]
            assert (math.isnan(gap) and not gaps) or gap == max(gaps)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "advance", "remove"]), st.integers(1, 5000)), max_size=60))
def test_cohort_knows_its_longest_member(ops):
    """``max_kv_tokens`` is the longest member's num_computed_tokens after any joins, ticks and leaves
    (the simulator prices decode attention by it)."""
    from sloserve.core.request import Request
    from sloserve.sched.lockstep import Cohort

    cohort, now, made = Cohort(), 0.0, 0
    for op, n in ops:
        if op == "add":
            request = Request(made, 0.0, n, 10**6, 10**6)
            request.add_computed(n)
            request.add_output_token(now)  # the prompt's token: from here on one token per tick
            cohort.add(request)
            made += 1
        elif op == "advance":
            ends = [now + 0.01 * (k + 1) for k in range(n % 7 + 1)]
            cohort.advance(ends)
            now = ends[-1]
        elif cohort.members:
            cohort.remove(list(cohort.members)[n % len(cohort.members)])
        expected = max((r.num_computed_tokens for r in cohort.members), default=0)
        assert cohort.max_kv_tokens == expected
        cohort.check_integrity()


@settings(max_examples=80, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 11), st.integers(0, 2), st.booleans(), st.booleans()),
        max_size=40,
    )
)
def test_settle_all_leaves_no_member_owing_a_block(steps):
    """The engine's ``settle_all`` settles only the residue classes grown since its last call; after any
    mix of joins, single ticks, stretches (growth reserved ahead) and leaves, no member owes a block."""
    from sloserve.core.request import Request
    from sloserve.kv import PagedKVManager
    from sloserve.sched.decode_cohort import DecodeCohort

    kv = PagedKVManager(4096, 4)
    cohort, now, made = DecodeCohort(kv), 0.0, 0
    for joins, ticks, leaves, drop_kv, settle in steps:
        assert cohort.try_grow(cohort.ticks + 1)  # a step's growth, then its joins (as the scheduler does)
        for _ in range(joins):
            n = 1 + (made * 7) % 13
            request = Request(made, 0.0, n, 10**6, 10**6)
            request.add_computed(n)
            request.add_output_token(now)
            assert kv.allocate_slots(request, n + 1)
            cohort.add(request)
            made += 1
        cohort.grow_through(cohort.ticks + ticks)
        ends = [now + 0.01 * (k + 1) for k in range(ticks)]
        cohort.advance(ends)
        now = ends[-1]
        for request in list(cohort.members)[:leaves]:
            cohort.remove(request, drop_kv=drop_kv)
            kv.free(request)
        if settle:
            cohort.settle_all()
            assert all(cohort.granted_slots(r) == kv.num_slots(r) for r in cohort.members)
        cohort.check_integrity()
