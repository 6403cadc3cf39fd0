"""What crosses between a policy and an executor: ``SchedulerOutput`` one way, ``StepResult`` back."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

from sloserve.core.cohort import Cohort
from sloserve.core.request import Request


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


@dataclass(slots=True)
class SchedulerOutput:
    """One step's decisions. Built fresh by ``Scheduler.schedule``; not changed afterwards, except by
    ``repeated`` (the simulator's fast path) before it runs."""

    # Requests processing an explicit number of tokens (prefills, chunks, refills, and decodes of
    # policies that do not use a cohort). Each chunk starts at the request's num_computed_tokens.
    chunks: list[ScheduledChunk] = field(default_factory=list)
    # Cohort whose every member processes exactly one decode token this step (None: no cohort step).
    cohort: Cohort | None = None
    # Size of the cohort, the KV its members read (sum of their num_computed_tokens) and the longest
    # member's, this step.
    cohort_size: int = 0
    cohort_kv_tokens: int = 0
    cohort_max_kv_tokens: int = 0
    # Members that joined the cohort since the previous output (executors start tracking them).
    # NOTE: the sequences below default to a shared empty tuple (most steps have none of them, and an
    # output is built every step); a policy that adds to one assigns a new list.
    cohort_joined: Sequence[Request] = ()
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
    # Consecutive steps this output stands for (the simulator's closed-form fast path): each one
    # decodes the cohort once and runs every chunk's num_tokens again, from where the previous left.
    # NOTE: counts above describe the first of them; the cohort's KV grows by cohort_size per step.
    num_steps: int = 1
    # Blocks allocated before each of the num_steps steps, first one excluded (for the timeline).
    new_blocks_per_step: Sequence[int] | None = None

    def add_preemption(self, request: Request, mode: PreemptionMode) -> None:
        """Record that ``request`` left the GPU (``mode``) while this batch was built."""
        self.preempted = [*self.preempted, Preemption(request, mode)]

    def repeated(self, num_steps: int, new_blocks_per_step: Sequence[int]) -> SchedulerOutput:
        """This output (no preemption, swap or copy) made to stand for ``num_steps`` steps; returns it.

        NOTE: the one change an output may take after ``schedule`` built it: the simulator's fast
        path turns it into a stretch before it runs (in place: a new object per stretch cost more
        than the stretch's other bookkeeping)."""
        assert not (self.preempted or self.swap_in or self.swap_out or self.slot_copies), self
        self.num_steps = num_steps
        self.new_blocks_per_step = new_blocks_per_step
        return self

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_batched_tokens(self) -> int:
        """Forward size: tokens processed this step."""
        return self.num_prefill_tokens + self.cohort_size

    @property
    def num_requests(self) -> int:
        return len(self.chunks) + self.cohort_size

    @property
    def is_empty(self) -> bool:
        return (
            not self.chunks and self.cohort_size == 0 and not self.swap_in and not self.swap_out and not self.slot_copies
        )

    @property
    def is_decode_only(self) -> bool:
        return (
            not self.chunks
            and self.cohort_size > 0
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
    # Sampled token ids per request (engine only; the simulator samples nothing).
    # NOTE: None, not an empty dict, when nothing was sampled: a result is built every step.
    sampled_token_ids: dict[int, int] | None = None
