"""Per-request table and run summary, computed with the metric definitions of DESIGN.md (Contracts).

    TTFT               = first token - arrival
    TPOT               = (last token - first token) / (output tokens - 1)   (NaN for 1 output token)
    normalized latency = (finish - arrival) / output tokens
    JCT                = finish - arrival
    throughput         = completed requests (or their output tokens) / makespan
    goodput            = requests meeting their SLO / makespan
    KV utilization     = time-weighted tokens holding KV (or allocated) / capacity
    JCT decomposition  = waiting (first scheduled - arrival) + preemption (paused after preemptions)
                         + GT queuing (decode waiting to join the batch) + execution (the rest)
                         (EconoServe §2.1; kept per request by the step loop, see core/request.py)
    allocation failure share = requests that met >= 1 KV allocation failure in execution / requests

Latency statistics are taken over completed requests; NaN entries (e.g. TPOT of a one-token output)
are left out. Every float the summary holds is a plain Python float or ``None`` (undefined), so the
dict is valid JSON as is.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from sloserve.core.request import Request, RequestClass
from sloserve.metrics.timeline import Timeline

# Column name -> dtype of ``request_table``, in output (CSV) order.
REQUEST_COLUMNS: dict[str, Any] = {
    "request_id": np.int64,
    "replica": np.int64,
    "request_class": object,  # "rt" / "be"
    "priority": np.int64,  # vLLM's request priority (0 unless a workload stream sets one)
    "arrival_s": np.float64,
    "prompt_tokens": np.int64,
    "cached_tokens": np.int64,  # prompt tokens found in the prefix cache at admission
    "output_tokens": np.int64,  # sampled so far
    "finished": np.bool_,
    "first_token_s": np.float64,
    "last_token_s": np.float64,
    "finish_s": np.float64,
    "ttft_s": np.float64,
    "tpot_s": np.float64,
    "max_tbt_s": np.float64,
    "normalized_latency_s": np.float64,
    "jct_s": np.float64,
    "num_preemptions": np.int64,
    "num_allocation_failures": np.int64,
    "waiting_s": np.float64,
    "execution_s": np.float64,
    "preemption_s": np.float64,
    "gt_queuing_s": np.float64,
    "slo_ttft_s": np.float64,
    "slo_tpot_s": np.float64,
    "slo_jct_s": np.float64,
    "slo_met": np.bool_,
}

# Latency metrics summarized as {mean, p50, p90, p99} over completed requests.
LATENCY_METRICS: tuple[str, ...] = (
    "ttft_s", "tpot_s", "normalized_latency_s", "jct_s", "max_tbt_s",
)  # fmt: skip

# NOTE: an SLO counts as met when the value is within this many seconds above the target, so that
# float rounding in accumulated step times does not turn an on-deadline token into a violation.
SLO_TOLERANCE_S = 1e-9


def request_table(requests: Sequence[Request]) -> dict[str, np.ndarray]:
    """One row per request, sorted by ``request_id``; columns as in ``REQUEST_COLUMNS``.

    Times not reached are NaN. ``slo_met`` is True when the request finished and every SLO that is
    set is met (a request without any SLO counts as met once finished; a one-token output has no
    TPOT and meets any TPOT SLO).
    """
    reqs = sorted(requests, key=lambda r: r.request_id)
    nan = math.nan

    def slo_value(v: float | None) -> float:
        return nan if v is None else float(v)

    cols: dict[str, list[Any]] = {
        "request_id": [r.request_id for r in reqs],
        "replica": [r.replica for r in reqs],
        "request_class": [RequestClass(r.request_class).value for r in reqs],
        "priority": [r.priority for r in reqs],
        "arrival_s": [r.arrival_time for r in reqs],
        "prompt_tokens": [r.num_prompt_tokens for r in reqs],
        "cached_tokens": [r.num_cached_tokens for r in reqs],
        "output_tokens": [r.num_output_tokens for r in reqs],
        "finished": [r.is_finished for r in reqs],
        "first_token_s": [r.first_token_time for r in reqs],
        "last_token_s": [r.last_token_time for r in reqs],
        "finish_s": [r.finish_time for r in reqs],
        "max_tbt_s": [r.max_token_gap for r in reqs],
        "num_preemptions": [r.num_preemptions for r in reqs],
        "num_allocation_failures": [r.num_allocation_failures for r in reqs],
        "waiting_s": [r.first_scheduled_time - r.arrival_time for r in reqs],
        "preemption_s": [r.preempted_s for r in reqs],
        "gt_queuing_s": [r.gt_queued_s for r in reqs],
        "slo_ttft_s": [nan if r.slo is None else slo_value(r.slo.ttft_s) for r in reqs],
        "slo_tpot_s": [nan if r.slo is None else slo_value(r.slo.tpot_s) for r in reqs],
        "slo_jct_s": [nan if r.slo is None else slo_value(r.slo.jct_s) for r in reqs],
    }
    t: dict[str, np.ndarray] = {name: np.asarray(values, dtype=REQUEST_COLUMNS[name]) for name, values in cols.items()}

    out = t["output_tokens"].astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        t["ttft_s"] = t["first_token_s"] - t["arrival_s"]
        t["tpot_s"] = np.where(out > 1, (t["last_token_s"] - t["first_token_s"]) / np.maximum(out - 1, 1), nan)
        t["jct_s"] = t["finish_s"] - t["arrival_s"]
        t["normalized_latency_s"] = np.where(out > 0, t["jct_s"] / np.maximum(out, 1), nan)
        t["execution_s"] = t["jct_s"] - t["waiting_s"] - t["preemption_s"] - t["gt_queuing_s"]

    met = t["finished"].copy()
    for metric in ("ttft_s", "tpot_s", "jct_s"):
        target, value = t[f"slo_{metric}"], t[metric]
        ok = np.isnan(target)  # no SLO on this metric
        if metric == "tpot_s":
            ok |= np.isnan(value)  # one output token: TPOT undefined
        with np.errstate(invalid="ignore"):
            met &= ok | (value <= target + SLO_TOLERANCE_S)
    t["slo_met"] = met
    return {name: t[name] for name in REQUEST_COLUMNS}


def _float(x: float | np.floating) -> float | None:
    """A plain float, or None for NaN / inf."""
    x = float(x)
    return x if math.isfinite(x) else None


def latency_stats(values: np.ndarray) -> dict[str, float | None]:
    """``{mean, p50, p90, p99}`` of the non-NaN values (percentiles with linear interpolation);
    all ``None`` when no value is left."""
    v = values[~np.isnan(values)]
    if v.size == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(v, [50, 90, 99])
    return {"mean": _float(v.mean()), "p50": _float(p50), "p90": _float(p90), "p99": _float(p99)}


def _step_stats(values: np.ndarray) -> dict[str, float | None]:
    stats = latency_stats(values.astype(np.float64))
    stats["max"] = _float(values.max()) if values.size else None
    return stats


def _ratio(num: float, den: float) -> float:
    return float(num) / den if den > 0 else 0.0


def _makespan(table: dict[str, np.ndarray], timeline: Timeline) -> float:
    """Last finish - first arrival when every request completed; otherwise the end of the last step
    (or of the last recorded token or finish, if later) - first arrival."""
    arrival = table["arrival_s"]
    if arrival.size == 0:
        return 0.0
    finish = table["finish_s"]
    if bool(table["finished"].all()) and not np.isnan(finish).all():
        end = float(np.nanmax(finish))
    else:
        times = np.concatenate([finish, table["last_token_s"]])
        if len(timeline):
            ends = timeline.column("start_s") + timeline.column("duration_s")
            times = np.append(times, ends.max())
        times = times[~np.isnan(times)]
        end = float(times.max()) if times.size else float(arrival.min())
    return max(0.0, end - float(arrival.min()))


def _request_metrics(table: dict[str, np.ndarray], mask: np.ndarray, duration_s: float) -> dict:
    """The per-request keys of the summary for the rows in ``mask``, over ``duration_s``."""
    done = mask & table["finished"]
    completed = int(done.sum())
    num = int(mask.sum())
    met = int((mask & table["slo_met"]).sum())
    out: dict[str, Any] = {
        "num_requests": num,
        "completed": completed,
        "throughput_rps": _ratio(completed, duration_s),
        "throughput_tps": _ratio(int(table["output_tokens"][done].sum()), duration_s),
    }
    for metric in LATENCY_METRICS:
        out[metric] = latency_stats(table[metric][done])
    out["slo_attainment"] = met / num if num else None
    # Prefix caching: prompt tokens found cached over the prompt tokens of the completed requests.
    cached, prompt = int(table["cached_tokens"][done].sum()), int(table["prompt_tokens"][done].sum())
    out["cached_tokens"] = cached
    out["prefix_cache_hit_rate"] = _ratio(cached, prompt)
    # Requests with at least one SLO: with none, attainment only counts completions (tables show "-").
    with_slo = ~(np.isnan(table["slo_ttft_s"]) & np.isnan(table["slo_tpot_s"]) & np.isnan(table["slo_jct_s"]))
    out["num_with_slo"] = int((mask & with_slo).sum())
    out["goodput_rps"] = _ratio(met, duration_s)
    out["jct_breakdown_s"] = {
        part: _float(table[f"{part}_s"][done].mean()) if completed else None
        for part in ("waiting", "execution", "preemption", "gt_queuing")
    }
    failed = int((mask & (table["num_allocation_failures"] > 0)).sum())
    out["allocation_failure_share"] = failed / num if num else None
    return out


def distribution(values: Sequence[float], max_points: int = 50) -> dict[str, Any]:
    """``{count, mean, p50, p90, p99, max, cdf}`` of ``values``; ``cdf`` is ``[value, fraction of values
    <= value]`` at up to ``max_points`` distinct values (all of them when fewer), for CDF plots."""
    v = np.sort(np.asarray(values, dtype=np.float64))
    if v.size == 0:
        return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None, "cdf": []}
    stats = latency_stats(v)
    distinct = np.unique(v)
    if distinct.size > max_points:
        distinct = np.unique(np.quantile(v, np.linspace(0, 1, max_points), method="inverted_cdf"))
    fractions = np.searchsorted(v, distinct, side="right") / v.size
    cdf = [[_float(x), float(f)] for x, f in zip(distinct, fractions, strict=True)]
    return {"count": int(v.size), **stats, "max": _float(v[-1]), "cdf": cdf}


def summarize(
    requests: Sequence[Request],
    timeline: Timeline,
    *,
    kv_capacity_tokens: int,
    sim_wall_s: float,
    num_allocation_failures: int = 0,
    swapped_bytes: int = 0,
    num_replicas: int = 1,
    policy_metrics: dict | None = None,
    extra: dict | None = None,
) -> dict:
    """Summary of a run as a JSON-serializable dict (undefined values are ``None``).

    ``kv_capacity_tokens`` is per replica; utilization divides by ``capacity * num_replicas`` and
    the makespan (idle time counts as zero). Per-class entries under ``classes`` use the whole run's
    makespan, so their throughputs add up to the totals. ``policy_metrics`` (``Scheduler.policy_metrics``
    of the run) go under ``policy``, lists as distributions (``distribution``); with a
    ``target_forward_size`` among them, ``forward_size_to_target`` is the mean forward size over it.
    ``extra`` is merged in at the top level.
    """
    table = request_table(requests)
    duration = _makespan(table, timeline)
    everyone = np.ones(table["request_id"].size, dtype=bool)

    summary: dict[str, Any] = _request_metrics(table, everyone, duration)
    summary["duration_s"] = duration

    summary["kv_capacity_tokens"] = int(kv_capacity_tokens)
    summary["num_replicas"] = int(num_replicas)
    steps = timeline.as_dict()
    summary.update(_step_metrics(table, steps, float(kv_capacity_tokens) * num_replicas * duration))
    summary["allocation_failures"] = int(num_allocation_failures)
    summary["swapped_bytes"] = int(swapped_bytes)
    summary.update(_scheduling_metrics(steps))
    if policy_metrics:
        summary["policy"] = {
            k: distribution(v) if isinstance(v, (list, tuple)) else v for k, v in policy_metrics.items()
        }
        target = policy_metrics.get("target_forward_size")
        mean_forward = summary["forward_size"]["mean"]
        if target and mean_forward is not None:
            summary["forward_size_to_target"] = mean_forward / target
    summary["sim_wall_s"] = float(sim_wall_s)

    classes: dict[str, dict] = {}
    for cls in RequestClass:
        mask = table["request_class"] == cls.value
        if mask.any():
            classes[cls.value] = _request_metrics(table, mask, duration)
    summary["classes"] = classes
    levels = np.unique(table["priority"])
    if levels.size > 1:  # a workload with priorities (waiting_order=priority): each level's metrics
        summary["priorities"] = {str(p): _request_metrics(table, table["priority"] == p, duration) for p in levels}

    key_order = [
        "num_requests", "completed", "duration_s", "throughput_rps", "throughput_tps",
        *LATENCY_METRICS, "slo_attainment", "goodput_rps",
    ]  # fmt: skip
    ordered = {k: summary.pop(k) for k in key_order}
    ordered.update(summary)
    if extra:
        ordered.update(extra)
    return ordered


def _step_metrics(
    table: dict[str, np.ndarray], steps: dict[str, np.ndarray], capacity_token_s: float
) -> dict[str, Any]:
    """What the steps held: KV used and allocated over ``capacity_token_s`` (the replicas' KV capacity times
    the makespan), forward and batch sizes, steps and preemptions (a RuntimeWarning where the timeline's
    count is not the requests'). ``steps``: the timeline's columns."""
    step_s = steps["duration_s"]
    used_s = float(np.dot(steps["kv_used_tokens"], step_s))  # token-seconds
    allocated_s = float(np.dot(steps["kv_allocated_tokens"], step_s))
    preemptions = int(steps["num_preempted"].sum())
    per_request = int(table["num_preemptions"].sum())
    if preemptions != per_request:
        warnings.warn(
            f"preemptions: timeline counts {preemptions}, requests count {per_request}",
            RuntimeWarning,
            stacklevel=3,
        )
    return {
        "kv_utilization_mean": _ratio(used_s, capacity_token_s),
        "kv_allocated_mean": _ratio(allocated_s, capacity_token_s),
        "forward_size": _step_stats(steps["num_tokens"]),
        "batch_size": _step_stats(steps["num_requests"]),
        "num_steps": step_s.size,
        "preemptions": preemptions,
    }


def _scheduling_metrics(steps: dict[str, np.ndarray]) -> dict[str, Any]:
    """The scheduler's wall time per step (``steps``: the timeline's columns), and its share of the time the
    steps took (simulated or measured): its share of JCT."""
    sched = steps["sched_time_s"]
    return {
        "sched_time_per_step_s": {
            "mean": _float(sched.mean()) if sched.size else None,
            "p99": _float(np.percentile(sched, 99)) if sched.size else None,
            "total": float(sched.sum()),
        },
        "sched_time_share": _ratio(float(sched.sum()), float(steps["duration_s"].sum())),
    }


def metric_value(summary: dict, metric: str, stat: str = "mean") -> float:
    """One number from a summary: ``metric`` is a key or a dotted path (``"classes.rt.ttft_s"``);
    when it names a stats dict, ``stat`` picks the entry. Missing or ``None`` gives NaN."""
    node: Any = summary
    for part in metric.split("."):
        if not isinstance(node, dict) or part not in node:
            return math.nan
        node = node[part]
    if isinstance(node, dict):
        node = node.get(stat)
    return math.nan if node is None else float(node)
