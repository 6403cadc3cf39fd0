"""The optimal schedule as a constraint model (InferMax §5) with OR-Tools CP-SAT."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sloserve.cli import main
from sloserve.core.errors import ConfigError
from sloserve.cost import LinearCostModel, get_preset
from sloserve.optimal import BoundProblem, latency, relaxed_bound, replay, run_heuristic, solve_bound
from sloserve.optimal.relaxation import (
    eviction_cost,
    min_batches,
    packing_lower_bound,
    prefill_packing_lower_bound,
    sampling_clique,
    whole_model_coefficients,
)

COST = LinearCostModel(get_preset("llama-2-7b-a100"))
HEURISTICS = ("vllm", "vllm_ef", "sarathi", "sarathi_ef", "infermax")


def solve(problem: BoundProblem, names=HEURISTICS, time_limit=20.0):
    runs = [run_heuristic(name, problem, COST) for name in names]
    best = min(runs, key=lambda r: r.latency_s)
    problem = dataclasses.replace(problem, num_batches=max(r.num_batches for r in runs))
    return problem, runs, solve_bound(problem, COST, time_limit_s=time_limit, hint=best.hint)


def test_schedule_replays_to_exactly_the_same_latency():
    base = BoundProblem(
        (8, 20, 5),
        (3, 2, 3),
        (0.0, 0.0, 0.0),
        kv_capacity_tokens=30,
        max_num_batched_tokens=4096,
        prefill_token_budget=None,
    )
    problem, runs, result = solve(base)
    assert result.status == "OPTIMAL" and result.gap == pytest.approx(0, abs=1e-9)
    requests = replay(problem, result.schedule, COST)
    assert latency(requests) == pytest.approx(result.latency_s, rel=1e-9)
    assert [r.num_output_tokens for r in requests] == [3, 2, 3]
    # The integerized objective agrees with the float latency to the rounding of the coefficients.
    assert result.objective_s == pytest.approx(result.latency_s, rel=1e-3)
    assert all(result.latency_s <= r.latency_s * (1 + 1e-9) for r in runs)


def test_online_arrivals_are_respected():
    base = BoundProblem(
        (16, 16, 4),
        (2, 3, 2),
        (0.0, 0.004, 0.02),
        kv_capacity_tokens=40,
        max_num_batched_tokens=4096,
        prefill_token_budget=None,
    )
    problem, runs, result = solve(base, names=("vllm", "sarathi"))
    assert result.status == "OPTIMAL"
    for batch in result.schedule:
        for i in batch.tokens:
            assert batch.start_s >= problem.arrivals[i] - 1e-12
    requests = replay(problem, result.schedule, COST)
    assert latency(requests) == pytest.approx(result.latency_s, rel=1e-9)
    assert all(result.latency_s <= r.latency_s * (1 + 1e-9) for r in runs)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 3)), min_size=2, max_size=2),
    extra=st.integers(0, 40),
)
def test_optimum_is_no_worse_than_any_heuristic(lengths, extra):
    prompts = tuple(p for p, _ in lengths)
    outputs = tuple(o for _, o in lengths)
    capacity = max(p + o - 1 for p, o in lengths) + extra
    base = BoundProblem(prompts, outputs, (0.0, 0.0), capacity, 4096, None)
    problem, runs, result = solve(base, time_limit=10.0)
    assert result.status in ("OPTIMAL", "FEASIBLE")
    for run in runs:
        assert result.latency_s <= run.latency_s * (1 + 1e-6), run.name
    assert latency(replay(problem, result.schedule, COST)) == pytest.approx(result.latency_s, rel=1e-9)
    # The relaxation bounds the optimum, and the solver's proven bound is at least the relaxation
    # (its cuts; up to the integerized coefficients' rounding).
    relaxed = relaxed_bound(base, COST)
    assert relaxed <= result.latency_s * (1 + 1e-9)
    assert result.best_bound_s >= relaxed * (1 - 1e-3)


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 60), st.floats(0, 2)), min_size=1, max_size=60),
    slack=st.integers(0, 3000),
    budget=st.sampled_from([512, 4096]),
    prefill_budget=st.sampled_from([None, 256]),
    online=st.booleans(),
)
def test_relaxation_bounds_every_heuristic_at_any_size(lengths, slack, budget, prefill_budget, online):
    """optimal/relaxation.py: no schedule the heuristics make, evicting or not, beats the relaxation,
    offline or online, with or without a prefill budget (it is a bound on every schedule)."""
    prompts = tuple(p for p, _, _ in lengths)
    outputs = tuple(o for _, o, _ in lengths)
    arrivals = tuple(t if online else 0.0 for _, _, t in lengths)
    capacity = max(p + o - 1 for p, o, _ in lengths) + slack
    prefill_budget = None if prefill_budget is None or prefill_budget >= budget else prefill_budget
    problem = BoundProblem(prompts, outputs, arrivals, capacity, budget, prefill_budget)
    relaxed = relaxed_bound(problem, COST)
    assert relaxed > 0
    # Whole-prompt schedulers need a prompt to fit a prefill budget; chunking ones do not.
    names = ("sarathi", "sarathi_ef") if prefill_budget else ("vllm", "vllm_ef", "sarathi", "sarathi_ef", "infermax")
    for name in names:
        run = run_heuristic(name, problem, COST)
        assert relaxed <= run.latency_s * (1 + 1e-9), name


def test_relaxation_is_the_no_eviction_cost_when_nothing_binds():
    """With memory and batch size to spare, vLLM's schedule (every prompt in one batch, then the
    decodes) pays exactly the relaxation's terms, so the bound is tight."""
    base = BoundProblem((29, 25, 22), (3, 4, 2), (0.0,) * 3, 10_000, 4096, None)
    assert relaxed_bound(base, COST) == pytest.approx(run_heuristic("vllm", base, COST).latency_s, rel=1e-9)


