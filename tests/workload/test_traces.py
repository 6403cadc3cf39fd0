"""Bundled traces, user trace files and arrival processes."""

from __future__ import annotations

import gzip
import json
import re

import numpy as np
import pytest

from sloserve.core.errors import ConfigError, UnknownNameError
from sloserve.core.request import SLO
from sloserve.workload import arrivals, workload_from_trace
from sloserve.workload.traces import TRACES, load_trace, trace_summary

ROWS = {
    "sharegpt": 10000,
    "sharegpt-8k": 30731,
    "bwb": 33768,
    "arxiv": 28257,
    "azure-conv": 19366,
    "azure-code": 8819,
    "mooncake-conv": 12031,
    "mooncake-synthetic": 3993,
}


# --- bundled traces ------------------------------------------------------------------------------
def test_registry_matches_expected_names() -> None:
    assert set(TRACES) == set(ROWS)
    assert all(info.description for info in TRACES.values())


@pytest.mark.parametrize("name", sorted(ROWS))
def test_bundled_trace_loads(name: str) -> None:
    trace = load_trace(name)
    assert len(trace) == ROWS[name]
    assert trace.prompt_tokens.dtype == np.int64 and trace.output_tokens.dtype == np.int64
    assert trace.prompt_tokens.min() >= 1 and trace.output_tokens.min() >= 1
    has_times = name.startswith(("azure", "mooncake"))
    assert (trace.arrival_s is not None) == has_times
    if trace.arrival_s is not None:
        assert trace.arrival_s.dtype == np.float64
        assert trace.arrival_s[0] == 0.0
        assert np.all(np.diff(trace.arrival_s) >= 0)
    assert not trace.prompt_tokens.flags.writeable  # shared through the cache
    assert load_trace(name) is trace


def test_bundled_statistics_match_readme() -> None:
    conv = trace_summary("azure-conv")
    assert conv["duration_s"] == pytest.approx(3502, abs=1)
    assert conv["rate_rps"] == pytest.approx(5.53, abs=0.01)
    assert conv["prompt_p50"] == 1020 and conv["prompt_max"] == 14050
    assert conv["output_max"] == 1000
    assert trace_summary("azure-code")["duration_s"] == pytest.approx(3436, abs=1)
    moon = trace_summary("mooncake-conv")
    assert moon["duration_s"] == pytest.approx(3537, abs=1)
    assert moon["arrival_quantum_s"] == 3.0
    assert trace_summary("mooncake-synthetic")["duration_s"] == pytest.approx(1022, abs=1)
    share = trace_summary("sharegpt")
    assert share["has_arrivals"] is False and share["duration_s"] is None
    assert share["prompt_p50"] == 35 and share["prompt_max"] == 3973
    assert trace_summary("bwb")["output_max"] == 2858


def test_azure_timestamps_parse_to_seconds() -> None:
    # First rows of the conv file: 18:15:46.6805900 then 18:15:50.9951690.
    trace = load_trace("azure-conv")
    assert trace.arrival_s[1] == pytest.approx(4.314579, abs=1e-6)


def test_unknown_trace_lists_names() -> None:
    with pytest.raises(UnknownNameError) as info:
        load_trace("sharegtp")
    msg = str(info.value)
    assert "sharegtp" in msg and "azure-conv" in msg and "mooncake-conv" in msg and "path" in msg
    with pytest.raises(ConfigError, match="not found"):
        load_trace("no/such/file.csv")


# --- user files ----------------------------------------------------------------------------------
def test_user_csv_with_column_mapping(tmp_path) -> None:
    path = tmp_path / "mine.csv"
    path.write_text("t,in,out,other\n0.5,10,3,x\n1.5,20,4,y\n0.5,30,5,z\n")
    trace = load_trace(str(path), {"prompt": "in", "output": "out", "arrival": "t"})
    # Rows are sorted by arrival (stably) and rebased to start at 0.
    assert trace.prompt_tokens.tolist() == [10, 30, 20]
    assert trace.output_tokens.tolist() == [3, 5, 4]
    assert trace.arrival_s.tolist() == [0.0, 0.0, 1.0]
    no_times = load_trace(str(path), {"prompt": "in", "output": "out"})
    assert no_times.arrival_s is None  # "t" is not a default arrival name


