"""Prefix caching for models with state layers (kv/cached_states.py): the books of saved states under random
admissions, steps and departures, and a prefix found only up to a block that ends at saved states."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sloserve.core.prefix import TokenPrompt
from sloserve.core.request import Request
from sloserve.kv.cached_states import CachedStates
from sloserve.kv.manager import PagedKVManager

OPS = st.lists(
    st.tuples(st.sampled_from(["reserve", "compute", "release", "step", "use"]), st.integers(0, 5), st.integers(0, 7)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(num_entries=st.integers(1, 4), ops=OPS)
def test_every_entry_is_free_saved_or_being_written_once(num_entries, ops):
    """Whatever the order of reservations, computed chunks, departures and steps: no entry is lost or held twice; a
    state is findable only once the step that wrote it ended (or its owner left having computed its point), and an
    entry a save took in this step stays findable until the step ends (its states are written after the loads)."""
    states = CachedStates(num_entries)
    owners = [Request(i, 0.0, 64, 4, 4) for i in range(6)]
    written_this_step: set[int] = set()
    for op, who, key in ops:
        owner = owners[who]
        if op == "reserve":
            before = dict(states.entry_of)
            states.reserve(owner, key, 16)
            taken = set(before) - set(states.entry_of)
            assert taken <= set(states.evicted) and len(taken) <= 1  # (at most the least recently used one)
            if taken:
                assert next(iter(before)) in taken
        elif op == "compute":
            owner.add_computed(16)
            if owner in states.pending:
                written_this_step.add(states.pending[owner][0])
        elif op == "release":
            held = states.pending.get(owner)
            states.release(owner)
            if held is not None and owner.num_computed_tokens >= held[1]:
                assert states.entry_of[held[0]] == held[2]
            elif held is not None:  # (its point never computed: nothing saved)
                assert held[0] not in states.entry_of and held[2] not in states.entry_of.values()
            owner.reset_computed()
        elif op == "step":
            states.end_step()
            assert not states.evicted and not states.loads
            written_this_step.clear()
        elif states.longest([key], 1):
            states.use(owner, key)
            assert states.loads[owner] in (states.entry_of.get(key), states.evicted.get(key))
        # a state is findable only where it was written by a step that ended, or by an owner that left
        for found in states.entry_of:
            assert found not in {k for k, _, _ in states.pending.values()}
        states.check()


def test_a_prefix_is_found_up_to_the_block_that_ends_at_saved_states():
    """A prompt of 40 tokens (blocks of 4) saves its states at 36 (its last full block before its last token): a
    longer prompt that resends it finds its 9 blocks once the step that computed them ended, not before, and none
    once the states were evicted for another prompt's (one entry), though its KV blocks are still cached."""
    kv = PagedKVManager(64, 4, enable_prefix_caching=True)
    kv.max_requests, kv.cached_states = 4, CachedStates(1)
    first = Request(0, 0.0, 40, 4, 4, prompt_blocks=TokenPrompt(list(range(40))))
    assert kv.allocate_slots(first, 40)
    kv.cache_blocks(first, 40)
    assert kv.cached_states.pending[first][1:] == (36, 0)
    resent = Request(1, 0.0, 50, 4, 4, prompt_blocks=TokenPrompt([*range(40), *range(100, 110)]))
    assert kv.find_cached_prefix(resent) == []  # (its KV blocks registered; its states not written yet)
    first.add_computed(40)
    kv.cached_states.end_step()
    assert len(kv.find_cached_prefix(resent)) == 9
    other = Request(2, 0.0, 20, 4, 4, prompt_blocks=TokenPrompt(list(range(200, 220))))
    assert kv.allocate_slots(other, 20)
    other.add_computed(20)
    kv.cached_states.end_step()
    assert (
        len(kv.find_cached_prefix(resent)) == 0
        and len(kv.prefix_cache.match(resent.prompt_blocks.block_index(4), 12)) == 10
    )
    kv.check_integrity()


def test_a_reset_prefix_cache_forgets_the_saved_states_with_the_blocks():
    """vLLM's reset_prefix_cache on a model with state layers: refused while the prompt that saves states holds
    its blocks; once it left, its blocks and its states are forgotten, every entry free for new saves."""
    kv = PagedKVManager(64, 4, enable_prefix_caching=True)
    kv.max_requests, kv.cached_states = 4, CachedStates(2)
    first = Request(0, 0.0, 40, 4, 4, prompt_blocks=TokenPrompt(list(range(40))))
    assert kv.allocate_slots(first, 40)
    kv.cache_blocks(first, 40)
    first.add_computed(40)
    kv.cached_states.end_step()
    resent = Request(1, 0.0, 50, 4, 4, prompt_blocks=TokenPrompt([*range(40), *range(100, 110)]))
    assert not kv.reset_prefix_cache() and len(kv.find_cached_prefix(resent)) == 9
    kv.free(first)
    assert len(kv.find_cached_prefix(resent)) == 9  # (cached, nobody's)
    assert kv.reset_prefix_cache()
    assert kv.find_cached_prefix(resent) == [] and not kv.cached_states.entry_of
    assert kv.allocate_slots(resent, 50)
    kv.cache_blocks(resent, 50)
    assert kv.cached_states.pending[resent][1:] == (48, 0)  # the forgotten states' entry, free again
    kv.check_integrity()


def test_the_least_recently_used_saved_states_are_evicted_first():
    """Two entries: the states of key 1 then key 2 saved; a request starting from key 1 makes key 2 the least
    recently used, so a third save takes key 2's entry; key 2 stays findable until the step ends."""
    states = CachedStates(2)
    owners = [Request(i, 0.0, 64, 4, 4) for i in range(4)]
    for owner, key in zip(owners, (1, 2), strict=False):
        states.reserve(owner, key, 16)
        owner.add_computed(16)
        states.end_step()
    assert list(states.entry_of) == [1, 2] and states.num_saved == 2
    states.use(owners[3], 1)
    states.reserve(owners[2], 3, 16)
    assert list(states.entry_of) == [1] and states.evicted == {2: 1} and states.longest([2], 1) == 1
    states.end_step()
    assert states.longest([2], 1) == 0 and states.pending[owners[2]] == (3, 16, 1)
