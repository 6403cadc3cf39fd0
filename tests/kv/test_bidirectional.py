"""BROS §5 bidirectional KV blocks: layout, block preemption, lazy checkpointing, restore."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import reset_prefix_cache_and_check
from sloserve.core.errors import ConfigError
from sloserve.core.outputs import SlotCopy
from sloserve.core.prefix import TokenPrompt
from sloserve.core.request import Request, RequestClass
from sloserve.kv.bidirectional import CHECKPOINTED, BidirectionalKVManager

KVB = 10  # bytes per token


def req(i: int, cls: RequestClass) -> Request:
    return Request(
        request_id=i, arrival_time=0.0, num_prompt_tokens=4, true_output_tokens=1, max_tokens=64, request_class=cls
    )


def test_rt_from_the_left_be_from_the_right_never_share_a_slot():
    kv = BidirectionalKVManager(num_blocks=1, block_size=8, kv_bytes_per_token=KVB)
    rt, be = req(0, RequestClass.RT), req(1, RequestClass.BE)
    assert kv.allocate_slots(be, 3)
    assert kv.allocate_slots(rt, 5)  # the block has 5 empty slots: no checkpointing needed
    assert kv.slot_ids(rt, 0, 5) == [0, 1, 2, 3, 4]
    assert kv.slot_ids(be, 0, 3) == [7, 6, 5]
    assert kv.rt_fill[0] + len(kv.be_tokens[0]) == 8 and kv.checkpointed_bytes == 0
    kv.check_integrity()


def test_rt_preempts_a_be_block_and_checkpoints_exactly_the_overwritten_slots():
    kv = BidirectionalKVManager(num_blocks=1, block_size=8, kv_bytes_per_token=KVB)
    rt, be = req(0, RequestClass.RT), req(1, RequestClass.BE)
    assert kv.allocate_slots(be, 6)  # BE tokens 0..5 at slots 7..2
    assert kv.allocate_slots(rt, 4)  # no free block: RT preempts the BE block; 2 empty + 2 overwritten
    assert kv.token_slots[be] == [7, 6, 5, 4, CHECKPOINTED, CHECKPOINTED]  # its two newest tokens
    assert kv.checkpointed_bytes == 2 * KVB
    assert kv.preemption_table == {0: (rt, be)}
    assert kv.num_checkpointed(be) == 2 and kv.num_slots(be) == 4
    with pytest.raises(IndexError):
        kv.slot_ids(be, 0, 6)
    kv.check_integrity()
    # The RT request finishes; the BE request resumes with all its tokens on the GPU again.
    kv.free(rt)
    assert kv.restore(be) and kv.restored_bytes == 2 * KVB
    assert len(kv.slot_ids(be, 0, 6)) == 6 and kv.preemption_table == {}
    assert kv.allocate_slots(be, 8)  # and keeps growing
    kv.check_integrity()


def test_rt_takes_a_free_block_before_overwriting_the_be_tokens_facing_it():
    """§5.2: RT requests preempt BE slots only "if no GPU blocks are available" (the default); the
    earlier order (``rt_free_block_first=False``) overwrote the BE tokens facing it in its last block first."""
    runs = {}
    for free_block_first in (True, False):
        kv = BidirectionalKVManager(
            num_blocks=3, block_size=8, kv_bytes_per_token=KVB, rt_free_block_first=free_block_first
        )
        rt, be, be2 = req(0, RequestClass.RT), req(1, RequestClass.BE), req(2, RequestClass.BE)
        assert kv.allocate_slots(be, 8)  # block 0 full of BE tokens
        assert kv.allocate_slots(be2, 4)  # block 1: 4 BE tokens, 4 empty
        assert kv.allocate_slots(rt, 8)  # block 2 (free), filled
        # Its last block is full and faces no BE tokens, and no block is free: either order preempts
        # the BE-only block with the most empty slots (block 1); the ninth token fills an empty slot.
        assert kv.allocate_slots(rt, 9)
        assert kv.blocks_of[rt] == [2, 1] and kv.checkpointed_bytes == 0
        # Block 1's 3 other empty slots, then a BE token facing it: the only BE-only block left
        # (block 0) has no empty slot either, so both orders overwrite the facing token.
        assert kv.allocate_slots(rt, 13)
        assert kv.checkpointed_bytes == KVB
        kv.free(be)  # block 0 is free now
        assert kv.allocate_slots(rt, 14)
        kv.check_integrity()
        runs[free_block_first] = kv, rt
    paper, rt = runs[True]
    assert paper.checkpointed_bytes == KVB and paper.blocks_of[rt] == [2, 1, 0]  # took the free block
    facing, rt = runs[False]
    assert facing.checkpointed_bytes == 2 * KVB and facing.blocks_of[rt] == [2, 1]  # overwrote be2 again


def test_protected_requests_are_not_overwritten_and_be_never_overwrites_rt():
    kv = BidirectionalKVManager(num_blocks=1, block_size=8, kv_bytes_per_token=KVB)
    rt, be, be2 = req(0, RequestClass.RT), req(1, RequestClass.BE), req(2, RequestClass.BE)
    assert kv.allocate_slots(be, 8)
    assert not kv.allocate_slots(rt, 1, protect=[be])  # be runs this step: its slots are off limits
    assert kv.num_allocation_failures == 1 and rt not in kv.token_slots
    assert kv.allocate_slots(rt, 8)  # everything of be overwritten
    assert kv.num_checkpointed(be) == 8 and kv.be_owner[0] is None
    assert not kv.allocate_slots(be2, 1)  # a full RT block: BE may not overwrite RT
    kv.check_integrity()


def test_block_size_must_leave_two_slots_per_side():
    with pytest.raises(ConfigError, match="at least 2 slots per side: block_size 3 < 4"):
        BidirectionalKVManager(num_blocks=4, block_size=3)


OPS = st.lists(
    st.tuples(
        st.sampled_from(["admit", "grow", "free", "restore", "truncate", "drop", "steps", "reset"]),
        st.integers(0, 5),
        st.integers(1, 12),
    ),
    max_size=60,
)


def _prompted(i: int) -> Request:
    """Request i of the random operations: prompts that share 0, 8 or 16 leading tokens."""
    tokens = list(range(4 * (i % 3) + 8)) + [100 + i] * 3
    cls = RequestClass.RT if i % 2 == 0 else RequestClass.BE
    return Request(i, 0.0, len(tokens), 1, 64, cls, prompt_blocks=TokenPrompt(tokens))


def test_slots_released_count_a_shared_block_once_and_only_when_no_one_else_holds_it():
    """What BROS's anti-thrash rule counts on freeing when it drops requests (prefix caching)."""
    kv = BidirectionalKVManager(num_blocks=12, block_size=4, kv_bytes_per_token=KVB, enable_prefix_caching=True)
    a, b, c = (_prompted(i) for i in (0, 3, 6))  # the same first 8 tokens: two blocks to share
    for r in (a, b, c):
        assert kv.allocate_slots(r, r.num_prompt_tokens, cached=kv.find_cached_prefix(r))
        kv.cache_blocks(r, r.num_prompt_tokens)
    shared = kv.prefix_blocks[a][:2]
    assert kv.prefix_blocks[b][:2] == shared == kv.prefix_blocks[c][:2]

    def own(r: Request) -> int:
        return kv.num_slots(r) - 4 * len(kv.prefix_blocks[r])

    assert kv.num_slots_released([b]) == own(b)  # a and c still read the shared blocks
    assert kv.num_slots_released([b, c]) == own(b) + own(c)
    a_alone = 4 * (len(kv.prefix_blocks[a]) - 2)  # a's blocks past the shared two are its alone
    assert kv.num_slots_released([a, b, c]) == own(a) + own(b) + own(c) + 8 + a_alone
    kv.free(b)
    kv.free(c)
    assert kv.num_slots_released([a]) == own(a) + 8 + a_alone  # now a alone holds them
    free = kv.num_free_blocks
    kv.free(a)
    assert kv.num_free_blocks >= free + 2  # the shared two stay cached, nobody's: free
    kv.check_integrity()


