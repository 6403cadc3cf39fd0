"""Workload specs and building request lists."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from sloserve.core.errors import ConfigError, UnknownNameError
from sloserve.core.request import SLO, RequestClass
from sloserve.workload import (
    build_workload,
    list_workloads,
    load_trace,
    load_workload_spec,
    parse_workload_spec,
    synthetic_workload,
    workload_from_trace,
)


def _key(wl) -> list[tuple]:
    return [
        (r.request_id, r.arrival_time, r.num_prompt_tokens, r.true_output_tokens, r.max_tokens, r.request_class, r.slo)
        for r in wl.requests
    ]


def _check_ordered(wl) -> None:
    assert [r.request_id for r in wl.requests] == list(range(len(wl.requests)))
    times = [r.arrival_time for r in wl.requests]
    assert times == sorted(times)


# --- shipped specs -------------------------------------------------------------------------------
def test_shipped_specs_build() -> None:
    names = list_workloads()
    assert {"sharegpt-poisson", "azure-conv-trace", "mixed-rt-be"} <= set(names)
    for name in names:
        wl = build_workload(load_workload_spec(name), seed=0, context_len=4096)
        _check_ordered(wl)
        assert len(wl) > 0
        for r in wl.requests:
            assert r.num_prompt_tokens + r.true_output_tokens <= 4096
            assert r.true_output_tokens <= r.max_tokens <= 4096 - r.num_prompt_tokens


def test_sharegpt_poisson_spec() -> None:
    spec = load_workload_spec("sharegpt-poisson")
    (stream,) = spec.streams
    assert stream.arrival.process == "poisson" and stream.arrival.rate == 8
    wl = build_workload(spec, seed=3, context_len=4096)
    assert len(wl) == 1000
    assert wl.requests[0].arrival_time == 0.0
    assert 999 / wl.duration_s == pytest.approx(8, rel=0.15)
    assert all(r.request_class is RequestClass.RT for r in wl.requests)


def test_mixed_spec_has_both_classes_and_slos() -> None:
    wl = build_workload(load_workload_spec("mixed-rt-be"), seed=0, context_len=4096)
    rt = [r for r in wl.requests if r.request_class is RequestClass.RT]
    be = [r for r in wl.requests if r.request_class is RequestClass.BE]
    assert len(rt) == 1200 and len(be) == 400
    assert all(r.slo == SLO(ttft_s=0.4, tpot_s=0.2) for r in rt)
    assert all(512 <= r.num_prompt_tokens <= 1024 and 32 <= r.true_output_tokens <= 128 for r in be)


def test_azure_trace_arrivals_follow_the_trace() -> None:
    wl = build_workload(load_workload_spec("azure-conv-trace"), seed=7, context_len=16384)
    assert len(wl) == 2000 and wl.requests[0].arrival_time == 0.0
    assert wl.num_clipped == 0
    trace = load_trace("azure-conv")
    prompts = [r.num_prompt_tokens for r in wl.requests]
    times = np.array([r.arrival_time for r in wl.requests])
    # 2000 consecutive trace rows, times rebased to the first of them.
    candidates = np.flatnonzero(trace.prompt_tokens[: len(trace) - 1999] == prompts[0])
    starts = [s for s in candidates if trace.prompt_tokens[s : s + 2000].tolist() == prompts]
    assert len(starts) == 1
    window = trace.arrival_s[starts[0] : starts[0] + 2000]
    assert np.allclose(times, window - window[0])


# --- determinism ---------------------------------------------------------------------------------
def test_same_seed_same_workload_different_seed_differs() -> None:
    spec = load_workload_spec("mixed-rt-be")
    a = build_workload(spec, seed=11, context_len=4096)
    b = build_workload(spec, seed=11, context_len=4096)
    c = build_workload(spec, seed=12, context_len=4096)
    assert _key(a) == _key(b)
    assert _key(a) != _key(c)
    t1 = workload_from_trace("mooncake-conv", num_requests=500, seed=4, context_len=200_000, trace_arrivals=True)
    t2 = workload_from_trace("mooncake-conv", num_requests=500, seed=4, context_len=200_000, trace_arrivals=True)
    assert _key(t1) == _key(t2)


def test_ties_broken_by_stream_then_sample_order() -> None:
    spec = parse_workload_spec(
        {
            "streams": [
                {
                    "name": "a",
                    "source": {"fixed": {"prompt": 10, "output": 5}},
                    "arrival": {"process": "offline"},
                    "num_requests": 3,
                },
                {
                    "name": "b",
                    "class": "be",
                    "source": {"fixed": {"prompt": 20, "output": 5}},
                    "arrival": {"process": "offline"},
                    "num_requests": 2,
                },
            ]
        }
    )
    wl = build_workload(spec, seed=0, context_len=100)
    assert [r.num_prompt_tokens for r in wl.requests] == [10, 10, 10, 20, 20]
    assert wl.requests[3].request_class is RequestClass.BE


def test_num_requests_override_splits_proportionally() -> None:
    spec = load_workload_spec("mixed-rt-be")  # 1200 rt + 400 be
    wl = build_workload(spec, seed=0, context_len=4096, num_requests=101)
    rt = sum(r.request_class is RequestClass.RT for r in wl.requests)
    assert len(wl) == 101 and rt == 76


def test_rate_scale_compresses_time() -> None:
    spec = load_workload_spec("azure-conv-trace")
    base = build_workload(spec, seed=1, context_len=16384)
    fast = build_workload(spec, seed=1, context_len=16384, rate_scale=2.0)
    assert fast.duration_s == pytest.approx(base.duration_s / 2)


# --- clipping and max_tokens ---------------------------------------------------------------------
def test_clipping_counts() -> None:
    trace = load_trace("arxiv")
    wl = workload_from_trace("arxiv", num_requests=len(trace), seed=0, context_len=2048, offline=True)
    # Sampling without replacement takes every row once, so counts are exact.
    p, o = trace.prompt_tokens, trace.output_tokens
    prompt_cut = int(np.sum(p > 2047))
    expected = int(np.sum((p > 2047) | (np.minimum(p, 2047) + o > 2048)))
    assert wl.num_clipped == expected > 0
    assert f"{expected} of {len(trace)} requests clipped to context_len 2048" in wl.clipped_details
    assert f"{prompt_cut} prompts cut to 2047 tokens" in wl.clipped_details
    for r in wl.requests:
        assert r.num_prompt_tokens <= 2047
        assert r.num_prompt_tokens + r.true_output_tokens <= 2048
        assert r.max_tokens == 2048 - r.num_prompt_tokens
    none = workload_from_trace("arxiv", num_requests=100, seed=0, context_len=8192, offline=True)
    assert none.num_clipped == 0 and none.clipped_details == ""


def test_max_tokens_caps_output() -> None:
    wl = workload_from_trace("sharegpt", num_requests=500, seed=2, context_len=4096, rate=4, max_tokens=128)
    assert all(r.max_tokens == min(128, 4096 - r.num_prompt_tokens) for r in wl.requests)
    assert all(r.true_output_tokens <= r.max_tokens for r in wl.requests)
    assert max(r.true_output_tokens for r in wl.requests) == 128
    assert "truncated to their max_tokens" in wl.clipped_details


# --- convenience constructors --------------------------------------------------------------------
def test_workload_from_trace_modes() -> None:
    poisson = workload_from_trace("sharegpt", num_requests=300, seed=0, context_len=4096, rate=5, slo={"ttft_s": 1.0})
    assert len(poisson) == 300 and poisson.requests[0].slo == SLO(ttft_s=1.0)
    bursty = workload_from_trace(
        "sharegpt", num_requests=300, seed=0, context_len=4096, rate=5, burstiness_cv=3.0, request_class="be"
    )
    assert bursty.requests[0].request_class is RequestClass.BE
    offline = workload_from_trace("bwb", num_requests=50, seed=0, context_len=4096, offline=True)
    assert all(r.arrival_time == 0.0 for r in offline.requests)
    with pytest.warns(UserWarning, match="trace azure-code has 8819 rows and 20000 requests were asked for"):
        replay = workload_from_trace(
            "azure-code", num_requests=20000, seed=0, context_len=8192, trace_arrivals=True
        )  # more than the 8819 rows: wraps around
    _check_ordered(replay)
    assert replay.duration_s > 2 * 3436


def test_workload_from_trace_flag_errors() -> None:
    kw = {"num_requests": 10, "seed": 0, "context_len": 4096}
    with pytest.raises(ConfigError, match="exactly one of rate"):
        workload_from_trace("sharegpt", **kw)
    with pytest.raises(ConfigError, match="exactly one of rate"):
        workload_from_trace("sharegpt", rate=2, offline=True, **kw)
    with pytest.raises(ConfigError, match="needs a rate"):
        workload_from_trace("sharegpt", burstiness_cv=2, offline=True, **kw)
    with pytest.raises(ConfigError, match=r"arrival\.rate must be > 0, got -1"):
        workload_from_trace("sharegpt", rate=-1, **kw)
    with pytest.raises(ConfigError, match=r"'trace' needs arrival times, but trace 'sharegpt'"):
        workload_from_trace("sharegpt", trace_arrivals=True, **kw)
    with pytest.raises(UnknownNameError, match=r"sharegpt-8k"):
        workload_from_trace("nope", offline=True, **kw)


def test_synthetic_workload() -> None:
    wl = synthetic_workload(1024, 128, 8, context_len=4096)
    assert [(r.num_prompt_tokens, r.true_output_tokens, r.arrival_time) for r in wl.requests] == [(1024, 128, 0.0)] * 8
    timed = synthetic_workload(100, 10, 50, context_len=4096, rate=10, seed=1)
    assert timed.duration_s > 0


def test_user_trace_in_spec_relative_to_yaml(tmp_path) -> None:
    (tmp_path / "lens.csv").write_text("in,out\n10,2\n20,3\n30,4\n")
    spec_file = tmp_path / "w.yaml"
    spec_file.write_text(
        "streams:\n"
        "  - source: {trace: lens.csv, columns: {prompt: in, output: out}}\n"
        "    arrival: {process: poisson, rate: 1}\n"
        "    num_requests: 3\n"
    )
    spec = load_workload_spec(str(spec_file))
    assert spec.name == "w" and spec.streams[0].name == "stream0"
    wl = build_workload(spec, seed=0, context_len=100)
    assert sorted(r.num_prompt_tokens for r in wl.requests) == [10, 20, 30]


def test_exponent_notation_is_a_number_in_a_spec(tmp_path) -> None:
    """PyYAML (YAML 1.1) reads ``5e-1`` as a string, which the strict fields refused ("must be a number,
    got '5e-1'"); a spec reads it as YAML 1.2 and JSON do. A quoted "5e-1" is still a string."""
    spec_file = tmp_path / "w.yaml"
    spec_file.write_text(
        "streams:\n"
        "  - source: {fixed: {prompt: 10, output: 5}}\n"
        "    arrival: {process: gamma, rate: 5e-1, cv: 1.5E0}\n"
        "    slo: {ttft_s: .5e1, tpot_s: 1.e-1}\n"
        "    num_requests: 3\n"
    )
    stream = load_workload_spec(str(spec_file)).streams[0]
    assert (stream.arrival.rate, stream.arrival.cv) == (0.5, 1.5)
    assert (stream.slo.ttft_s, stream.slo.tpot_s) == (5.0, 0.1)
    spec_file.write_text(spec_file.read_text().replace("rate: 5e-1", 'rate: "5e-1"'))
    with pytest.raises(ConfigError, match=r"arrival\.rate must be a number, got '5e-1'"):
        load_workload_spec(str(spec_file))


def test_a_key_given_twice_in_a_spec_is_named_and_a_merge_may_still_be_overridden(tmp_path) -> None:
    """PyYAML keeps the last of two equal keys without a word (the stream below was named b)."""
    spec_file = tmp_path / "w.yaml"
    stream = "  - source: {fixed: {prompt: 10, output: 5}}\n    arrival: {process: offline}\n    num_requests: 3\n"
    spec_file.write_text("streams:\n" + stream + "    name: a\n    name: b\n")
    with pytest.raises(
        ConfigError, match=r"w\.yaml: invalid YAML: line 6, column 5: key 'name' is given twice \(first on line 5\)"
    ):
        load_workload_spec(str(spec_file))
    spec_file.write_text(
        "streams:\n"
        "  - &first\n"
        "    source: {fixed: {prompt: 10, output: 5}}\n"
        "    arrival: {process: offline}\n"
        "    num_requests: 3\n"
        "  - <<: *first\n"
        "    num_requests: 4\n"
    )
    assert [s.num_requests for s in load_workload_spec(str(spec_file)).streams] == [3, 4]


# --- spec errors ---------------------------------------------------------------------------------
GOOD = {
    "name": "chat",
    "source": {"trace": "sharegpt"},
    "arrival": {"process": "poisson", "rate": 2},
    "num_requests": 10,
}


def _with(**changes) -> dict:
    stream = {**GOOD, **changes}
    return {k: v for k, v in stream.items() if v is not None}


@pytest.mark.parametrize(
    ("stream", "expected"),
    [
        (
            _with(arrival={"process": "poisson", "rate": -2}),
            r"workload\.yaml: streams\[1\] \(chat\): arrival\.rate must be > 0, got -2",
        ),
        (_with(arrival={"process": "gamma", "rate": 2}), r"arrival\.cv is required"),
        (_with(arrival={"process": "gamma", "rate": 2, "cv": 0}), r"arrival\.cv must be > 0, got 0"),
        (
            _with(arrival={"process": "burst", "rate": 2}),
            r"arrival\.process must be one of poisson, gamma, trace, offline, closed-batches; got 'burst'",
        ),
        (_with(arrival={"process": "offline", "rate": 2}), r"unknown key 'arrival\.rate'"),
        (_with(arrival={"process": "poisson", "rate": "fast"}), r"arrival\.rate must be a number, got 'fast'"),
        (_with(num_requests=-5), r"streams\[1\] \(chat\): num_requests must be >= 1, got -5"),
        (_with(num_requests=2.5), r"num_requests must be an integer, got 2\.5"),
        (_with(num_requests=None), r"num_requests is required"),
        (_with(source=None), r"streams\[1\] \(chat\): source is required"),
        (
            _with(source={"trace": "nope"}),
            r"streams\[1\] \(chat\): source\.trace: unknown trace 'nope'; valid: arxiv, ",
        ),
        (_with(source={"fixed": {"prompt": 0, "output": 5}}), r"source\.fixed\.prompt must be >= 1, got 0"),
        (
            _with(source={"uniform": {"prompt": [9, 3], "output": [1, 2]}}),
            r"source\.uniform\.prompt must have lo <= hi, got \[9, 3\]",
        ),
        (
            _with(source={"trace": "sharegpt", "fixed": {"prompt": 1, "output": 1}}),
            r"source must have exactly one of trace, fixed, uniform",
        ),
        (
            _with(source={"fixed": {"prompt": 5, "output": 5}}, arrival={"process": "trace"}),
            r"'trace' needs a trace source",
        ),
        (_with(slo={"ttft_s": 0}), r"slo\.ttft_s must be > 0, got 0"),
        (_with(slo={"tbt": 1}), r"unknown key 'slo\.tbt'"),
        (_with(weight=3), r"streams\[1\] \(chat\): unknown key 'weight'"),
        (_with(priority="high"), r"priority must be an integer, got 'high'"),
        (_with(**{"class": "gold"}), r"class must be 'rt' or 'be', got 'gold'"),
        (_with(max_tokens=0), r"max_tokens must be >= 1, got 0"),
        (_with(start_s=-1), r"start_s must be >= 0, got -1"),
        # each of these once overflowed numpy's int64 or divided by 0 (a traceback, or 745 GiB asked for)
        (_with(num_requests=10**11), r"num_requests must be <= 10,000,000, got 100000000000"),
        (_with(source={"fixed": {"prompt": 10**30, "output": 5}}), r"source\.fixed\.prompt must be <= 1,000,000,000"),
        (
            _with(source={"uniform": {"prompt": [1, 10**30], "output": [1, 2]}}),
            r"source\.uniform\.prompt\[1\] must be <= 1,000,000,000",
        ),
        (
            _with(source={"lognormal": {"prompt": [1e300, 1e300], "output": [9, 2]}}),
            r"source\.lognormal\.prompt\[0\] must be <= 1,000,000,000, got 1e\+300",
        ),
        (
            _with(source={"lognormal": {"prompt": [0.001, 1e9], "output": [9, 2]}}),
            r"source\.lognormal\.prompt must have a mean >= 1 token, got 0\.001",
        ),
        (_with(arrival={"process": "gamma", "rate": 2, "cv": 1e300}), r"arrival\.cv must be <= 100, got 1e\+300"),
        (_with(max_tokens=10**30), r"max_tokens must be <= 1,000,000,000"),
        (_with(priority=-(10**30)), r"priority must be >= -1,000,000,000"),
    ],
)
def test_bad_stream_fields(tmp_path, stream: dict, expected: str) -> None:
    path = tmp_path / "workload.yaml"

    first = {**GOOD, "name": "first"}
    path.write_text(yaml.safe_dump({"streams": [first, stream]}))
    with pytest.raises(ConfigError, match=expected):
        load_workload_spec(str(path))


def test_bad_spec_top_level(tmp_path) -> None:
    path = tmp_path / "w.yaml"
    path.write_text("streams: [\n")
    with pytest.raises(ConfigError, match=r"w\.yaml: invalid YAML: line 2, column 1: .*'<stream end>'$") as info:
        load_workload_spec(str(path))
    assert "\n" not in str(info.value)  # one line, not PyYAML's excerpt of the file
    path.write_text("streams: []\n")
    with pytest.raises(ConfigError, match=r"w\.yaml: streams must be a non-empty list"):
        load_workload_spec(str(path))
    path.write_text("nme: x\nstreams: []\n")
    with pytest.raises(ConfigError, match=r"w\.yaml: unknown key 'nme'"):
        load_workload_spec(str(path))
    path.write_text("")
    with pytest.raises(ConfigError, match=r"w\.yaml: empty workload spec"):
        load_workload_spec(str(path))
    with pytest.raises(ConfigError, match=r"the streams' num_requests add up to 12,000,000, above the 10,000,000"):
        parse_workload_spec(
            {"streams": [{**GOOD, "name": "a", "num_requests": 6 * 10**6}, {**GOOD, "num_requests": 6 * 10**6}]}
        )
    with pytest.raises(ConfigError, match=r"streams\[1\]\.name 'a' is used by another stream"):
        parse_workload_spec({"streams": [{**GOOD, "name": "a"}, {**GOOD, "name": "a"}]})
    with pytest.raises(UnknownNameError, match=r"unknown workload 'nope'; valid: .*mixed-rt-be"):
        load_workload_spec("nope")
    with pytest.raises(ConfigError, match=r"missing\.yaml not found"):
        load_workload_spec(str(tmp_path / "missing.yaml"))


def test_build_argument_errors() -> None:
    spec = load_workload_spec("sharegpt-poisson")
    with pytest.raises(ConfigError, match=r"context_len must be an integer >= 2, got 1"):
        build_workload(spec, seed=0, context_len=1)
    with pytest.raises(ConfigError, match=r"seed must be an integer >= 0, got -1"):
        build_workload(spec, seed=-1, context_len=4096)
    with pytest.raises(ConfigError, match=r"rate_scale must be > 0"):
        build_workload(spec, seed=0, context_len=4096, rate_scale=0)


# --- invariants --------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    context_len=st.integers(2, 3000),
    lo=st.integers(1, 2000),
    span=st.integers(0, 2000),
    max_tokens=st.one_of(st.none(), st.integers(1, 500)),
    seed=st.integers(0, 2**32),
)
def test_clipping_invariants(context_len: int, lo: int, span: int, max_tokens: int | None, seed: int) -> None:
    stream = {
        "source": {"uniform": {"prompt": [lo, lo + span], "output": [lo, lo + span]}},
        "arrival": {"process": "gamma", "rate": 3, "cv": 2},
        "num_requests": 20,
    }
    if max_tokens is not None:
        stream["max_tokens"] = max_tokens
    wl = build_workload(parse_workload_spec({"streams": [stream]}), seed=seed, context_len=context_len)
    _check_ordered(wl)
    clipped = 0
    for r in wl.requests:
        assert 1 <= r.num_prompt_tokens <= context_len - 1
        assert r.num_prompt_tokens + r.true_output_tokens <= context_len
        assert r.true_output_tokens <= r.max_tokens <= context_len - r.num_prompt_tokens
        if max_tokens is not None:
            assert r.max_tokens <= max_tokens
        clipped += r.num_prompt_tokens + r.true_output_tokens == context_len
    if max_tokens is None:  # a clipped request fills the context exactly
        assert wl.num_clipped <= clipped


