"""InferMax §5: the optimal schedule as a constraint model, solved with OR-Tools CP-SAT.

Variables per request i and batch j = 1..J (papers/infermax.md §5; j = 0 is the initial state):
    S[i,j]  prompt + generated tokens after batch j        S[i,0] = I_i
    m[i,j]  tokens with KV after batch j                    m[i,0] = 0
    c[i,j]  tokens processed in batch j (0: not in it)
    g[i,j]  1 if batch j samples a token of request i
    e[i,j]  1 if request i's KV is dropped at batch j (an eviction; after the last token, a release)
Constraints:
    termination       sum_j g[i,j] = O_i
    length            S[i,j] = S[i,j-1] + g[i,j]
    memory (1)        m[i,j] = 0 if e[i,j] else m[i,j-1] + c[i,j]
    tokens (2)        c[i,j] = 0 if e[i,j] else c[i,j] <= S[i,j-1] - m[i,j-1]
    generation (3)    g[i,j] = 1 iff c[i,j] = S[i,j-1] - m[i,j-1]
    batch (4)         sum_i c[i,j] <= C, sum_i m[i,j] <= M
    prefill budget    sum_i c[i,j] <= P when batch j holds a prefill (Sarathi's budget)
    online            a request is processed only in batches that start at or after its arrival
Objective: the latency (end of the last batch), each batch's time given by the linear cost model of
§3.2 with its coefficients integerized to picoseconds (``TIME_UNITS_PER_S``; rounding error < 0.1%
for the bundled presets). The reported latency of a schedule is re-evaluated in floating point, exactly
as the simulator does, so a replay of the schedule gives the same number.

Conditional constraints use CP-SAT's enforcement literals (``OnlyEnforceIf``), the solver's native form
of the paper's Big-M linearization.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields

from sloserve.core.errors import ConfigError
from sloserve.cost.base import BatchShape
from sloserve.cost.linear import LinearCostModel
from sloserve.optimal.problem import BatchPlan, BoundProblem
from sloserve.optimal.relaxation import min_batches, offline_bound, request_work, whole_model_coefficients

TIME_UNITS_PER_S = 10**12  # the objective's integer time unit: picoseconds
# Largest model solved by default: requests x batches (each cell holds ~14 variables).
MAX_CELLS = 4000


@dataclass
class BoundResult:
    status: str  # OPTIMAL, FEASIBLE, INFEASIBLE, UNKNOWN, MODEL_INVALID
    latency_s: float  # the schedule's latency, evaluated like the simulator (nan without one)
    objective_s: float  # the solver's objective (integerized cost model)
    best_bound_s: float  # proven lower bound on the objective
    gap: float  # (objective - bound) / objective
    schedule: list[BatchPlan] = field(default_factory=list)
    wall_s: float = 0.0
    num_variables: int = 0


def _int_coefficients(cost: LinearCostModel) -> dict[str, int]:
    """The preset's per-layer ms coefficients as integer picoseconds for the whole model."""
    return {key: round(value * TIME_UNITS_PER_S) for key, value in whole_model_coefficients(cost).items()}


def batch_seconds(cost: LinearCostModel, prompts_done: list[tuple[int, int]], decodes: list[int]) -> float:
    """Float time of a batch: ``prompts_done`` = (c, m) of prefill requests, ``decodes`` = m of each
    decode request, evaluated by the same cost model the simulator uses."""
    return cost.batch_time(BatchShape.of(prompts_done, decodes)).total_s


