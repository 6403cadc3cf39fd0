"""The request: identity, lengths, class, SLO, progress counters and per-token timing.

The scheduler deals in tokens, not phases. A request knows ``num_tokens`` tokens (prompt plus the
output tokens sampled so far); ``num_computed_tokens`` of them have KV in the cache. To sample the next
token every known token must have KV, so a step that brings ``num_computed_tokens`` up to
``num_tokens`` emits one token. A prefill, a chunk of one, a refill after eviction and a decode step
are the same thing with different counts:

    prefill       computed 0      -> I        emits output token 1
    decode step   computed I+g-1  -> I+g      emits output token g+1
    refill        computed 0      -> I+g      emits output token g+1 (after a recompute eviction)

NOTE: the KV a request ever holds peaks at I + O - 1 tokens: the last output token is never processed.

A policy may let decode requests that advance together every step share one tick counter (the
decode cohort of sched/cohort.py, which policies opt into). While a request is in one, its counters
are derived from that counter, so a step costs O(1) for the whole cohort instead of O(batch):
``num_computed_tokens = computed_offset + cohort.ticks``. The request sees the cohort only through
``TickCounter``; ``enter_cohort`` and ``leave_cohort`` convert the counters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from sloserve.core.prefix import PromptBlocks


class TickCounter(Protocol):
    """What a request's counters read while it advances in lockstep with others: a tick count, each
    tick one more processed token and one more output token for every member."""

    ticks: int


class RequestClass(str, Enum):
    """Service class: real-time (interactive, latency SLOs) or best-effort (throughput)."""

    RT = "rt"
    BE = "be"


class RequestStatus(str, Enum):
    WAITING = "waiting"  # never scheduled, or evicted by recompute: holds no KV
    RUNNING = "running"  # holds KV on the GPU
    SWAPPED = "swapped"  # KV lives in CPU swap space
    TRANSFERRING = "transferring"  # prefilled on one replica, KV on its way to a decode replica
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class SLO:
    """Service-level objective of one request; ``None`` means no objective on that metric.

    ttft_s: first token - arrival. tpot_s: (last token - first token) / (output tokens - 1).
    jct_s: finish - arrival (the EconoServe JCT deadline, relative to arrival).
    """

    ttft_s: float | None = None
    tpot_s: float | None = None
    jct_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s", "jct_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"SLO {name} must be > 0, got {value}")


@dataclass(eq=False, slots=True)
class Request:
    """One inference request. Compared and hashed by identity.

    ``true_output_tokens`` is the length the response will have. Only executors (the simulator ends a
    request when it is reached) and the oracle predictor may read it; schedulers never do.
    """

    request_id: int
    arrival_time: float
    num_prompt_tokens: int
    true_output_tokens: int
    # User-visible cap on output tokens (OpenAI ``max_tokens``); max-allocation reserves prompt + this.
    max_tokens: int
    request_class: RequestClass = RequestClass.RT
    slo: SLO = field(default_factory=SLO)
    # Predicted response length, set at arrival by a LengthPredictor (None when no predictor runs).
    predicted_output_tokens: int | None = None
    # What the prompt's KV blocks hold (prefix caching): None when unknown (no block is ever shared).
    prompt_blocks: PromptBlocks | None = None
    # A closed-loop turn (a conversation's next message): seconds between the end of the request it
    # follows and its arrival; 0 for a request that arrives on its own or at once.
    think_time_s: float = 0.0
    # The client went away (a served request): the executor finishes it the next time it is scheduled,
    # without computing it, and predictors do not learn from its cut-short length.
    aborted: bool = False
    # vLLM's request priority: the lower, the sooner (schedulers with waiting_order=priority read it)
    priority: int = 0

    # --- progress (mutated only by the scheduler's update) -------------------------------------
    status: RequestStatus = RequestStatus.WAITING
    # Stored with the cohort's tick subtracted while in a cohort; read through the properties.
    # computed_offset: num_computed_tokens - cohort.ticks in a cohort (constant while it stays in it),
    # the position by which a cohort orders its members and schedules their KV growth; outside one,
    # num_computed_tokens. NOTE: read-only outside this class (the methods below change it).
    computed_offset: int = 0
    _output_offset: int = 0
    cohort: TickCounter | None = None
    # Sequence number of cohort joins; lets executors discard stale per-member bookkeeping.
    cohort_epoch: int = 0
    replica: int = 0

    # --- timing (seconds of simulated or wall time) ----------------------------------------------
    first_token_time: float = math.nan
    last_token_time: float = math.nan
    finish_time: float = math.nan
    max_token_gap: float = math.nan  # largest gap between consecutive output tokens
    # Every output token's time, kept only when set to a list before the run (metrics that need each
    # token, such as BROS's token groups; None: not kept, the default).
    token_times: list[float] | None = None
    num_preemptions: int = 0
    # Prompt tokens found in the prefix cache when first admitted (vLLM's num_cached_tokens).
    num_cached_tokens: int = 0
    # JCT decomposition (EconoServe §2.1), kept by the step loop (replica.Replica) from the
    # outputs: waiting = first scheduled - arrival; preemption = time from each preemption until the
    # request runs again; GT queuing = time between sampling a token outside the decode cohort and
    # joining it (EconoServe's GT queue; zero for policies whose decodes join at once).
    # Execution is the rest of the JCT.
    first_scheduled_time: float = math.nan
    preempted_s: float = 0.0
    gt_queued_s: float = 0.0
    paused_since: float = math.nan  # start of the step that preempted it, until it runs again
    # Times it needed KV in execution that its allocation did not give it: a preemption for memory,
    # or (EconoServe) a GT running past its exact region.
    num_allocation_failures: int = 0

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 1:
            raise ValueError(f"request {self.request_id}: prompt must have >= 1 token")
        if self.true_output_tokens < 1:
            raise ValueError(f"request {self.request_id}: output must have >= 1 token")
        if self.max_tokens < self.true_output_tokens:
            raise ValueError(
                f"request {self.request_id}: max_tokens {self.max_tokens} < output length {self.true_output_tokens}"
            )

    # --- counters ----------------------------------------------------------------------------
    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV is in the cache (``m`` in InferMax)."""
        cohort = self.cohort
        return self.computed_offset if cohort is None else self.computed_offset + cohort.ticks

    @property
    def num_output_tokens(self) -> int:
        """Output tokens sampled so far."""
        cohort = self.cohort
        return self._output_offset if cohort is None else self._output_offset + cohort.ticks

    @property
    def num_tokens(self) -> int:
        """Known tokens: prompt + sampled output."""
        cohort = self.cohort
        return self.num_prompt_tokens + (self._output_offset if cohort is None else self._output_offset + cohort.ticks)

    # NOTE: in the two below, num_tokens - num_computed_tokens, the cohort's ticks cancel out (a
    # member's two counters advance together), so they read the offsets alone: these run every step.
    @property
    def num_tokens_to_process(self) -> int:
        """Tokens to process before the next token can be sampled (``c`` at most)."""
        return self.num_prompt_tokens + self._output_offset - self.computed_offset

    @property
    def is_prefill(self) -> bool:
        """True while more than one token must be processed (prefill, chunked prefill or refill)."""
        return self.num_prompt_tokens + self._output_offset - self.computed_offset > 1

    @property
    def max_kv_tokens(self) -> int:
        """KV the request could ever need under its ``max_tokens`` cap: I + max_tokens - 1."""
        return self.num_prompt_tokens + self.max_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    # --- mutation (scheduler side) -------------------------------------------------------------
    def add_computed(self, num_tokens: int) -> None:
        self.computed_offset += num_tokens

    def add_output_token(self, now: float) -> None:
        """Record one sampled output token at time ``now``."""
        self._output_offset += 1
        self.record_token_time(now)

    def drop_output_token(self) -> None:
        """Take back the last output token counted: the engine sampled it, then dropped it (it came back
        from the device after the request was aborted). NOTE: its time stays the last token's."""
        self._output_offset -= 1

    def add_output_run(self, times: Sequence[float], max_inner_gap: float) -> None:
        """Record ``len(times)`` sampled output tokens, one at each of ``times`` (a named decode repeated
        through a stretch; ``max_inner_gap``: the largest gap between consecutive times, NaN for one),
        as that many ``add_output_token`` calls would."""
        self._output_offset += len(times)
        self.record_token_run(times[0], times[-1], max_inner_gap, times)

    def enter_cohort(self, cohort: TickCounter) -> None:
        """From now on the counters advance with ``cohort.ticks``: one token per tick."""
        assert self.cohort is None, self
        t = cohort.ticks
        # NOTE: from here until it leaves, the counters read offset + ticks.
        self.computed_offset -= t
        self._output_offset -= t
        self.cohort = cohort
        self.cohort_epoch += 1

    def leave_cohort(self) -> None:
        """The counters stop advancing with the cohort's ticks; they keep what those ticks gave."""
        t = self.cohort.ticks
        self.computed_offset += t
        self._output_offset += t
        self.cohort = None

    def set_output_tokens(self, num_tokens: int) -> None:
        """Set the output count measured outside a scheduler (a load client reading a server's usage)."""
        assert self.cohort is None, "not for a request in a cohort"
        self._output_offset = num_tokens

    def reset_computed(self) -> None:
        """Drop all KV (recompute eviction): generated tokens are kept and will be refilled."""
        assert self.cohort is None, "leave the cohort before dropping KV"
        self.computed_offset = 0

    def record_token_time(self, now: float) -> None:
        if self.token_times is not None:
            self.token_times.append(now)
        if math.isnan(self.first_token_time):
            self.first_token_time = now
        else:
            gap = now - self.last_token_time
            if math.isnan(self.max_token_gap) or gap > self.max_token_gap:
                self.max_token_gap = gap
        self.last_token_time = now

    def record_token_run(
        self, first: float, last: float, max_inner_gap: float, times: Sequence[float] | None = None
    ) -> None:
        """Record a run of consecutive tokens (a cohort stretch) by its first and last time and the
        largest gap inside it (NaN when the run is one token); ``times``, every token's time, is
        needed only when ``token_times`` is kept."""
        self.record_token_time(first)
        if self.token_times is not None:
            assert times is not None and times[0] == first and times[-1] == last, "a run's token times"
            self.token_times.extend(times[1:])
        if not math.isnan(max_inner_gap) and (math.isnan(self.max_token_gap) or max_inner_gap > self.max_token_gap):
            self.max_token_gap = max_inner_gap
        self.last_token_time = last

    def __repr__(self) -> str:
        return (
            f"Request(id={self.request_id}, I={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}/{self.true_output_tokens}, "
            f"computed={self.num_computed_tokens}, {self.status.value})"
        )