def test_with_rt_rate_sets_the_rate_even_to_the_current_one():
    from sloserve.core.errors import ConfigError
    from sloserve.workload import load_workload_spec, with_rt_rate

    spec = load_workload_spec("bros-sharegpt")
    current = next(s.arrival.rate for s in spec.streams if s.request_class.value == "rt")
    assert with_rt_rate(spec, current) == spec  # was refused as "no RT stream" before
    assert next(s.arrival.rate for s in with_rt_rate(spec, 7.0).streams if s.request_class.value == "rt") == 7.0
    with pytest.raises(ConfigError, match="no Poisson or gamma RT stream"):
        with_rt_rate(load_workload_spec("azure-conv-trace"), 2.0)


def test_closed_loop_batches_release_the_next_batch_when_the_last_of_one_is_done():
    from sloserve.core.request import Request
    from sloserve.workload.closed_loop import ClosedLoopBatches

    r = [Request(i, 0.0, 4, 2, 2) for i in range(5)]
    loop = ClosedLoopBatches([[[r[0], r[1]], [r[2], r[3]], [r[4]]]])
    assert [loop.arrives_on_its_own(x) for x in r] == [True, True, False, False, False]
    assert loop.done(r[1]) == () and list(loop.done(r[0])) == [r[2], r[3]]
    assert loop.done(r[3]) == () and list(loop.done(r[2])) == [r[4]]
    assert loop.done(r[4]) == ()  # the chain's last batch releases nothing