def solve_bound(
    problem: BoundProblem,
    cost: LinearCostModel,
    *,
    time_limit_s: float = 60.0,
    hint: list[dict[int, tuple[int, bool]]] | None = None,
    num_workers: int = 2,
    seed: int = 0,
    max_cells: int = MAX_CELLS,
) -> BoundResult:
    """Build and solve the model. ``hint``: a heuristic schedule as, per batch, {request: (c, evicted
    before it)} (a warm start). Raises ConfigError when the model is larger than ``max_cells``."""
    from ortools.sat.python import cp_model

    n, J = len(problem.prompts), problem.num_batches
    if beyond := cost.coefficients.beyond_infermax():
        raise ConfigError(
            f"bound: the constraint model encodes InferMax's linear form; cost model {cost.name!r} has "
            f"{', '.join(beyond)} (use a preset, or a fit with --form infermax)"
        )
    if J < max(problem.outputs):
        raise ConfigError(f"bound: {J} batches cannot produce {max(problem.outputs)} tokens")
    if n * J > max_cells:
        suggest = max(1, max_cells // J)
        raise ConfigError(
            f"bound: {n} requests x {J} batches = {n * J} cells (~{14 * n * J} variables) exceeds "
            f"the limit of {max_cells}; use at most ~{suggest} requests or shorter outputs "
            "(the model is NP-hard; --max-cells raises the limit)"
        )
    k = _int_coefficients(cost)
    model = cp_model.CpModel()
    cells = _Cells.empty(n, J)
    batch_terms: list[list] = [[] for _ in range(J + 1)]  # per batch: integer time expressions
    for i in range(n):
        _add_request(model, problem, k, cells, i, batch_terms)
    _break_symmetry(model, problem, cells.S)
    horizon = _horizon(problem, cost)
    if horizon * max(J, 2) > 2**62:  # NOTE: CP-SAT's integers are 64-bit: the sum of J batch times must fit
        raise ConfigError(
            f"bound: a schedule of these requests could last up to {horizon / TIME_UNITS_PER_S:,.0f} s, beyond what "
            "the solver's 64-bit time in picoseconds holds over its batches; give shorter requests or fewer of them"
        )
    batch_time = _add_batches(model, problem, k, cells, batch_terms, horizon)
    if problem.online:
        model.Minimize(_latest_end(model, problem, cells, batch_time, horizon))
    else:
        model.Minimize(sum(batch_time))
    if hint:
        _add_hints(model, _relabel_hint(hint, problem), problem, cells)

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = num_workers
    solver.parameters.random_seed = seed
    t0 = time.perf_counter()
    status = solver.Solve(model)
    wall = time.perf_counter() - t0
    name = solver.StatusName(status)
    num_vars = len(model.Proto().variables)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return BoundResult(name, math.nan, math.nan, math.nan, math.nan, [], wall, num_vars)
    plan = _extract(problem, cost, solver, cells)
    objective = solver.ObjectiveValue() / TIME_UNITS_PER_S
    bound = solver.BestObjectiveBound() / TIME_UNITS_PER_S
    latency = plan[-1].end_s - min(problem.arrivals) if plan else 0.0
    gap = (objective - bound) / objective if objective > 0 else 0.0
    return BoundResult(name, latency, objective, bound, gap, plan, wall, num_vars)


@dataclass
class _Cells:
    """The model's variables, each a list per request i of one per batch j = 0..J (j = 0: before the first
    batch; the module docstring's symbols)."""

    S: list[list]  # prompt + generated tokens after batch j
    m: list[list]  # tokens with KV after batch j
    c: list[list]  # tokens processed in batch j
    g: list[list]  # 1 if batch j samples a token
    e: list[list]  # 1 if the KV is dropped at batch j
    active: list[list]  # 1 if batch j processes any of its tokens
    decodes: list[list]  # 1 if it is a decode in batch j
    prefills: list[list]  # 1 if it is a prefill chunk in batch j

    @classmethod
    def empty(cls, num_requests: int, num_batches: int) -> _Cells:
        return cls(*([[None] * (num_batches + 1) for _ in range(num_requests)] for _ in fields(cls)))


def _add_request(model, problem: BoundProblem, k: dict[str, int], cells: _Cells, i: int, batch_terms: list[list]):
    """Request i's variables in every batch, constraints (1)-(3), termination, its phases and its share of each
    batch's time (added to ``batch_terms``), and the cuts its own work gives."""
    J, C = problem.num_batches, problem.max_num_batched_tokens
    prompt, output = problem.prompts[i], problem.outputs[i]
    S, m, c, g, e = cells.S[i], cells.m[i], cells.c[i], cells.g[i], cells.e[i]
    top = prompt + output - 1
    S[0], m[0] = prompt, 0
    request_terms = []  # its share of every batch's time
    for j in range(1, J + 1):
        S[j] = model.NewIntVar(prompt, prompt + output, f"S{i}_{j}")
        m[j] = model.NewIntVar(0, top, f"m{i}_{j}")
        c[j] = model.NewIntVar(0, min(C, top), f"c{i}_{j}")
        g[j] = model.NewBoolVar(f"g{i}_{j}")
        e[j] = model.NewBoolVar(f"e{i}_{j}")
        rem = S[j - 1] - m[j - 1]  # tokens available to process
        model.Add(S[j] == S[j - 1] + g[j])
        # (1) memory and (2) tokens to process
        model.Add(m[j] == 0).OnlyEnforceIf(e[j])
        model.Add(c[j] == 0).OnlyEnforceIf(e[j])
        model.Add(m[j] == m[j - 1] + c[j]).OnlyEnforceIf(e[j].Not())
        model.Add(c[j] <= rem)
        # (3) a token is sampled exactly when every known token has been processed
        model.Add(c[j] == rem).OnlyEnforceIf(g[j])
        model.Add(c[j] <= rem - 1).OnlyEnforceIf(g[j].Not())
        # phases: in prefill while >= 2 tokens are to be processed, else decode
        pre = model.NewBoolVar(f"pre{i}_{j}")
        model.Add(rem >= 2).OnlyEnforceIf(pre)
        model.Add(rem <= 1).OnlyEnforceIf(pre.Not())
        active = cells.active[i][j] = model.NewBoolVar(f"act{i}_{j}")
        model.Add(c[j] >= 1).OnlyEnforceIf(active)
        model.Add(c[j] == 0).OnlyEnforceIf(active.Not())
        decode = cells.decodes[i][j] = model.NewBoolVar(f"dec{i}_{j}")
        model.AddBoolAnd([active, pre.Not()]).OnlyEnforceIf(decode)
        model.AddBoolOr([active.Not(), pre]).OnlyEnforceIf(decode.Not())
        prefill = cells.prefills[i][j] = model.NewBoolVar(f"pf{i}_{j}")
        model.AddBoolAnd([active, pre]).OnlyEnforceIf(prefill)
        model.AddBoolOr([active.Not(), pre.Not()]).OnlyEnforceIf(prefill.Not())
        # cost terms: prefill attention work c^2 + 2mc, KV read by decodes and by chunks
        sq = model.NewIntVar(0, min(C, top) ** 2, f"sq{i}_{j}")
        model.AddMultiplicationEquality(sq, [c[j], c[j]])
        work = model.NewIntVar(0, min(C, top) ** 2 + 2 * top * min(C, top), f"w{i}_{j}")
        if j == 1:
            model.Add(work == sq).OnlyEnforceIf(prefill)
        else:
            mc = model.NewIntVar(0, top * min(C, top), f"mc{i}_{j}")
            model.AddMultiplicationEquality(mc, [m[j - 1], c[j]])
            model.Add(work == sq + 2 * mc).OnlyEnforceIf(prefill)
        model.Add(work == 0).OnlyEnforceIf(prefill.Not())
        kv_read = model.NewIntVar(0, top, f"kd{i}_{j}")
        model.Add(kv_read == m[j - 1]).OnlyEnforceIf(decode)
        model.Add(kv_read == 0).OnlyEnforceIf(decode.Not())
        chunk_ctx = model.NewIntVar(0, top, f"kp{i}_{j}")
        model.Add(chunk_ctx == m[j - 1]).OnlyEnforceIf(prefill)
        model.Add(chunk_ctx == 0).OnlyEnforceIf(prefill.Not())
        cell = [
            k["a_o"] * c[j],
            k["a_d"] * kv_read,
            k["s_d"] * decode,
            k["a_p"] * work,
            k["s_p"] * prefill,
            k["m_p"] * chunk_ctx,
        ]
        batch_terms[j] += cell
        request_terms += cell
    model.Add(sum(g[j] for j in range(1, J + 1)) == output)  # termination
    # Redundant cuts (they tighten the relaxation the solver bounds with): every KV a request ends
    # with is processed once, and the request costs at least what relaxation.py says any schedule pays.
    model.Add(sum(c[j] for j in range(1, J + 1)) >= prompt + output - 1)
    model.Add(sum(request_terms) >= math.floor(request_work(k, prompt, output)))


def _add_batches(
    model, problem: BoundProblem, k: dict[str, int], cells: _Cells, batch_terms: list[list], horizon: int
) -> list:
    """Each batch's constraints (4) and prefill budget, and its time (returned, one a batch): the requests'
    terms plus each kind of work's base cost where the batch holds any; empty batches last; the cuts the
    relaxation gives."""
    n, J = len(problem.prompts), problem.num_batches
    C, M, P = problem.max_num_batched_tokens, problem.kv_capacity_tokens, problem.prefill_token_budget
    c, m = cells.c, cells.m
    batch_time = []
    any_act = []
    for j in range(1, J + 1):
        model.Add(sum(c[i][j] for i in range(n)) <= C)  # (4)
        model.Add(sum(m[i][j] for i in range(n)) <= M)  # (4)
        flags = {}
        for name, lits in (
            ("act", [cells.active[i][j] for i in range(n)]),
            ("dec", [cells.decodes[i][j] for i in range(n)]),
            ("pre", [cells.prefills[i][j] for i in range(n)]),
        ):
            flags[name] = model.NewBoolVar(f"any_{name}{j}")
            model.AddMaxEquality(flags[name], lits)
        if P is not None:
            model.Add(sum(c[i][j] for i in range(n)) <= P).OnlyEnforceIf(flags["pre"])
        t = model.NewIntVar(0, horizon, f"time{j}")
        model.Add(
            t == sum(batch_terms[j]) + k["b_o"] * flags["act"] + k["b_d"] * flags["dec"] + k["b_p"] * flags["pre"]
        )
        batch_time.append(t)
        any_act.append(flags["act"])
    # NOTE: empty batches go last (symmetry breaking; an empty batch costs nothing).
    for j in range(len(any_act) - 1):
        model.AddImplication(any_act[j + 1], any_act[j])
    # Redundant cuts: at least J_min batches run (one token per request per batch, C tokens per batch,
    # M KV tokens held after each), and they take at least the relaxation's time.
    I, O = problem.prompts, problem.outputs
    model.Add(sum(any_act) >= min_batches(I, O, M, C, P))
    model.Add(sum(batch_time) >= math.floor(offline_bound(k, I, O, M, C, P)))
    return batch_time


def _latest_end(model, problem: BoundProblem, cells: _Cells, batch_time: list, horizon: int):
    """Online: the last batch's end, each batch starting after the one before and after the arrival of every
    request it processes."""
    n, J = len(problem.prompts), problem.num_batches
    start = [model.NewIntVar(0, horizon, f"start{j}") for j in range(1, J + 1)]
    for j in range(J):
        if j:
            model.Add(start[j] >= start[j - 1] + batch_time[j - 1])
        for i in range(n):
            arrival = round(problem.arrivals[i] * TIME_UNITS_PER_S)
            if arrival > 0:
                model.Add(start[j] >= arrival).OnlyEnforceIf(cells.active[i][j + 1])
    end = model.NewIntVar(0, 2 * horizon, "end")
    model.Add(end == start[-1] + batch_time[-1])
    return end


def _interchangeable(problem: BoundProblem) -> list[list[int]]:
    """Groups of requests alike in I, O and arrival (any two can swap places in a schedule)."""
    groups: dict[tuple, list[int]] = {}
    for i in range(len(problem.prompts)):
        groups.setdefault((problem.prompts[i], problem.outputs[i], problem.arrivals[i]), []).append(i)
    return [members for members in groups.values() if len(members) > 1]


def _break_symmetry(model, problem: BoundProblem, S) -> None:
    """Of two interchangeable requests i < i2, ask that i finish no later than i2 (any schedule can
    be relabelled to meet this)."""
    for members in _interchangeable(problem):
        for i, later in zip(members, members[1:]):
            full = problem.prompts[i] + problem.outputs[i]
            for j in range(1, problem.num_batches + 1):
                # S is monotone, so "later done by batch j" implies "i done by batch j".
                later_done = model.NewBoolVar(f"done{later}_{j}")
                model.Add(S[later][j] == full).OnlyEnforceIf(later_done)
                model.Add(S[later][j] <= full - 1).OnlyEnforceIf(later_done.Not())
                model.Add(S[i][j] == full).OnlyEnforceIf(later_done)


def _relabel_hint(hint: list[dict[int, tuple[int, bool]]], problem: BoundProblem) -> list[dict[int, tuple[int, bool]]]:
    """The hint with interchangeable requests renumbered in the order they finish (as
    ``_break_symmetry`` asks), so that the warm start stays a feasible schedule."""
    finish = {i: j for j, batch in enumerate(hint) for i, (tokens, _) in batch.items() if tokens > 0}  # the last wins
    rename = {i: i for i in range(len(problem.prompts))}
    for members in _interchangeable(problem):
        by_finish = sorted(members, key=lambda i: (finish.get(i, -1), i))
        rename.update(zip(by_finish, members))
    return [{rename[i]: value for i, value in batch.items()} for batch in hint]


def _horizon(problem: BoundProblem, cost: LinearCostModel) -> int:
    """An upper bound on any batch time and on the schedule's length, in time units: every token
    processed in its own batch, twice over (refills)."""
    C = problem.max_num_batched_tokens
    tops = [i + o - 1 for i, o in zip(problem.prompts, problem.outputs, strict=True)]
    # NOTE: over-counts every term of a real batch: request i prefills at most min(C, top) tokens after
    # at most top, and decodes after at most top (the domains of c and m). C and M themselves would
    # over-count past the solver's 64-bit integers where they are large (M = C = 10^7 did).
    worst = batch_seconds(cost, [(min(C, top), top) for top in tops], tops)
    total = problem.num_batches * worst + max(problem.arrivals)
    return int(2 * total * TIME_UNITS_PER_S) + 1


def _add_hints(model, hint, problem, cells: _Cells) -> None:
    """Warm start from a heuristic schedule: per batch {request: (c, evicted before)}."""
    S, m, c, g, e = cells.S, cells.m, cells.c, cells.g, cells.e
    n = len(problem.prompts)
    S_prev = list(problem.prompts)
    m_prev = [0] * n
    for j, batch in enumerate(hint[: problem.num_batches], start=1):
        for i in range(n):
            tokens, evicted = batch.get(i, (0, False))
            if S_prev[i] == problem.prompts[i] + problem.outputs[i]:
                evicted = True  # finished: its KV is released (the model frees memory through e)
            m_now = 0 if evicted else m_prev[i] + tokens
            gen = int(not evicted and tokens > 0 and tokens == S_prev[i] - m_prev[i])
            model.AddHint(c[i][j], tokens)
            model.AddHint(e[i][j], int(evicted))
            model.AddHint(m[i][j], m_now)
            model.AddHint(g[i][j], gen)
            model.AddHint(S[i][j], S_prev[i] + gen)
            S_prev[i] += gen
            m_prev[i] = m_now


def _extract(problem, cost, solver, cells: _Cells) -> list[BatchPlan]:
    """The solved schedule, timed in floating point like the simulator (a batch starts when the
    previous one ends and its requests have arrived)."""
    S, m, c, e = cells.S, cells.m, cells.c, cells.e
    n, J = len(problem.prompts), problem.num_batches
    plan: list[BatchPlan] = []
    now = 0.0
    for j in range(1, J + 1):
        tokens = {i: int(solver.Value(c[i][j])) for i in range(n) if solver.Value(c[i][j]) > 0}
        evicted = [
            i
            for i in range(n)
            if solver.Value(e[i][j])
            and solver.Value(m[i][j - 1]) > 0
            and solver.Value(S[i][j - 1]) < problem.prompts[i] + problem.outputs[i]
        ]
        if not tokens:
            continue
        prefills, decodes = [], []
        for i, tok in tokens.items():
            m_prev = int(solver.Value(m[i][j - 1]))
            remaining = int(solver.Value(S[i][j - 1])) - m_prev
            if remaining == 1:
                decodes.append(m_prev)
            else:
                prefills.append((tok, m_prev))
        start = max([now] + [problem.arrivals[i] for i in tokens])
        now = start + batch_seconds(cost, prefills, decodes)
        kv = sum(int(solver.Value(m[i][j])) for i in range(n))
        plan.append(BatchPlan(start, now, tokens, evicted, kv))
    return plan