def _state(kv: BidirectionalKVManager, reqs: list[Request]) -> tuple:
    """Everything placement decides, with requests by their index (to compare a copy of the manager)."""
    index = {r: i for i, r in enumerate(reqs)}
    return (
        {index[r]: list(slots) for r, slots in kv.token_slots.items()},
        {index[r]: dict(saved) for r, saved in kv.cpu_slots.items()},
        list(kv.pending_copies),
        list(kv._cpu_free),
        list(kv.rt_fill),
        [list(tokens) for tokens in kv.be_tokens],
        [index.get(r) for r in kv.rt_owner],
        [index.get(r) for r in kv.be_owner],
        sorted(kv.gpu.free_ids()),
        kv.checkpointed_bytes,
        kv.restored_bytes,
    )


def _restore_token_by_token(kv: BidirectionalKVManager, r: Request) -> bool:
    """The reference ``restore``: each checkpointed token placed as a new one would be, its copy and
    its CPU slot's release right after it."""
    saved = kv.cpu_slots.get(r)
    if not saved:
        return True
    if not kv.has_room(r, len(saved)):
        kv.num_allocation_failures += 1
        return False
    slots = kv.token_slots[r]
    kv._slots_rewritten(r)
    del kv.cpu_slots[r]
    for i in sorted(saved):
        slots[i] = kv._place_rt(r, i, ()) if r.request_class is RequestClass.RT else kv._place_be(r, i)
        kv.pending_copies.append(SlotCopy(saved[i], slots[i], to_cpu=False))
        kv._cpu_free.append(saved[i])
    kv.restored_bytes += len(saved) * kv.kv_bytes_per_token
    kv.swapped_bytes += len(saved) * kv.kv_bytes_per_token
    return True


