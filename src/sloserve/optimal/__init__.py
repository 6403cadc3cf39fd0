"""The optimal schedule as a constraint model (InferMax §5): a bound on what any policy can do."""

from sloserve.optimal.heuristic import HeuristicRun, latency, problem_requests, replay, run_heuristic
from sloserve.optimal.model import MAX_CELLS, BoundResult, solve_bound
from sloserve.optimal.problem import BatchPlan, BoundProblem
from sloserve.optimal.relaxation import relaxed_bound
from sloserve.optimal.replay import ReplayScheduler, ScheduleViolation

__all__ = [
    "MAX_CELLS",
    "BatchPlan",
    "BoundProblem",
    "BoundResult",
    "HeuristicRun",
    "ReplayScheduler",
    "ScheduleViolation",
    "latency",
    "problem_requests",
    "relaxed_bound",
    "replay",
    "run_heuristic",
    "solve_bound",
]