def test_figure15_regime_change_between_evicting_and_not():
    """O = B = 3, M = max(2I, I+O-1): the optimum evicts for short prompts and not for long ones
    (the paper: evictions for I <= 32 with O = B = 4), and vLLM / vLLM-EF match it on either side."""
    outcome = {}
    for prompt in (8, 128):
        M = max(2 * prompt, prompt + 3 - 1)
        base = BoundProblem((prompt,) * 3, (3,) * 3, (0.0,) * 3, M, 4096, None)
        _, runs, result = solve(base, names=("vllm", "vllm_ef"))
        assert result.status == "OPTIMAL"
        by_name = {r.name: r.latency_s for r in runs}
        outcome[prompt] = (sum(len(b.evicted) for b in result.schedule), result.latency_s, by_name)
    evictions, optimum, heuristics = outcome[8]
    assert evictions >= 1 and heuristics["vllm"] == pytest.approx(optimum, rel=1e-9)
    assert heuristics["vllm_ef"] > optimum * 1.02
    evictions, optimum, heuristics = outcome[128]
    assert evictions == 0 and heuristics["vllm_ef"] == pytest.approx(optimum, rel=1e-9)
    assert heuristics["vllm"] > optimum * 1.02


def test_bad_bound_problems():
    with pytest.raises(ConfigError, match="P=8192 exceeds C=4096"):
        BoundProblem((8,), (2,), (0.0,), 100, 4096, 8192)
    with pytest.raises(ConfigError, match="below the longest request's I \\+ O - 1 = 9"):
        BoundProblem((8,), (2,), (0.0,), 8, 4096, None)
    big = BoundProblem((8,) * 50, (100,) * 50, (0.0,) * 50, 10_000, 4096, None, num_batches=200)
    with pytest.raises(ConfigError, match="exceeds the limit of 4000; use at most ~20 requests"):
        solve_bound(big, COST)
    knee = LinearCostModel(dataclasses.replace(get_preset("llama-2-7b-a100"), knee_tokens=100.0))
    with pytest.raises(ConfigError, match="encodes InferMax's linear form; .* has knee_tokens 100"):
        solve_bound(BoundProblem((8,), (2,), (0.0,), 100, 4096, None), knee)
    with pytest.raises(ConfigError, match="relaxation prices tokens by InferMax's linear form"):
        relaxed_bound(BoundProblem((8,), (2,), (0.0,), 100, 4096, None), knee)
    floored = LinearCostModel(dataclasses.replace(get_preset("llama-2-7b-a100"), floor_p=1.5))
    with pytest.raises(ConfigError, match="linear form; .* has floor_p 1.5 \\(use a preset"):
        relaxed_bound(BoundProblem((8,), (2,), (0.0,), 100, 4096, None), floored)
    # M, C, P and the requests are bounded: 10^12 once ran the heuristics out of memory, or the model
    # past the solver's 64-bit integers (a TypeError from OR-Tools)
    with pytest.raises(ConfigError, match="KV capacity M=1,000,000,000,000 must be in 1..10,000,000 tokens"):
        BoundProblem((8,), (2,), (0.0,), 10**12, 4096, None)
    with pytest.raises(ConfigError, match="batch budget C=0 must be in 1..10,000,000 tokens"):
        BoundProblem((8,), (2,), (0.0,), 100, 0, None)
    with pytest.raises(ConfigError, match="the longest request's I \\+ O - 1 = 20,000,001 is above 10,000,000"):
        BoundProblem((20_000_000,), (2,), (0.0,), 10**7, 4096, None)
    huge = BoundProblem((9_000_000,) * 3, (3,) * 3, (0.0,) * 3, 10**7, 10**7, None, num_batches=3)
    with pytest.raises(ConfigError, match="could last up to .* beyond what the solver's 64-bit time"):
        solve_bound(huge, COST)