def test_user_files_default_columns_gzip_and_jsonl(tmp_path) -> None:
    path = tmp_path / "a.csv.gz"
    data = b"arrived_at,num_prefill_tokens,num_decode_tokens\n0,5,6\n2,7,8"  # no final newline
    path.write_bytes(gzip.compress(data))
    trace = load_trace(str(path))
    assert trace.prompt_tokens.tolist() == [5, 7] and trace.arrival_s.tolist() == [0.0, 2.0]

    jl = tmp_path / "b.jsonl"
    rows = [
        {"timestamp": 1000, "input_length": 9, "output_length": 2},
        {"timestamp": 4500, "input_length": 8, "output_length": 1},
    ]
    jl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    trace = load_trace(str(jl))
    assert trace.arrival_s.tolist() == [0.0, 3.5]  # JSONL "timestamp" is in ms
    assert load_trace(str(jl), {"arrival_unit": "s"}).arrival_s.tolist() == [0.0, 3500.0]


def test_user_csv_datetime_arrivals(tmp_path) -> None:
    path = tmp_path / "az.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109"
    )
    assert load_trace(str(path)).arrival_s[1] == pytest.approx(4.314579)


@pytest.mark.parametrize(
    ("content", "columns", "expected"),
    [
        ("a,b\n1,2\n", None, r"bad\.csv: no prompt-length column .*columns present: a, b"),
        (
            "p,o\n1,2\n",
            {"prompt": "p", "output": "x"},
            r"bad\.csv: column 'x' \(mapped to output\) not found; columns present: p, o",
        ),
        (
            "prompt_tokens,output_tokens\n5,6\n7,abc\n",
            None,
            r"bad\.csv: line 3: column 'output_tokens': output length 'abc' is not an integer",
        ),
        (
            "prompt_tokens,output_tokens\n5,6\n-3,4\n",
            None,
            r"bad\.csv: line 3: column 'prompt_tokens': prompt length must be in 1\.\.1,000,000,000, got -3",
        ),
        ("prompt_tokens,output_tokens\n0,6\n", None, r"line 2: .*prompt length must be in 1\.\.1,000,000,000, got 0"),
        ("prompt_tokens,output_tokens\n5,0\n", None, r"line 2: .*output length must be in 1\.\.1,000,000,000, got 0"),
        ("prompt_tokens,output_tokens\n5,2.5\n", None, r"line 2: .*output length 2\.5 is not an integer"),
        (  # once "column 'prompt_tokens': prompt length out of range", without its line
            "prompt_tokens,output_tokens\n5,6\n1" + "0" * 30 + ",6\n",
            None,
            r"line 3: column 'prompt_tokens': prompt length must be in 1\.\.1,000,000,000, got 1" + "0" * 30,
        ),
        ("prompt_tokens,output_tokens\n5\n", None, r"line 2: column 'output_tokens' is missing"),
        (
            "prompt_tokens,output_tokens,arrival_s\n5,6,1\n5,6,soon\n",
            None,
            r"line 3: column 'arrival_s': arrival 'soon' is neither a number",
        ),
        ("", None, r"bad\.csv: empty file"),
        ("prompt_tokens,output_tokens\n", None, r"bad\.csv: no data rows"),
        ("prompt_tokens,output_tokens\n5,6\n", {"promt": "x"}, r"unknown column role\(s\) 'promt'"),
    ],
)
def test_bad_user_csv(tmp_path, content: str, columns: dict | None, expected: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(content)
    with pytest.raises(ConfigError, match=expected):
        load_trace(str(path), columns)


def test_bad_user_jsonl(tmp_path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"input_length": 5, "output_length": 6}\n{"input_length": 5}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl: line 2: column 'output_length' is missing"):
        load_trace(str(path))
    path.write_text('{"input_length": 5, "output_length": 6}\nnot json\n')
    with pytest.raises(ConfigError, match=r"line 2: invalid JSON"):
        load_trace(str(path))
    path.write_text('{"input_length": 5, "output_length": 6}\n1, 2\n')  # two values on one line
    with pytest.raises(ConfigError, match=r"line 2: invalid JSON: Extra data"):
        load_trace(str(path))
    path.write_text('{"input_length": 5, "output_length": 6}\n\n[1, 2]\n')
    with pytest.raises(ConfigError, match=r"line 3: expected a JSON object, got list"):
        load_trace(str(path))
    other = tmp_path / "t.txt"
    other.write_text("x")
    with pytest.raises(ConfigError, match=r"unsupported trace file type"):
        load_trace(str(other))


def test_bundled_trace_rejects_columns() -> None:
    with pytest.raises(ConfigError, match="bundled"):
        load_trace("sharegpt", {"prompt": "x"})


# --- arrival processes ---------------------------------------------------------------------------
def test_poisson_rate_and_determinism() -> None:
    times = arrivals.poisson(200_000, 8.0, np.random.default_rng(1))
    assert times[0] == 0.0 and np.all(np.diff(times) >= 0)
    assert (len(times) - 1) / times[-1] == pytest.approx(8.0, rel=0.02)
    gaps = np.diff(times)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.03)
    again = arrivals.poisson(200_000, 8.0, np.random.default_rng(1))
    assert np.array_equal(times, again)


