"""InferMax's unified scheduler (papers/infermax.md §3.1, Algorithm 1) and its vLLM, Sarathi-Serve and
ORCA presets.

GETNEXTBATCH walks request groups in priority order (1), skips a candidate of the other phase when
hybrid batching is off (2), checks CANALLOCATE against the token budget C, the prefill budget P and
the KV memory M (3), and on a memory failure evicts lower-priority running requests (4):

    prefill_first (vLLM):   R_w (waiting: prefills and refills), then R_r (running decodes)
    decode_first (Sarathi): R_r^d (running decodes), R_r^p (running chunked prefills), then R_w

Running decodes form one ``DecodeCohort`` that is scheduled as a group: every member takes one token,
and the group's memory need is the blocks its members must grow by this step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from sloserve.core.errors import ConfigError
from sloserve.core.outputs import PreemptionMode, ScheduledChunk, SchedulerOutput
from sloserve.core.request import Request, RequestClass
from sloserve.kv.manager import ExactReservationKVManager, KVCacheManager
from sloserve.predict import LengthPredictor
from sloserve.sched.base import check_fits_alone
from sloserve.sched.cohort import CohortScheduler


@dataclass
class UnifiedConfig:
    """Knobs of Algorithm 1 (InferMax Table 1). Validated by ``validate``."""

    priority: Literal["prefill_first", "decode_first"] = "prefill_first"
    hybrid_batching: bool = False  # prefill and decode requests in one batch
    chunked_prefill: bool = False  # split prompts into chunks of at most P tokens per batch
    max_num_batched_tokens: int | None = None  # C: tokens per batch (None: max(model length, 2048))
    prefill_token_budget: int | None = None  # P: tokens per batch once prefills join (None: C)
    max_num_seqs: int = 256  # running requests at most
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    watermark: float = 0.01  # fraction of blocks kept free when admitting prefills (vLLM)
    kv_manager: Literal["paged", "max", "exact"] = "paged"
    block_size: int = 16
    # m_reserve at admission: the prompt (plus generated tokens on a refill), or prompt + predicted
    # output - 1 held as an exact reservation (eviction-free variants with the oracle; InferMax §6
    # with the online histogram).
    # "predicted_check": admit only if prompt + predicted output - 1 fits in the free KV (CANALLOCATE's
    # M check with that m_reserve), but hold only the prompt (paged growth).
    reservation: Literal["prompt", "predicted", "predicted_check"] = "prompt"
    predictor: Literal["none", "oracle", "histogram"] = "none"
    histogram_quantile: float = 0.5  # the output-length quantile the histogram predicts
    # A trace (a served request log) whose prompt and output lengths the histogram starts from
    histogram_history: str | None = None
    # Whom to evict when the decode group's KV does not fit (4): the lowest-priority running request
    # (the latest admitted), or the one holding the least KV (InferMax §6: keep long, evict short).
    eviction_victim: Literal["lowest_priority", "shortest"] = "lowest_priority"
    # Where a recomputed request waits: the queue's front (vLLM v0) or its back (InferMax Algorithm 1,
    # "any evicted request is ... appended to R_w").
    evicted_to: Literal["front", "back"] = "front"
    # Disaggregated serving (DistServe): a prefill replica hands each request off after its first
    # token; a decode replica admits requests that arrive with their KV.
    role: Literal["colocated", "prefill", "decode"] = "colocated"
    # Real-time requests before best-effort ones: admitted first, evicted last (BROS's "vLLM with
    # priority" baseline).
    class_priority: bool = False
    # The waiting queue's order: first come, first served, or longest prefix match first (SGLang's
    # "lpm": the request whose prompt has the most blocks in the prefix cache; ties by arrival). Like
    # SGLang, lpm falls back to FCFS while more than LPM_MAX_WAITING requests wait (matching them all
    # every step costs more than it gains). Without prefix caching the two are the same. "priority":
    # vLLM's --scheduling-policy priority: by (priority, arrival), and the lowest-priority victim is
    # the running request with the largest (priority, arrival).
    waiting_order: Literal["fcfs", "lpm", "priority"] = "fcfs"

    def resolve(self, max_model_len: int) -> None:
        """Fill defaults that depend on the model and check every knob."""
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(max_model_len, 2048)
        if self.prefill_token_budget is None:
            self.prefill_token_budget = self.max_num_batched_tokens
        c, p = self.max_num_batched_tokens, self.prefill_token_budget
        if self.priority not in ("prefill_first", "decode_first"):
            raise ConfigError(f"priority must be prefill_first or decode_first, got {self.priority!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ConfigError(f"preemption_mode must be recompute or swap, got {self.preemption_mode!r}")
        if c < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {c}")
        if p < 1:
            raise ConfigError(f"prefill_token_budget must be >= 1, got {p}")
        if p > c:
            raise ConfigError(f"prefill_token_budget P={p} exceeds max_num_batched_tokens C={c}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_seqs > c:
            raise ConfigError(
                f"max_num_seqs={self.max_num_seqs} exceeds max_num_batched_tokens C={c}: "
                "every running decode must fit in one batch"
            )
        if not self.chunked_prefill and p < max_model_len:
            raise ConfigError(
                f"without chunked prefill a whole prompt must fit one batch: P={p} < model length "
                f"{max_model_len}; raise prefill_token_budget or set chunked_prefill=true"
            )
        if self.chunked_prefill and not self.hybrid_batching:
            raise ConfigError("chunked prefill needs hybrid batching (a chunked prompt runs beside decodes)")
        if not 0 <= self.watermark < 1:
            raise ConfigError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.reservation == "predicted_check" and self.predictor == "none":
            raise ConfigError("reservation=predicted_check needs a predictor (oracle or histogram)")
        if self.reservation == "predicted" and (self.kv_manager != "exact" or self.predictor == "none"):
            raise ConfigError(
                "reservation=predicted needs kv_manager=exact and a predictor (oracle or histogram), "
                f"got kv_manager={self.kv_manager}, predictor={self.predictor}"
            )
        if self.role not in ("colocated", "prefill", "decode"):
            raise ConfigError(f"role must be colocated, prefill or decode, got {self.role!r}")
        if self.eviction_victim not in ("lowest_priority", "shortest"):
            raise ConfigError(f"eviction_victim must be lowest_priority or shortest, got {self.eviction_victim!r}")
        if self.evicted_to not in ("front", "back"):
            raise ConfigError(f"evicted_to must be front or back, got {self.evicted_to!r}")
        if self.waiting_order not in ("fcfs", "lpm", "priority"):
            raise ConfigError(f"waiting_order must be fcfs, lpm or priority, got {self.waiting_order!r}")


# SGLang's lpm policy sorts the waiting queue only while at most this many requests wait.
LPM_MAX_WAITING = 128


def _priority_order(request: Request) -> tuple[int, float]:
    """vLLM's priority order: the lower ``priority``, then the earlier arrival, first."""
    return request.priority, request.arrival_time