def _grow_token_by_token(kv: BidirectionalKVManager, r: Request, num_tokens: int) -> bool:
    """The reference ``allocate_slots`` (no cached prefix): all or nothing, then each new token placed on
    its own (its last block's empty slot, a BE token facing it checkpointed, or a new block)."""
    slots = kv.token_slots.setdefault(r, [])
    need = num_tokens - len(slots)
    if need > 0 and not kv.has_room(r, need):
        kv.num_allocation_failures += 1
        if not slots:
            del kv.token_slots[r]
            kv._slots_rewritten(r)
        return False
    for _ in range(need):
        slots.append(
            kv._place_rt(r, len(slots), ()) if r.request_class is RequestClass.RT else kv._place_be(r, len(slots))
        )
    return True


def _decode_steps_one_by_one(kv: BidirectionalKVManager, members: list[Request], num_steps: int) -> None:
    """The reference for ``allocate_decode_steps``: step by step, a slot per member in order; checks
    that none overwrites a BE token or takes a block that was not free or cached unused
    (``decode_growth_steps``)."""
    held = {r: len(kv.token_slots[r]) for r in members}
    checkpointed = kv.checkpointed_bytes
    for step in range(1, num_steps + 1):
        for r in members:
            free = set(kv.gpu.free_ids())
            if kv.prefix_cache is not None:  # a cached block nobody uses is free (taking it evicts it)
                free |= set(kv.prefix_cache.evictable.blocks())
            blocks = set(kv.blocks_of.get(r, ()))
            assert kv.allocate_slots(r, held[r] + step)
            assert set(kv.blocks_of[r]) - blocks <= free, "a block taken from someone"
    assert kv.checkpointed_bytes == checkpointed, "a BE token overwritten"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, block_size=st.sampled_from([4, 8]), free_block_first=st.booleans(), caching=st.booleans())
