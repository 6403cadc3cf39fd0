"""FastServe (Wu et al. 2023), as EconoServe compares with it (papers/econoserve.md §2.1): a
skip-join multi-level feedback queue with 5 levels, batches of 8 and max allocation.

    skip-join   a new request enters the highest-priority level whose quantum is at least the
                cost model's time of its first iteration (its whole prompt, alone)
    quanta      level i (0 = highest priority) has quantum base x ratio^i; base defaults to the cost
                model's time of the smallest iteration (one decode of one request), ratio to 2
    demotion    every iteration a request runs, the iteration's time counts against its quantum;
                once the quantum is used up it goes to the tail of the next level (the last level
                keeps it)
    batching    the highest-priority requests that fit (batch size, prompt budget, free KV for a
                newcomer's max allocation); FCFS within a level (``PriorityBatchScheduler``)

With prefix caching (``IterationScheduler``), a request skip-joins by the time of what it does not
find cached on arrival.

NOTE: FastServe's proactive KV swapping is left out: with max allocation a paused request keeps its
KV on the GPU (preempted in place), as in the EconoServe setup.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from sloserve.core.errors import ConfigError
from sloserve.core.outputs import SchedulerOutput, StepResult
from sloserve.core.request import Request, RequestStatus
from sloserve.cost.base import BatchShape, CostModel, advance_shape, batch_shape
from sloserve.kv.manager import KVCacheManager
from sloserve.predict import LengthPredictor
from sloserve.sched.srtf import PriorityBatchScheduler, PriorityConfig


@dataclass
class FastServeConfig(PriorityConfig):
    """Skip-join MLFQ knobs on top of the shared batch size, prompt budget and KV knobs."""

    num_levels: int = 5  # EconoServe §2.1: "FastServe using 5-level queues"
    # Quantum of the top level in seconds (None: the cost model's time of one decode of one request,
    # FastServe's smallest iteration).
    base_quantum_s: float | None = None
    quantum_ratio: float = 2.0  # each level's quantum is this many times the one above it
    # NOTE: FastServe promotes a request that waited longer than a starvation limit to the top level;
    # the paper gives no value, so it is off (None) by default: seconds since the request last ran.
    starvation_limit_s: float | None = None

    def resolve(self, max_model_len: int) -> None:
        super().resolve(max_model_len)
        if self.num_levels < 1:
            raise ConfigError(f"num_levels must be >= 1, got {self.num_levels}")
        if not self.quantum_ratio >= 1:
            raise ConfigError(f"quantum_ratio must be >= 1, got {self.quantum_ratio}")
        for name in ("base_quantum_s", "starvation_limit_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name} must be > 0 (or none), got {value}")


class FastServeScheduler(PriorityBatchScheduler):
    """Skip-join MLFQ (see the module docstring). ``level``, ``attained_s`` are public for tests."""

    name = "fastserve"
    config: FastServeConfig
    named_decode_stretches = True

    def __init__(
        self,
        kv: KVCacheManager,
        config: FastServeConfig,
        predictor: LengthPredictor | None = None,
        cost_model: CostModel | None = None,
    ) -> None:
        super().__init__(kv, config, predictor)
        if cost_model is None:
            raise ConfigError("the fastserve scheduler needs a cost model for its skip-join estimates")
        self.cost_model = cost_model
        base = config.base_quantum_s or cost_model.batch_time(BatchShape(num_decode=1, decode_kv_tokens=1)).total_s
        self.quanta = [base * config.quantum_ratio**i for i in range(config.num_levels)]  # seconds per level
        self.level: dict[Request, int] = {}  # 0 = highest priority
        self.attained_s: dict[Request, float] = {}  # time run at its current level
        self._position: dict[Request, int] = {}  # FCFS order within a level (entry sequence number)
        self._last_run: dict[Request, float] = {}  # end of its last iteration (arrival before it ran)
        self._entries = itertools.count()
        self._step_start = 0.0

    def first_iteration_s(self, request: Request) -> float:
        """The cost model's time of the request's prompt alone (FastServe profiles this). With prefix
        caching, of the part of it not cached when it arrives (attention still reads the cached part):
        the cache may change before it runs, and FastServe decides the level on arrival."""
        n = request.num_prompt_tokens
        cached = len(self.kv.find_cached_prefix(request)) * self.kv.block_size if self._caching else 0
        return self.cost_model.batch_time(BatchShape.of([(n - cached, cached)], [])).total_s

    def skip_join_level(self, request: Request) -> int:
        """The highest-priority level whose quantum covers the first iteration (else the last)."""
        first = self.first_iteration_s(request)
        return next((i for i, quantum in enumerate(self.quanta) if quantum >= first), len(self.quanta) - 1)

    def priority(self, request: Request) -> tuple:
        return (self.level[request], self._position[request])

    def add_request(self, request: Request) -> None:
        self._enter(request, self.skip_join_level(request))  # before it is queued by its level
        self._last_run[request] = request.arrival_time
        super().add_request(request)

    def _enter(self, request: Request, level: int) -> None:
        """Put ``request`` at the tail of ``level`` with a fresh quantum."""
        self.level[request] = level
        self.attained_s[request] = 0.0
        self._position[request] = next(self._entries)

    def schedule(self, now: float) -> SchedulerOutput:
        self._step_start = now
        limit = self.config.starvation_limit_s
        if limit is not None:
            promoted = False
            for request, last in self._last_run.items():
                if self.level[request] > 0 and now - last >= limit:
                    self._enter(request, 0)
                    self._last_run[request] = now
                    promoted = True
            if promoted:
                self._reorder_queue()
        return super().schedule(now)

    def decode_horizon(self, output: SchedulerOutput, limit: int) -> int:
        """A step of decodes only repeats until the first member could use up its level's quantum (its
        demotion changes the order), an arrival or a completion: levels and positions stay, and under
        max allocation the free KV does not move. Steps only get longer along a stretch, so none is
        longer than the last one's cost-model time, and the quantum left over that time bounds the
        steps run before a demotion: the step that demotes may end the stretch, as a single step would.
        NOTE: ``cost_model`` is the simulator's (``runs`` gives both the same one). One step at a time
        with the starvation limit (a waiting request's promotion depends on the clock)."""
        if self.config.starvation_limit_s is not None:
            return 1
        last = len(self.quanta) - 1
        left = min(
            (self.quanta[self.level[r]] - self.attained_s[r] for r, _ in output.chunks if self.level[r] < last),
            default=math.inf,
        )
        if left == math.inf:
            return limit
        longest_s = self.cost_model.step_seconds(advance_shape(batch_shape(output), limit - 1))
        # (k - 1) steps of at most longest_s each stay under the quantum left; a margin for rounding
        return max(1, min(limit, math.ceil(left * (1 - 1e-9) / longest_s)))

    def update(self, output: SchedulerOutput, result: StepResult, now: float) -> list[Request]:
        """Apply the step, then charge its duration to every request in it that goes on."""
        finished = super().update(output, result, now)
        # NOTE: the iteration's measured time (simulated or wall) counts in full for every request in
        # it, as a job's execution time does in FastServe; schedule() and update() get its start and end.
        # A stretch's steps are charged one by one (the same sums as step by step).
        ends = result.step_end_times
        for request, _ in output.chunks:
            if request.status is not RequestStatus.RUNNING:
                continue
            self._last_run[request] = now
            start = self._step_start
            for end in ends:
                self.attained_s[request] += end - start
                start = end
            level = self.level[request]
            if self.attained_s[request] >= self.quanta[level] and level + 1 < len(self.quanta):
                self._enter(request, level + 1)
        return finished

    def _finish(self, request: Request, now: float) -> None:
        super()._finish(request, now)
        for table in (self.level, self.attained_s, self._position, self._last_run):
            table.pop(request, None)
