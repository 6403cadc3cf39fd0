"""EconoServe §3.2 KV-cache pipelining: nested regions at physical slots (Figure 7), the buffer b,
eviction of an under-predicted hosted GT to CPU memory and its restore, and invariants under random
operation sequences."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import reset_prefix_cache_and_check
from sloserve.core.prefix import TokenPrompt
from sloserve.core.request import Request
from sloserve.kv.pipelined import CHECKPOINTED, PipelinedKVManager


def _req(i: int, prompt: int = 4) -> Request:
    return Request(i, 0.0, prompt, 64, 64)


def _context_table(kv: PipelinedKVManager, request: Request) -> list[int]:
    """The engine's context table of ``request`` (``block_id_tables``; one slot per token here)."""
    return kv.block_id_tables([request], np.array([len(kv.token_slots[request])]))[0].tolist()


def _gt(kv: PipelinedKVManager, request: Request) -> None:
    """Allocate the request's prompt (its PT part) from its own blocks."""
    assert kv.allocate_slots(request, request.num_prompt_tokens)


def test_figure_7a_host_lends_its_second_half():
    """r1 (RL 32) gets 32 slots; r2 (RL 16) gets the 16 slots from the middle of r1's allocation;
    both run; r2 finishes exactly when r1 reaches the middle, and r1 then writes there."""
    kv = PipelinedKVManager(num_blocks=8, block_size=16)
    r1, r2 = _req(1), _req(2)
    for r in (r1, r2):
        _gt(kv, r)
    assert kv.reserve_region(r1, 32)
    region = kv.regions[r1].slots
    assert kv.lend_limit(r1) == 16
    assert kv.lend(r1, r2, 16)
    assert kv.regions[r2].slots == region[16:32]  # physically inside r1's allocation
    for step in range(1, 17):  # both generate 16 tokens side by side
        assert kv.allocate_slots(r1, 4 + step) and kv.allocate_slots(r2, 4 + step)
        kv.check_integrity()
    assert kv.slot_ids(r1, 4, 20) == region[:16]
    assert kv.slot_ids(r2, 4, 20) == region[16:32]
    # r1's next token needs offset 16: r2 is in the way until it finishes.
    assert kv.hosted_in_the_way(r1) is r2 and not kv.allocate_slots(r1, 21)
    blocks_before = kv.num_free_blocks
    kv.free(r2)
    assert kv.num_free_blocks == blocks_before + 1  # r2's prompt block only: its region was r1's
    assert kv.allocate_slots(r1, 36)
    assert kv.slot_ids(r1, 20, 36) == region[16:32]
    kv.check_integrity()


def test_figure_7b_recursive_nesting():
    """r1 hosts r2 in [16, 32) and r3 in [8, 16); r2 hosts r4 in its second half, [24, 32) of r1."""
    kv = PipelinedKVManager(num_blocks=8, block_size=16)
    r1, r2, r3, r4 = (_req(i) for i in range(1, 5))
    for r in (r1, r2, r3, r4):
        _gt(kv, r)
    assert kv.reserve_region(r1, 32)
    region = kv.regions[r1].slots
    assert kv.lend(r1, r2, 16)
    assert kv.lend_limit(r1) == 8 and kv.lend(r1, r3, 8)
    assert kv.lend_limit(r2) == 8 and kv.lend(r2, r4, 8)
    assert kv.regions[r3].slots == region[8:16]
    assert kv.regions[r4].slots == region[24:32]
    # Levels continue: r1 could host RL 4 in [4, 8), r3 RL 4 in [12, 16), ... (m * 2^k GTs per level)
    assert kv.lend_limit(r1) == 4 and kv.lend_limit(r3) == 4 and kv.lend_limit(r4) == 4
    for step in range(1, 9):
        for r in (r1, r2, r3, r4):
            assert kv.allocate_slots(r, 4 + step)
    kv.check_integrity()
    # All four write 8 tokens: r3 and r4 are done exactly when r1 and r2 reach their first slots.
    assert kv.hosted_in_the_way(r1) is r3 and kv.hosted_in_the_way(r2) is r4
    assert {s for r in (r1, r2, r3, r4) for s in kv.slot_ids(r, 4, 12)} == set(region)


def test_buffer_b_keeps_hosted_gts_clear_of_the_host():
    """With b = 2 a host of RL 32 hosts at most RL 14; a host that started generating lends nothing."""
    kv = PipelinedKVManager(num_blocks=8, block_size=16, buffer_tokens=2)
    host, late, hosted = _req(1), _req(2), _req(3)
    for r in (host, late, hosted):
        _gt(kv, r)
    assert kv.reserve_region(host, 32)
    assert kv.lend_limit(host) == 14
    assert not kv.lend(host, hosted, 15)
    assert kv.reserve_region(late, 32) and kv.allocate_slots(late, 4 + 5)  # late started generating
    assert kv.regions[late].used == 32 and kv.lend_limit(late) < 1  # granted its whole region: nothing to lend
    assert kv.lend(host, hosted, 14)