def test_invariants_under_random_operations(ops, block_size, free_block_first, caching):
    """With prefix caching too: a shared block is never a side, never freed or overwritten under a
    user (check_integrity: reference counts equal the tables, shared slots keep their layout)."""
    kv = BidirectionalKVManager(
        num_blocks=5,
        block_size=block_size,
        kv_bytes_per_token=KVB,
        rt_free_block_first=free_block_first,
        enable_prefix_caching=caching,
    )
    reqs = [_prompted(i) for i in range(6)]
    grown_from: dict[Request, int] = {}  # tokens before a request's last growth (what truncate undoes)
    for op, i, n in ops:
        r = reqs[i]
        if op == "admit" and r not in kv.token_slots:  # as a scheduler admits a prompt: shared blocks first
            cached = kv.find_cached_prefix(r)
            if kv.allocate_slots(r, r.num_prompt_tokens, cached=cached):
                assert kv.token_slots[r][: len(cached) * block_size] == kv._shared_slots(cached)
                kv.cache_blocks(r, r.num_prompt_tokens)
                grown_from[r] = 0
        elif op == "grow":
            if r.request_class is RequestClass.RT and kv.num_checkpointed(r) and not kv.restore(r):
                continue  # a dropped RT request runs again only once restored (the scheduler's order)
            before = list(kv.token_slots.get(r, []))
            reference, reference_reqs = copy.deepcopy((kv, reqs))
            grown = kv.allocate_slots(r, len(before) + n)
            assert grown == _grow_token_by_token(reference, reference_reqs[i], len(before) + n)
            assert _state(kv, reqs) == _state(reference, reference_reqs), "growth places runs as token by token"
            if grown:
                grown_from[r] = len(before)
            else:
                assert kv.token_slots.get(r, []) == before  # all or nothing
        elif op == "free":
            kv.free(r)
            grown_from.pop(r, None)
        elif op == "restore" and r in kv.token_slots:
            grown_from.pop(r, None)
            reference, reference_reqs = copy.deepcopy((kv, reqs))
            restored = kv.restore(r)
            assert restored == _restore_token_by_token(reference, reference_reqs[i])
            assert _state(kv, reqs) == _state(reference, reference_reqs), "restore places runs as token by token"
            if restored:
                assert kv.num_checkpointed(r) == 0
        elif op == "steps":  # as BROS repeats a step of decodes: those on the GPU, RT first, n steps at most
            grown_from.clear()
            members = [x for x in reqs if kv.token_slots.get(x) and not kv.num_checkpointed(x)]
            members.sort(key=lambda x: x.request_class is RequestClass.BE)
            num_steps = kv.decode_growth_steps(members, n)
            reference, reference_reqs = copy.deepcopy((kv, reqs))
            _decode_steps_one_by_one(reference, [reference_reqs[reqs.index(x)] for x in members], num_steps)
            kv.allocate_decode_steps(members, num_steps)
            assert _state(kv, reqs) == _state(reference, reference_reqs)
        elif op == "drop":
            grown_from.pop(r, None)
            tokens, free_before = kv.num_tracked_tokens(r), kv.num_free_blocks
            kv.drop_to_cpu(r)
            assert kv.num_slots(r) == 0 and kv.num_checkpointed(r) == tokens  # every token kept, in CPU memory
            assert kv.num_free_blocks >= free_before and not kv.blocks_of.get(r) and r not in kv.prefix_blocks
        elif op == "truncate" and r in grown_from:  # undo the last growth, as BROS's _remove does
            kv.truncate(r, grown_from.pop(r))
            assert r not in kv.prefix_blocks or len(kv.token_slots[r]) >= len(kv.prefix_blocks[r]) * block_size
        elif op == "reset":
            reset_prefix_cache_and_check(kv, reqs)
        kv.check_integrity()
        for b in range(kv.gpu.num_blocks):
            assert kv.rt_fill[b] + len(kv.be_tokens[b]) <= block_size
        on_gpu = [r for r, slots in kv.token_slots.items() if slots and not kv.num_checkpointed(r)]
        if on_gpu:  # the batch slot table (the engine's decodes) is each request's own
            lengths = np.array([kv.num_tracked_tokens(r) for r in on_gpu])
            table = kv.slot_tables(on_gpu, lengths)
            assert [table[i, :n].tolist() for i, n in enumerate(lengths)] == [kv.token_slots[r] for r in on_gpu]
        for r in kv.token_slots:
            if kv.num_checkpointed(r):  # the engine reads only contexts wholly on the GPU
                with pytest.raises(IndexError, match="not all on the GPU"):
                    kv.block_id_tables([r], np.array([kv.num_tracked_tokens(r)]))


