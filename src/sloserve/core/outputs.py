"""What crosses between a policy and an executor: ``SchedulerOutput`` one way, ``StepResult`` back."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple, Protocol

from sloserve.core.request import Request, TickCounter


class PreemptionMode(str, Enum):
    RECOMPUTE = "recompute"  # drop the KV; the request is refilled later (prompt + generated tokens)
    SWAP = "swap"  # copy the KV blocks to CPU swap space; swapped back in later
    KEEP = "keep"  # offload-free (EconoServe §3.3.2): the KV stays on the GPU while the request waits


class ScheduledChunk(NamedTuple):
    """``num_tokens`` of ``request`` processed this step, starting at its ``num_computed_tokens``."""

    request: Request
    num_tokens: int


class Preemption(NamedTuple):
    request: Request
    mode: PreemptionMode


class BlockCopy(NamedTuple):
    """Copy one KV block between devices (swap) or inside the GPU (copy-on-write)."""

    src_block: int
    dst_block: int


class SlotCopy(NamedTuple):
    """Copy one token's KV between a GPU slot and a CPU slot (BROS lazy checkpointing / restore)."""

    src_slot: int
    dst_slot: int
    to_cpu: bool  # True: GPU slot -> CPU slot (checkpoint); False: CPU slot -> GPU slot (restore)


class DecodeGroup(TickCounter, Protocol):
    """What an executor sees of a decode cohort (sched/decode_cohort.py): its members, and the
    block ids of the KV growth reserved for a member by count, given on demand."""

    members: Mapping[Request, int]

    def settle(self, request: Request) -> None:
        """Give ``request`` the block ids of its reserved growth: every token it will process this
        step then has a physical slot (what the engine writes KV to)."""
        ...


class CohortStep(NamedTuple):
    """The decode cohort's part of a step: each of its members processes exactly one token."""

    cohort: DecodeGroup
    size: int  # members this step
    kv_tokens: int  # the KV their decode attention reads: the sum of their num_computed_tokens
    max_kv_tokens: int  # the longest member's num_computed_tokens


@dataclass(slots=True)
class SchedulerOutput:
    """One step's decisions. Built fresh by ``Scheduler.schedule``; not changed afterwards, except by
    ``repeated`` (the simulator's fast path) before it runs."""

    # --- what runs -----------------------------------------------------------------------------
    # Requests processing an explicit number of tokens (prefills, chunks, refills, and decodes of
    # policies without a decode cohort). Each chunk starts at the request's num_computed_tokens.
    chunks: list[ScheduledChunk] = field(default_factory=list)
    # The decode cohort's step, for a policy that has one (sched/cohort.py); None: no cohort step.
    decode: CohortStep | None = None
    # Requests that joined the decode cohort since the previous output (executors start tracking
    # them), whether or not this step runs the cohort.
    # NOTE: the sequences below default to a shared empty tuple (most steps have none of them, and an
    # output is built every step); a policy that adds to one assigns a new list.
    cohort_joined: Sequence[Request] = ()
    # Prompt tokens the requests admitted in this step found in the prefix cache (not computed).
    num_cached_tokens: int = 0
    # --- preemptions and KV copies ----------------------------------------------------------------
    # Requests preempted while building this batch, with their mode; they are not in this batch.
    preempted: Sequence[Preemption] = ()
    # Block copies GPU -> CPU (swap out) and CPU -> GPU (swap in) done before the step's compute.
    swap_out: Sequence[BlockCopy] = ()
    swap_in: Sequence[BlockCopy] = ()
    # Single-token copies between GPU and CPU slots, to run in this order after the block swaps.
    slot_copies: Sequence[SlotCopy] = ()
    # KV bytes moved by the swaps and copies above (for the cost model), and whether those copies run
    # on their own stream beside the forward pass (BROS's lazy checkpointing) or before it.
    swap_bytes: int = 0
    swap_overlapped: bool = False
    # --- the simulator's fast path (sim/stretch.py) -------------------------------------------------
    # Consecutive steps this output stands for: each one decodes the cohort once and runs every
    # chunk's num_tokens again, from where the previous left (a one-token decode chunk samples a
    # token in each of them).
    # NOTE: counts above describe the first of them; the cohort's KV grows by its size per step.
    num_steps: int = 1
    # KV slots allocated before each of the num_steps steps, the first one's counted as 0 (it was
    # allocated when the output was built), for the timeline.
    new_slots_per_step: Sequence[int] | None = None

    def add_preemption(self, request: Request, mode: PreemptionMode) -> None:
        """Record that ``request`` left the GPU (``mode``) while this batch was built."""
        self.preempted = [*self.preempted, Preemption(request, mode)]

    def repeated(self, num_steps: int, new_slots_per_step: Sequence[int]) -> SchedulerOutput:
        """This output (no preemption, swap or copy) made to stand for ``num_steps`` steps; returns it.

        NOTE: the one change an output may take after ``schedule`` built it: the simulator's fast
        path turns it into a stretch before it runs (in place: a new object per stretch cost more
        than the stretch's other bookkeeping)."""
        assert not (self.preempted or self.swap_in or self.swap_out or self.slot_copies), self
        self.num_steps = num_steps
        self.new_slots_per_step = new_slots_per_step
        return self

    @property
    def num_cohort_decodes(self) -> int:
        """Members of the decode cohort that run this step."""
        return 0 if self.decode is None else self.decode.size

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_batched_tokens(self) -> int:
        """Forward size: tokens processed this step."""
        return self.num_prefill_tokens + self.num_cohort_decodes

    @property
    def num_requests(self) -> int:
        return len(self.chunks) + self.num_cohort_decodes

    @property
    def is_empty(self) -> bool:
        return (
            not self.chunks and self.decode is None and not self.swap_in and not self.swap_out and not self.slot_copies
        )

    @property
    def is_named_decode_only(self) -> bool:
        """Only one-token decodes scheduled by name (no cohort, no prompt chunk, no preemption or copy):
        what the simulator's decode stretches repeat for a policy with ``named_decode_stretches``."""
        if self.decode is not None or not self.chunks or self.preempted:
            return False
        if self.swap_in or self.swap_out or self.slot_copies:
            return False
        for request, num_tokens in self.chunks:  # NOTE: a loop: read once per step of such policies
            if num_tokens != 1 or request.num_tokens_to_process != 1:
                return False
        return True

    @property
    def is_decode_only(self) -> bool:
        """Only the decode cohort's step: what the simulator's decode stretches repeat."""
        return (
            not self.chunks
            and self.decode is not None
            and not self.preempted
            and not self.swap_in
            and not self.swap_out
            and not self.slot_copies
        )


@dataclass(slots=True)
class StepResult:
    """What the executor reports after running a ``SchedulerOutput``."""

    # End time of each of the output's num_steps steps (seconds, simulated or wall).
    step_end_times: Sequence[float]
    # Requests whose last output token was sampled in this output's (last) step.
    finished: list[Request] = field(default_factory=list)
    # The engine's: requests this step ran, or was to run, that had ended before it (aborted, or ended
    # by the step before's token, which came back late with async scheduling): nothing this step did
    # for them counts (their token of it, if computed, is dropped), and they finish before its tokens
    # are counted. Not in ``finished``.
    ended_before: Sequence[Request] = ()
