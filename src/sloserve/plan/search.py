"""The configuration search of ``sloserve plan``: the cheapest deployment that serves ``qps`` requests/s
with at least ``attainment`` of them within their SLOs.

A *candidate* is a GPU type, a tensor-parallel degree ``tp``, a layout and a scheduler with one point of
the knob grid. Its *unit* is one colocated replica of ``tp`` GPUs, or P prefill and D decode replicas of
``tp`` GPUs each (DistServe's disaggregation); a deployment is ``k`` units behind the router.

1. **Goodput** of one unit: the highest Poisson rate whose SLO attainment reaches the target, by
   bisection on a log scale between ``qps / max_units`` (the least a unit may serve) and ``qps`` (one
   unit serves it all; then up by doubling, at most ``MAX_DOUBLINGS`` times), until the bracket is within
   ``tolerance``. Every live candidate runs one probe per round, all of them in parallel.
2. **Pruning** between rounds. As Vidur's config search does, the search models a deployment's goodput
   as k times its unit's, so a candidate needs at least ``floor(qps / hi) + 1`` units (``hi``: its lowest
   failing rate) and at most ``ceil(qps / lo)`` (``lo``: its highest passing rate). One whose least
   possible cost is above another's greatest cannot win, and stops. Should verification cost the answer
   more than that, the pruned candidates it made competitive search again: in the end no pruned
   candidate's least cost is below the answer's.
3. **Verification**: the cheapest candidates by that estimate are simulated whole (k units at ``qps``,
   k x ``num_requests`` requests) at k-1, k and k+1 units, then further while the answer is open, so the
   plan's answer and its alternatives are deployments that met the SLO in a run of their own. Candidates
   are verified in order of their estimate until no unverified one is estimated cheaper than the
   ``num_alternatives + 1``-th verified.

NOTE: every probe is a deterministic simulation and rounds are formed the same way on any executor, so
a search on Ray returns exactly what the serial search does.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sloserve.core.errors import ConfigError, SloserveError
from sloserve.cost import get_gpu, kv_capacity_tokens
from sloserve.cost.specs import ModelSpec, check_tensor_parallel
from sloserve.parallel import Executor
from sloserve.runs import SimOptions, simulate_options

MAX_DOUBLINGS = 3  # a unit that serves qps is probed at up to 8 x qps for its goodput


@dataclass(frozen=True)
class Candidate:
    """One configuration: a unit of ``gpus_per_unit`` GPUs and how it schedules."""

    gpu: str  # canonical name (sloserve.cost.GPUS)
    tensor_parallel: int
    scheduler: str
    options: tuple[tuple[str, str], ...] = ()  # scheduler options of the --set-grid point
    prefill_replicas: int = 0  # 0: colocated
    decode_replicas: int = 0

    @property
    def disaggregated(self) -> bool:
        return self.decode_replicas > 0

    @property
    def gpus_per_unit(self) -> int:
        replicas = self.prefill_replicas + self.decode_replicas if self.disaggregated else 1
        return replicas * self.tensor_parallel

    @property
    def layout(self) -> str:
        return f"{self.prefill_replicas}P:{self.decode_replicas}D" if self.disaggregated else "colocated"

    @property
    def label(self) -> str:
        knobs = "".join(f" {k}={v}" for k, v in self.options)
        return f"{self.gpu} tp{self.tensor_parallel} {self.layout} {self.scheduler}{knobs}"

    def system_options(self, units: int) -> dict[str, Any]:
        """The system options (``sloserve.runs``) of ``units`` units of this candidate."""
        if self.disaggregated:
            layout = {"replicas": 1, "disaggregate": f"{units * self.prefill_replicas}:{units * self.decode_replicas}"}
        else:
            layout = {"replicas": units, "disaggregate": None}
        return {"gpu": self.gpu, "num_gpus": self.tensor_parallel, **layout}


@dataclass
class CandidateSearch:
    """What the search knows of one candidate."""

    candidate: Candidate
    unit_price: float  # USD per hour of one unit
    max_units: int
    status: str = "searching"  # searching, estimated, pruned, infeasible, error, verified, unverifiable
    reason: str = ""
    lo: float = 0.0  # highest rate that met the target (0: none yet)
    hi: float | None = None  # lowest rate that missed it
    doublings: int = 0
    probes: list[dict] = field(default_factory=list)  # one unit: {rate, attainment, ...}
    checks: list[dict] = field(default_factory=list)  # whole deployments at qps: {units, attainment, ...}
    units: int | None = None  # verified: the fewest units that met the target at qps

    def units_bounds(self, qps: float) -> tuple[int, float]:
        """(least, most) units the linear model allows: most is inf while no rate has passed."""
        if self.units is not None:
            return self.units, self.units
        least = 1 if self.hi is None else math.floor(qps / self.hi) + 1
        failed = [c["units"] for c in self.checks if not c["met"]]
        least = max(least, max(failed, default=0) + 1)
        most = math.ceil(qps / self.lo - 1e-9) if self.lo > 0 else math.inf
        return least, max(most, least)

    def cost_bounds(self, qps: float) -> tuple[float, float]:
        least, most = self.units_bounds(qps)
        return least * self.unit_price, most * self.unit_price

    def summary(self, qps: float) -> dict:
        least, most = self.units_bounds(qps)
        c = self.candidate
        best_check = next((x for x in self.checks if x["units"] == self.units), None)
        return {
            "label": c.label,
            "gpu": c.gpu,
            "tensor_parallel": c.tensor_parallel,
            "layout": c.layout,
            "scheduler": c.scheduler,
            "options": dict(c.options),
            "gpus_per_unit": c.gpus_per_unit,
            "unit_price_per_hour": self.unit_price,
            "status": self.status,
            "reason": self.reason,
            "goodput_rps": self.lo,
            "goodput_upper_rps": self.hi,
            "goodput_per_gpu_rps": self.lo / c.gpus_per_unit,
            "goodput_capped": self.hi is None and self.lo > 0,
            "units": self.units,
            "num_gpus": self.units * c.gpus_per_unit if self.units else None,
            "cost_per_hour": self.units * self.unit_price if self.units else None,
            "estimated_units": [least, most if most != math.inf else None],
            "verified": best_check,
            "probes": self.probes,
            "checks": self.checks,
        }


@dataclass(frozen=True)
class PlanQuery:
    """What ``sloserve plan`` was asked: ``base_options`` are the workload and system options of
    ``sloserve.runs`` shared by every run (model, trace, SLOs, seed, num_requests, cost model)."""

    qps: float
    attainment: float
    max_gpus: int
    base_options: SimOptions
    tolerance: float = 0.05
    num_alternatives: int = 3


def probe(options: dict[str, Any], scheduler: str, set_options: dict[str, str], rate: float) -> dict:
    """One simulation at ``rate``: its SLO attainment (of the real-time requests when the workload has
    classes) and latencies; a task, so module-level and picklable. A configuration the simulator
    refuses comes back as ``{"error": message}``."""
    try:
        s = simulate_options(options, scheduler, set_options, rate)
    except SloserveError as err:
        return {"error": str(err)}
    # NOTE: with real-time and best-effort streams (--workload), the SLO is the real-time requests'.
    rt = s["classes"].get("rt", s)
    return {
        "attainment": rt["slo_attainment"] or 0.0,
        "ttft_p99_s": rt["ttft_s"]["p99"],
        "tpot_p99_s": rt["tpot_s"]["p99"],
        "throughput_rps": rt["throughput_rps"],
    }


def enumerate_candidates(
    model: ModelSpec,
    gpus: list[str],
    tensor_parallel: list[int] | None,
    schedulers: list[str],
    layouts: list[tuple[int, int]],
    grid: dict[str, dict[str, list[str]]],
    max_gpus: int,
    memory_utilization: float,
    role_schedulers: set[str],
) -> tuple[list[Candidate], list[dict]]:
    """Every candidate of the search space, and those left out with the reason (weights do not fit,
    more GPUs than ``max_gpus``, a degree that does not divide the heads, a scheduler with no
    disaggregated roles). ``tensor_parallel`` None: 1, 2, 4, 8. ``grid``: scheduler -> option -> values."""
    candidates, skipped = [], []
    for gpu_name in gpus:
        gpu = get_gpu(gpu_name).name
        for tp in tensor_parallel or [1, 2, 4, 8]:
            try:
                check_tensor_parallel(model, tp)
                kv_capacity_tokens(model, get_gpu(gpu), num_gpus=tp, memory_utilization=memory_utilization)
            except ConfigError as err:
                skipped.append({"label": f"{gpu} tp{tp}", "reason": str(err)})
                continue
            for (p, d), scheduler in itertools.product(layouts, schedulers):
                if d and scheduler not in role_schedulers:
                    skipped.append(
                        {
                            "label": f"{gpu} tp{tp} {p}P:{d}D {scheduler}",
                            "reason": f"{scheduler} has no prefill/decode roles (disaggregation)",
                        }
                    )
                    continue
                knobs = grid.get(scheduler, {})
                for values in itertools.product(*knobs.values()):
                    c = Candidate(gpu, tp, scheduler, tuple(zip(knobs, values, strict=True)), p, d)
                    if c.gpus_per_unit > max_gpus:
                        skipped.append(
                            {
                                "label": c.label,
                                "reason": f"a unit has {c.gpus_per_unit} GPUs, over --max-gpus {max_gpus}",
                            }
                        )
                        continue
                    candidates.append(c)
    return candidates, skipped


class PlanSearch:
    """The search over ``candidates`` for ``query``, run by ``executor`` (see the module docstring).
    ``on_round(description, num_decided)`` reports progress."""

    def __init__(
        self,
        query: PlanQuery,
        candidates: list[Candidate],
        prices: dict[str, float],
        executor: Executor,
        on_round: Callable[[str, int], None] | None = None,
    ) -> None:
        from sloserve.plan.prices import price_per_gpu_hour

        self.query, self.executor, self.on_round = query, executor, on_round
        self.searches = [
            CandidateSearch(c, c.gpus_per_unit * price_per_gpu_hour(prices, c.gpu), query.max_gpus // c.gpus_per_unit)
            for c in candidates
        ]
        self.num_runs = 0
        self.num_rounds = 0

    # --- the two phases -------------------------------------------------------------------------
    def run(self) -> list[CandidateSearch]:
        """Search, verify, and search again what verification made competitive; every candidate's
        final state, ranked (verified first, by cost)."""
        while True:
            while any(s.status == "searching" for s in self.searches):
                self._goodput_round()
            batch = self._to_verify()
            if batch:
                for s in batch:
                    s.status = "verifying"
                while any(s.status == "verifying" for s in batch):
                    self._verify_round([s for s in batch if s.status == "verifying"])
            elif not self._resume_pruned():
                break
        return sorted(self.searches, key=self._rank)

    def _goodput_round(self) -> None:
        q = self.query.qps
        live = [s for s in self.searches if s.status == "searching"]
        calls, owners = [], []
        for s in live:
            for rate in self._next_rates(s):
                calls.append(self._call(s.candidate, 1, rate))
                owners.append((s, rate))
        for (s, rate), result in zip(owners, self._map(calls, "goodput"), strict=True):
            if "error" in result:
                s.status, s.reason = "error", result["error"]
                continue
            if s.status != "searching":
                continue
            met = result["attainment"] >= self.query.attainment
            s.probes.append({"rate": rate, "met": met, **result})
            if met:
                s.lo = max(s.lo, rate)
            else:
                s.hi = rate if s.hi is None else min(s.hi, rate)
        for s in live:
            if s.status != "searching":
                continue
            r_min = q / s.max_units
            if s.lo == 0 and s.hi is not None and s.hi <= r_min * (1 + 1e-9):
                s.status = "infeasible"
                best = max(p["attainment"] for p in s.probes)
                s.reason = (
                    f"below {self.query.attainment:.0%} attainment at {r_min:.3g} req/s per unit, the least "
                    f"that serves {q:g} req/s with {s.max_units} units ({best:.0%} reached)"
                )
            elif self._converged(s):
                s.status = "estimated"
        self._prune()

    def _next_rates(self, s: CandidateSearch) -> list[float]:
        q = self.query.qps
        if not s.probes:  # the least useful rate and the whole load, together
            return sorted({q / s.max_units, q})
        if s.hi is None:  # one unit serves q: how much more
            s.doublings += 1
            return [s.lo * 2]
        return [math.sqrt(s.lo * s.hi)]  # NOTE: lo > 0 here: a failing least rate ends the search

    def _converged(self, s: CandidateSearch) -> bool:
        """The goodput bracket is within the tolerance, or one unit served ``8 x qps`` (a lower bound)."""
        if s.hi is None:
            return s.doublings >= MAX_DOUBLINGS
        return s.lo > 0 and s.hi <= s.lo * (1 + self.query.tolerance)

    def _prune(self) -> None:
        """Stop the searching candidates whose least cost is above the greatest cost of another
        (estimated, or verified)."""
        q = self.query.qps
        bounds = [s.cost_bounds(q)[1] for s in self.searches if s.status in ("searching", "estimated", "verified")]
        best_most = min(bounds, default=math.inf)
        for s in self.searches:
            least = s.cost_bounds(q)[0]
            if s.status == "searching" and least > best_most * (1 + 1e-9):
                s.status = "pruned"
                s.reason = f"costs at least ${least:.2f}/h; another costs at most ${best_most:.2f}/h"

    def _resume_pruned(self) -> bool:
        """Verification can cost the answer more units than estimated: pruned candidates whose least
        cost is now below the cheapest verified one search again. Whether any did."""
        q = self.query.qps
        best = min((s.units * s.unit_price for s in self.searches if s.status == "verified"), default=math.inf)
        resumed = [s for s in self.searches if s.status == "pruned" and s.cost_bounds(q)[0] < best * (1 - 1e-9)]
        for s in resumed:
            s.status, s.reason = ("estimated" if self._converged(s) else "searching"), ""
        return bool(resumed)

    def _to_verify(self) -> list[CandidateSearch]:
        """The next candidates to verify: the cheapest estimates, while one could still rank among
        the first ``num_alternatives + 1`` verified."""
        q, keep = self.query.qps, self.query.num_alternatives + 1
        verified = sorted(s.units * s.unit_price for s in self.searches if s.status == "verified")
        bar = verified[keep - 1] if len(verified) >= keep else math.inf
        waiting = sorted((s for s in self.searches if s.status == "estimated" and s.lo > 0), key=self._rank)
        waiting = [s for s in waiting if s.units_bounds(q)[1] <= s.max_units and s.cost_bounds(q)[0] <= bar]
        return waiting[: max(keep - len(verified), 1)] if waiting else []

    def _verify_round(self, batch: list[CandidateSearch]) -> None:
        calls, owners = [], []
        for s in batch:
            for units in self._next_units(s):
                calls.append(self._call(s.candidate, units, self.query.qps))
                owners.append((s, units))
        for (s, units), result in zip(owners, self._map(calls, "verify"), strict=True):
            if "error" in result:
                s.status, s.reason = "error", result["error"]
                continue
            s.checks.append({"units": units, "met": result["attainment"] >= self.query.attainment, **result})
        for s in batch:
            if s.status != "verifying":
                continue
            passed = [c["units"] for c in s.checks if c["met"]]
            failed = [c["units"] for c in s.checks if not c["met"]]
            fewest = min(passed, default=None)
            if fewest is not None and (fewest == 1 or fewest - 1 in failed):
                s.status, s.units = "verified", fewest
            elif fewest is None and max(failed) >= s.max_units:
                s.status = "unverifiable"
                s.reason = f"missed {self.query.attainment:.0%} attainment at {self.query.qps:g} req/s with up to {s.max_units} units"

    def _next_units(self, s: CandidateSearch) -> list[int]:
        """Deployments to simulate next: k-1, k, k+1 around the estimate first, then down while the
        fewest passing count's neighbour is untried, or up by three while nothing passed."""
        tried = {c["units"] for c in s.checks}
        passed = [c["units"] for c in s.checks if c["met"]]
        if not tried:
            k = s.units_bounds(self.query.qps)[1]
            wanted = [k - 1, k, k + 1]
        elif passed:
            wanted = [min(passed) - 1]
        else:
            top = max(tried)
            wanted = [top + 1, top + 2, top + 3]
        return [k for k in wanted if 1 <= k <= s.max_units and k not in tried]

    # --- helpers ------------------------------------------------------------------------------------
    def _call(self, c: Candidate, units: int, rate: float) -> tuple:
        base = self.query.base_options
        n = base.num_requests or 1000
        options = dataclasses.replace(base, **c.system_options(units), num_requests=n * units)
        return (options, c.scheduler, dict(c.options), rate)

    def _map(self, calls: list[tuple], phase: str) -> list[dict]:
        self.num_rounds += 1
        decided = sum(s.status not in ("searching", "verifying") for s in self.searches)

        def on_done(done: int) -> None:
            if self.on_round is not None:
                self.on_round(f"round {self.num_rounds} ({phase}): {done}/{len(calls)} runs", decided)

        on_done(0)
        results = self.executor.map(probe, calls, on_done)
        self.num_runs += len(calls)
        return results

    def _rank(self, s: CandidateSearch) -> tuple:
        """Verified first by cost, then estimates by their greatest cost; ties: fewer GPUs, then more
        headroom (units x unit goodput), then the label."""
        q = self.query.qps
        order = {"verified": 0, "estimated": 1, "unverifiable": 2, "pruned": 3, "infeasible": 4, "error": 5}
        units = s.units or s.units_bounds(q)[1]
        headroom = units * s.lo if s.lo > 0 else 0.0  # NOTE: units is inf while nothing passed
        return (
            order.get(s.status, 6),
            units * s.unit_price,
            units * s.candidate.gpus_per_unit,
            -headroom,
            s.candidate.label,
        )
