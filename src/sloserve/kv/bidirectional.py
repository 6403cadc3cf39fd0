"""BROS §5: bidirectional KV blocks, block preemption and lazy checkpointing.

Each block of S slots holds one real-time (RT) request's tokens from the left and one best-effort (BE)
request's tokens from the right: RT token k of the block at slot ``block * S + k``, BE token k at
``block * S + S - 1 - k``. Growth (§5.2):

    RT  its last block while it has empty slots; then the BE tokens facing it in that block, which
        are checkpointed to CPU memory (lazy checkpointing: only the overwritten slots); then a
        free block; then a BE-only block with the most empty slots (block preemption).
        ``rt_free_block_first=True`` takes a free block before the facing BE tokens (BE slots
        preempted only "if no GPU blocks are available"). §5.2 reads both ways: its allocation
        sentence suggests free blocks first, its lazy checkpointing paragraph and Fig. 9 (B8 over
        a3) an RT request growing over its peer "when all empty slots are exhausted". Facing first
        is the default because only it reproduces the paper's Figure 13 (Bi-cache better than none):
        free block first leaves fewer BE-only blocks to preempt, and BE requests are evicted whole.
    BE  its last block while it has empty slots; then the block with the most empty slots among
        those without a BE owner (free blocks first); BE never overwrites RT

A BE request's checkpointed tokens get new slots when it runs again (``restore``). The preemption
table records the blocks where an RT request overwrote BE slots and the two requests sharing them.
Requests in ``protect`` (scheduled in the same step) are never overwritten. Progressive dropping
(§5: "swap out their cache blocks") moves every token of a request, RT or BE, to CPU memory
(``drop_to_cpu``); ``restore`` brings them back when it runs again.

Prefix caching (``enable_prefix_caching``, ours: §5 predates it; kv/shared_prefix.py): a block one
request filled whole on its side (all S slots, block-aligned tokens, RT or BE) leaves both sides when
registered and becomes shared, found by later prompts RT or BE alike (a BE request's block keeps its
right-to-left layout, whoever reads it). The rule: a shared block is never a side, so growth, lazy
checkpointing and block preemption never overwrite it; a request dropped to CPU memory copies its
tokens there, shared ones too, and lets go of its shared blocks. An RT request that needs room takes
free and cached blocks, then preempts BE-only sides; it evicts a BE request holding shared blocks
only as a whole.

NOTE: this manager keeps an explicit token -> slot list per request (-1: checkpointed), so it costs
O(tokens); schedulers using it schedule requests explicitly (no decode cohort).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence

from sloserve.core.errors import ConfigError
from sloserve.core.outputs import BlockCopy, SlotCopy
from sloserve.core.request import Request, RequestClass
from sloserve.kv.manager import KVCacheManager
from sloserve.kv.shared_prefix import SharedPrefixBlocks
from sloserve.kv.token_slots import CHECKPOINTED, TokenSlotTable


class BidirectionalKVManager(SharedPrefixBlocks, TokenSlotTable, KVCacheManager):
    name = "bidirectional"
    periodic_growth = False
    copies_kv_to_cpu = True
    supports_max_requests = False  # (its own tables; a model with state layers runs on the paged managers)

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        rt_free_block_first: bool = False,
        **options,
    ) -> None:
        """``options``: ``KVCacheManager``'s (bytes per token, CPU blocks, prefix caching)."""
        if block_size < 4:
            raise ConfigError(f"bidirectional blocks need at least 2 slots per side: block_size {block_size} < 4")
        super().__init__(num_blocks, block_size, **options)
        self.rt_free_block_first = rt_free_block_first  # §5.2's other reading (see the module docstring)
        n = num_blocks
        self.rt_owner: list[Request | None] = [None] * n
        self.rt_fill = [0] * n  # RT tokens stored from the left
        self.be_owner: list[Request | None] = [None] * n
        self.be_tokens: list[list[int]] = [[] for _ in range(n)]  # BE token indices, rightmost slot first
        self._init_token_slots()
        self.blocks_of: dict[Request, list[int]] = {}  # blocks a request owns a side of, in order
        self.preemption_table: dict[int, tuple[Request, Request]] = {}  # block -> (RT, BE)
        # GPU -> CPU copies made by lazy checkpointing and dropping, CPU -> GPU copies made by restore
        # (their sum is ``swapped_bytes``, every manager's count of host-link traffic)
        self.checkpointed_bytes = 0
        self.restored_bytes = 0
        # Running aggregates so room checks need no scan (kept by _update after every change):
        # RT-only blocks and their empty slots (where BE requests may start), BE-only blocks per
        # owner (what RT requests may preempt).
        self._rt_only: dict[int, int] = {}  # block -> empty slots
        self._rt_only_empty = 0
        self._rt_only_by_empty: list[set[int]] = [set() for _ in range(block_size + 1)]
        self._be_only: dict[int, Request] = {}  # block -> BE owner
        self._be_only_by_owner: dict[Request, int] = {}
        self._be_only_by_empty: list[set[int]] = [set() for _ in range(block_size + 1)]
        self._be_only_empty: dict[int, int] = {}  # block -> its bucket in _be_only_by_empty
        self._used_slots = 0  # slots held on the sides
        self._init_shared_prefix(n)

    # --- aggregates --------------------------------------------------------------------------------
    def _update(self, block: int) -> None:
        """Refresh ``block``'s place in the running aggregates after a change to it."""
        if block in self._rt_only:
            empty = self._rt_only.pop(block)
            self._rt_only_empty -= empty
            self._rt_only_by_empty[empty].discard(block)
        owner = self._be_only.pop(block, None)
        if owner is not None:
            self._be_only_by_owner[owner] -= 1
            self._be_only_by_empty[self._be_only_empty.pop(block)].discard(block)
        rt, be = self.rt_owner[block], self.be_owner[block]
        if rt is not None and be is None:
            empty = self._empty(block)
            self._rt_only[block] = empty
            self._rt_only_empty += empty
            self._rt_only_by_empty[empty].add(block)
        elif rt is None and be is not None:
            self._be_only[block] = be
            self._be_only_by_owner[be] = self._be_only_by_owner.get(be, 0) + 1
            empty = self._empty(block)
            self._be_only_empty[block] = empty
            self._be_only_by_empty[empty].add(block)

    # --- accounting ------------------------------------------------------------------------------
    def _empty(self, block: int) -> int:
        return self.block_size - self.rt_fill[block] - len(self.be_tokens[block])

    @property
    def allocated_tokens(self) -> int:
        """Slots held on the sides and in shared blocks (each shared block once)."""
        return self._used_slots + self.num_shared_blocks_used * self.block_size

    @property
    def num_shared_tokens(self) -> int:
        return 0  # NOTE: allocated_tokens already counts a shared block once

    def _last(self, request: Request) -> int | None:
        blocks = self.blocks_of.get(request)
        return blocks[-1] if blocks else None

    def _be_candidate(self) -> int:
        """The RT-only block with the most empty slots (where a BE request starts when no block is free)."""
        return next(min(bucket) for bucket in reversed(self._rt_only_by_empty) if bucket)

    # --- growth ------------------------------------------------------------------------------------
    def can_allocate(
        self, request: Request, num_tokens: int, reserve_blocks: int = 0, protect: Collection[Request] = ()
    ) -> bool:
        need = num_tokens - len(self.token_slots.get(request, ())) + reserve_blocks * self.block_size
        return self.has_room(request, need, protect)

    def slots_needed(self, request: Request, num_tokens: int, cached: Sequence[int] = ()) -> int:
        """New GPU slots for ``request`` to hold ``num_tokens`` tokens, restoring checkpointed ones; for
        a request holding nothing yet that starts with the ``cached`` blocks (``find_cached_prefix``),
        the slots past them, and a whole block for each cached one nobody uses (taking it lowers the
        free count)."""
        if cached and request not in self.token_slots:
            taken = self.prefix_cache.num_evictable(cached)
            return max(0, num_tokens - len(cached) * self.block_size) + taken * self.block_size
        return max(0, num_tokens - len(self.token_slots.get(request, ()))) + self.num_checkpointed(request)

    def has_room(self, request: Request, need: int, protect: Collection[Request] = ()) -> bool:
        """Whether ``request`` could get ``need`` new slots now (O(protected requests)): ``need <=
        room(request, protect)``, the other requests' blocks looked at only when its own and the free
        ones fall short."""
        if need <= 0:
            return True
        need -= self._room_in_place(request, protect)
        return need <= 0 or need <= self._room_elsewhere(request, protect)

    def room(self, request: Request, protect: Collection[Request] = ()) -> int:
        """The new slots ``request`` could get now (see ``has_room``)."""
        return self._room_in_place(request, protect) + self._room_elsewhere(request, protect)

    def _room_in_place(self, request: Request, protect: Collection[Request]) -> int:
        """Slots of the free blocks and of the request's own last block: its empty ones and, for an RT
        request, the BE tokens facing it that it may overwrite."""
        room = self.block_size * self.num_free_blocks
        last = self._last(request)
        rt = request.request_class is RequestClass.RT
        if last is not None and (self.rt_owner[last] if rt else self.be_owner[last]) is request:
            room += self._empty(last)
            if rt and self._may_overwrite_facing(last, protect):
                room += len(self.be_tokens[last])
        return room

    def _room_elsewhere(self, request: Request, protect: Collection[Request]) -> int:
        """Slots in other requests' blocks: for an RT request every slot of the unprotected BE-only
        blocks (block preemption), for a BE request the empty slots of RT-only blocks."""
        if request.request_class is RequestClass.RT:
            preemptible = len(self._be_only) - sum(self._be_only_by_owner.get(p, 0) for p in protect)
            return self.block_size * preemptible
        return self._rt_only_empty

    def decode_growth_steps(self, requests: Sequence[Request], limit: int) -> int:
        """Steps (0 to ``limit``) through which each of ``requests``, in this order, can take one more
        slot per step touching nobody else's tokens: in its own last block while it has empty slots
        (requests facing each other in a block share them, in this order), then in a free block; not
        over the BE tokens facing an RT request (lazy checkpointing, whoever is protected: BE requests
        join a BROS batch after the RT ones), nor by block preemption or in an RT-only block. A dry
        run: nothing changes. NOTE: with these rules the tokens facing an RT request stay as they are
        through the steps counted (only an overwrite takes them, a BE request starts only in a free
        block), so each is looked up once."""
        S = self.block_size
        empty: dict[int, int] = {}  # block -> its empty slots as the steps take them
        grows_in: list[int | None] = []  # each request's block to grow in (None: it needs a new one)
        blocked: list[bool] = []  # an RT request whose block, once full, has BE tokens facing it
        for r in requests:
            b = self._last(r)
            rt = r.request_class is RequestClass.RT
            if b is not None and (self.rt_owner[b] if rt else self.be_owner[b]) is r:
                empty.setdefault(b, self._empty(b))
                grows_in.append(b)
                blocked.append(rt and self.be_owner[b] is not None and bool(self.be_tokens[b]))
            else:
                grows_in.append(None)
                blocked.append(False)
        free = self.num_free_blocks
        new_block = -1  # blocks taken in the dry run, by made-up ids
        for step in range(limit):
            for i, b in enumerate(grows_in):
                if b is not None and empty[b] > 0:
                    empty[b] -= 1
                    continue
                if free == 0 or (blocked[i] and not self.rt_free_block_first):
                    return step
                free -= 1
                grows_in[i], empty[new_block], blocked[i] = new_block, S - 1, False
                new_block -= 1
        return limit

    def allocate_decode_steps(self, requests: Sequence[Request], num_steps: int) -> None:
        """Give each of ``requests`` ``num_steps`` more slots, as ``num_steps`` steps taking one each,
        request by request, would: the same slots and the same free blocks in the same order. NOTE:
        the caller proved each goes to its own last block or a free one (``decode_growth_steps``)."""
        held = [len(self.token_slots[r]) for r in requests]
        if len({self._last(r) for r in requests}) < len(requests):
            # Two of them grow in one block, facing each other: they take its empty slots turn by turn.
            for step in range(1, num_steps + 1):
                for r, n in zip(requests, held, strict=True):
                    done = self.allocate_slots(r, n + step)
                    assert done, r
            return
        # Each fills its own block, then takes a free block every S steps: those takes, in step order,
        # are all that depends on the others.
        S = self.block_size
        takes = sorted(
            (step, i) for i, r in enumerate(requests) for step in range(self._own_empty_slots(r) + 1, num_steps + 1, S)
        )
        for step, i in takes:
            done = self.allocate_slots(requests[i], held[i] + step)
            assert done, requests[i]
        for r, n in zip(requests, held, strict=True):
            done = self.allocate_slots(r, n + num_steps)
            assert done, r

    def allocate_slots(
        self, request: Request, num_tokens: int, protect: Collection[Request] = (), cached: Sequence[int] = ()
    ) -> bool:
        """Grow ``request`` to ``num_tokens`` tokens with slots; all or nothing. A request holding
        nothing yet starts with the ``cached`` blocks ``find_cached_prefix`` found."""
        if cached and request not in self.token_slots:
            if not self.has_room(request, self.slots_needed(request, num_tokens, cached), protect):
                self.num_allocation_failures += 1
                return False
            self._share_prefix(request, cached)
        slots = self.token_slots.setdefault(request, [])
        need = num_tokens - len(slots)
        if need <= 0:
            return True
        if need <= self._own_empty_slots(request):  # the common decode step: no room check needed
            self._fill_last_block(request, slots, need)
            return True
        if not self.has_room(request, need, protect):
            self.num_allocation_failures += 1
            if not slots:
                del self.token_slots[request]
                self._slots_rewritten(request)
            return False
        rt = request.request_class is RequestClass.RT
        place = self._place_rt if rt else self._place_be
        while need > 0:
            # Runs of tokens go in at once: into empty slots of the request's own last block, or (RT) over
            # the BE tokens facing it there (lazy checkpointing); a token that needs a new block on its own.
            filled = self._fill_last_block(request, slots, min(need, self._own_empty_slots(request)))
            if not filled and rt:
                overwrite = min(need, self._facing_tokens(request, protect))
                if overwrite:
                    slots.extend(self._checkpoint_facing(request, overwrite))
                    filled = overwrite
            if not filled:
                slots.append(place(request, len(slots), protect))
                filled = 1
            need -= filled
        return True

    def free_blocks_to_grow(self, request: Request, num_tokens: int) -> int | None:
        """Free blocks that growing the RT ``request`` to ``num_tokens`` tokens takes when it touches no
        other request's tokens and nothing of it is checkpointed: 0 (the empty slots of its own last
        block) or 1 (one more token, its last block full with no BE token facing it, or not its own).
        None otherwise (a restore, an overwrite, several blocks: ``allocate_slots`` decides). NOTE:
        ``allocate_slots`` then takes a free block as ``_place_rt`` does, if one is left."""
        need = num_tokens - len(self.token_slots.get(request, ()))
        if self.cpu_slots.get(request):
            return None
        if need <= self._own_empty_slots(request):
            return 0
        b = self._last(request)
        if need == 1 and (b is None or self.rt_owner[b] is not request or not self.be_tokens[b]):
            return 1
        return None

    def _own_empty_slots(self, request: Request) -> int:
        """Empty slots of the block ``request`` grows in (its last one), when it owns its side."""
        blocks = self.blocks_of.get(request)
        if not blocks:
            return 0
        b = blocks[-1]
        owner = self.rt_owner[b] if request.request_class is RequestClass.RT else self.be_owner[b]
        return self._empty(b) if owner is request else 0

    def _fill_last_block(self, request: Request, slots: list[int], count: int) -> int:
        """Place ``count`` (<= ``_own_empty_slots``) new tokens in the request's last block, as ``count``
        calls of ``_place_*`` would, with one ``_update`` of the aggregates."""
        if count <= 0:
            return 0
        slots.extend(self._fill_own_block(request, range(len(slots), len(slots) + count)))
        return count

    def _fill_own_block(self, request: Request, tokens: Sequence[int]) -> range:
        """Place the request's ``tokens`` (indices, at most ``_own_empty_slots`` of them) in its last
        block, in order, as a call of ``_place_*`` each would; returns their slots."""
        b = self.blocks_of[request][-1]
        S, count = self.block_size, len(tokens)
        if request.request_class is RequestClass.RT:
            fill = self.rt_fill[b]
            placed = range(b * S + fill, b * S + fill + count)
            self.rt_fill[b] = fill + count
        else:
            be_tokens = self.be_tokens[b]
            top = b * S + S - 1 - len(be_tokens)  # BE token k of a block at base + S - 1 - k
            placed = range(top, top - count, -1)
            be_tokens.extend(tokens)
        self._used_slots += count
        self._update(b)
        return placed

    def _take_block(self, request: Request, block: int) -> None:
        self.blocks_of.setdefault(request, []).append(block)

    def _may_overwrite_facing(self, block: int, protect: Collection[Request]) -> bool:
        """Whether the RT owner of ``block`` (its last block, full) grows over the BE tokens facing it
        now: they are there and unprotected, and (with ``rt_free_block_first``) no block is free.
        NOTE: an RT request that leaves a block for a free one cannot come back to its facing tokens,
        so ``has_room`` counts them under the same condition."""
        be = self.be_owner[block]
        if be is None or be in protect or not self.be_tokens[block]:
            return False
        return not self.rt_free_block_first or self.num_free_blocks == 0

    def _preemptible_block(self, protect: Collection[Request]) -> int | None:
        """Block preemption's pick: the unprotected BE-only block with the most empty slots."""
        for bucket in reversed(self._be_only_by_empty):
            if not bucket:
                continue
            first = min(bucket)
            if self._be_only[first] not in protect:  # (the common case: no scan of the bucket)
                return first
            candidates = [x for x in bucket if self._be_only[x] not in protect]
            if candidates:
                return min(candidates)
        return None

    def _place_rt(self, request: Request, token: int, protect: Collection[Request]) -> int:
        S = self.block_size
        b = self._last(request)
        own = b is not None and self.rt_owner[b] is request
        if not own or self._empty(b) == 0:
            if not (own and self._may_overwrite_facing(b, protect)):
                fresh = self._allocate(1)  # (prefix caching: a cached block nobody uses, evicted)
                b = fresh[0] if fresh is not None else self._preemptible_block(protect)  # block preemption
                assert b is not None, "has_room counted a block to preempt"
                self.rt_owner[b] = request
                self._take_block(request, b)
                self._update(b)
        if self._empty(b) == 0:  # lazy checkpointing: the BE token facing us goes to CPU memory
            return self._checkpoint_facing(request, 1)[0]
        slot = b * S + self.rt_fill[b]
        self.rt_fill[b] += 1
        self._used_slots += 1
        self._update(b)
        return slot

    def _facing_tokens(self, request: Request, protect: Collection[Request]) -> int:
        """The BE tokens the RT ``request`` may overwrite in its last block now (lazy checkpointing):
        all of those facing it once the block is full, when ``_may_overwrite_facing``; else 0."""
        b = self._last(request)
        if b is None or self.rt_owner[b] is not request or self._empty(b) or not self._may_overwrite_facing(b, protect):
            return 0
        return len(self.be_tokens[b])

    def _checkpoint_facing(self, request: Request, count: int) -> range:
        """Lazy checkpointing (§5.2): the last ``count`` BE tokens facing the RT ``request`` in its full
        last block go to CPU memory (a copy each, in order), and ``count`` RT tokens take their slots, as
        ``count`` calls of ``_place_rt`` would; returns those slots."""
        S, b = self.block_size, self.blocks_of[request][-1]
        be = self.be_owner[b]
        assert be is not None and count <= len(self.be_tokens[b])
        facing, be_slots, saved = self.be_tokens[b], self.token_slots[be], self.cpu_slots.setdefault(be, {})
        for _ in range(count):
            overwritten = facing.pop()
            saved[overwritten] = cpu_slot = self._take_cpu_slot()
            self.pending_copies.append(SlotCopy(be_slots[overwritten], cpu_slot, to_cpu=True))
            be_slots[overwritten] = CHECKPOINTED
        self._slots_rewritten(be)
        moved = count * self.kv_bytes_per_token
        self.checkpointed_bytes += moved
        self.swapped_bytes += moved
        self.preemption_table[b] = (request, be)
        fill = self.rt_fill[b]
        self.rt_fill[b] = fill + count  # NOTE: the slots held do not change: a BE token's became RT's
        if not facing:
            self._drop_side(be, b)
        self._update(b)
        return range(b * S + fill, b * S + fill + count)

    def _place_be(self, request: Request, token: int, protect: Collection[Request] = ()) -> int:
        S = self.block_size
        b = self._last(request)
        if b is None or self.be_owner[b] is not request or self._empty(b) == 0:
            fresh = self._allocate(1)
            b = fresh[0] if fresh is not None else self._be_candidate()
            self.be_owner[b] = request
            self._take_block(request, b)
        slot = b * S + S - 1 - len(self.be_tokens[b])
        self.be_tokens[b].append(token)
        self._used_slots += 1
        self._update(b)
        return slot

    def restore(self, request: Request, protect: Collection[Request] = ()) -> bool:
        """Give a request's checkpointed tokens new GPU slots (swap-in); all or nothing. A BE
        request's are those RT requests overwrote; an RT request's, all of them (dropped)."""
        saved = self.cpu_slots.get(request)
        if not saved:
            return True
        if not self.has_room(request, len(saved), protect):
            self.num_allocation_failures += 1
            return False
        # NOTE: cpu_slots[request] is keyed by exactly the token indices whose slot is CHECKPOINTED.
        slots = self.token_slots[request]
        self._slots_rewritten(request)
        missing = sorted(saved)
        del self.cpu_slots[request]
        rt = request.request_class is RequestClass.RT
        done = 0
        while done < len(missing):
            # A run into its own block's empty slots at once; a token that needs a new block (or
            # overwrites, checkpointing a BE token) on its own, its copies in between as they happen.
            run = min(self._own_empty_slots(request), len(missing) - done)
            if run:
                tokens = missing[done : done + run]
                placed = self._fill_own_block(request, tokens)
            else:
                tokens = missing[done : done + 1]
                placed = [self._place_rt(request, tokens[0], protect) if rt else self._place_be(request, tokens[0])]
            for i, slot in zip(tokens, placed, strict=True):
                slots[i] = slot
                self.pending_copies.append(SlotCopy(saved[i], slot, to_cpu=False))
                self._cpu_free.append(saved[i])
            done += len(tokens)
        self.restored_bytes += len(missing) * self.kv_bytes_per_token
        self.swapped_bytes += len(missing) * self.kv_bytes_per_token
        return True

    def drop_to_cpu(self, request: Request) -> int:
        """Progressive dropping (§5): copy every GPU token of ``request`` to CPU memory and give up
        its blocks' sides; ``restore`` brings them back. The number of tokens moved."""
        slots = self.token_slots.get(request)
        if not slots:
            return 0
        self.cache_blocks(request, request.num_computed_tokens)  # its full blocks stay cached
        saved = self.cpu_slots.setdefault(request, {})
        moved = 0
        for i, slot in enumerate(slots):
            if slot != CHECKPOINTED:
                saved[i] = self._take_cpu_slot()
                self.pending_copies.append(SlotCopy(slot, saved[i], to_cpu=True))
                slots[i] = CHECKPOINTED
                moved += 1
        self._slots_rewritten(request)
        self._release_blocks(request)
        self.checkpointed_bytes += moved * self.kv_bytes_per_token
        self.swapped_bytes += moved * self.kv_bytes_per_token
        return moved

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Give back the slots of ``request``'s tokens from ``num_tokens`` on: undo its last growth
        (each token given back is the newest in its block; tokens restored since break that)."""
        S = self.block_size
        slots = self.token_slots.get(request, [])
        if len(slots) > num_tokens:
            self._slots_rewritten(request)
        num_shared = len(self.prefix_blocks.get(request, ()))
        while len(slots) > max(num_tokens, num_shared * S):
            slot = slots.pop()
            if slot == CHECKPOINTED:
                self._cpu_free.append(self.cpu_slots[request].pop(len(slots)))
                continue
            self._used_slots -= 1
            b = slot // S
            if request.request_class is RequestClass.RT:
                assert slot == b * S + self.rt_fill[b] - 1, "only the newest RT slot can be given back"
                self.rt_fill[b] -= 1
                emptied = self.rt_fill[b] == 0
            else:
                assert self.be_tokens[b][-1] == len(slots), "only the newest BE slot of a block can be given back"
                self.be_tokens[b].pop()
                emptied = not self.be_tokens[b]
            if emptied:
                self._drop_side(request, b)
            else:
                self._update(b)
        if len(slots) > num_tokens:  # into its shared blocks (a request that was to start with them)
            assert num_tokens % S == 0, "a shared block is given back whole"
            del slots[num_tokens:]
            self._release_shared(request, num_tokens // S)
        if not slots:
            self.token_slots.pop(request, None)

    # --- release -----------------------------------------------------------------------------------
    def _drop_side(self, request: Request, block: int) -> None:
        """``request`` no longer holds tokens in ``block``."""
        if self.rt_owner[block] is request:
            self._used_slots -= self.rt_fill[block]
            self.rt_owner[block], self.rt_fill[block] = None, 0
        if self.be_owner[block] is request:
            self._used_slots -= len(self.be_tokens[block])
            self.be_owner[block], self.be_tokens[block] = None, []
        self.blocks_of[request].remove(block)
        self._update(block)
        if self.rt_owner[block] is None and self.be_owner[block] is None:
            self._release([block])
            self.preemption_table.pop(block, None)

    def free(self, request: Request) -> None:
        self.cache_blocks(request, request.num_computed_tokens)  # a turn's answer, resent next turn
        self._release_blocks(request)
        self.token_slots.pop(request, None)
        self._slots_rewritten(request)
        self._cpu_free.extend(self.cpu_slots.pop(request, {}).values())

    def _release_blocks(self, request: Request) -> None:
        """Give up ``request``'s side of every block it holds, and its preemption-table entries."""
        for block in list(self.blocks_of.get(request, ())):
            self._drop_side(request, block)
        self._release_shared(request, 0)
        self.blocks_of.pop(request, None)
        self._be_only_by_owner.pop(request, None)
        for block, pair in list(self.preemption_table.items()):
            if request in pair:
                del self.preemption_table[block]

    # --- prefix caching (kv/shared_prefix.py) -------------------------------------------------------
    def _whole_block(self, request: Request, j: int) -> int | None:
        S = self.block_size
        slots = self.token_slots[request][j * S : j * S + S]
        block = slots[0] // S
        if request.request_class is RequestClass.RT:
            whole = self.rt_owner[block] is request and slots == list(range(block * S, block * S + S))
        else:
            whole = self.be_owner[block] is request and self.be_tokens[block] == list(range(j * S, j * S + S))
        return block if whole else None

    def _give_up_block(self, request: Request, block: int) -> bool:
        rt = self.rt_owner[block] is request
        if rt:
            self.rt_owner[block], self.rt_fill[block] = None, 0
        else:
            self.be_owner[block], self.be_tokens[block] = None, []
        self._used_slots -= self.block_size
        self.blocks_of[request].remove(block)
        self._update(block)
        self.preemption_table.pop(block, None)
        return not rt  # a BE request's tokens run right to left

    def swap_out(self, request: Request) -> list[BlockCopy] | None:
        """Not by block copies: this layout moves KV by single slots (lazy checkpointing, and
        ``drop_to_cpu`` for a whole request)."""
        return None

    # --- invariants --------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        S = self.block_size
        seen: dict[int, Request] = {}
        for b in range(self.gpu.num_blocks):
            assert self.rt_fill[b] + len(self.be_tokens[b]) <= S, f"block {b} over-full"
            assert self.rt_owner[b] is not None or self.rt_fill[b] == 0, f"block {b}: RT tokens without owner"
            assert self.be_owner[b] is not None or not self.be_tokens[b], f"block {b}: BE tokens without owner"
        rt_only = {
            b: self._empty(b)
            for b in range(self.gpu.num_blocks)
            if self.rt_owner[b] is not None and self.be_owner[b] is None
        }
        be_only = {
            b: self.be_owner[b]
            for b in range(self.gpu.num_blocks)
            if self.rt_owner[b] is None and self.be_owner[b] is not None
        }
        assert self._rt_only == rt_only and self._rt_only_empty == sum(rt_only.values()), "RT-only aggregate"
        assert all(b in self._rt_only_by_empty[e] for b, e in rt_only.items())
        assert sum(len(x) for x in self._rt_only_by_empty) == len(rt_only)
        assert self._be_only == be_only, "BE-only aggregate"
        assert all(b in self._be_only_by_empty[self._empty(b)] for b in be_only)
        assert sum(len(x) for x in self._be_only_by_empty) == len(be_only)
        assert all(b in self._be_only_by_empty[e] for b, e in self._be_only_empty.items())
        assert self._be_only_empty.keys() == be_only.keys()
        assert self._used_slots == sum(self.rt_fill) + sum(len(t) for t in self.be_tokens), "used slots"
        self._check_token_slots()
        # a block with a side held counts one reference, whoever holds its sides
        cached = self._check_shared_prefix(
            [b for b, (rt, be) in enumerate(zip(self.rt_owner, self.be_owner)) if rt or be]
        )
        by_owner = Counter(be_only.values())
        assert all(self._be_only_by_owner.get(o, 0) == n for o, n in by_owner.items()), "BE-only blocks by owner"
        free = set(self.gpu.free_ids())
        assert not free & cached, "a shared or cached block is free"
        for b in range(self.gpu.num_blocks):
            no_side = self.rt_owner[b] is None and self.be_owner[b] is None
            assert (b in free or b in cached) == no_side, f"block {b} free state"
        for request, slots in self.token_slots.items():
            rt = request.request_class is RequestClass.RT
            num_shared = len(self.prefix_blocks.get(request, ())) * S
            # RT tokens are never overwritten: only a dropped RT request has them in CPU memory
            assert not rt or CHECKPOINTED not in slots or set(slots) == {CHECKPOINTED}, "RT checkpointed in part"
            for token, slot in enumerate(slots):
                if token < num_shared or slot == CHECKPOINTED:
                    continue
                assert slot not in seen, f"slot {slot} owned by {seen[slot]} and {request}"
                seen[slot] = request
                b, offset = divmod(slot, S)
                if rt:
                    assert self.rt_owner[b] is request and offset < self.rt_fill[b], (request, slot)
                else:
                    j = S - 1 - offset
                    assert self.be_owner[b] is request and self.be_tokens[b][j] == token, (request, slot)
