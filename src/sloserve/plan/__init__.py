"""Capacity planning (``sloserve plan``): which GPU, how many, colocated or disaggregated, and which
scheduler with which settings serve a load within its SLOs at the lowest cost per hour. The search is
in ``search``, the price table in ``prices``, the table, JSON and plots in ``report``."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from sloserve.parallel import Executor
from sloserve.plan.prices import DEFAULT_PRICES_PER_GPU_HOUR, parse_prices
from sloserve.plan.search import Candidate, PlanQuery, PlanSearch, enumerate_candidates, probe

__all__ = [
    "DEFAULT_PRICES_PER_GPU_HOUR",
    "Candidate",
    "PlanQuery",
    "PlanSearch",
    "enumerate_candidates",
    "parse_prices",
    "plan",
    "probe",
]


def plan(
    query: PlanQuery,
    candidates: list[Candidate],
    prices: dict[str, float],
    executor: Executor,
    *,
    skipped: list[dict] = (),
    describe: dict | None = None,
    on_round: Callable[[str, int], None] | None = None,
) -> dict:
    """Search ``candidates`` and return the plan as a JSON-serializable dict: ``answer`` (the cheapest
    verified deployment, or None), ``alternatives`` (the next verified ones), ``candidates`` (all, ranked),
    ``skipped``, ``message`` (why there is no answer), ``search`` (runs, rounds, workers, wall time).
    ``describe`` goes into ``query`` as it is (model, workload, SLO for the report)."""
    wall0 = time.perf_counter()
    search = PlanSearch(query, candidates, prices, executor, on_round)
    ranked = []
    for s in search.run():
        summary = s.summary(query.qps)
        if s.units:
            summary["simulate_command"] = simulate_command(query, s.candidate, s.units)
        ranked.append(summary)
    verified = [c for c in ranked if c["status"] == "verified"]
    doc = {
        "query": {
            "qps": query.qps,
            "attainment": query.attainment,
            "max_gpus": query.max_gpus,
            "tolerance": query.tolerance,
            **(describe or {}),
        },
        "answer": verified[0] if verified else None,
        "alternatives": verified[1 : 1 + query.num_alternatives],
        "message": None if verified else no_answer_message(query, ranked),
        "prices_per_gpu_hour": prices,
        "search": {
            "candidates": len(candidates),
            "runs": search.num_runs,
            "rounds": search.num_rounds,
            "workers": executor.workers,
            "wall_s": time.perf_counter() - wall0,
        },
        "candidates": ranked,
        "skipped": list(skipped),
    }
    return doc


def simulate_command(query: PlanQuery, candidate: Candidate, units: int) -> str:
    """The ``sloserve simulate`` command line that runs ``units`` units of ``candidate`` at the load,
    as the verification did: a user re-runs (or changes) the answer with it."""
    o = dataclasses.asdict(query.base_options) | candidate.system_options(units)
    o["num_requests"] = query.base_options.num_requests * units
    args = ["sloserve", "simulate", "--scheduler", candidate.scheduler]
    args += [f"--set {k}={v}" for k, v in candidate.options]
    args += (
        ["--workload", o["workload"], "--rt-rate", f"{query.qps:g}"]
        if o["workload"]
        else ["--trace", o["trace"], "--rate", f"{query.qps:g}"]
    )
    flags = ("columns", "num_requests", "max_tokens", "burstiness", "slo_ttft", "slo_tpot", "slo_jct", "seed", "model",
             "gpu", "num_gpus", "replicas", "disaggregate", "cost_model", "memory_utilization", "swap_space_gib",
             "router", "link_gbps")  # fmt: skip
    args += [f"--{k.replace('_', '-')} {o[k]}" for k in flags if o.get(k) is not None]
    return " ".join(str(a) for a in args)


def no_answer_message(query: PlanQuery, ranked: list[dict]) -> str:
    """Why no deployment serves the load, with the best that was reached."""
    target = f"{query.attainment:.0%} attainment"
    if not ranked:
        return "no configuration to search: every one was skipped (see `skipped` in plan.json)"
    serving = [c for c in ranked if c["goodput_rps"] > 0]
    if serving:
        most = max(serving, key=lambda c: c["goodput_rps"] * (query.max_gpus // c["gpus_per_unit"]))
        units = query.max_gpus // most["gpus_per_unit"]
        return (
            f"no configuration serves {query.qps:g} req/s at {target} within --max-gpus {query.max_gpus}: "
            f"the most is about {most['goodput_rps'] * units:.3g} req/s ({units} x {most['label']})"
        )
    probes = [(p["attainment"], p["rate"], c["label"]) for c in ranked for p in c["probes"]]
    if not probes:
        return f"every configuration was refused by the simulator; the first: {ranked[0]['reason']}"
    attainment, rate, label = max(probes, key=lambda x: (x[0], -x[1]))
    return (
        f"no configuration reaches {target} for {query.qps:g} req/s within --max-gpus {query.max_gpus}: the best "
        f"reached {attainment:.1%} ({label} at {rate:.3g} req/s per unit, the least per unit that serves the load "
        "with that many GPUs)"
    )
