"""Metric definitions, summaries, output files, plots and tables on hand-computed examples."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

from sloserve.core.request import SLO, Request, RequestClass, RequestStatus
from sloserve.metrics import (
    compare_table,
    render_table,
    request_table,
    summarize,
    summary_to_json,
    sweep_table,
    write_run_outputs,
)
from sloserve.metrics import plots as plots_module
from sloserve.metrics.timeline import Timeline

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_request(
    request_id: int,
    arrival: float,
    token_times: list[float],
    *,
    finished: bool = True,
    total_tokens: int | None = None,
    request_class: RequestClass = RequestClass.RT,
    slo: SLO | None = None,
    num_preemptions: int = 0,
) -> Request:
    """A request whose output tokens were sampled at ``token_times``; finished at the last one."""
    total = total_tokens or max(1, len(token_times))
    r = Request(
        request_id=request_id,
        arrival_time=arrival,
        num_prompt_tokens=10,
        true_output_tokens=total,
        max_tokens=total,
        request_class=request_class,
        slo=slo or SLO(),
    )
    for t in token_times:
        r.add_output_token(t)
    r.num_preemptions = num_preemptions
    if finished:
        r.status = RequestStatus.FINISHED
        r.finish_time = token_times[-1]
    elif token_times:
        r.status = RequestStatus.RUNNING
    return r


def make_timeline(rows: list[tuple[float, float, int, int, int, int, int]]) -> Timeline:
    """Rows of (start, duration, num_tokens, num_requests, kv_used, kv_allocated, num_preempted)."""
    tl = Timeline()
    for start, dur, tokens, reqs, used, alloc, preempted in rows:
        tl.append(start, dur, tokens, 0, 0, reqs, reqs, used, alloc, preempted, 0.001 * tokens)
    return tl


def three_requests() -> list[Request]:
    # R0: 4 tokens, TTFT 1, TPOT (3-1)/3, JCT 3, norm 3/4, max gap 1.
    # R1: 1 token, TTFT 0.5, TPOT undefined, JCT 0.5, norm 0.5.
    # R2: 2 tokens, TTFT 2, TPOT 1, JCT 3, norm 1.5.
    return [
        make_request(2, 2.0, [4.0, 5.0]),
        make_request(0, 0.0, [1.0, 1.5, 2.0, 3.0]),
        make_request(1, 1.0, [1.5]),
    ]


def run_summary(requests, timeline=None, **kw) -> dict:
    kw.setdefault("kv_capacity_tokens", 1000)
    kw.setdefault("sim_wall_s", 0.25)
    return summarize(requests, timeline if timeline is not None else Timeline(), **kw)


# --- definitions -------------------------------------------------------------------------------


def test_request_table_definitions():
    t = request_table(three_requests())
    assert t["request_id"].tolist() == [0, 1, 2]  # sorted by id
    assert t["output_tokens"].tolist() == [4, 1, 2]
    np.testing.assert_allclose(t["ttft_s"], [1.0, 0.5, 2.0])
    np.testing.assert_allclose(t["tpot_s"], [2 / 3, np.nan, 1.0])  # NaN for a 1-token output
    np.testing.assert_allclose(t["jct_s"], [3.0, 0.5, 3.0])
    np.testing.assert_allclose(t["normalized_latency_s"], [0.75, 0.5, 1.5])
    np.testing.assert_allclose(t["max_tbt_s"], [1.0, np.nan, 1.0])
    assert t["request_class"].tolist() == ["rt", "rt", "rt"]
    assert t["slo_met"].all()  # no SLO, finished
    assert np.isnan(t["slo_ttft_s"]).all()


def test_unfinished_request_has_nan_times():
    r = make_request(0, 0.0, [1.0], finished=False, total_tokens=5)
    t = request_table([r])
    assert not t["finished"][0] and not t["slo_met"][0]
    assert t["ttft_s"][0] == pytest.approx(1.0)
    assert np.isnan(t["jct_s"][0]) and np.isnan(t["normalized_latency_s"][0])
    never = make_request(1, 0.0, [], finished=False, total_tokens=5)
    t = request_table([never])
    assert t["output_tokens"][0] == 0 and np.isnan(t["ttft_s"][0]) and np.isnan(t["tpot_s"][0])


def test_summary_latency_stats_and_throughput():
    s = run_summary(three_requests())
    assert s["num_requests"] == 3 and s["completed"] == 3
    assert s["duration_s"] == pytest.approx(5.0)  # last finish 5 - first arrival 0
    assert s["throughput_rps"] == pytest.approx(3 / 5)
    assert s["throughput_tps"] == pytest.approx((4 + 1 + 2) / 5)
    # TTFT [0.5, 1, 2]: linear-interpolation percentiles.
    assert s["ttft_s"]["mean"] == pytest.approx(3.5 / 3)
    assert s["ttft_s"]["p50"] == pytest.approx(1.0)
    assert s["ttft_s"]["p90"] == pytest.approx(1.8)
    assert s["ttft_s"]["p99"] == pytest.approx(1.98)
    # TPOT ignores the 1-token request: [2/3, 1].
    assert s["tpot_s"]["mean"] == pytest.approx(5 / 6)
    assert s["tpot_s"]["p90"] == pytest.approx(2 / 3 + 0.9 / 3)
    assert s["normalized_latency_s"]["mean"] == pytest.approx((0.75 + 0.5 + 1.5) / 3)
    assert s["jct_s"]["p50"] == pytest.approx(3.0)
    assert s["max_tbt_s"]["mean"] == pytest.approx(1.0)
    assert s["slo_attainment"] == 1.0 and s["goodput_rps"] == pytest.approx(3 / 5)
    assert s["sim_wall_s"] == 0.25
    json.dumps(s, allow_nan=False)  # plain JSON as returned


def test_latency_stats_only_over_completed():
    reqs = three_requests() + [make_request(9, 0.0, [6.0], finished=False, total_tokens=3)]
    tl = make_timeline([(0.0, 1.0, 10, 1, 0, 0, 0), (7.0, 1.0, 10, 1, 0, 0, 0)])
    s = run_summary(reqs, tl)
    assert s["completed"] == 3 and s["num_requests"] == 4
    assert s["ttft_s"]["p99"] == pytest.approx(1.98)  # the unfinished TTFT of 6 is left out
    assert s["duration_s"] == pytest.approx(8.0)  # not all completed: last step end - first arrival


# --- SLOs and classes --------------------------------------------------------------------------


def test_slo_attainment_and_goodput():
    reqs = [
        make_request(0, 0.0, [1.0, 2.0], slo=SLO(ttft_s=1.0)),  # TTFT 1 == SLO: met
        make_request(1, 0.0, [0.5, 1.0], slo=SLO(ttft_s=0.4)),  # TTFT 0.5 > 0.4: unmet
        make_request(2, 0.0, [3.0, 4.0]),  # no SLO, finished: met
        make_request(3, 0.0, [1.0], finished=False, total_tokens=4),  # no SLO, unfinished: unmet
        make_request(4, 1.0, [2.0], slo=SLO(ttft_s=5.0, tpot_s=0.01)),  # 1 token: TPOT n/a, met
        make_request(5, 0.0, [1.0, 1.5, 2.0], slo=SLO(tpot_s=0.4)),  # TPOT 0.5 > 0.4: unmet
        make_request(6, 0.0, [1.0, 3.0], slo=SLO(ttft_s=2.0, jct_s=2.5)),  # JCT 3 > 2.5: unmet
        make_request(7, 0.0, [1.0, 3.0], slo=SLO(tpot_s=2.0, jct_s=3.0)),  # all met
    ]
    t = request_table(reqs)
    assert t["slo_met"].tolist() == [True, False, True, False, True, False, False, True]
    assert t["slo_ttft_s"][0] == 1.0 and np.isnan(t["slo_jct_s"][0])
    tl = make_timeline([(0.0, 5.0, 8, 8, 0, 0, 0)])
    s = run_summary(reqs, tl)
    assert s["duration_s"] == pytest.approx(5.0)
    assert s["slo_attainment"] == pytest.approx(4 / 8)
    assert s["goodput_rps"] == pytest.approx(4 / 5)


def test_per_class_numbers_add_up():
    rt, be = RequestClass.RT, RequestClass.BE
    reqs = [
        make_request(0, 0.0, [0.5, 1.0], request_class=rt, slo=SLO(ttft_s=1.0)),
        make_request(1, 0.5, [3.0, 3.5, 4.0], request_class=rt, slo=SLO(ttft_s=1.0)),
        make_request(2, 0.0, [2.0, 6.0], request_class=be),
        make_request(3, 1.0, [5.0], request_class=be, finished=False, total_tokens=9),
        make_request(4, 1.0, [2.0, 2.5, 3.0, 3.5], request_class=be),
    ]
    tl = make_timeline([(0.0, 7.0, 1, 1, 0, 0, 0)])
    s = run_summary(reqs, tl)
    classes = s["classes"]
    assert set(classes) == {"rt", "be"}
    for key in ("num_requests", "completed"):
        assert classes["rt"][key] + classes["be"][key] == s[key]
    for key in ("throughput_rps", "throughput_tps", "goodput_rps"):
        assert classes["rt"][key] + classes["be"][key] == pytest.approx(s[key])
    assert classes["rt"]["slo_attainment"] == pytest.approx(1 / 2)
    assert classes["be"]["slo_attainment"] == pytest.approx(2 / 3)
    assert classes["rt"]["ttft_s"]["mean"] == pytest.approx((0.5 + 2.5) / 2)
    only_rt = run_summary(reqs[:2])
    assert set(only_rt["classes"]) == {"rt"}


# --- timeline metrics --------------------------------------------------------------------------


def test_kv_utilization_time_weighted_with_idle_gap():
    # Busy [0, 1) with 50 used / 80 allocated, idle [1, 3), busy [3, 4) with 100 / 100.
    tl = make_timeline([(0.0, 1.0, 30, 2, 50, 80, 1), (3.0, 1.0, 10, 4, 100, 100, 0)])
    reqs = [make_request(0, 0.0, [1.0, 4.0], num_preemptions=1)]
    s = run_summary(reqs, tl, kv_capacity_tokens=100)
    assert s["duration_s"] == pytest.approx(4.0)
    assert s["kv_utilization_mean"] == pytest.approx((50 + 100) / (100 * 4))
    assert s["kv_allocated_mean"] == pytest.approx((80 + 100) / (100 * 4))
    two = run_summary(reqs, tl, kv_capacity_tokens=100, num_replicas=2)
    assert two["kv_utilization_mean"] == pytest.approx(s["kv_utilization_mean"] / 2)
    assert s["forward_size"] == {"mean": 20.0, "p50": 20.0, "p90": 28.0, "p99": 29.8, "max": 30.0}
    assert s["batch_size"]["max"] == 4.0 and s["num_steps"] == 2
    assert s["preemptions"] == 1
    assert s["sched_time_per_step_s"]["total"] == pytest.approx(0.04)
    assert s["sched_time_per_step_s"]["mean"] == pytest.approx(0.02)


def test_preemption_mismatch_warns_and_extra_merged():
    tl = make_timeline([(0.0, 1.0, 10, 1, 0, 0, 2)])
    with pytest.warns(RuntimeWarning, match="preemptions"):
        s = run_summary([make_request(0, 0.0, [1.0])], tl, extra={"scheduler": "vllm"})
    assert s["preemptions"] == 2 and s["scheduler"] == "vllm"


def test_empty_run():
    s = run_summary([])
    assert s["num_requests"] == 0 and s["completed"] == 0
    assert s["duration_s"] == 0.0 and s["throughput_rps"] == 0.0 and s["goodput_rps"] == 0.0
    assert s["ttft_s"]["mean"] is None and s["slo_attainment"] is None
    assert s["forward_size"]["max"] is None and s["kv_utilization_mean"] == 0.0
    assert s["classes"] == {}
    json.loads(summary_to_json(s))


# --- outputs -----------------------------------------------------------------------------------


def small_run():
    reqs = three_requests()
    tl = make_timeline([(0.0, 2.0, 20, 2, 30, 40, 0), (2.0, 3.0, 5, 1, 15, 20, 0)])
    return reqs, tl, run_summary(reqs, tl, extra={"note": math.nan})


def test_write_run_outputs(tmp_path: Path):
    reqs, tl, summary = small_run()
    out = tmp_path / "nested" / "run"
    written = write_run_outputs(out, summary, reqs, tl)
    names = {p.name for p in written}
    expected = {"summary.json", "requests.csv", "timeline.csv", "latency_cdf.png", "timeline.png"}
    assert names == expected
    assert all(p.parent == out and p.is_file() for p in written)
    loaded = json.loads((out / "summary.json").read_text())
    assert loaded["note"] is None  # NaN -> null
    assert loaded["completed"] == 3
    with open(out / "requests.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["request_id"] for r in rows] == ["0", "1", "2"]
    assert rows[1]["tpot_s"] == "" and float(rows[0]["tpot_s"]) == pytest.approx(2 / 3)
    with open(out / "timeline.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and rows[1]["kv_used_tokens"] == "15"
    for png in ("latency_cdf.png", "timeline.png"):
        data = (out / png).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000
    assert not list(out.parent.glob(".sloserve-*"))
    # Writing again replaces the files.
    write_run_outputs(out, {**summary, "completed": 99}, reqs, tl, plots=False)
    assert json.loads((out / "summary.json").read_text())["completed"] == 99


def test_write_run_outputs_is_all_or_nothing(tmp_path: Path, monkeypatch):
    reqs, tl, summary = small_run()

    def boom(*args, **kwargs):
        raise RuntimeError("plot failed")

    monkeypatch.setattr(plots_module, "plot_run", boom)
    fresh = tmp_path / "fresh"
    with pytest.raises(RuntimeError, match="plot failed"):
        write_run_outputs(fresh, summary, reqs, tl)
    assert not fresh.exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "summary.json").write_text("old")
    with pytest.raises(RuntimeError):
        write_run_outputs(existing, summary, reqs, tl)
    assert [p.name for p in existing.iterdir()] == ["summary.json"]
    assert (existing / "summary.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing"]  # no temp dir left


def test_summary_to_json_is_strict():
    text = summary_to_json({"a": math.nan, "b": [np.float64(np.inf), np.int64(3)], "c": {"d": 1.5}})
    assert json.loads(text) == {"a": None, "b": [None, 3], "c": {"d": 1.5}}


# --- plots and tables --------------------------------------------------------------------------


def sweep_results() -> dict[str, list[tuple[float, dict]]]:
    reqs, tl, _ = small_run()
    base = run_summary(reqs, tl)
    slower = {**base, "normalized_latency_s": {**base["normalized_latency_s"], "mean": 2.0}}
    return {"vllm": [(2.0, slower), (1.0, base)], "econoserve": [(1.0, base), (2.0, base)]}


def test_sweep_and_compare_plots(tmp_path: Path):
    results = sweep_results()
    p = plots_module.plot_sweep(results, tmp_path / "sweep.png", ylabel="norm. latency (s/token)", logy=True)
    assert p.read_bytes().startswith(PNG_MAGIC)
    p = plots_module.plot_sweep(results, tmp_path / "rt.png", metric="classes.rt.ttft_s", stat="p99")
    assert p.stat().st_size > 1000
    summaries = {name: pts[0][1] for name, pts in results.items()}
    p = plots_module.plot_compare_bars(summaries, tmp_path / "bars.png")
    assert p.read_bytes().startswith(PNG_MAGIC) and p.stat().st_size > 1000


def test_tables_render():
    results = sweep_results()
    summaries = {name: pts[0][1] for name, pts in results.items()}
    text = render_table(compare_table(summaries, title="compare"))
    for needle in ("compare", "vllm", "econoserve", "req/s", "TTFT p99", "SLO %", "KV util %"):
        assert needle in text
    assert "\x1b[" not in text  # no colour codes
    text = render_table(sweep_table(results, "normalized_latency_s"))
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if len(cells) == 3 and cells[0].replace(".", "").isdigit():
            rows[cells[0]] = cells[1:]
    # rows = rates (sorted), columns = schedulers in the order given; mean normalized latency.
    assert rows == {"1": ["0.917", "0.917"], "2": ["2", "0.917"]}
    assert "vllm" in text and "econoserve" in text


def test_timeline_keeps_recording_order_across_reads():
    """Appended rows are buffered and copied into the columns when the timeline is read; stretches
    recorded between them still land where they were recorded, reads in between change nothing,
    and integer columns stay exact."""
    tl = Timeline()
    expected_starts, expected_used = [], []
    t = 0.0
    for i in range(8199):
        if i == 4100:  # a read in the middle moves what is buffered
            np.testing.assert_array_equal(tl.column("start_s"), expected_starts)
        tl.append(t, 0.5, 3, 1, 0, 2, 3, 2**40 + i, 2**41, 0, 1e-6, 1)
        expected_starts.append(t)
        expected_used.append(2**40 + i)
        t += 0.5
        if i % 1000 == 999:  # a stretch of 3 decode steps of 2 requests
            ends = [t + 0.25, t + 0.5, t + 0.75]
            tl.append_stretch(t, ends, 2, 0, 0, 0, 100, 106, 160, 160, [0, 0, 0], 1e-6, 1)
            expected_starts += [t, t + 0.25, t + 0.5]
            expected_used += [102, 104, 106]
            t = ends[-1]
    assert len(tl) == len(expected_starts)
    np.testing.assert_array_equal(tl.column("start_s"), expected_starts)
    np.testing.assert_array_equal(tl.column("kv_used_tokens"), expected_used)
    assert tl.column("kv_used_tokens").dtype == np.int64
    tl.append(t, 0.5, 3, 1, 0, 2, 3, 7, 7, 0, 1e-6, 1)  # appending after a read goes on in order
    assert tl.column("start_s")[-1] == t and len(tl) == len(expected_starts) + 1


def test_writing_outputs_removes_the_temporaries_of_killed_writers_only(tmp_path: Path):
    """A writer killed mid-write (kill -9) leaves its hidden temporary folder; the next write in the
    same place removes it, and leaves a live writer's alone."""
    import os

    from sloserve.metrics.outputs import TMP_PREFIX, write_run_outputs

    dead = tmp_path / f"{TMP_PREFIX}999999999-abc"  # above any pid_max: no such process
    live = tmp_path / f"{TMP_PREFIX}{os.getpid()}-xyz"
    for folder in (dead, live):
        folder.mkdir()
        (folder / "summary.json").write_text("{}")
    request = Request(0, 0.0, 10, 2, 2)
    write_run_outputs(tmp_path / "run", {"completed": 0}, [request], Timeline(), plots=False)
    assert not dead.exists() and live.exists() and (tmp_path / "run" / "summary.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, "run"])


def test_the_table_shows_no_slo_attainment_when_no_request_had_an_slo():
    """Without SLOs the attainment counts only completions: the table shows "-", not 100."""
    from sloserve.metrics import compare_table

    def slo_cell(summary: dict) -> str:
        table = compare_table({"x": summary}, "t")
        column = next(c for c in table.columns if c.header == "SLO %")
        return list(column.cells)[0]

    without = run_summary(three_requests())
    assert without["num_with_slo"] == 0 and without["slo_attainment"] == 1.0 and slo_cell(without) == "-"
    with_slo = run_summary([make_request(0, 0.0, [1.0, 2.0], slo=SLO(ttft_s=0.5))])
    assert with_slo["num_with_slo"] == 1 and slo_cell(with_slo) == "0"


def test_the_compare_table_fits_an_80_column_terminal_by_turning_to_a_row_per_metric():
    from io import StringIO

    from rich.console import Console

    from sloserve.metrics import compare_table

    summaries = {name: run_summary(three_requests()) for name in ("vllm", "sarathi", "econoserve-sdo")}
    for width in (80, 160):
        text = StringIO()
        Console(file=text, width=width).print(compare_table(summaries, "t", width))
        lines = text.getvalue().splitlines()
        assert max(len(line) for line in lines) <= width and "…" not in text.getvalue()
        rows = [line for line in lines if line.startswith("│")]
        assert len(rows) == (13 if width == 80 else 3)  # a row per metric, or per scheduler


def test_plots_name_what_they_show_and_go_log_scale_on_wide_spreads():
    from sloserve.metrics.plots import caption, wide_spread

    summary = {"scheduler": "vllm", "model": "llama-2-7b", "gpu": "a100-80gb", "workload": "sharegpt@rate=9"}
    assert caption(summary) == "vllm · llama-2-7b on a100-80gb · sharegpt@rate=9"
    assert caption(summary, with_scheduler=False, with_workload=False) == "llama-2-7b on a100-80gb"
    assert caption({"workload": "w"}) == "w"
    assert wide_spread(np.array([0.337, 0.508, 38.0 * 10]))
    assert not wide_spread(np.array([0.337, 0.508, 30.0]))
    assert not wide_spread(np.array([0.0, 5.0, np.nan]))  # one positive value: nothing to compare


def test_token_groups_worked_example():
    """BROS's token groups (metrics/token_groups.py): the first token due TTFT after arrival, then each
    group of g tokens due g x TPOT after the previous group came. A stall costs the one late group;
    per-token deadlines (first token + (k - 1) x TPOT) count every token after it as late."""
    from sloserve.metrics.token_groups import group_deadlines_met

    times = [0.3, 0.5, 0.7, 1.4, 1.5, 1.6]
    assert group_deadlines_met(0.0, times, ttft_s=0.4, tpot_s=0.2, group_size=2) == [True, True, False, True]
    per_token_late = [t > times[0] + k * 0.2 + 1e-9 for k, t in enumerate(times)]
    assert per_token_late == [False, False, False, True, True, True]
    assert group_deadlines_met(0.0, [0.5], 0.4, 0.2) == [False]  # a one-token output: TTFT only
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        group_deadlines_met(0.0, times, 0.4, 0.2, group_size=0)


@pytest.mark.parametrize("scheduler", ["vllm", "sarathi", "bros", "econoserve"])
def test_token_times_agree_with_the_summary_times(scheduler):
    """Requests that keep ``token_times`` get every token's time, also from a decode cohort's
    stretches: as many as tokens, in order, matching the first and last token times and the
    largest gap the request keeps without them."""
    from sloserve.cost import LinearCostModel, get_preset
    from sloserve.metrics.token_groups import token_group_attainment
    from sloserve.sched import make_scheduler
    from sloserve.sim import simulate
    from sloserve.workload import workload_from_trace

    cost = LinearCostModel(get_preset("llama-2-7b-a100"))
    requests = workload_from_trace("sharegpt", num_requests=150, seed=0, context_len=4096, rate=12).requests
    for r in requests:
        r.token_times = []
    simulate(
        requests,
        lambda: make_scheduler(
            scheduler, kv_capacity_tokens=20_000, max_model_len=4096, kv_bytes_per_token=524288, cost_model=cost
        ),
        cost,
    )
    assert sum(r.num_preemptions for r in requests) > 0  # evictions happened on the way
    for r in requests:
        t = r.token_times
        assert len(t) == r.num_output_tokens and t[0] == r.first_token_time and t[-1] == r.last_token_time
        assert all(b >= a for a, b in zip(t, t[1:]))
        if len(t) > 1:
            assert max(b - a for a, b in zip(t, t[1:])) == pytest.approx(r.max_token_gap, abs=1e-12)
    result = token_group_attainment(requests, 1.0, 0.1)
    assert 0 <= result.requests <= 1 and 0 <= result.groups <= 1 and result.num_groups > len(requests)


def test_columns_are_written_a_chunk_of_rows_at_a_time_as_one_file(tmp_path):
    """write_columns_csv streams rows in chunks: the file is the same whatever the chunk size, NaN an
    empty field, floats round-tripping."""
    from sloserve.metrics.outputs import write_columns_csv

    rng = np.random.default_rng(0)
    floats = rng.random(23)
    floats[[0, 7, 22]] = np.nan
    columns = {"i": np.arange(23), "x": floats}
    write_columns_csv(tmp_path / "whole.csv", columns)
    write_columns_csv(tmp_path / "chunked.csv", columns, chunk_rows=5)
    assert (tmp_path / "whole.csv").read_text() == (tmp_path / "chunked.csv").read_text()
    rows = list(csv.DictReader((tmp_path / "chunked.csv").read_text().splitlines()))
    assert [int(r["i"]) for r in rows] == list(range(23))
    back = np.array([float(r["x"]) if r["x"] else np.nan for r in rows])
    np.testing.assert_array_equal(back, floats)