def test_a_capacity_and_budget_far_above_the_requests_bound_as_the_requests_need():
    """M and C at the limit do not bind two 3+3-token requests: the same optimum as M=6, C=4096 (the
    model's time horizon once took C and M as every request's size, past 64-bit integers)."""
    small = BoundProblem((3, 3), (3, 3), (0.0, 0.0), 10, 4096, None, num_batches=4)
    large = dataclasses.replace(small, kv_capacity_tokens=10**7, max_num_batched_tokens=10**7)
    a, b = solve_bound(small, COST, time_limit_s=20), solve_bound(large, COST, time_limit_s=20)
    assert a.status == b.status == "OPTIMAL"
    assert b.latency_s == pytest.approx(a.latency_s, rel=1e-9)


def test_bound_command(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sloserve.cli",
            "bound",
            "--fixed",
            "8,3",
            "--num-requests",
            "3",
            "--compare",
            "vllm,vllm_ef",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "bound: OPTIMAL" in proc.stdout and "vllm_ef" in proc.stdout
    assert (tmp_path / "gantt.png").stat().st_size > 0 and (tmp_path / "schedule.json").exists()
    # Too large for the exact model: the heuristics are measured against the relaxation instead.
    too_big = subprocess.run(
        [
            sys.executable,
            "-m",
            "sloserve.cli",
            "bound",
            "--fixed",
            "64,200",
            "--num-requests",
            "40",
            "--compare",
            "vllm",
            "--out",
            str(tmp_path / "big"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert too_big.returncode == 0, too_big.stderr
    assert "bound: not solved: 40 requests x" in too_big.stdout and "exceeds the limit" in too_big.stdout
    assert "over the relaxation" in too_big.stdout
    doc = json.loads((tmp_path / "big" / "schedule.json").read_text())
    assert doc["status"] == "NOT_SOLVED" and 0 < doc["relaxed_bound_s"] <= doc["heuristics"]["vllm"]["latency_s"]
    # Far too large to run step by step: refused at once, with what to do instead.
    refused = subprocess.run(
        [sys.executable, "-m", "sloserve.cli", "bound", "--fixed", "64,200", "--num-requests", "100000"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2 and "--num-requests 100000 is above bound's limit of 10,000" in refused.stderr


def test_bound_without_a_schedule_in_the_time_limit_compares_with_the_relaxation(tmp_path):
    """CP-SAT stopped before any schedule (UNKNOWN): the heuristics are measured against the
    relaxation, not against a NaN latency (which printed "+0.0%"), and schedule.json stays JSON."""
    args = ["bound", "--fixed", "8,3", "--num-requests", "2", "--compare", "vllm,vllm_ef", "--out", str(tmp_path)]
    result = CliRunner().invoke(main, [*args, "--time-limit", "1e-6"])
    assert result.exit_code == 0, result.output
    assert "bound: UNKNOWN in" in result.output and "no schedule within --time-limit 1e-06 s" in result.output
    assert "+10.8% over the relaxation" in result.output  # vllm_ef: 22.264 ms against 20.086 ms
    doc = json.loads((tmp_path / "schedule.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert doc["status"] == "UNKNOWN" and "latency_s" not in doc and not (tmp_path / "gantt.png").exists()
    refused = CliRunner().invoke(main, [*args, "--time-limit", "0"])
    assert refused.exit_code == 2 and "--time-limit must be > 0 seconds, got 0.0" in refused.output
    for bad, message in (
        (["--max-cells", "0"], "--max-cells must be >= 1, got 0"),  # once taken as no limit given
        (["--rate", "inf"], "--rate must be a finite number > 0 (requests/s), got inf"),
        (["--cost-model", "presets/none.json"], "cost model file presets/none.json: not found"),
        (["--out", __file__], "exists and is not a directory"),  # once FileExistsError after the solve
    ):
        refused = CliRunner().invoke(main, [*args, *bad])
        assert refused.exit_code == 2 and message in refused.output, refused.output


def test_bound_under_a_token_budget_below_sarathis_chunk():
    """C = 256 under Sarathi's P = 512: its chunks are capped at C (once "P=512 exceeds C=256", exit 2)."""
    args = ["bound", "--fixed", "8,3", "--num-requests", "2", "--compare", "vllm,sarathi"]
    result = CliRunner().invoke(main, [*args, "--max-num-batched-tokens", "256", "--time-limit", "10"])
    assert result.exit_code == 0, result.output
    assert "bound: OPTIMAL" in result.output and "sarathi" in result.output


def _fewest_bins(sizes: list[int], capacity: int) -> int:
    """Exact bin packing by search over subsets (a handful of items)."""
    n = len(sizes)
    full = (1 << n) - 1
    weight = [sum(sizes[i] for i in range(n) if mask >> i & 1) for mask in range(full + 1)]
    best = {0: 0}
    for mask in range(1, full + 1):
        low = mask & -mask  # the lowest item goes in some bin: try every fitting bin that holds it
        sub, found = mask, n
        while sub:
            if sub & low and weight[sub] <= capacity:
                found = min(found, best[mask ^ sub] + 1)
            sub = (sub - 1) & mask
        best[mask] = found
    return best[full]


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 3)), min_size=1, max_size=3),
    extra=st.integers(0, 30),
)
def test_packing_bound_is_a_lower_bound_of_the_exact_packing(lengths, extra):
    """relaxation.packing_lower_bound: the samplings (request i's k-th token, in a batch holding
    I + k - 1 of its tokens) need at least that many batches of M tokens; with items above M/2 it is
    at least the footprint over M (without, it leaves that term to its caller and returns 0)."""
    prompts = [p for p, _ in lengths]
    outputs = [o for _, o in lengths]
    capacity = max(p + o - 1 for p, o in lengths) + extra
    sizes = [p + k - 1 for p, o in lengths for k in range(1, o + 1)]
    bound = packing_lower_bound(prompts, outputs, capacity)
    footprint = -(-sum(sizes) // capacity)
    assert bound <= _fewest_bins(sizes, capacity)
    assert bound >= footprint if 2 * max(sizes) > capacity else bound == 0


def test_packing_bound_in_figure15s_memory():
    # I = 64, O = B = 4, M = 2I: the 12 samplings of tokens 2-4 hold more than M/2 and the first
    # tokens (64 each) fit only beside each other: 12 + 2 batches, where the footprint gives 9.
    assert packing_lower_bound([64] * 4, [4] * 4, 128) == 14
    assert min_batches([64] * 4, [4] * 4, 128, 4096, None) == 14
    # Two prompts whose last prefill chunks share a batch then hold 63 tokens each until one of them
    # finishes, with 4 tokens: 63 + 63 + 4 > 128. So every prompt gets its own prefill batch.
    assert prefill_packing_lower_bound([64] * 4, [4] * 4, 128) == 4
    assert (
        prefill_packing_lower_bound([64] * 4, [1] * 4, 128) == 0
    )  # one output: pairs fit (L2 leaves it to the footprint)


def test_relaxation_proves_figure15s_long_prompts_optimal():
    """I = 64, O = B = 4, M = 2I: the 12 samplings above M/2 and the 4 first samplings (64 held) pairwise
    cannot share a batch unless a request is evicted afterwards, and an eviction (recomputing 64
    tokens, 3.9 ms) costs more than a batch (b_o + b_d, 2.7 ms): 16 batches, where J_min counts 14. So
    the relaxation equals vLLM-EF's schedule, which evicts nothing: it is optimal. With short prompts an
    eviction is the cheaper (I = 16: 1.0 ms), and the relaxation charges that instead."""
    k = whole_model_coefficients(COST)
    size, cost = sampling_clique(k, [64] * 4, [4] * 4, 128)
    assert size == 16 and cost == pytest.approx(eviction_cost(k, 64, 4))
    assert cost > k["b_o"] + min(k["b_d"], k["b_p"]) > eviction_cost(k, 16, 4)
    assert eviction_cost(k, 64, 1) == float("inf")  # finishes with its first token: never evicted
    base = BoundProblem((64,) * 4, (4,) * 4, (0.0,) * 4, 128, 4096, None)
    assert relaxed_bound(base, COST) == pytest.approx(run_heuristic("vllm_ef", base, COST).latency_s, rel=1e-9)
    assert sampling_clique(k, [64] * 4, [4] * 4, 10_000)[0] == 1  # memory to spare: no two conflict


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 4)), min_size=1, max_size=4),
    extra=st.integers(0, 30),
)
def test_prefill_packing_bound_is_a_lower_bound_of_its_exact_packing(lengths, extra):
    """relaxation.prefill_packing_lower_bound: prompts of 2 tokens or more, as items I - 1, need at
    least that many bins of M - min(O); without items above half a bin it returns 0."""
    prompts = [p for p, _ in lengths]
    outputs = [o for _, o in lengths]
    capacity = max(p + o - 1 for p, o in lengths) + extra
    sizes = [p - 1 for p in prompts if p >= 2]
    bound = prefill_packing_lower_bound(prompts, outputs, capacity)
    bins = capacity - min(outputs)
    assert bound <= (_fewest_bins(sizes, bins) if sizes else 0)
    if not sizes or 2 * max(sizes) <= bins:
        assert bound == 0
