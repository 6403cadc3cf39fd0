"""EconoServe §3.2 KV-cache pipelining: a generation task (GT) lends the unused part of its allocated
KV region to GTs predicted to finish before it gets there, recursively ("Russian nesting dolls").

A GT's *region* is the KV allocated for its predicted response length (RL) l (EconoServe's exact
allocation). Its owner writes generated tokens from offset 0 up. The owner lends its second half,
offsets [l/2, l), to a hosted GT whose RL is at most l/2 - b (b: the buffer for under-prediction),
then the second half of what it kept, [l/4, l/2), to another with RL at most l/4 - b, and so on; each
hosted GT lends its own region the same way (Figure 7b). Hosted GTs start with their host, so one
reaching the end of its RL (+ buffer) has finished before its host writes its first lent slot:

    Figure 7a   r1 (RL 32): offsets [0, 16) its own, [16, 32) lent to r2 (RL 16)
    Figure 7b   r1 also lends [8, 16) to r3 (RL 8); r2 lends [24, 32) to r4 (RL 8)

Every offset is a physical slot: a top-level region takes whole blocks from the pool; a hosted
region is a slice of its host's slots, so the engine writes a hosted GT's KV inside its host's
allocation. If a hosted GT has not finished when its host reaches its first slot (an under-predicted
RL), the policy evicts it: its tokens in the lent slots are copied to CPU memory (``SlotCopy``; the
paper's copy-on-write) and come back to fresh slots when it resumes (``restore``).

A GT is granted its region up to the first offset a hosted GT holds in one go, so a running GT asks
for slots only at the start of a hosted region (or at its region's end): a decode cohort of GTs
grows in O(1) per step between those points.

Prompt tokens (a prompt task's KV, allocated at its prompt length) and tokens past a region's end
live in the request's own paged blocks.

Prefix caching (``enable_prefix_caching``; kv/shared_prefix.py): a prompt's own blocks, full and
block-aligned, become shared blocks when registered, and a later prompt that starts alike takes them
instead of own blocks. Regions are never shared: a generated token is written in its region, and a
hosted GT's eviction copies only the tokens in its lent region, never a shared block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain

from sloserve.core.errors import ConfigError
from sloserve.core.outputs import SlotCopy
from sloserve.core.request import Request
from sloserve.kv.manager import KVCacheManager
from sloserve.kv.shared_prefix import SharedPrefixBlocks
from sloserve.kv.token_slots import CHECKPOINTED, TokenSlotTable


@dataclass(eq=False)
class Region:
    """A GT's allocation: ``slots[k]`` is the physical slot of offset k."""

    owner: Request | None  # None once the owner left while GTs hosted inside still run
    slots: list[int]
    parent: Region | None = None  # the region these slots are lent from (None: from the pool)
    start: int = 0  # offset of slots[0] in the parent region
    blocks: list[int] = field(default_factory=list)  # pool blocks (top-level regions only)
    frontier: int = 0  # offsets [frontier, len(slots)) are lent out (one child per halving)
    used: int = 0  # offsets [0, used) are granted to the owner (it writes them in order)
    children: list[Region] = field(default_factory=list)  # live hosted regions

    def child_at(self, offset: int) -> Region | None:
        for child in self.children:
            if child.start <= offset < child.start + len(child.slots):
                return child
        return None


