"""``CohortScheduler``: the base of policies that run every running decode in every decode step.

vLLM, Sarathi-Serve, ORCA-style unified presets and EconoServe's GT batch put each running decode
request into each decode step. Such a policy derives from ``CohortScheduler``: a request whose
prompt is done (it sampled a token and goes on) joins the decode cohort (``on_token_emitted``), and
the cohort's members then advance together in O(1) per step whatever their number
(sched/lockstep.py), with their KV growth reserved in O(1) per step too (sched/decode_cohort.py).

What a policy adds: each step that runs the decodes, reserve their growth with
``self.cohort.try_grow`` and then call ``_schedule_cohort(out)``; and put ``_take_joined()`` into
``out.cohort_joined``. Running requests outside the cohort (prompts in progress) are in
``outside_cohort``. The simulator's fast path comes with it: ``_cohort_memory_horizon`` is a ready
``decode_horizon`` for a policy whose decode-only step changes only on a completion, an arrival or a
memory event, and ``_cohort_repeat`` a ready ``repeat``.
"""

from __future__ import annotations

from collections.abc import Sequence

from sloserve.core.outputs import CohortStep, SchedulerOutput
from sloserve.core.request import Request, RequestStatus
from sloserve.kv.manager import KVCacheManager
from sloserve.predict import LengthPredictor
from sloserve.sched.base import Scheduler
from sloserve.sched.decode_cohort import DecodeCohort


class CohortScheduler(Scheduler):
    """A ``Scheduler`` whose running decodes form one decode cohort."""

    def __init__(self, kv: KVCacheManager, predictor: LengthPredictor | None = None) -> None:
        super().__init__(kv, predictor)
        self.cohort = DecodeCohort(kv)
        # Running requests outside the cohort (prefills in progress), in running order.
        self.outside_cohort: dict[Request, None] = {}
        self._joined: list[Request] = []  # cohort joins not yet reported in an output

    # --- the step -------------------------------------------------------------------------------
    def on_token_emitted(self, request: Request) -> None:
        """A request outside the cohort sampled a token and goes on: by default it joins the cohort."""
        self._join_cohort(request)

    def _schedule_cohort(self, out: SchedulerOutput) -> None:
        """Run the cohort's members this step, one token each, when it has any (their growth for this
        tick reserved by ``self.cohort.try_grow``); ``update`` advances the cohort."""
        cohort = self.cohort
        if cohort.members:  # NOTE: not `if cohort`: len() of a Python-level class costs a call
            # NOTE: tuple.__new__ builds the named tuple without its Python-level __new__: every step.
            out.decode = tuple.__new__(
                CohortStep, (cohort, len(cohort.members), cohort.kv_tokens, cohort.max_kv_tokens)
            )
        else:
            cohort.skip_growth()  # an empty cohort's tick is not run

    # --- membership -----------------------------------------------------------------------------
    def _admit(self, request: Request) -> None:
        """Move a request that now holds KV into ``running`` (outside the cohort)."""
        # NOTE: the base's two lines repeated, not called: this runs for every admission.
        request.status = RequestStatus.RUNNING
        self.running[request] = None
        self.outside_cohort[request] = None

    def _join_cohort(self, request: Request) -> None:
        self.outside_cohort.pop(request, None)
        self.cohort.add(request)
        self._joined.append(request)

    def _take_joined(self) -> Sequence[Request]:
        """The cohort joins since the previous output, for ``SchedulerOutput.cohort_joined``."""
        if not self._joined:
            return ()  # the common case: no new list per step
        joined, self._joined = self._joined, []
        return joined

    def _leave_running(self, request: Request, *, drop_kv: bool = False) -> None:
        # NOTE: the base's one line repeated, not called: this runs twice per request.
        if request.cohort is not None:
            request.cohort.remove(request, drop_kv=drop_kv)
        self.running.pop(request, None)
        self.outside_cohort.pop(request, None)

    # --- the simulator's fast path ----------------------------------------------------------------
    def _cohort_memory_horizon(self, output: SchedulerOutput, limit: int) -> int:
        """Steps (>= 1, <= limit, for limit >= 1) from the scheduled ``output`` whose cohort growth fits
        the free KV (the scheduled step's growth is reserved already): the ``decode_horizon`` of a
        policy whose decode-only step changes only on a completion, an arrival or a memory event."""
        cohort = self.cohort
        return 1 + cohort.memory_horizon(cohort.ticks + 2, self.kv.num_free_blocks, limit - 1)

    def _cohort_repeat(self, output: SchedulerOutput, num_steps: int) -> SchedulerOutput:
        """``repeat`` for a policy whose repeated steps only grow the cohort (and move a chunk on)."""
        first = self.cohort.ticks + 1  # grown by schedule()
        later = self.cohort.grow_through(first + num_steps - 1)  # blocks: num_steps - 1 of them
        bs = self.kv.block_size
        return output.repeated(num_steps, [0, *(n * bs for n in later)])

    # --- metrics --------------------------------------------------------------------------------
    def kv_used_tokens(self) -> int:
        used = self.cohort.kv_tokens
        for request in self.outside_cohort:  # NOTE: a loop: read every step, and a generator costs more
            used += request.num_computed_tokens
        return used - self.kv.num_shared_tokens if self.kv.prefix_cache is not None else used

    def _granted_slots(self, request: Request) -> int:
        if request.cohort is self.cohort:
            return self.cohort.granted_slots(request)
        return super()._granted_slots(request)

    def check_integrity(self) -> None:
        """As ``Scheduler``'s, and the cohort's members and the requests outside it are the running
        requests, each in one of the two."""
        super().check_integrity()
        self.cohort.check_integrity()
        for r in self.cohort.members:
            assert r in self.running, f"cohort member {r} is not running"
        assert set(self.outside_cohort) | set(self.cohort.members) == set(self.running)
        assert not set(self.outside_cohort) & set(self.cohort.members)