def test_progressive_dropping_swaps_a_request_out_and_restore_brings_back_every_token():
    """§5: a dropped request's tokens all go to CPU memory (one copy each) and its blocks are freed;
    restoring it copies each back, RT tokens from the left again."""
    kv = BidirectionalKVManager(num_blocks=4, block_size=8, kv_bytes_per_token=KVB)
    rt, be = req(0, RequestClass.RT), req(1, RequestClass.BE)
    assert kv.allocate_slots(rt, 10) and kv.allocate_slots(be, 5)
    kv.take_copies()
    assert kv.drop_to_cpu(rt) == 10
    copies = kv.take_copies()
    assert len(copies) == 10 and all(c.to_cpu for c in copies)
    assert kv.num_slots(rt) == 0 and kv.num_checkpointed(rt) == 10 and kv.checkpointed_bytes == 10 * KVB
    assert kv.allocated_tokens == 5
    kv.check_integrity()
    assert kv.restore(rt, protect={be})
    back = kv.take_copies()
    assert [c.to_cpu for c in back] == [False] * 10 and sorted(c.src_slot for c in back) == sorted(
        c.dst_slot for c in copies
    )
    assert kv.num_checkpointed(rt) == 0 and kv.restored_bytes == 10 * KVB
    S = kv.block_size
    assert all(slot % S < kv.rt_fill[slot // S] for slot in kv.token_slots[rt])  # from the left
    kv.check_integrity()


def _facing_pair(free_block_first: bool) -> tuple[BidirectionalKVManager, Request, Request]:
    """An RT request (4 tokens) and a BE one (2 tokens) facing each other in block 0, 2 slots empty
    between them, and 3 free blocks (a third request filled them and left)."""
    kv = BidirectionalKVManager(
        num_blocks=4, block_size=8, kv_bytes_per_token=KVB, rt_free_block_first=free_block_first
    )
    rt, other, be = req(0, RequestClass.RT), req(1, RequestClass.RT), req(2, RequestClass.BE)
    assert kv.allocate_slots(rt, 4) and kv.allocate_slots(other, 24)
    assert kv.allocate_slots(be, 2)  # no free block: the BE request starts in the RT-only block 0
    assert kv.blocks_of[be] == [0] == kv.blocks_of[rt]
    kv.free(other)
    return kv, rt, be


@pytest.mark.parametrize("free_block_first", [False, True])
def test_decode_growth_stops_where_an_rt_request_would_overwrite_the_be_tokens_facing_it(free_block_first):
    """BROS repeats a step of decodes only while no KV is copied: the RT request whose block is full
    grows over the facing BE tokens first (facing_first), even with free blocks; with
    ``rt_free_block_first`` it takes a free block."""
    kv, rt, be = _facing_pair(free_block_first)
    assert kv.allocate_slots(rt, 6)  # block 0 full: 6 RT tokens facing 2 BE tokens
    assert kv.decode_growth_steps([rt], 5) == (5 if free_block_first else 0)
    assert kv.decode_growth_steps([be], 5) == 5  # a BE request takes a free block


def test_decode_steps_at_once_equal_step_by_step_when_two_share_a_block():
    """Two requests growing in one block take its empty slots turn by turn, then a free block each in
    their order: ``allocate_decode_steps`` leaves what a step-by-step allocation leaves."""
    kv, rt, be = _facing_pair(free_block_first=True)
    reqs = [rt, be]
    assert kv.decode_growth_steps(reqs, 5) == 5
    reference, reference_reqs = copy.deepcopy((kv, reqs))
    _decode_steps_one_by_one(reference, reference_reqs, 5)
    kv.allocate_decode_steps(reqs, 5)
    assert _state(kv, reqs) == _state(reference, reference_reqs)
    # step 1: the two empty slots of block 0, RT from the left, BE from the right; step 2: a free block each
    assert kv.token_slots[rt][4] == 4 and kv.token_slots[be][2] == 5
    assert len({0, kv.token_slots[rt][5] // 8, kv.token_slots[be][3] // 8}) == 3
    kv.check_integrity()