def test_a_lognormal_source_has_the_moments_it_is_given():
    """bros-lmsys: LMSYS-Chat-1M's published statistics (BROS §7.1), prompt 90.5 +- 148.5 and output
    237 +- 228, drawn log-normal: the sample moments land near them (rounding and the floor of 1 add
    a little)."""
    spec = load_workload_spec("bros-lmsys")
    rt = next(s for s in spec.streams if s.name == "rt")
    rt = dataclasses.replace(rt, num_requests=200_000, arrival=dataclasses.replace(rt.arrival, rate=1000.0))
    requests = build_workload(dataclasses.replace(spec, streams=[rt]), seed=0, context_len=100_000).requests
    prompts = np.array([r.num_prompt_tokens for r in requests])
    outputs = np.array([r.true_output_tokens for r in requests])
    assert abs(prompts.mean() / 90.5 - 1) < 0.03 and abs(prompts.std() / 148.5 - 1) < 0.15
    assert abs(outputs.mean() / 237 - 1) < 0.03 and abs(outputs.std() / 228 - 1) < 0.1
    assert prompts.min() >= 1 and np.median(prompts) < prompts.mean()  # right-skewed, as chat prompts are


def test_lognormal_source_errors(tmp_path):
    path = tmp_path / "w.yaml"
    stream = {**GOOD, "source": {"lognormal": {"prompt": [90.5], "output": [237, 228]}}}
    path.write_text(yaml.safe_dump({"streams": [stream]}))
    with pytest.raises(ConfigError, match=r"source\.lognormal\.prompt must be a list \[mean, std\], got \[90\.5\]"):
        load_workload_spec(str(path))
    stream["source"] = {"lognormal": {"prompt": [90.5, -1], "output": [237, 228]}}
    path.write_text(yaml.safe_dump({"streams": [stream]}))
    with pytest.raises(ConfigError, match=r"source\.lognormal\.prompt\[1\] must be > 0, got -1"):
        load_workload_spec(str(path))


def test_a_trace_run_loads_no_pydantic():
    """``--trace`` runs build their one stream without the YAML validator: pydantic costs a third of
    a second and 10 MB at start-up (issue 39's regression)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from sloserve.workload import synthetic_workload, workload_from_trace\n"
        "workload_from_trace('sharegpt', num_requests=5, seed=0, context_len=4096, rate=2.0)\n"
        "synthetic_workload(8, 4, 3, context_len=64)\n"
        "assert 'pydantic' not in sys.modules, 'pydantic imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