@pytest.mark.parametrize("cv", [0.5, 2.0, 4.0])
def test_gamma_cv(cv: float) -> None:
    times = arrivals.gamma(200_000, 5.0, cv, np.random.default_rng(2))
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(0.2, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.08)
    assert np.all(gaps >= 0)


def test_offline_and_bad_parameters() -> None:
    assert arrivals.offline(3).tolist() == [0.0, 0.0, 0.0]
    rng = np.random.default_rng(0)
    with pytest.raises(ConfigError, match=r"arrival rate must be > 0, got -2"):
        arrivals.poisson(10, -2, rng)
    with pytest.raises(ConfigError, match=r"arrival rate must be > 0, got 0"):
        arrivals.gamma(10, 0, 1.0, rng)
    with pytest.raises(ConfigError, match=r"arrival cv must be > 0, got 0"):
        arrivals.gamma(10, 1.0, 0, rng)
    with pytest.raises(ConfigError, match=r"integer >= 0"):
        arrivals.offline(-1)


def test_mooncake_jitter_stays_in_bucket_and_sorted() -> None:
    trace = load_trace("mooncake-conv")
    quantum = trace.arrival_quantum_s
    times, rows = arrivals.trace_replay(trace.arrival_s, 3000, np.random.default_rng(5), quantum)
    assert np.all(np.diff(times) >= 0)
    bucket = trace.arrival_s[rows] - trace.arrival_s[rows.min()]
    assert np.all(times >= bucket) and np.all(times < bucket + quantum)
    # Jitter spreads the bucketed arrivals: far fewer ties than in the raw trace.
    assert np.mean(np.diff(times) == 0) < 0.01 < np.mean(np.diff(trace.arrival_s) == 0)
    assert sorted(rows.tolist()) == list(range(rows.min(), rows.min() + 3000))


def test_trace_replay_wraps_around() -> None:
    base = np.array([0.0, 1.0, 3.0])  # duration 3, mean gap 1.5 -> period 4.5
    times, rows = arrivals.trace_replay(base, 7, np.random.default_rng(0))
    assert len(times) == 7 and np.all(np.diff(times) >= 0) and times[0] == 0.0
    start = rows[0]
    idx = np.arange(start, start + 7)
    expected = base[idx % 3] + (idx // 3) * 4.5
    assert np.allclose(times, expected - expected[0])


@pytest.mark.parametrize(
    ("hash_ids", "message"),
    [
        ('"abc"', r"line 2: column 'hash_ids': expected a list of integers >= 0, got 'abc'"),
        ("[1, -2]", r"line 2: column 'hash_ids': expected a list of integers >= 0"),
        ("[1]", r"line 2: column 'hash_ids': 1 ids for a prompt of 600 tokens; expected ceil\(600 / 512\) = 2"),
    ],
)
def test_a_bad_hash_ids_line_is_one_error_naming_file_and_line(tmp_path, hash_ids, message):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"input_length": 10, "output_length": 3, "hash_ids": [7]}\n'
        f'{{"input_length": 600, "output_length": 3, "hash_ids": {hash_ids}}}\n'
    )
    with pytest.raises(ConfigError, match=rf"{re.escape(str(trace))}: {message}"):
        load_trace(str(trace))