class PipelinedKVManager(SharedPrefixBlocks, TokenSlotTable, KVCacheManager):
    """EconoServe's KV manager: exact regions for GTs, nested by KV-cache pipelining.

    ``buffer_tokens`` is the paper's b: a hosted GT's RL is at most half of what its host keeps,
    minus b, minus the tokens the host has written already.
    """

    name = "pipelined"
    periodic_growth = False
    copies_kv_to_cpu = True
    supports_max_requests = False  # (its own tables; a model with state layers runs on the paged managers)

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        buffer_tokens: int = 0,
        **options,
    ) -> None:
        """``options``: ``KVCacheManager``'s (bytes per token, CPU blocks, prefix caching)."""
        super().__init__(num_blocks, block_size, **options)
        if buffer_tokens < 0:
            raise ConfigError(f"pipelining buffer b must be >= 0 tokens, got {buffer_tokens}")
        self.buffer_tokens = buffer_tokens
        self._init_token_slots()
        self._init_shared_prefix(num_blocks)
        bs = block_size
        self._slots_of_block = [range(b * bs, b * bs + bs) for b in range(num_blocks)]  # block -> its slots
        self.regions: dict[Request, Region] = {}
        self.own_blocks: dict[Request, list[int]] = {}  # paged blocks for prompt and overflow tokens
        self._own_used: dict[Request, int] = {}  # slots taken in own_blocks
        self.num_evictions = 0

    # --- regions -------------------------------------------------------------------------------
    def reserve_region(self, request: Request, num_tokens: int) -> bool:
        """Allocate a top-level region of ``num_tokens`` (the predicted RL, padding included) from the
        pool, in whole blocks; all or nothing."""
        assert request not in self.regions, f"{request} already has a region"
        blocks = self._take(-(-num_tokens // self.block_size))
        if blocks is None:
            return False
        slots = self._block_slots(blocks, num_tokens)
        self.regions[request] = Region(request, slots, blocks=blocks, frontier=num_tokens)
        self.token_slots.setdefault(request, [])
        return True

    def _block_slots(self, blocks: list[int], num_tokens: int) -> list[int]:
        """The first ``num_tokens`` slots of ``blocks``, in order."""
        return list(chain.from_iterable(map(self._slots_of_block.__getitem__, blocks)))[:num_tokens]

    def region_blocks_needed(self, request: Request, num_tokens: int) -> int:
        """Pool blocks a region of ``num_tokens`` more offsets takes: a new one, or the extension of
        the request's own top-level region (``extend_region``)."""
        region = self.regions.get(request)
        spare = 0 if region is None else len(region.blocks) * self.block_size - len(region.slots)
        return max(0, -(-(num_tokens - spare) // self.block_size))

    def extend_region(self, request: Request, num_tokens: int) -> bool:
        """Add ``num_tokens`` offsets to the end of ``request``'s top-level region (a GT that used its
        whole region and goes on with a new predicted RL), in whole blocks; all or nothing.

        NOTE: a GT reaches its region's end only when nothing is hosted ahead of it, so the region
        has no hosted GTs and all of it is granted.
        """
        region = self.regions[request]
        assert region.parent is None and region.owner is request and not region.children, region
        blocks = self._take(self.region_blocks_needed(request, num_tokens))
        if blocks is None:
            return False
        region.blocks.extend(blocks)
        region.slots = self._block_slots(region.blocks, len(region.slots) + num_tokens)
        region.frontier = len(region.slots)
        return True

    def lend_limit(self, host: Request, buffer_tokens: int | None = None) -> int:
        """The largest RL a GT hosted next in ``host``'s region may have (< 1: nothing to lend).
        ``buffer_tokens`` overrides the manager's b (EconoServe sets b per host: a share of its RL).

        NOTE: lending happens when the host is admitted: once the host has been granted slots up to
        its first hosted GT (``allocate_slots``), what is left to lend is what it has not been granted.
        """
        region = self.regions.get(host)
        if region is None or region.owner is not host:
            return 0
        b = self.buffer_tokens if buffer_tokens is None else buffer_tokens
        half = region.frontier // 2
        mid = region.frontier - half  # the host keeps [0, mid), lends [mid, frontier)
        return min(half, mid - region.used - b)

    def lend(self, host: Request, hosted: Request, num_tokens: int, buffer_tokens: int | None = None) -> bool:
        """Host ``hosted`` (predicted RL ``num_tokens``) in the second half of what ``host`` keeps;
        False (nothing changes) when the RL exceeds ``lend_limit(host, buffer_tokens)``."""
        assert hosted not in self.regions, f"{hosted} already has a region"
        if not 1 <= num_tokens <= self.lend_limit(host, buffer_tokens):
            return False
        region = self.regions[host]
        half = region.frontier // 2
        mid = region.frontier - half
        child = Region(hosted, region.slots[mid : region.frontier], parent=region, start=mid, frontier=half)
        region.children.append(child)
        region.frontier = mid
        self.regions[hosted] = child
        self.token_slots.setdefault(hosted, [])
        return True

    def hosted_in_the_way(self, request: Request) -> Request | None:
        """The hosted GT occupying the slot ``request`` writes next (to evict before it grows)."""
        region = self.regions.get(request)
        if region is None or region.used >= len(region.slots):
            return None
        child = region.child_at(region.used)
        return None if child is None else child.owner

    # --- growth ----------------------------------------------------------------------------------
    def _own_slots(self, request: Request, count: int) -> list[int]:
        """``count`` more of the request's own paged slots (prompts, tokens past its region, restored
        tokens), filling its last own block before taking new ones. NOTE: the caller has checked
        that the blocks are free."""
        S = self.block_size
        used = self._own_used.get(request, 0)
        blocks = self.own_blocks.setdefault(request, [])
        end = used + count
        short = -(-end // S) - len(blocks)
        if short > 0:
            new = self._take(short)
            assert new is not None, "own blocks short"
            blocks.extend(new)
        self._own_used[request] = end
        first = used // S
        slots = self._block_slots(blocks[first : -(-end // S)], end - first * S)
        return slots[used - first * S :]

    def own_blocks_needed(self, request: Request, num_new: int) -> int:
        have = len(self.own_blocks.get(request, ())) * self.block_size - self._own_used.get(request, 0)
        return max(0, -(-(num_new - have) // self.block_size))

    @staticmethod
    def _barrier(region: Region) -> int:
        """The first offset at or after ``region.used`` that a hosted GT holds (the region's end if
        none): the owner may be granted every offset before it."""
        if not region.children:  # the common case: nothing hosted
            return len(region.slots)
        return min((c.start for c in region.children if c.start >= region.used), default=len(region.slots))

    def blocks_needed(self, request: Request, num_tokens: int, cached: Sequence[int] = ()) -> int:
        """New pool blocks growing ``request`` to ``num_tokens`` takes (region slots are held). A GT
        whose next region slot a hosted GT still holds cannot grow from free blocks: more than the
        pool (evict the hosted GT first). A prompt holding nothing yet that starts with the ``cached``
        blocks takes own blocks for the rest, and the cached ones nobody uses (they count as free)."""
        if cached and request not in self.token_slots:
            taken = self.prefix_cache.num_evictable(cached)
            return self.own_blocks_needed(request, num_tokens - len(cached) * self.block_size) + taken
        new = num_tokens - len(self.token_slots.get(request, ()))
        if new <= 0:
            return 0
        region = self.regions.get(request)
        if new == 1 and region is not None and region.used == len(region.slots):  # as in allocate_slots
            return self.own_blocks_needed(request, 1)
        if region is not None:
            barrier = self._barrier(region)
            if new > barrier - region.used and barrier < len(region.slots):
                return self.gpu.num_blocks + 1
            new -= barrier - region.used
        return self.own_blocks_needed(request, new) if new > 0 else 0

    def allocate_slots(self, request: Request, num_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Give ``request`` slots up to at least ``num_tokens`` tokens: a GT is granted its region's
        offsets up to the first one a hosted GT holds (or the region's end) at once, so that it asks
        again only there; tokens past its region, and prompts, take their own paged blocks (a prompt
        holding nothing yet starts with the ``cached`` blocks ``find_cached_prefix`` found). All or
        nothing: False when blocks are short or a hosted GT holds the next region slot (evict it with
        ``evict``, then retry)."""
        if cached and request not in self.token_slots:
            if self.blocks_needed(request, num_tokens, cached) > self.num_free_blocks:
                self.num_allocation_failures += 1
                return False
            self._share_prefix(request, cached)
        slots = self.token_slots.setdefault(request, [])
        new = num_tokens - len(slots)
        if new <= 0:
            return True
        region = self.regions.get(request)
        past_region = region is not None and region.used == len(region.slots)
        if new == 1 and past_region:
            # The common case past a region's end: the rest of the request's last own block.
            used = self._own_used.get(request, 0)
            blocks = self.own_blocks.get(request)
            S = self.block_size
            if blocks and used < len(blocks) * S:
                base = blocks[-1] * S
                slots.extend(range(base + used % S, base + S))
                self._own_used[request] = len(blocks) * S
                return True
        barrier = 0
        if region is not None:
            barrier = self._barrier(region)
            if new > barrier - region.used and barrier < len(region.slots):
                self.num_allocation_failures += 1
                return False
            new -= barrier - region.used
        overflow = max(new, 0)
        if self.own_blocks_needed(request, overflow) > self.num_free_blocks:
            self.num_allocation_failures += 1
            return False
        if region is not None:
            slots.extend(region.slots[region.used : barrier])
            region.used = barrier
            past_region = barrier == len(region.slots)
        if overflow:
            if past_region:  # to the end of the last own block: it asks again only for a new block
                overflow += -(self._own_used.get(request, 0) + overflow) % self.block_size
            slots.extend(self._own_slots(request, overflow))
        return True

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the own slots granted past ``request``'s first ``num_tokens`` tokens (a GT past
        its region's end is granted its last own block to the end): before it leaves the batch, so
        that what it is granted when it resumes is what a new grant would be."""
        slots = self.token_slots.get(request)
        if not slots or len(slots) <= num_tokens:
            return
        own, S = set(self.own_blocks.get(request, ())), self.block_size
        keep = len(slots)
        while keep > num_tokens and slots[keep - 1] // S in own:
            keep -= 1
        if keep < len(slots):
            # NOTE: own slots are granted in order, so the trimmed ones are the last taken.
            self._own_used[request] -= len(slots) - keep
            del slots[keep:]
            self._slots_rewritten(request)

    # --- eviction and restore ----------------------------------------------------------------------
    def evict(self, hosted: Request, num_written: int) -> None:
        """Its host needs the slots: copy the first ``num_written`` tokens of ``hosted`` that lie in its
        lent region to CPU memory, drop its granted but unwritten slots and give the region back (GTs
        hosted inside it stay, now inside the host's region)."""
        region = self.regions[hosted]
        assert region.parent is not None, "only hosted GTs are evicted"
        self.trim(hosted, num_written)
        slots = self.token_slots[hosted]
        lent = set(region.slots)
        # NOTE: slots past the written tokens are region slots granted ahead (own ones were trimmed).
        assert all(s in lent for s in slots[num_written:]), "unwritten slots outside the region"
        del slots[num_written:]
        self._slots_rewritten(hosted)
        saved = self.cpu_slots.setdefault(hosted, {})
        for token, slot in enumerate(slots):
            if slot in lent:
                cpu = self._take_cpu_slot()
                saved[token] = cpu
                self.pending_copies.append(SlotCopy(slot, cpu, to_cpu=True))
                slots[token] = CHECKPOINTED
        if not saved:
            del self.cpu_slots[hosted]
        self.swapped_bytes += len(saved) * self.kv_bytes_per_token
        self.num_evictions += 1
        self._leave_region(hosted)

    def restore_blocks_needed(self, request: Request) -> int:
        """Own blocks ``restore(request)`` takes."""
        saved = self.cpu_slots.get(request)
        return self.own_blocks_needed(request, len(saved)) if saved else 0

    def restore(self, request: Request) -> bool:
        """Bring an evicted GT's tokens back to fresh slots of its own blocks; all or nothing."""
        saved = self.cpu_slots.get(request)
        if not saved:
            return True
        if self.own_blocks_needed(request, len(saved)) > self.num_free_blocks:
            self.num_allocation_failures += 1
            return False
        slots = self.token_slots[request]
        self._slots_rewritten(request)
        restored = sorted(saved.items())
        for (token, cpu), slot in zip(restored, self._own_slots(request, len(restored)), strict=True):
            slots[token] = slot
            self.pending_copies.append(SlotCopy(cpu, slot, to_cpu=False))
            self._cpu_free.append(cpu)
        self.swapped_bytes += len(saved) * self.kv_bytes_per_token
        del self.cpu_slots[request]
        return True

    # --- release -----------------------------------------------------------------------------------
    def _leave_region(self, request: Request) -> None:
        """``request`` no longer uses its region: a hosted one returns to its host (with the GTs it
        hosts); a top-level one is released once nothing hosted in it runs."""
        region = self.regions.pop(request, None)
        if region is None:
            return
        region.owner = None
        parent = region.parent
        if parent is not None:
            parent.children.remove(region)
            for child in region.children:  # re-parent: their slots lie in the parent's range too
                child.parent, child.start = parent, child.start + region.start
                parent.children.append(child)
            region.children = []
            self._release_if_idle(parent)
        else:
            self._release_if_idle(region)

    def _release_if_idle(self, region: Region) -> None:
        """A top-level region whose owner left goes back to the pool when nothing runs inside it.

        NOTE: hosted regions are never left owner-less: ``_leave_region`` detaches them at once.
        """
        if region.parent is None and region.owner is None and not region.children:
            self._release(region.blocks)
            region.blocks = []

    def free(self, request: Request) -> None:
        self.cache_blocks(request, request.num_computed_tokens)  # its prompt's blocks stay cached
        self._leave_region(request)
        self._release_shared(request)
        blocks = self.own_blocks.pop(request, None)
        if blocks:
            self._release(blocks)
        self._own_used.pop(request, None)
        self.token_slots.pop(request, None)
        self._slots_rewritten(request)
        self._cpu_free.extend(self.cpu_slots.pop(request, {}).values())
        super().free(request)

    def swap_out(self, request: Request):
        """Whole-request swapping is not how this layout moves KV (eviction of hosted GTs is)."""
        return None

    # --- prefix caching (kv/shared_prefix.py) -------------------------------------------------------
    def _whole_block(self, request: Request, j: int) -> int | None:
        own = self.own_blocks.get(request)
        if not own:
            return None
        S, block = self.block_size, own[0]  # NOTE: the shared blocks were the first own ones
        return block if self.token_slots[request][j * S : j * S + S] == list(range(block * S, block * S + S)) else None

    def _give_up_block(self, request: Request, block: int) -> bool:
        assert self.own_blocks[request][0] == block
        del self.own_blocks[request][0]
        self._own_used[request] -= self.block_size
        return False

    # --- invariants ----------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Every slot holds at most one request's token; region and block bookkeeping agree."""
        owner_of: dict[int, Request] = {}
        for request, slots in self.token_slots.items():
            for slot in slots[len(self.prefix_blocks.get(request, ())) * self.block_size :]:
                if slot == CHECKPOINTED:
                    continue
                assert slot not in owner_of, f"slot {slot} holds tokens of {owner_of[slot]} and {request}"
                owner_of[slot] = request
        self._check_token_slots()
        top = {id(r): r for r in self._all_regions() if r.parent is None}
        pool_blocks = [b for r in top.values() for b in r.blocks] + [b for bl in self.own_blocks.values() for b in bl]
        assert len(set(pool_blocks)) == len(pool_blocks), "a block is used twice"
        cached = self._check_shared_prefix(pool_blocks)
        assert not cached & set(pool_blocks), "a shared block is someone's own"
        assert len(pool_blocks) + len(cached) + self.gpu.num_free == self.gpu.num_blocks, "blocks lost"
        for region in self._all_regions():
            for child in region.children:
                assert child.parent is region
                assert region.slots[child.start : child.start + len(child.slots)] == child.slots, "child not nested"
            spans = sorted((c.start, c.start + len(c.slots)) for c in region.children)
            assert all(s >= region.frontier for s, _ in spans), "a hosted region overlaps what its host kept"
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "hosted regions overlap"
            assert all(s >= region.used for s, _ in spans) or region.owner is None, "owner wrote into a lent slot"

    def _all_regions(self) -> list[Region]:
        seen: dict[int, Region] = {}
        stack = list(self.regions.values())
        while stack:
            region = stack.pop()
            if id(region) in seen:
                continue
            seen[id(region)] = region
            stack.extend(region.children)
            if region.parent is not None:
                stack.append(region.parent)
        return list(seen.values())
