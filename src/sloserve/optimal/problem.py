"""What the bound solves and what it returns: a workload on one replica (``BoundProblem``) and the
batches of a schedule (``BatchPlan``). The constraint model (model.py), the relaxation
(relaxation.py), the heuristics' replay and the Gantt chart all speak these."""

from __future__ import annotations

from dataclasses import dataclass

from sloserve.core.errors import ConfigError

# Most tokens of M, C, P and a request's I + O: beyond any model's context and the largest GPU's KV
# (9.4M tokens). NOTE: the heuristics give each a KV pool of M tokens, and the model's time horizon
# grows with C and M: 10^12 once ran out of memory, or past the solver's 64-bit integers.
MAX_BOUND_TOKENS = 10_000_000


@dataclass(frozen=True)
class BoundProblem:
    """A workload and the limits of one replica."""

    prompts: tuple[int, ...]  # I_i
    outputs: tuple[int, ...]  # O_i
    arrivals: tuple[float, ...]  # T_i, seconds (all 0: offline)
    kv_capacity_tokens: int  # M
    max_num_batched_tokens: int  # C
    prefill_token_budget: int | None  # P (None: no prefill budget beyond C)
    num_batches: int = 0  # J (set before solving, e.g. from heuristic schedules)

    def __post_init__(self) -> None:
        n = len(self.prompts)
        if not n or len(self.outputs) != n or len(self.arrivals) != n:
            raise ConfigError("bound: prompts, outputs and arrivals must be non-empty and of one length")
        longest = max(i + o - 1 for i, o in zip(self.prompts, self.outputs, strict=True))
        if longest > MAX_BOUND_TOKENS:
            raise ConfigError(f"the longest request's I + O - 1 = {longest:,} is above {MAX_BOUND_TOKENS:,} tokens")
        for what, value in (
            ("KV capacity M", self.kv_capacity_tokens),
            ("batch budget C", self.max_num_batched_tokens),
            ("prefill budget P", self.prefill_token_budget),
        ):
            if value is not None and not 1 <= value <= MAX_BOUND_TOKENS:
                raise ConfigError(f"{what}={value:,} must be in 1..{MAX_BOUND_TOKENS:,} tokens")
        if self.prefill_token_budget is not None and self.prefill_token_budget > self.max_num_batched_tokens:
            raise ConfigError(f"prefill budget P={self.prefill_token_budget} exceeds C={self.max_num_batched_tokens}")
        if self.kv_capacity_tokens < longest:
            raise ConfigError(
                f"KV capacity M={self.kv_capacity_tokens} is below the longest request's I + O - 1 = {longest}"
            )

    @property
    def online(self) -> bool:
        return any(t > 0 for t in self.arrivals)


@dataclass
class BatchPlan:
    """One batch of a schedule."""

    start_s: float
    end_s: float
    tokens: dict[int, int]  # request index -> tokens processed (c)
    evicted: list[int]  # requests whose KV is dropped before they finished
    kv_tokens: int  # sum of m after the batch
