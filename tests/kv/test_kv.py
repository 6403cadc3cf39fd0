"""KV cache managers: physical slots, all-or-nothing allocation, invariants under random operations."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import Driver, make_requests, scheduler
from sloserve.core.errors import ConfigError
from sloserve.core.request import Request, RequestStatus
from sloserve.kv import ExactReservationKVManager, MaxAllocationKVManager, PagedKVManager


def req(i: int, prompt: int = 10, max_tokens: int = 20) -> Request:
    return Request(
        request_id=i, arrival_time=0.0, num_prompt_tokens=prompt, true_output_tokens=1, max_tokens=max_tokens
    )


def test_paged_slots_are_block_offsets():
    kv = PagedKVManager(num_blocks=8, block_size=4)
    a, b = req(0), req(1)
    assert kv.allocate_slots(a, 6) and kv.allocate_slots(b, 3)
    assert kv.block_tables[a] == [0, 1] and kv.block_tables[b] == [2]
    assert kv.slot_ids(a, 0, 6) == [0, 1, 2, 3, 4, 5]
    assert kv.slot_ids(b, 0, 3) == [8, 9, 10]
    assert kv.num_slots(a) == 8 and kv.allocated_tokens == 12
    with pytest.raises(IndexError):
        kv.slot_ids(b, 0, 5)


def test_allocation_is_all_or_nothing():
    kv = PagedKVManager(num_blocks=4, block_size=4)
    a, b = req(0), req(1)
    assert kv.allocate_slots(a, 12)
    assert not kv.allocate_slots(b, 8)  # needs 2 blocks, 1 free
    assert b not in kv.block_tables and kv.num_free_blocks == 1 and kv.num_allocation_failures == 1
    kv.check_integrity()


def test_max_and_exact_reservations():
    kv = MaxAllocationKVManager(num_blocks=100, block_size=4)
    a = req(0, prompt=10, max_tokens=20)
    assert kv.allocate_slots(a, 10)
    assert kv.num_slots(a) == 32  # ceil((10 + 20) / 4) blocks, taken at once
    assert kv.blocks_needed(a, 29) == 0
    ex = ExactReservationKVManager(num_blocks=100, block_size=4)
    b = req(1)
    ex.set_reservation(b, 17)
    assert ex.allocate_slots(b, 10) and ex.num_slots(b) == 20
    assert ex.allocate_slots(b, 21) and ex.num_slots(b) == 24  # paged growth past the reservation
    ex.free(b)
    assert ex.num_free_blocks == 100


def test_swap_round_trip_keeps_the_block_count():
    kv = PagedKVManager(num_blocks=6, block_size=4, kv_bytes_per_token=10, num_cpu_blocks=3)
    a = req(0)
    assert kv.allocate_slots(a, 10)
    out = kv.swap_out(a)
    assert out is not None and len(out) == 3 and kv.num_free_blocks == 6
    assert kv.swapped_bytes == 3 * 4 * 10
    back = kv.swap_in(a)
    assert back is not None and [c.src_block for c in back] == [c.dst_block for c in out]
    assert kv.num_slots(a) == 12 and kv.cpu.num_free == 3
    b = req(1)
    assert kv.allocate_slots(b, 24 - 12)
    assert kv.swap_out(a) is not None and kv.swap_out(b) is None  # CPU space holds one of them
    kv.check_integrity()


def test_capacity_below_one_block_is_an_error():
    with pytest.raises(ConfigError, match="at least one block"):
        PagedKVManager(num_blocks=0, block_size=16)


OPS = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "free", "swap_out", "swap_in", "reserve", "settle"]),
        st.integers(0, 5),
        st.integers(1, 40),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=OPS,
    manager=st.sampled_from([PagedKVManager, MaxAllocationKVManager, ExactReservationKVManager]),
    block_size=st.sampled_from([1, 4, 16]),
)
def test_manager_invariants_under_random_operations(ops, manager, block_size):
    kv = manager(num_blocks=12, block_size=block_size, kv_bytes_per_token=2, num_cpu_blocks=6)
    requests = [req(i, prompt=5, max_tokens=10) for i in range(6)]
    owed: dict[Request, int] = {}
    for op, i, n in ops:
        r = requests[i]
        before = (kv.num_free_blocks, dict((k, list(v)) for k, v in kv.block_tables.items()))
        if op == "alloc" and r not in kv.cpu_tables:
            if isinstance(kv, ExactReservationKVManager):
                kv.set_reservation(r, n)
            ok = kv.allocate_slots(r, n)
            if ok:
                assert kv.num_slots(r) >= n
            else:  # all or nothing
                assert (kv.num_free_blocks, kv.block_tables) == before
        elif op == "free":
            if r in kv.block_tables:
                kv.settle_blocks(r, owed.pop(r, 0))
            kv.free(r)
            assert r not in kv.block_tables and r not in kv.cpu_tables
        elif op == "swap_out" and r in kv.block_tables:
            kv.settle_blocks(r, owed.pop(r, 0))
            held = len(kv.block_tables[r])
            copies = kv.swap_out(r)
            assert copies is None or len(copies) == held
        elif op == "swap_in" and r in kv.cpu_tables:
            kv.swap_in(r)
        elif op == "reserve" and r in kv.block_tables:
            if kv.reserve_blocks(n % 3):
                owed[r] = owed.get(r, 0) + n % 3
        elif op == "settle" and r in owed:
            kv.settle_blocks(r, owed.pop(r))
        kv.check_integrity()
        assert kv.num_free_blocks + kv.gpu.num_used + sum(owed.values()) == kv.gpu.num_blocks
        # Slot ids of different requests never collide.
        slots = [s for rr, t in kv.block_tables.items() for s in kv.slot_ids(rr, 0, len(t) * block_size)]
        assert len(slots) == len(set(slots))
        # The batch slot table (the engine's decodes and, one row at a time, its prefills) agrees with
        # each request's slot ids, for partial blocks too.
        held = [rr for rr, t in kv.block_tables.items() if t]
        if held:
            lengths = np.array([max(1, kv.num_slots(rr) - rr.request_id % block_size) for rr in held])
            table = kv.slot_tables(held, lengths)
            assert table.shape == (len(held), lengths.max())
            # Its compact form, the block ids the engine sends for decodes, follows every change to a
            # block table (the manager keeps them as arrays between calls).
            block_ids = kv.block_id_tables(held, lengths)
            for row, (rr, length) in enumerate(zip(held, lengths)):
                assert table[row, :length].tolist() == kv.slot_ids(rr, 0, length) == kv.slot_table(rr, length).tolist()
                num_blocks = -(-length // block_size)
                assert block_ids[row, :num_blocks].tolist() == kv.block_tables[rr][:num_blocks]


LENGTHS = st.lists(st.tuples(st.integers(1, 120), st.integers(1, 80)), min_size=1, max_size=14)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=LENGTHS,
    name=st.sampled_from(["vllm", "sarathi"]),
    mode=st.sampled_from(["recompute", "swap"]),
    block_size=st.sampled_from([1, 4, 16]),
    gaps=st.lists(st.floats(0, 0.2), min_size=14, max_size=14),
)
def test_schedulers_keep_kv_invariants_under_pressure(lengths, name, mode, block_size, gaps):
    """Random workloads in a KV cache barely larger than the longest request: every step keeps the
    queue/KV invariants (Driver calls check_integrity) and every request finishes with its length."""
    arrivals = [sum(gaps[: i + 1]) for i in range(len(lengths))]
    reqs = make_requests(lengths, arrivals)
    capacity = max(p + o for p, o in lengths) + 2 * block_size
    capacity = -(-capacity // block_size) * block_size
    sched = scheduler(
        name,
        capacity,
        max_model_len=256,
        block_size=block_size,
        watermark=0,
        preemption_mode=mode,
        swap_space_tokens=capacity,
    )
    Driver(sched).run(reqs)
    for r in reqs:
        assert r.status is RequestStatus.FINISHED and r.num_output_tokens == r.true_output_tokens
    assert sched.kv.num_free_blocks == sched.kv.gpu.num_blocks