def test_mooncake_hash_ids_become_the_prompts_prefix_structure():
    trace = load_trace("mooncake-conv")
    assert trace.hash_ids is not None and len(trace.hash_ids) == len(trace)
    assert all(len(ids) == -(-n // 512) for ids, n in zip(trace.hash_ids, trace.prompt_tokens.tolist()))
    workload = workload_from_trace("mooncake-conv", num_requests=50, seed=0, context_len=4096, trace_arrivals=True)
    for r in workload.requests:  # clipped prompts keep their first segments' ids
        assert r.prompt_blocks is not None and r.prompt_blocks.num_tokens == r.num_prompt_tokens <= 4095
    assert (
        workload_from_trace("sharegpt", num_requests=5, seed=0, context_len=4096, rate=1.0).requests[0].prompt_blocks
        is None
    )


# --- what each request was served with (a request log's class, priority, SLO, max_tokens) -------------
LOGGED = [  # out of arrival order, as a request log is (one line as each request ends)
    {"arrival_s": 0.3, "prompt_tokens": 40, "output_tokens": 9, "request_class": "rt", "priority": -1,
     "slo_ttft_s": 0.2, "slo_tpot_s": 0.05, "max_tokens": 9},
    {"arrival_s": 0.1, "prompt_tokens": 30, "output_tokens": 20, "request_class": "be", "priority": 3,
     "slo_ttft_s": None, "slo_tpot_s": None, "max_tokens": None},
    {"arrival_s": 0.2, "prompt_tokens": 20, "output_tokens": 5, "request_class": "RT", "priority": 0,
     "slo_ttft_s": 1.5, "slo_tpot_s": None, "max_tokens": 16},
]  # fmt: skip


def settings(workload):
    return [(r.request_class.value, r.priority, r.slo, r.max_tokens) for r in workload.requests]


def test_a_request_log_replays_with_each_requests_class_priority_slo_and_max_tokens(tmp_path):
    log = tmp_path / "requests.jsonl"
    log.write_text("".join(json.dumps(line) + "\n" for line in LOGGED))
    replay = workload_from_trace(str(log), num_requests=3, seed=0, context_len=100, trace_arrivals=True)
    assert [r.num_prompt_tokens for r in replay.requests] == [30, 20, 40]  # in arrival order, settings with them
    assert settings(replay) == [("be", 3, SLO(), 70), ("rt", 0, SLO(1.5), 16), ("rt", -1, SLO(0.2, 0.05), 9)]
    # what the command line sets applies to every request
    fixed = workload_from_trace(
        str(log), num_requests=3, seed=0, context_len=100, trace_arrivals=True, slo={"ttft_s": 0.4}, max_tokens=12
    )
    assert settings(fixed) == [("be", 3, SLO(0.4), 12), ("rt", 0, SLO(0.4), 12), ("rt", -1, SLO(0.4), 12)]
    assert [r.true_output_tokens for r in fixed.requests] == [12, 5, 9]  # truncated to the cap, as served
    # the same rows as CSV, empty cells left to the stream
    csv_log = tmp_path / "requests.csv"
    csv_log.write_text(
        "arrival_s,prompt_tokens,output_tokens,request_class,priority,slo_ttft_s,max_tokens\n"
        "0,30,20,be,3,,\n0.1,20,5,,,1.5,16\n"
    )
    replay = workload_from_trace(str(csv_log), num_requests=2, seed=0, context_len=100, trace_arrivals=True)
    assert settings(replay) == [("be", 3, SLO(), 70), ("rt", 0, SLO(1.5), 16)]


def test_a_spec_streams_own_settings_replace_the_rows_and_the_others_stay_the_rows(tmp_path):
    from sloserve.workload import build_workload
    from sloserve.workload.spec_yaml import parse_workload_spec

    log = tmp_path / "requests.jsonl"
    log.write_text("".join(json.dumps(line) + "\n" for line in LOGGED))

    def replay(**stream):
        spec = parse_workload_spec(
            {"streams": [{"source": {"trace": str(log)}, "arrival": {"process": "trace"}, "num_requests": 3, **stream}]}
        )
        return settings(build_workload(spec, seed=0, context_len=100))

    assert replay() == [("be", 3, SLO(), 70), ("rt", 0, SLO(1.5), 16), ("rt", -1, SLO(0.2, 0.05), 9)]
    assert replay(**{"class": "be", "priority": 0}) == [
        ("be", 0, SLO(), 70), ("be", 0, SLO(1.5), 16), ("be", 0, SLO(0.2, 0.05), 9)
    ]  # fmt: skip
    assert replay(slo={}, max_tokens=50) == [("be", 3, SLO(), 50), ("rt", 0, SLO(), 50), ("rt", -1, SLO(), 50)]
    # a conversation's turns take a row's lengths, not its request's settings
    spec = parse_workload_spec(
        {"streams": [{"source": {"conversations": {"trace": str(log), "turns": [1, 1]}},
                      "arrival": {"process": "offline"}, "num_requests": 3}]}
    )  # fmt: skip
    assert {s[:3] for s in settings(build_workload(spec, seed=0, context_len=100))} == {("rt", 0, SLO())}


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("request_class", '"gold"', "request class must be 'rt' or 'be', got 'gold'"),
        ("request_class", "1", "request class must be 'rt' or 'be', got 1"),
        ("priority", "1.5", "priority must be an integer, got 1.5"),
        ("priority", '"high"', "priority must be an integer, got 'high'"),
        ("slo_tpot_s", "0", "slo_tpot_s must be a number of seconds > 0, got 0"),
        ("slo_ttft_s", "true", "slo_ttft_s must be a number of seconds > 0, got True"),
        ("max_tokens", "0", "max_tokens must be in 1..1,000,000,000, got 0"),
        # these two once overflowed int64 in the replay (a traceback)
        ("max_tokens", "1" + "0" * 30, "max_tokens must be in 1..1,000,000,000, got 1" + "0" * 30),
        ("priority", "-1" + "0" * 30, "priority must be in -1,000,000,000..1,000,000,000, got -1" + "0" * 30),
    ],
)
def test_a_bad_recorded_setting_is_one_error_naming_file_line_and_column(tmp_path, key, value, message):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        f'{{"prompt_tokens": 10, "output_tokens": 3, "{key}": null}}\n'
        f'{{"prompt_tokens": 10, "output_tokens": 3, "{key}": {value}}}\n'
    )
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(trace))}: line 2: column '{key}': {re.escape(message)}$"):
        load_trace(str(trace))


def test_prefix_shared_is_the_share_of_prompt_tokens_an_earlier_prompt_had(tmp_path):
    """``sloserve traces``' "prefix shared": per row, the segments its hash ids share with earlier rows,
    from its first (equal ids mean equal tokens there and before), in tokens."""
    trace = tmp_path / "t.jsonl"
    rows = [(1000, [1, 2]), (700, [1, 3]), (1000, [1, 2]), (300, [4])]  # the third: all of it
    trace.write_text("".join(json.dumps({"prompt_tokens": n, "output_tokens": 5, "hash_ids": ids}) + "\n"
                             for n, ids in rows))  # fmt: skip
    summary = trace_summary(str(trace))
    assert summary["prefix_shared"] == pytest.approx((0 + 512 + 1000 + 0) / (1000 + 700 + 1000 + 300))
    assert trace_summary("sharegpt")["prefix_shared"] is None
