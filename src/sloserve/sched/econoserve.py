"""EconoServe (papers/econoserve.md §3, Algorithm 1) and its variants D, SD, SDO, full, Oracle, and
the SyncCoupled scheduler of §2.2.

A request is a prompt task (PT) until its prompt is processed, then a generation task (GT). One
iteration, as in Algorithm 1:

    0. grow       running GTs take the slot of their next token; a hosted GT whose host reaches it is
                  evicted to CPU memory (§3.2); a GT past its padded region grows into the free KV
                  (the reserve) or, when there is none, stops with its KV kept (offload-free, O4)
    1. ①          when a GT group has completed, GT groups from the GT queue fill the KV up to the
                  reserve, each GT with an exact region of its predicted RL + padding (§3.3.1)
    2. ②          KV-cache pipelining: GTs hosted in the regions of the GTs just admitted (§3.2)
    3. ③          PTs from the PT queue until the forward size reaches the TFS (§3.3.1)
    4. ④ ⑤        execute; a PT whose prompt is done becomes a GT in the GT queue (ordered, §3.4)

Running GTs decode as one ``DecodeCohort`` and are never rescheduled per iteration (time-synced
batching, §3.3.2): their slots are granted ahead, so a step costs O(1) between KV events.

NOTE: GTs in the GT queue hold KV on the GPU (their prompt, and what they generated before an
offload-free stop): their status is RUNNING although they are not in the batch (``running``).

With prefix caching (ours; EconoServe predates it) a PT's prompt blocks found in the cache are not
computed, and neither the free KV nor the PTs' reserve is charged for them (a found block that nobody
used counts as taken from the free KV); a PT registers its prompt's full blocks chunk by chunk. The
reserve counts the KV that prompts in progress and queued GTs hold per holder, shared blocks included:
it may admit fewer PTs than an exact count would, never more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from sloserve.core.errors import ConfigError
from sloserve.core.outputs import (
    PreemptionMode,
    ScheduledChunk,
    SchedulerOutput,
)
from sloserve.core.request import Request, RequestStatus
from sloserve.cost.base import CostModel
from sloserve.cost.derived import jct_slo_s, saturating_forward_size
from sloserve.kv.manager import ExactReservationKVManager, KVCacheManager
from sloserve.kv.pipelined import PipelinedKVManager
from sloserve.predict import LengthPredictor
from sloserve.sched.cohort import CohortScheduler
from sloserve.sched.ordering import TaskQueue


@dataclass
class EconoServeConfig:
    """Knobs of EconoServe and its variants. Defaults: the paper's ShareGPT setting (§2.3, §4)."""

    decoupled: bool = True  # §3.3.1 PT and GT queues (False: SyncCoupled, §2.2)
    time_synced: bool = True  # §3.3.2 admit GTs only when a group completes (False: every iteration)
    ordering: bool = True  # §3.4 deadline / occupied KV / length ordering with binary search
    pipelining: bool = True  # §3.2 KV-cache pipelining (needs kv_manager=pipelined)
    target_forward_size: int | None = None  # TFS in tokens; None: where the cost model's throughput saturates
    tfs_saturation: float = 0.95  # the share of the best throughput that counts as saturated
    padding: float = 0.15  # predicted RL x (1 + padding) is allocated (ShareGPT's sweet spot, §2.3)
    reserve: float = 0.03  # share of the KV kept from GT admission, for PTs and overruns (§2.2: 3%)
    buffer: float = 0.15  # b as a share of the host's region (§4: 15% of the predicted RL)
    slo_scale: float = 2.0  # JCT SLO = scale x (t_p + t_g x l_g) (§4)
    urgent_deadline_s: float = 0.5  # deadline ranges: < 0.5 s, 0.5-2 s, > 2 s left (§3.4)
    soon_deadline_s: float = 2.0
    kv_range_tokens: int = 128  # width of an occupied-KV range (§3.4)
    predictor: Literal["oracle", "noisy-oracle", "histogram"] = "noisy-oracle"
    # The noisy oracle is calibrated to this accuracy at this padding (§2.3: ShareGPT 73.2% at 15%),
    # independently of the padding the scheduler allocates.
    predictor_accuracy: float = 0.732
    predictor_padding: float = 0.15
    predictor_seed: int = 0
    # Predictions in multiples of this (50: as from the predictor of [23], trained on lengths rounded
    # up to 50-token cells), the accuracy then calibrated on the bundled ShareGPT output lengths.
    # NOTE: default 1: at 73.2% accuracy, 50-token cells need sigma 0.51 instead of 0.23 and
    # over-provision 35% of the allocated KV (paper, Figure 5a: 5.6%), and GT groups still average
    # 1.0-1.1 GTs at the rates EconoServe sustains (the GT queue is short there).
    predictor_bucket_tokens: int = 1
    histogram_quantile: float = 0.5
    # A trace (a served request log) whose prompt and output lengths the histogram starts from
    histogram_history: str | None = None
    max_num_seqs: int = 1024
    max_num_batched_tokens: int | None = None  # upper bound of the TFS (None: max(model length, 2048))
    block_size: int = 16
    kv_manager: Literal["exact", "pipelined"] = "exact"

    def resolve(self, max_model_len: int) -> None:
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(max_model_len, 2048)
        for name in ("padding", "reserve", "buffer"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                raise ConfigError(f"EconoServe {name} must be in [0, 1), got {value}")
        if self.target_forward_size is not None and not 0 < self.target_forward_size <= self.max_num_batched_tokens:
            raise ConfigError(
                f"target_forward_size (TFS) must be in (0, max_num_batched_tokens={self.max_num_batched_tokens}], "
                f"got {self.target_forward_size}"
            )
        # (finite: a deadline of inf has no place on the deadline wheel)
        if not (self.slo_scale > 0 and math.isfinite(self.slo_scale)):
            raise ConfigError(f"slo_scale must be a finite number > 0, got {self.slo_scale}")
        if not 0 < self.urgent_deadline_s < self.soon_deadline_s < math.inf:
            raise ConfigError(
                f"deadline ranges need 0 < urgent_deadline_s < soon_deadline_s, both finite, got "
                f"{self.urgent_deadline_s}, {self.soon_deadline_s}"
            )
        if min(self.kv_range_tokens, self.max_num_seqs, self.block_size, self.predictor_bucket_tokens) < 1:
            raise ConfigError("kv_range_tokens, max_num_seqs, block_size and predictor_bucket_tokens must be >= 1")
        if self.predictor not in ("oracle", "noisy-oracle", "histogram"):
            raise ConfigError(f"unknown predictor {self.predictor!r}; valid: histogram, noisy-oracle, oracle")
        if self.pipelining != (self.kv_manager == "pipelined"):
            raise ConfigError("KV-cache pipelining and kv_manager=pipelined go together")
        if self.kv_manager not in ("exact", "pipelined"):
            raise ConfigError(f"EconoServe uses kv_manager exact or pipelined, got {self.kv_manager!r}")
        if self.pipelining and not self.decoupled:
            raise ConfigError("KV-cache pipelining needs decoupled PT and GT queues")


class EconoServeScheduler(CohortScheduler):
    """EconoServe with the mechanisms of ``EconoServeConfig`` switched on or off."""

    name = "econoserve"
    supports_prefix_caching = True

    def __init__(
        self,
        kv: KVCacheManager,
        config: EconoServeConfig,
        predictor: LengthPredictor | None = None,
        cost_model: CostModel | None = None,
    ) -> None:
        super().__init__(kv, predictor)
        assert predictor is not None and cost_model is not None, "EconoServe needs a predictor and a cost model"
        assert isinstance(kv, PipelinedKVManager if config.pipelining else ExactReservationKVManager), kv
        self.config = config
        self.cost_model = cost_model
        c = config.max_num_batched_tokens or 0
        # TFS: the forward size at which throughput saturates (§2.1).
        self.target_forward_size = config.target_forward_size or saturating_forward_size(
            cost_model, c, fraction=config.tfs_saturation
        )
        self._coupled_token_budget = c  # SyncCoupled: prompt tokens per step
        self.reserve_blocks = int(config.reserve * kv.gpu.num_blocks)
        order = "ordered" if config.ordering else "grouped" if config.time_synced else "fcfs"
        ranges = (config.urgent_deadline_s, config.soon_deadline_s)
        # PT queue: by prompt length (decoupled) or, SyncCoupled, requests grouped by predicted RL.
        pt_order = "ordered" if config.ordering else "fcfs" if config.decoupled else order
        self.pt_queue = TaskQueue(pt_order, ranges, config.kv_range_tokens, lookup_by_length=False)
        # Pipelining looks up hosted GTs by length (largest_at_most).
        self.gt_queue = TaskQueue(order, ranges, config.kv_range_tokens, lookup_by_length=config.pipelining)
        self._deadline: dict[Request, float] = {}
        self._remaining: dict[Request, int] = {}  # predicted RL still to come (L), of queued GTs
        # Running GTs: tokens their exact region covers (prompt + generated + padded L at admission);
        # dropped once the GT has run past it (counted once per region as an allocation failure).
        self._region_end: dict[Request, int] = {}
        self._queued_kv_tokens = 0  # KV held by the GT queue
        # Running groups: GTs admitted together with the same predicted RL.
        self._group_of: dict[Request, int] = {}
        self._group_left: dict[int, int] = {}
        self._num_groups = 0
        self._refill = True  # a group completed (or KV came free) since the last GT admission
        # What the paper's figures report.
        self.group_sizes: list[int] = []  # size of every GT group admitted (Figure 2)
        self.num_offload_free_stops = 0
        self.num_hosted = 0
        self.num_hosted_evictions = 0
        self.num_dropped = 0  # queued GTs whose KV was dropped so that the queue can move (liveness)
        # Why pipelining hosts what it hosts: the GTs left in the queue when ① is done (the only ones
        # ② can host), per admission round, and the lend limit (l/2 - b) of every GT ② offers as a host.
        self.gt_queue_after_admission: list[int] = []
        self.lend_limits: list[int] = []

    # --- arrivals and transitions ------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """A PT arrives: its RL is predicted and its JCT deadline set (§4); it waits in the PT queue."""
        request.status = RequestStatus.WAITING
        assert self.predictor is not None
        predicted = self.predictor.predict(request)
        request.predicted_output_tokens = predicted
        self._deadline[request] = request.arrival_time + jct_slo_s(
            self.cost_model, request.num_prompt_tokens, predicted, self.config.slo_scale
        )
        self._queue_pt(request)

    def _queue_pt(self, request: Request) -> None:
        length = request.num_tokens if self.config.decoupled else request.predicted_output_tokens or 1
        self.pt_queue.add(request, self._deadline[request], 0, length)

    def has_unfinished(self) -> bool:
        return bool(self.pt_queue or self.gt_queue or self.running)

    def on_token_emitted(self, request: Request) -> None:
        """⑤ A PT whose prompt is done becomes a GT: decoupled, it waits in the GT queue with its
        prompt's KV; SyncCoupled, it decodes at once in the region it was admitted with."""
        if not self.config.decoupled:
            self._join_cohort(request)
            return
        del self.running[request]
        self.outside_cohort.pop(request, None)
        self._queue_gt(request, self._predicted_remaining(request))

    def _predicted_remaining(self, request: Request) -> int:
        """L: output tokens still to come by the arrival prediction, or re-predicted once the GT has
        generated that many (L_new, §3.3.2)."""
        left = (request.predicted_output_tokens or 1) - request.num_output_tokens
        if left >= 1:
            return left
        assert self.predictor is not None
        return self.predictor.predict_remaining(request)

    def _queue_gt(self, request: Request, remaining: int) -> None:
        self._remaining[request] = remaining
        held = request.num_computed_tokens
        self.gt_queue.add(request, self._deadline[request], held, remaining)
        self._queued_kv_tokens += held
        # KV came free for it (time-synced batching admits when "there is available KVC").
        if self._gt_blocks(request) <= self._gt_room_blocks():
            self._refill = True

    def _unqueue_gt(self, request: Request) -> int:
        self.gt_queue.remove(request)
        self._queued_kv_tokens -= request.num_computed_tokens
        return self._remaining.pop(request)

    # --- allocation sizes ----------------------------------------------------------------------------
    def _region_tokens(self, request: Request, remaining: int, held: int | None = None) -> int:
        """Exact allocation: the predicted RL plus padding, capped so that the request fits the cache alone
        beside the ``held`` tokens its region follows (default: those computed, a GT's; a SyncCoupled
        PT's region follows its prompt). The cap is only reached by predictions longer than the cache."""
        held = request.num_computed_tokens if held is None else held
        padded = math.ceil(remaining * (1 + self.config.padding))
        room = self.kv.capacity_tokens - self.reserve_blocks * self.kv.block_size - held
        return max(1, min(padded, room))

    def _gt_blocks(self, request: Request, remaining: int | None = None) -> int:
        """Pool blocks admitting the queued GT takes: its region, and its tokens back from CPU."""
        region = self._region_tokens(request, self._remaining[request] if remaining is None else remaining)
        kv = self.kv
        if isinstance(kv, PipelinedKVManager):
            return kv.region_blocks_needed(request, region) + kv.restore_blocks_needed(request)
        have = len(kv.block_tables.get(request, ()))
        return max(0, -(-(request.num_computed_tokens + region) // kv.block_size) - have)

    # --- Algorithm 1 ----------------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        self.pt_queue.advance(now)
        self.gt_queue.advance(now)
        self._grow_running(out)  # 0
        if self._refill or not self.config.time_synced or not self.cohort:
            self._refill = False
            if self.config.decoupled:
                self._admit_gt_groups(out)  # ① and ②
            else:
                self._admit_coupled_groups(out)
        self._fill_forward(out)  # ③
        self._schedule_cohort(out)
        if isinstance(self.kv, PipelinedKVManager):
            out.slot_copies = self.kv.take_copies()
            out.swap_bytes += len(out.slot_copies) * self.kv.kv_bytes_per_token
        out.cohort_joined = self._take_joined()
        return out

    # --- 0: growth, evictions of hosted GTs, overruns --------------------------------------------------
    def _grow_running(self, out: SchedulerOutput) -> None:
        cohort, kv = self.cohort, self.kv
        tick = cohort.ticks + 1
        for gt in cohort.due_members(tick):
            # A GT due past its region was under-provisioned (O4): a KV allocation failure, whether
            # the reserve absorbs it below or it stops.
            if gt.num_computed_tokens + 1 > self._region_end.get(gt, math.inf):
                del self._region_end[gt]
                gt.num_allocation_failures += 1
            if isinstance(kv, PipelinedKVManager):
                hosted = kv.hosted_in_the_way(gt)
                while hosted is not None:  # §3.2: not done when its host needs the slots
                    self._evict_hosted(hosted, out)
                    hosted = kv.hosted_in_the_way(gt)
        while not cohort.try_grow(tick):
            # O4: GTs past their region that the free KV (the reserve) cannot grow stop, least urgent first.
            overrun = [r for r in cohort.due_members(tick) if kv.blocks_needed(r, r.num_computed_tokens + 1)]
            self._stop(max(overrun, key=lambda r: (self._deadline[r], r.request_id)), out)

    def _leave_batch(self, request: Request) -> None:
        if request.cohort is not None:
            request.cohort.remove(request)
        del self.running[request]
        self.outside_cohort.pop(request, None)
        self._leave_group(request)
        self._region_end.pop(request, None)
        request.num_preemptions += 1
        self.num_preemptions += 1

    def _stop(self, request: Request, out: SchedulerOutput) -> None:
        """Offload-free preemption (§3.3.2): the under-provisioned GT leaves the batch with its KV and
        is regrouped by its new predicted RL; its occupied KV puts it early in the GT queue."""
        kv = self.kv
        if isinstance(kv, PipelinedKVManager) and kv.regions[request].parent is not None:
            # A hosted GT cannot keep its host's slots while it waits: it goes to CPU memory instead.
            self._evict_hosted(request, out)
            return
        self._leave_batch(request)
        if isinstance(kv, PipelinedKVManager):
            kv.trim(request, request.num_computed_tokens)  # the slots granted ahead of its tokens
        self.num_offload_free_stops += 1
        out.add_preemption(request, PreemptionMode.KEEP)
        self._queue_gt(request, self._predicted_remaining(request))

    def _evict_hosted(self, request: Request, out: SchedulerOutput) -> None:
        """§3.2: a hosted GT still running when its host reaches its slots moves to CPU memory."""
        assert isinstance(self.kv, PipelinedKVManager)
        self._leave_batch(request)
        request.num_allocation_failures += 1  # it lost the slots it was still writing
        self.kv.evict(request, request.num_computed_tokens)
        self.num_hosted_evictions += 1
        out.add_preemption(request, PreemptionMode.SWAP)
        self._queue_gt(request, self._predicted_remaining(request))

    # --- 1 and 2: GT groups and hosted GTs -------------------------------------------------------------
    def _admit_gt_groups(self, out: SchedulerOutput) -> None:
        """① GT groups in queue order until the KV is allocated up to the reserve (a group that does
        not fit is split); with ordering, a binary search finds a GT that fits what is left."""
        queue, kv = self.gt_queue, self.kv
        admitted: list[Request] = []
        groups: dict[int, int] = {}  # predicted RL -> group id, this admission round
        room = self._gt_room_blocks()
        while queue and len(self.running) < self.config.max_num_seqs:
            request = queue.first()
            assert request is not None
            blocks = self._gt_blocks(request)
            if blocks > room:
                if not self.config.ordering:
                    break  # the head group is split here; the rest waits for the next completion
                fit = self._fitting_gt(room)
                if fit is None:
                    break
                request, blocks = fit
            room -= blocks
            self._start_gt(request, self._unqueue_gt(request), groups, admitted)
        if not admitted and queue and not self.running:
            self._unblock_gt_queue(out, groups, admitted)
        self.gt_queue_after_admission.append(len(queue))
        if self.config.pipelining:
            self._host_gts(admitted, groups)  # ②
        for request in admitted:
            done = kv.allocate_slots(request, request.num_computed_tokens + 1)
            assert done
            self._join_cohort(request)

    def _fitting_gt(self, room_blocks: int) -> tuple[Request, int] | None:
        """Binary search (§3.4) for a GT whose allocation fits ``room_blocks``: the longest predicted
        RL whose padded region fits, in the most urgent ranges, and the blocks it takes; None when
        none does."""
        bs, pad = self.kv.block_size, self.config.padding
        max_rl = int(room_blocks * bs / (1 + pad))
        while max_rl >= 1:
            request = self.gt_queue.first_fit(max_rl)
            if request is None:
                return None
            blocks = self._gt_blocks(request)
            if blocks <= room_blocks:
                return request, blocks
            max_rl = self._remaining[request] - 1  # its prompt's partial block or restore did not fit
        return None

    def _unblock_gt_queue(self, out: SchedulerOutput, groups: dict[int, int], admitted: list[Request]) -> None:
        """Liveness: nothing runs and the head GT does not fit beside the KV the queue holds. It may
        use the reserve; if that is not enough, queued GTs from the back drop their KV (recompute)."""
        head = self.gt_queue.first()
        assert head is not None
        while self._gt_blocks(head) > self.kv.num_free_blocks:
            victim = list(self.gt_queue)[-1]
            if victim is head:
                break
            self._drop(victim, out)
        if self._gt_blocks(head) <= self.kv.num_free_blocks:
            self._start_gt(head, self._unqueue_gt(head), groups, admitted)

    def _drop(self, request: Request, out: SchedulerOutput) -> None:
        self._unqueue_gt(request)
        self.kv.free(request)
        request.reset_computed()
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        request.num_allocation_failures += 1
        self.num_preemptions += 1
        self.num_dropped += 1
        out.add_preemption(request, PreemptionMode.RECOMPUTE)
        self._queue_pt(request)

    def _start_gt(
        self,
        request: Request,
        remaining: int,
        groups: dict[int, int],
        admitted: list[Request],
        host: Request | None = None,
    ) -> None:
        """Allocate the GT's region (exact allocation) and put it in the batch with its group."""
        kv = self.kv
        region = self._region_tokens(request, remaining)
        self._region_end[request] = request.num_computed_tokens + region
        if isinstance(kv, PipelinedKVManager):
            done = kv.restore(request)
            assert done
            if host is not None:
                done = kv.lend(host, request, region, self._buffer_tokens(host))
                assert done
                self.num_hosted += 1
            elif request in kv.regions:
                done = kv.extend_region(request, region)
                assert done
            else:
                done = kv.reserve_region(request, region)
                assert done
        else:
            assert isinstance(kv, ExactReservationKVManager)
            kv.set_reservation(request, request.num_computed_tokens + region)
            done = kv.allocate_slots(request, request.num_computed_tokens + region)
            assert done
        self._admit_in_group(request, remaining, groups, admitted)

    def _admit_in_group(
        self, request: Request, remaining: int, groups: dict[int, int], admitted: list[Request]
    ) -> None:
        """Put ``request`` in the batch, in this admission round's group of its predicted RL."""
        self._admit(request)
        group = groups.get(remaining)
        if group is None:
            group = groups[remaining] = self._num_groups
            self._num_groups += 1
            self._group_left[group] = 0
            self.group_sizes.append(0)
        self._group_of[request] = group
        self._group_left[group] += 1
        self.group_sizes[group] += 1
        admitted.append(request)

    def _buffer_tokens(self, host: Request) -> int:
        """b for ``host``: the buffer share of its region (§4: a share of the predicted RL)."""
        assert isinstance(self.kv, PipelinedKVManager)
        return math.ceil(self.config.buffer * len(self.kv.regions[host].slots))

    def _host_gts(self, hosts: list[Request], groups: dict[int, int]) -> None:
        """② KV-cache pipelining (§3.2): each admitted GT hosts, in the second half of what it keeps,
        the queued GT whose padded RL is the largest at most its lend limit (l/2 - b, then l/4 - b,
        ...), recursively in the hosted GTs' own regions."""
        kv, queue, pad = self.kv, self.gt_queue, self.config.padding
        assert isinstance(kv, PipelinedKVManager)
        i = 0
        while i < len(hosts) and len(self.running) < self.config.max_num_seqs:
            host = hosts[i]
            i += 1
            b = self._buffer_tokens(host)
            limit = kv.lend_limit(host, b)
            self.lend_limits.append(limit)
            while len(self.running) < self.config.max_num_seqs:
                max_rl = int(limit / (1 + pad))
                while max_rl >= 1 and math.ceil(max_rl * (1 + pad)) > limit:
                    max_rl -= 1
                hosted = queue.largest_at_most(max_rl) if max_rl >= 1 else None
                if (
                    hosted is None
                    or hosted in kv.regions  # holds a region of its own (stopped after using it)
                    or kv.restore_blocks_needed(hosted) > self._gt_room_blocks()
                ):
                    break
                self._start_gt(hosted, self._unqueue_gt(hosted), groups, hosts, host=host)
                limit = kv.lend_limit(host, b)  # what the host has left to lend

    def _leave_group(self, request: Request) -> None:
        group = self._group_of.pop(request, None)
        if group is not None:
            self._group_left[group] -= 1
            if self._group_left[group] == 0:
                del self._group_left[group]
                self._refill = True  # §3.3.2: a group completed

    # --- SyncCoupled (§2.2) ------------------------------------------------------------------------------
    def _admit_coupled_groups(self, out: SchedulerOutput) -> None:
        """Requests grouped by predicted RL, each allocated prompt + padded RL, fill the KV up to the
        reserve; their prompts run, then they decode together. No PT joins between completions.

        GTs stopped past their region (O4) come first: they hold KV, and go on decoding in a region
        of their new predicted RL; when nothing runs then (no PT fits either) and the head does not fit,
        queued GTs drop their KV until it does (``_unblock_gt_queue``, as the decoupled variants).
        NOTE: a request alone fits (``_region_tokens`` caps the region to what the cache holds beside its
        tokens, or a PT's prompt, and queued PTs hold no KV), so the queues always move.
        """
        queue, kv = self.pt_queue, self.kv
        assert isinstance(kv, ExactReservationKVManager)
        groups: dict[int, int] = {}
        admitted: list[Request] = []
        room = kv.num_free_blocks - (self.reserve_blocks if self.running else 0)
        resumed_groups: dict[int, int] = {}  # their own groups: they have no prompt to run first
        while self.gt_queue and len(self.running) < self.config.max_num_seqs:
            request = self.gt_queue.first()
            assert request is not None
            blocks = self._gt_blocks(request)
            if blocks > room:
                break
            room -= blocks
            self._start_gt(request, self._unqueue_gt(request), resumed_groups, [])
            self._join_cohort(request)
        while queue and len(self.running) < self.config.max_num_seqs:
            request = queue.first()
            assert request is not None
            remaining = request.predicted_output_tokens or 1
            held = request.num_tokens - 1  # (RL outputs take RL - 1 slots past the prompt: the last is not computed)
            target = held + self._region_tokens(request, remaining, held)
            cached = kv.find_cached_prefix(request)
            blocks = kv.blocks_needed(request, target, cached)
            if blocks > room:
                break
            queue.remove(request)
            room -= blocks
            kv.set_reservation(request, target)
            done = kv.allocate_slots(request, request.num_tokens, cached)
            assert done
            self._admit_in_group(request, remaining, groups, admitted)
            self._skip_cached(request, cached, out)
        if self.gt_queue and not self.running:  # liveness: queued GTs hold the KV the head needs
            resumed: list[Request] = []
            self._unblock_gt_queue(out, resumed_groups, resumed)
            for request in resumed:
                self._join_cohort(request)

    # --- 3: PTs up to the TFS --------------------------------------------------------------------------
    def _fill_forward(self, out: SchedulerOutput) -> None:
        """③ Prompts in progress go on, then PTs join until the forward size reaches the TFS. A PT
        takes KV for its whole prompt (the reserve included) and may be chunked to hit the TFS."""
        budget = self.target_forward_size if self.config.decoupled else self._coupled_token_budget
        room = budget - len(self.cohort)
        for request in self.outside_cohort:  # prompts in progress (chunked)
            if room <= 0:
                return
            num_tokens = min(request.num_tokens_to_process, room)
            self._add_prompt_chunk(out, request, num_tokens)
            room -= num_tokens
        if not self.config.decoupled:
            return
        queue, kv = self.pt_queue, self.kv
        while room > 0 and queue and len(self.running) < self.config.max_num_seqs:
            request = queue.first()
            assert request is not None
            if self.config.ordering and queue.length(request) > room:
                request = queue.first_fit(room) or request  # a prompt that fills the rest, else chunk
            tokens = request.num_tokens
            cached = kv.find_cached_prefix(request)  # (none without prefix caching)
            new_tokens = tokens - len(cached) * kv.block_size
            if kv.blocks_needed(request, tokens, cached) > kv.num_free_blocks or not self._pt_fits_reserve(new_tokens):
                break
            queue.remove(request)
            done = kv.allocate_slots(request, tokens, cached)
            assert done
            self._admit(request)
            self._skip_cached(request, cached, out)
            num_tokens = min(new_tokens, room)
            self._add_prompt_chunk(out, request, num_tokens)
            room -= num_tokens

    def _skip_cached(self, request: Request, cached: list[int], out: SchedulerOutput) -> None:
        """With prefix caching: the PT just admitted starts past the ``cached`` blocks of its prompt."""
        if self.kv.prefix_cache is not None:
            self._skip_cached_prefix(request, cached, out)

    def _add_prompt_chunk(self, out: SchedulerOutput, request: Request, num_tokens: int) -> None:
        """Schedule ``num_tokens`` of the PT's prompt; with prefix caching, register the full blocks
        they complete (as the unified scheduler does)."""
        out.chunks.append(ScheduledChunk(request, num_tokens))
        if self.kv.prefix_cache is not None:
            self.kv.cache_blocks(request, request.num_computed_tokens + num_tokens)

    def _pt_held_tokens(self) -> int:
        """KV held by tasks without a region: prompts in progress and GTs in the GT queue."""
        return self._queued_kv_tokens + sum(r.num_tokens for r in self.outside_cohort)

    def _pt_fits_reserve(self, new_tokens: int) -> bool:
        """The reserve is the PTs' share of the KV (§3.3.1, Figure 8b): a PT whose prompt adds
        ``new_tokens`` of KV (those not cached) joins while the KV held by prompts in progress and GTs
        waiting for a region stays within it (a prompt larger than the whole reserve joins when
        nothing else holds any).

        NOTE: the paper keeps the reserve "for adding PTs at each iteration"; we read it as the KV
        prompts may hold until their GT gets a region. Without such a bound prompts outpace
        generation and their KV fills the cache until no GT region fits.
        """
        held = self._pt_held_tokens()
        return held == 0 or held + new_tokens <= self.reserve_blocks * self.kv.block_size

    def _gt_room_blocks(self) -> int:
        """Free blocks GT regions may take: all but what is left of the PTs' reserve."""
        reserve_left = -(
            -max(0, self.reserve_blocks * self.kv.block_size - self._pt_held_tokens()) // self.kv.block_size
        )
        return self.kv.num_free_blocks - reserve_left

    # --- finishing, metrics, fast path -------------------------------------------------------------------
    def policy_metrics(self) -> dict[str, Any]:
        """Figure 2's GT group sizes, the TFS, how often each misprediction remedy ran, and what
        pipelining had to work with (queued GTs after ①, lend limits); the prefix cache's counters."""
        return {
            **super().policy_metrics(),
            "target_forward_size": self.target_forward_size,
            "gt_group_sizes": list(self.group_sizes),
            "num_offload_free_stops": self.num_offload_free_stops,
            "num_hosted_gts": self.num_hosted,
            "num_hosted_evictions": self.num_hosted_evictions,
            "num_dropped_gts": self.num_dropped,
            "gt_queue_after_admission": list(self.gt_queue_after_admission),
            "lend_limit_tokens": list(self.lend_limits),
        }

    def _finish(self, request: Request, now: float) -> None:
        super()._finish(request, now)
        self._leave_group(request)
        self._region_end.pop(request, None)
        self._deadline.pop(request, None)

    def kv_used_tokens(self) -> int:
        return super().kv_used_tokens() + self._queued_kv_tokens

    def decode_horizon(self, output: SchedulerOutput, limit: int) -> int:
        """Decode-only steps repeat until a KV event (a GT outgrowing its granted slots), a completion,
        an arrival or, with ordering, a queued task moving to a more urgent deadline range
        (``stretch_deadline``): a step that admitted nothing admits nothing again while the queues keep
        their order, the cohort its size and the free KV only shrinks."""
        return self._cohort_memory_horizon(output, limit)

    def stretch_deadline(self) -> float:
        """With ordering, the queues' order moves with the clock (§3.4's deadline ranges)."""
        if not self.config.ordering:
            return math.inf
        return min(self.pt_queue.next_move_time(), self.gt_queue.next_move_time())

    repeat = CohortScheduler._cohort_repeat  # NOTE: the base class's method itself: a call fewer per stretch

    def check_fits(self, request: Request, max_kv_tokens: int) -> None:
        kv = self.kv
        usable = kv.capacity_tokens - self.reserve_blocks * kv.block_size
        if max_kv_tokens > usable:
            raise ConfigError(
                f"KV capacity {kv.capacity_tokens} tokens ({self.reserve_blocks} blocks of {kv.block_size} "
                f"reserved) cannot hold request {request.request_id}: prompt {request.num_prompt_tokens} + "
                f"output {max_kv_tokens - request.num_prompt_tokens + 1} - 1 = {max_kv_tokens} tokens"
            )

    def check_integrity(self) -> None:
        """Invariants across the PT and GT queues, the batch, the cohort and the KV manager."""
        self.kv.check_integrity()
        self.cohort.check_integrity()
        assert set(self.outside_cohort) | set(self.cohort.members) == set(self.running)
        assert not set(self.outside_cohort) & set(self.cohort.members)
        for r in self.running:
            assert r.status is RequestStatus.RUNNING and r not in self.gt_queue and r not in self.pt_queue, r
        held = 0
        for r in self.gt_queue:
            assert r.status is RequestStatus.RUNNING and r not in self.pt_queue, r
            assert self.kv.num_tracked_tokens(r) >= r.num_computed_tokens > 0, r
            held += r.num_computed_tokens
        assert held == self._queued_kv_tokens, (held, self._queued_kv_tokens)
        for r in self.pt_queue:
            assert r.status is RequestStatus.WAITING and r.num_computed_tokens == 0, r
            assert self.kv.num_tracked_tokens(r) == 0, r
        assert sum(self._group_left.values()) == len(self._group_of)