class UnifiedScheduler(CohortScheduler):
    """Algorithm 1 with the knobs of ``UnifiedConfig``."""

    name = "unified"
    supports_prefix_caching = True
    supports_disaggregation = True

    def __init__(self, kv: KVCacheManager, config: UnifiedConfig, predictor: LengthPredictor | None = None) -> None:
        super().__init__(kv, predictor)
        self.config = config
        self._budget = config.max_num_batched_tokens or 0  # C
        self._prefill_budget = config.prefill_token_budget or 0  # P
        self._watermark_blocks = int(config.watermark * kv.gpu.num_blocks)
        self._preemption_mode = PreemptionMode(config.preemption_mode)
        self._chunk_tokens = 0  # tokens of the chunks of the output being built
        self._caching = kv.prefix_cache is not None

    # --- Algorithm 1, GETNEXTBATCH ----------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        self._chunk_tokens = 0  # tokens of out.chunks so far
        cfg = self.config
        # NOTE: groups are visited only when not empty, and the cohort is tested by its members dict
        # (len() of a Python-level class is a call): this runs every step.
        if cfg.priority == "prefill_first":
            # Hybrid: prefills go first but leave room in C for the running decodes.
            reserved = len(self.cohort.members) if cfg.hybrid_batching else 0
            if self.outside_cohort:
                self._schedule_running_prefills(out, reserved)
            if self.waiting and not self.swapped:
                self._schedule_waiting(out, reserved)
            if not out.chunks or cfg.hybrid_batching:
                self._schedule_decodes(out)
        else:
            self._schedule_decodes(out)
            if cfg.hybrid_batching or not self.cohort.members:
                if self.outside_cohort:
                    self._schedule_running_prefills(out, 0)
                if self.waiting and not out.preempted and not self.swapped:
                    self._schedule_waiting(out, 0)
        if self._joined:
            out.cohort_joined = self._take_joined()
        return out

    def _prefill_room(self, out: SchedulerOutput, reserved: int) -> int:
        """Tokens a prefill candidate may still take: min(C, P) minus what the batch holds (3)."""
        used = self._chunk_tokens if out.decode is None else out.decode.size + self._chunk_tokens
        room_c, room_p = self._budget - reserved - used, self._prefill_budget - used
        return room_c if room_c < room_p else room_p  # min(), without the builtin's call: every step

    def _add_chunk(self, out: SchedulerOutput, request: Request, num_tokens: int) -> None:
        out.chunks.append(tuple.__new__(ScheduledChunk, (request, num_tokens)))  # no Python-level __new__
        self._chunk_tokens += num_tokens
        if self._caching:
            self.kv.cache_blocks(request, request.num_computed_tokens + num_tokens)

    def _schedule_decodes(self, out: SchedulerOutput) -> None:
        """Group R_r^d: every running decode takes one token; evict from the lowest priority until
        the cohort's KV growth fits (4), then swap requests back in if nothing was evicted."""
        cohort = self.cohort
        # NOTE: reserve this tick's growth even for an empty cohort, before swapped-in requests join.
        while not cohort.try_grow(cohort.ticks + 1):
            self._preempt(self._victim(out), self._preemption_mode, out, front=self.config.evicted_to == "front")
        if not out.preempted:
            if self.swapped:
                self._schedule_swap_in(out)
            if self.incoming:
                self._schedule_incoming(out)
        self._schedule_cohort(out)

    def _victim(self, out: SchedulerOutput) -> Request:
        """The running request to evict (4), among those not in the batch yet: Algorithm 1 takes a request
        out of R_w and R_r as it joins the batch, and evicts only running requests (a prefill-first hybrid
        batch holds its prefills before the decodes grow; evicting one would leave its chunk in the step)."""
        running = self.running
        if out.chunks:
            in_batch = {request for request, _ in out.chunks}
            running = [r for r in running if r not in in_batch]
        if self.config.class_priority:
            best_effort = [r for r in running if r.request_class is RequestClass.BE]
            if best_effort:
                return best_effort[-1]
        if self.config.waiting_order == "priority" and self.config.eviction_victim == "lowest_priority":
            return max(reversed(running), key=_priority_order)  # among equals the latest admitted
        if self.config.eviction_victim == "shortest":
            # Least KV held; among equals the latest admitted. O(running), and evictions are rare.
            return min(reversed(running), key=lambda r: r.num_computed_tokens)
        return next(reversed(running))

    def _reserve_target(self, request: Request) -> tuple[int, int]:
        """(tokens of KV that must fit to admit ``request`` (m_reserve), tokens to hold)."""
        reservation = self.config.reservation
        if reservation == "prompt":
            return request.num_tokens, request.num_tokens
        predicted = request.predicted_output_tokens or 1
        # On a refill the generated tokens are known; at least the next token is still to come.
        target = request.num_tokens + max(predicted - request.num_output_tokens, 1) - 1
        if reservation == "predicted_check":
            return target, request.num_tokens
        assert isinstance(self.kv, ExactReservationKVManager)
        self.kv.set_reservation(request, target)
        return target, target

    def _schedule_swap_in(self, out: SchedulerOutput) -> None:
        """Swapped requests come back (FCFS) when their blocks, plus the next token's, fit."""
        kv = self.kv
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            request = self.swapped[0]
            held = kv.swap_in_blocks_needed(request)
            tokens = request.num_computed_tokens + (0 if request.is_prefill else 1)
            extra = max(0, -(-kv.target_slots(request, tokens) // kv.block_size) - held)
            if held + extra + self._watermark_blocks > kv.num_free_blocks:
                break
            self.swapped.popleft()
            copies = kv.swap_in(request)
            assert copies is not None
            done = kv.allocate_slots(request, tokens)
            assert done
            out.swap_in = [*out.swap_in, *copies]
            out.swap_bytes += kv.swap_bytes(copies)
            self._admit(request)
            if not request.is_prefill:
                self._join_cohort(request)

    def on_token_emitted(self, request: Request) -> None:
        if self.config.role == "prefill":
            self._hand_off(request)
        else:
            self._join_cohort(request)

    def _schedule_incoming(self, out: SchedulerOutput) -> None:
        """Decode role: requests whose KV arrived from a prefill replica take slots for it and their
        next token (FCFS), then decode with the cohort."""
        kv = self.kv
        while self.incoming and len(self.running) < self.config.max_num_seqs:
            request = self.incoming[0]
            tokens = request.num_computed_tokens + 1
            if not kv.can_allocate(request, tokens, self._watermark_blocks):
                break
            self.incoming.popleft()
            done = kv.allocate_slots(request, tokens)
            assert done
            self._admit(request)
            self._join_cohort(request)

    def _schedule_running_prefills(self, out: SchedulerOutput, reserved: int) -> None:
        """Group R_r^p: chunked prefills in progress already hold KV for their whole prompt."""
        room = self._prefill_room(out, reserved)
        for request in self.outside_cohort:
            if room <= 0:
                break
            num_tokens = min(request.num_tokens_to_process, room)
            self._add_chunk(out, request, num_tokens)
            room -= num_tokens

    def _schedule_waiting(self, out: SchedulerOutput, reserved: int) -> None:
        """Group R_w, FCFS: admit while C, P, M and max_num_seqs allow; stop at the first that does
        not fit (a memory failure here skips the group, as vLLM and Sarathi do)."""
        kv, cfg, caching = self.kv, self.config, self._caching
        room = self._prefill_room(out, reserved)
        if caching and cfg.waiting_order == "lpm" and 1 < len(self.waiting) <= LPM_MAX_WAITING:
            self._order_by_prefix_match()
        elif cfg.waiting_order == "priority" and len(self.waiting) > 1:
            ordered = sorted(self.waiting, key=_priority_order)  # NOTE: nearly sorted after the first step
            self.waiting.clear()
            self.waiting.extend(ordered)
        while self.waiting and len(self.running) < cfg.max_num_seqs:
            request = self.waiting[0]
            if cfg.class_priority and request.request_class is not RequestClass.RT:
                request = next((r for r in self.waiting if r.request_class is RequestClass.RT), request)
            tokens, cached = request.num_tokens_to_process, ()
            if caching:  # the blocks of its prompt already cached: their tokens are not computed
                cached = kv.find_cached_prefix(request)
                tokens -= len(cached) * kv.block_size
            num_tokens = min(tokens, room) if cfg.chunked_prefill else tokens
            if num_tokens <= 0 or num_tokens > room:
                break
            # m_reserve: the whole prompt (or prompt + generated tokens for a refill), or more.
            must_fit, hold = self._reserve_target(request)
            if not kv.can_allocate(request, must_fit, self._watermark_blocks, cached):
                break
            done = kv.allocate_slots(request, hold, cached)
            assert done
            if request is self.waiting[0]:
                self.waiting.popleft()
            else:
                self.waiting.remove(request)
            if caching:
                self._skip_cached_prefix(request, cached, out)
            self._admit(request)
            self._add_chunk(out, request, num_tokens)
            room -= num_tokens

    def _order_by_prefix_match(self) -> None:
        """SGLang's lpm: the waiting requests by the cached blocks their prompts start with, most
        first; a stable sort, so ties keep their queue order."""
        found = {r: len(self.kv.find_cached_prefix(r)) for r in self.waiting}
        ordered = sorted(self.waiting, key=found.__getitem__, reverse=True)
        self.waiting.clear()
        self.waiting.extend(ordered)

    # --- simulator fast path -----------------------------------------------------------------
    # A decode-only step repeats unchanged until the cohort's growth outruns free memory: every
    # admission that failed this step failed on C, P, max_num_seqs or memory, and none of those
    # loosens before a completion, an arrival or an eviction.
    # NOTE: the base class's methods themselves, not methods calling them: a call fewer per stretch.
    decode_horizon = CohortScheduler._cohort_memory_horizon

    def chunk_horizon(self, output: SchedulerOutput, limit: int) -> int:
        """Sarathi (decode first, chunked prefill): a step of the cohort and one prompt chunk that
        takes all the room C and P leave repeats, the chunk moving on by its size, while the prompt
        has more than a chunk to go. Arrivals change nothing (the waiting queue gets no room), the
        prompt's KV was allocated at admission, and the cohort grows as in ``decode_horizon``. The
        chunk that ends the prompt (it samples a token, and leaves room) runs on its own. Not on a decode
        replica (disaggregated): its chunks are refills, and its arrivals, KV handed off by a prefill
        replica, join the cohort at the next step whatever room the chunk leaves."""
        cfg = self.config
        if (
            limit <= 1
            or cfg.role == "decode"
            or len(output.chunks) != 1
            # NOTE: _chunk_tokens is the chunk of the output just scheduled: no room is left. The
            # common way out (the chunk ends its prompt), so tested early.
            or self._prefill_room(output, 0) > 0
            or cfg.priority != "decode_first"
            or not cfg.chunked_prefill
            or output.decode is None
            or output.preempted
            or output.swap_in
            or self.swapped
            or self.incoming
        ):
            return 1
        request, chunk = output.chunks[0]
        if chunk < 2:
            return 1
        # Step j (from 0) runs `chunk` of the tokens left before it and must leave some.
        limit = min(limit, -(-request.num_tokens_to_process // chunk) - 1)
        return self._cohort_memory_horizon(output, limit) if limit > 1 else 1

    def repeat(self, output: SchedulerOutput, num_steps: int) -> SchedulerOutput:
        """``output`` for ``num_steps`` steps; with prefix caching, the chunk's later steps register the
        blocks they fill, as ``_add_chunk`` did its first."""
        if self._caching:
            for request, num_tokens in output.chunks:
                self.kv.cache_blocks(request, request.num_computed_tokens + num_tokens * num_steps)
        return self._cohort_repeat(output, num_steps)

    # --- validation ----------------------------------------------------------------------------
    def policy_metrics(self) -> dict[str, Any]:
        """With swap preemption: how many preemptions found the swap space full and recomputed; the
        prefix cache's counters (``Scheduler.policy_metrics``)."""
        metrics = super().policy_metrics()
        if self._preemption_mode is PreemptionMode.SWAP:
            metrics["num_swap_fallbacks"] = self.num_swap_fallbacks
        return metrics

    def check_fits(self, request: Request, max_kv_tokens: int) -> None:
        """Raise ConfigError when ``request`` could never finish alone in this KV cache."""
        check_fits_alone(self.kv, request, max_kv_tokens, self._watermark_blocks)