def test_under_predicted_hosted_gt_is_evicted_to_cpu_and_restored():
    kv = PipelinedKVManager(num_blocks=8, block_size=16, kv_bytes_per_token=100)
    host, hosted = _req(1), _req(2)
    for r in (host, hosted):
        _gt(kv, r)
    assert kv.reserve_region(host, 32) and kv.lend(host, hosted, 16)
    lent = kv.regions[hosted].slots
    for step in range(1, 17):
        assert kv.allocate_slots(host, 4 + step) and kv.allocate_slots(hosted, 4 + step)
    kv.take_copies()
    # The hosted GT was under-predicted: it has not finished when the host needs offset 16.
    assert kv.hosted_in_the_way(host) is hosted
    assert _context_table(kv, hosted) == kv.token_slots[hosted]
    kv.evict(hosted, 20)
    with pytest.raises(IndexError, match="not all on the GPU"):  # the engine never reads it now
        _context_table(kv, hosted)
    copies = kv.take_copies()
    assert [c.src_slot for c in copies] == lent and all(c.to_cpu for c in copies)
    assert kv.token_slots[hosted][4:] == [CHECKPOINTED] * 16 and kv.num_slots(hosted) == 4
    assert kv.swapped_bytes == 16 * 100
    assert kv.allocate_slots(host, 21)  # the host goes on in its own slots
    kv.check_integrity()
    assert kv.restore(hosted)
    back = kv.take_copies()
    assert [c.src_slot for c in back] == [c.dst_slot for c in copies] and not any(c.to_cpu for c in back)
    assert [c.dst_slot for c in back] == kv.slot_ids(hosted, 4, 20)
    assert _context_table(kv, hosted) == kv.token_slots[hosted]  # the restored slots, not the lent ones
    assert kv.allocate_slots(hosted, 21)  # resumes in its own blocks
    assert _context_table(kv, hosted) == kv.token_slots[hosted]
    kv.check_integrity()


def test_a_host_that_finishes_first_keeps_its_region_until_hosted_gts_finish():
    kv = PipelinedKVManager(num_blocks=4, block_size=16)
    host, hosted = _req(1), _req(2)
    for r in (host, hosted):
        _gt(kv, r)
    assert kv.reserve_region(host, 32) and kv.lend(host, hosted, 16)
    free = kv.num_free_blocks
    kv.free(host)  # over-predicted host: done early
    assert kv.num_free_blocks == free + 1  # its prompt block; the region still holds hosted's slots
    assert kv.allocate_slots(hosted, 10)
    kv.check_integrity()
    kv.free(hosted)
    assert kv.num_free_blocks == kv.gpu.num_blocks
    kv.check_integrity()


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(
                ["reserve", "lend", "lend", "lend", "grow", "grow", "grow", "free", "evict", "restore", "trim", "reset"]
            ),
            st.integers(0, 5),
            st.integers(0, 5),
            st.integers(1, 40),
        ),
        min_size=20,
        max_size=80,
    ),
    st.booleans(),
)
def test_random_operations_keep_every_slot_owned_once(ops, caching):
    """With prefix caching too: prompts of 19 tokens, every other one starting with the same 16 (two
    blocks), so hosted regions, evictions and restores run beside shared prompt blocks."""
    kv = PipelinedKVManager(num_blocks=16, block_size=8, buffer_tokens=1, enable_prefix_caching=caching)
    reqs = [_req(i, prompt=19) for i in range(6)]
    for i, r in enumerate(reqs):
        r.prompt_blocks = TokenPrompt([*range(16 * (i % 2) + 1, 16 * (i % 2) + 17), 100 + i, 100 + i, 100 + i])
    live = set()

    def admit(r: Request) -> None:  # its prompt, starting with the cached blocks of it
        cached = kv.find_cached_prefix(r)
        if kv.allocate_slots(r, 19, cached):
            kv.cache_blocks(r, 19)
            live.add(r)

    for op, a, b, n in ops:
        ra, rb = reqs[a], reqs[b]
        if op == "reserve" and ra not in kv.regions and ra not in kv.cpu_slots:
            if ra not in live:
                admit(ra)
            if ra in live:
                kv.reserve_region(ra, n)
        elif op == "lend" and ra in kv.regions and rb not in kv.regions and ra is not rb:
            if rb not in live:
                admit(rb)
            if rb in live:
                kv.lend(ra, rb, 1 + n % max(1, kv.lend_limit(ra)))
        elif op == "grow" and ra in live and not kv.cpu_slots.get(ra):
            kv.allocate_slots(ra, len(kv.token_slots[ra]) + 1 + n % 4)
        elif op == "free" and ra in live:
            kv.free(ra)
            live.discard(ra)
        elif op == "evict" and ra in kv.regions and kv.regions[ra].parent is not None:
            kv.evict(ra, len(kv.token_slots[ra]))
        elif op == "restore" and ra in live:
            kv.restore(ra)
        elif op == "trim" and ra in live and kv.token_slots.get(ra):
            kv.trim(ra, len(kv.token_slots[ra]) - n % 4)
        elif op == "reset":
            reset_prefix_cache_and_check(kv, reqs)
        kv.check_integrity()
        # The engine's context tables (read every decode step, from arrays the manager keeps
        # between reads) follow every grant, trim, eviction and restore.
        readable = [r for r in live if kv.token_slots.get(r) and not kv.num_checkpointed(r)]
        if readable:
            lengths = np.array([len(kv.token_slots[r]) for r in readable])
            table = kv.block_id_tables(readable, lengths)
            assert [table[i, :n].tolist() for i, n in enumerate(lengths)] == [kv.token_slots[r] for r in readable]
        for r in live:
            if kv.num_checkpointed(r):
                with pytest.raises(IndexError, match="not all on the GPU"):
                    kv.block_id_tables([r], np.array([len(kv.token_slots[r])]))
    for r in list(live):
        kv.free(r)
    kv.check_integrity()
    assert kv.num_free_blocks == kv.gpu.num_blocks


def test_bad_buffer_is_rejected():
    from sloserve.core.errors import ConfigError

    with pytest.raises(ConfigError, match="buffer b must be >= 0"):
        PipelinedKVManager(num_blocks=4, buffer_tokens=-1)
