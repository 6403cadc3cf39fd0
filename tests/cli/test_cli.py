"""The ``sloserve`` command, run as a user runs it (a real subprocess for exit codes; the many refusals of bad
options in process, as click's test runner gives them)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from sloserve.workload import TRACES

SLOSERVE = [sys.executable, "-m", "sloserve.cli"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*SLOSERVE, *args], capture_output=True, text=True, timeout=120)


def test_simulate_writes_outputs_and_json(tmp_path: Path):
    out = tmp_path / "run"
    proc = run(
        "simulate",
        "--trace",
        "sharegpt",
        "--scheduler",
        "sarathi",
        "--rate",
        "6",
        "--num-requests",
        "300",
        "--seed",
        "4",
        "--out",
        str(out),
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    for key in (
        "completed",
        "throughput_rps",
        "throughput_tps",
        "slo_attainment",
        "goodput_rps",
        "kv_utilization_mean",
        "preemptions",
        "sim_wall_s",
    ):
        assert key in summary
    for key in ("ttft_s", "tpot_s", "normalized_latency_s", "jct_s"):
        assert set(summary[key]) == {"mean", "p50", "p90", "p99"}
    assert summary["completed"] == 300 and summary["scheduler"] == "sarathi"
    assert json.loads((out / "summary.json").read_text())["completed"] == 300
    with open(out / "requests.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 300 and {"ttft_s", "tpot_s", "jct_s"} <= set(rows[0])
    with open(out / "timeline.csv") as f:
        header = next(csv.reader(f))
    assert {"start_s", "num_tokens", "kv_used_tokens", "kv_allocated_tokens"} <= set(header)
    assert any(p.suffix == ".png" and p.stat().st_size > 0 for p in out.iterdir())


def test_compare_runs_every_scheduler_on_the_same_workload(tmp_path: Path):
    proc = run(
        "compare",
        "--trace",
        "azure-conv",
        "--trace-arrivals",
        "--schedulers",
        "vllm,sarathi,orca",
        "--num-requests",
        "200",
        "--set",  # a scheduler's own option wins over one for every scheduler, in either order
        "vllm.max_num_seqs=4",
        "--set",
        "max_num_seqs=8",
        "--out",
        str(tmp_path),
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    summaries = json.loads(proc.stdout)
    assert list(summaries) == ["vllm", "sarathi", "orca"]
    assert [s["scheduler_options"] for s in summaries.values()] == [{"max_num_seqs": v} for v in ("4", "8", "8")]
    assert all(s["completed"] == 200 for s in summaries.values())
    assert (tmp_path / "compare.png").stat().st_size > 0
    assert (tmp_path / "orca" / "summary.json").exists()


@pytest.mark.parametrize("trace", sorted(TRACES))
def test_simulate_on_every_bundled_trace(trace):
    arrivals = ["--trace-arrivals"] if trace.startswith(("azure", "mooncake")) else ["--rate", "2"]
    model = ["--model", "llama-3-70b", "--num-gpus", "4"] if trace.startswith("mooncake") else []
    proc = run("simulate", "--trace", trace, *arrivals, *model, "--num-requests", "60", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["completed"] == 60


def test_traces_lists_every_bundled_trace():
    proc = run("traces")
    assert proc.returncode == 0, proc.stderr
    for name in TRACES:
        assert name in proc.stdout
    assert "10000" in proc.stdout and "19366" in proc.stdout


def test_traces_summarizes_a_request_log_with_what_its_requests_were_served_with(tmp_path: Path):
    from sloserve.workload import trace_summary

    log = tmp_path / "requests.jsonl"
    log.write_text("".join(json.dumps(line) + "\n" for line in [
        {"arrival_s": 0.5, "prompt_tokens": 30, "output_tokens": 4, "request_class": "be", "priority": 3},
        {"arrival_s": 0.0, "prompt_tokens": 20, "output_tokens": 2, "request_class": "rt", "priority": -1,
         "slo_ttft_s": 0.2},
        {"arrival_s": 1.0, "prompt_tokens": 10, "output_tokens": 6, "request_class": None, "priority": 3},
    ]))  # fmt: skip
    assert trace_summary(str(log))["recorded"] == {
        "classes": {"-": 1, "be": 1, "rt": 1}, "priorities": {"-1": 1, "3": 2}, "with_slo": 1
    }  # fmt: skip
    assert trace_summary("sharegpt")["recorded"] is None
    proc = run("traces", str(log), "sharegpt")
    assert proc.returncode == 0, proc.stderr
    assert "requests.jsonl" in proc.stdout and "sharegpt" in proc.stdout and "served as" in proc.stdout
    proc = run("traces", str(tmp_path / "missing.jsonl"))
    assert proc.returncode == 2 and "missing.jsonl not found" in proc.stderr


def test_sweep_writes_plot(tmp_path: Path):
    proc = run(
        "sweep",
        "--trace",
        "sharegpt",
        "--rates",
        "2,6",
        "--schedulers",
        "vllm,sarathi",
        "--num-requests",
        "150",
        "--out",
        str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "sweep_normalized_latency_s.png").stat().st_size > 0
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    assert [p["rate"] for p in sweep["vllm"]] == [2.0, 6.0]


BAD = [
    (["--trace", "nope", "--rate", "1"], "unknown trace 'nope'; valid: arxiv"),
    (["--trace", "sharegpt", "--rate", "0"], "--rate must be a finite number > 0 (requests/s), got 0.0"),
    (["--trace", "sharegpt", "--rate", "inf"], "--rate must be a finite number > 0 (requests/s), got inf"),
    (
        ["--trace", "sharegpt", "--rate", "1", "--scheduler", "fifo"],
        "unknown scheduler 'fifo'; valid: bros, bros_nobicache, econoserve, econoserve-d, econoserve-oracle, econoserve-sd, econoserve-sdo, fastserve, infermax, multires, orca, rank_i",
    ),
    (["--trace", "sharegpt", "--rate", "1", "--gpu", "tpu"], "unknown GPU"),
    (["--trace", "sharegpt", "--rate", "1", "--kv-capacity-tokens", "8"], "below one block of 16 tokens"),
    (
        ["--trace", "sharegpt", "--rate", "1", "--scheduler", "orca", "--kv-capacity-tokens", "3000"],
        "cannot hold request",
    ),
    (["--trace", "sharegpt"], "give exactly one of rate"),
    (["--trace", "sharegpt", "--rate", "1", "--set", "nosuch=1"], "has no option 'nosuch'"),
    (["--trace", "sharegpt", "--rate", "1", "--disaggregate", "2"], "--disaggregate expects P:D"),
    (["--trace", "sharegpt", "--rate", "1", "--disaggregate", "1:1", "--link-gbps", "0"], "--link-gbps must be > 0"),
    (
        ["--trace", "sharegpt", "--rate", "1", "--scheduler", "rank_i", "--disaggregate", "1:1"],
        "--disaggregate: scheduler rank_i cannot prefill for another replica; those that can: infermax",
    ),
    (["--trace", "sharegpt", "--rate", "1", "--set", "role=prefill"], "--set role: a replica's role comes from"),
]


@pytest.mark.parametrize("args,message", BAD)
def test_bad_input_is_one_clear_line_and_exit_2(tmp_path: Path, args, message):
    out = tmp_path / "out"
    proc = run("simulate", *args, "--num-requests", "20", "--out", str(out))
    assert proc.returncode == 2
    assert message.lower() in proc.stderr.lower()
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not out.exists(), "nothing half-written"


def test_bad_trace_column(tmp_path: Path):
    path = tmp_path / "mine.csv"
    path.write_text("in,out\n10,5\n12,abc\n")
    proc = run("simulate", "--trace", str(path), "--columns", "prompt=in,output=out", "--rate", "1")
    assert proc.returncode == 2
    assert "mine.csv" in proc.stderr and "line 3" in proc.stderr and "abc" in proc.stderr


def test_fit_cost_makes_a_preset_that_simulate_uses(tmp_path: Path):
    """A profile measured on the Llama-2-7B preset's own times is fitted back, then simulated with."""
    from sloserve.cost import BatchShape, LinearCostModel, get_preset

    truth = LinearCostModel(get_preset("llama-2-7b-a100"))
    rows = [
        "num_decode,decode_kv_tokens,num_prefill,prefill_tokens,prefill_attention_work,prefill_context_tokens,time_s"
    ]
    for b in (1, 8, 32, 128):
        for kv in (512, 4096, 32768):
            shape = BatchShape(b, b * kv // 8)
            rows.append(f"{b},{b * kv // 8},0,0,0,0,{truth.batch_time(shape).total_s}")
    for c, m in ((128, 0), (512, 0), (2048, 0), (512, 1024), (1024, 2048), (256, 256)):
        for n in (1, 2):
            shape = BatchShape(0, 0, n, n * c, n * (c * c + 2 * m * c), n * m)
            rows.append(f"0,0,{n},{n * c},{n * (c * c + 2 * m * c)},{n * m},{truth.batch_time(shape).total_s}")
            shape = BatchShape(16, 16 * 700, n, n * c, n * (c * c + 2 * m * c), n * m)
            rows.append(
                f"16,{16 * 700},{n},{n * c},{n * (c * c + 2 * m * c)},{n * m},{truth.batch_time(shape).total_s}"
            )
    profile = tmp_path / "profile.csv"
    profile.write_text("\n".join(rows) + "\n")
    preset = tmp_path / "mine.json"
    proc = run("fit-cost", "--csv", str(profile), "--layers", "32", "--out", str(preset))
    assert proc.returncode == 0, proc.stderr
    assert "mean relative error 0.00%" in proc.stdout
    ours = run(
        "simulate", "--trace", "sharegpt", "--rate", "4", "--num-requests", "100", "--cost-model", str(preset), "--json"
    )
    ref = run("simulate", "--trace", "sharegpt", "--rate", "4", "--num-requests", "100", "--json")
    assert ours.returncode == 0, ours.stderr
    a, b = json.loads(ours.stdout), json.loads(ref.stdout)
    assert a["jct_s"]["mean"] == pytest.approx(b["jct_s"]["mean"], rel=1e-6)
    bad = run("fit-cost", "--csv", str(tmp_path / "none.csv"), "--layers", "32", "--out", str(preset))
    assert bad.returncode == 2 and "none.csv" in bad.stderr
    bad = run("fit-cost", "--csv", str(profile), "--layers", "32", "--out", str(profile / "x.json"))
    assert bad.returncode == 2 and f"--out {profile / 'x.json'}: {profile} is not an existing directory" in bad.stderr
    if Path("/proc/self").is_dir():  # a folder no one can create files in, root included (Linux)
        bad = run("fit-cost", "--csv", str(profile), "--layers", "32", "--out", "/proc/mine.json")
        assert bad.returncode == 2 and "--out /proc/mine.json: cannot write in /proc" in bad.stderr, bad.stderr
    straight = run("fit-cost", "--csv", str(profile), "--layers", "32", "--form", "infermax", "--out", str(preset))
    assert straight.returncode == 0 and "(infermax form)" in straight.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["simulate", "--out", "{file}"], "exists and is not a directory"),
        (["simulate", "--out", "{file}/sub"], "is a file, not a directory"),
        (["compare", "--out", "{file}"], "exists and is not a directory"),
        (["sweep", "--rates", "5", "--out", "{file}"], "exists and is not a directory"),
        (["simulate", "--slo-ttft", "-1"], "--slo-ttft must be > 0 seconds"),
        (["simulate", "--slo-jct", "0"], "--slo-jct must be > 0 seconds"),
        (["simulate", "--num-requests", "100000000000"], "--num-requests must be in 1..10,000,000"),
        (["simulate", "--num-requests", "0"], "--num-requests must be in 1..10,000,000"),
        (["simulate", "--rt-rate", "3"], "--rt-rate sets a --workload's RT rate"),
        (
            ["simulate", "--burstiness", "0"],
            "--burstiness (the arrivals' coefficient of variation) must be in (0, 100]",
        ),
        (
            ["simulate", "--burstiness", "inf"],
            "--burstiness (the arrivals' coefficient of variation) must be in (0, 100]",
        ),
        (["simulate", "--kv-capacity-tokens", "100000000000"], "--kv-capacity-tokens must be in 1..200,000,000"),
        (["simulate", "--replicas", "100000"], "--replicas 100,000: 100,000 replicas x 117,168 KV tokens"),
        (["simulate", "--disaggregate", "9000:9000"], "--disaggregate 9000:9000: 18,000 replicas x 117,168 KV"),
        (["simulate", "--set", "max_num_seqs=1", "--set", "max_num_seqs=2"], "--set max_num_seqs is given twice"),
        (["simulate", "--columns", "prompt=a,prompt=b"], "--columns maps prompt twice ('a', then 'b')"),
        (["simulate", "--max-tokens", "0"], "--max-tokens must be in 1..1,000,000,000, got 0"),
        (["simulate", "--max-tokens", "1" + "0" * 30], "--max-tokens must be in 1..1,000,000,000, got 1,000,000"),
        (["simulate", "--max-model-len", "1" + "0" * 30], "--max-model-len must be in 2..1,000,000,000, got 1,0"),
        (["simulate", "--trace", "bwb", "--trace-arrivals"], "--trace-arrivals: trace 'bwb' has no arrival times"),
        (["simulate", "--swap-space-gib", "nan"], "--swap-space-gib must be a finite number >= 0, got nan"),
        (["simulate", "--swap-space-gib", "1e30"], "--swap-space-gib 1e+30 holds more than 200,000,000 tokens"),
        (["sweep", "--rates", "5,nan", "--out", "{dir}/sweep"], "--rates must be a finite number > 0 (requests/s)"),
        (["sweep", "--rates", ",", "--out", "{dir}/sweep"], "--rates needs at least one rate"),
        (["simulate", "--disaggregate", "1:1", "--replicas", "3"], "--replicas 3 and --disaggregate 1:1 both set"),
        (["sweep", "--rates", "5", "--metric", "nonsense", "--out", "{dir}/sweep"], "--metric 'nonsense' is not in"),
    ],
)
def test_bad_options_get_one_line_and_exit_2(tmp_path: Path, monkeypatch, args: list[str], message: str):
    """Each once gave a traceback or ran silently with something else than asked. In process (26 cases):
    the exit code and stderr are a subprocess's, as the tests above show for the command's other exits."""
    from click.testing import CliRunner

    from sloserve.cli import main

    afile = tmp_path / "afile"
    afile.write_text("")
    args = [a.format(file=afile, dir=tmp_path) for a in args]
    arrivals_given = "--rates" in args or "--trace-arrivals" in args
    defaults = ["--trace", "sharegpt", "--num-requests", "10"] + ([] if arrivals_given else ["--rate", "5"])
    monkeypatch.chdir(tmp_path)  # where a default output folder would go
    result = CliRunner().invoke(main, [*args[:1], *defaults, *args[1:]])
    assert result.exit_code == 2 and message in result.stderr, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_an_engine_commands_missing_model_is_answered_before_torch_is_imported(tmp_path: Path):
    """`run`, `profile` and `serve` read --model's config.json (its random: name, its GGUF file) before importing the
    engine or the server: a typo is answered in well under a second, not after torch's import (2-3 s). A subprocess,
    to see what it imported."""
    (tmp_path / "rwkv").mkdir()
    (tmp_path / "rwkv" / "config.json").write_text(json.dumps({"model_type": "rwkv"}))
    script = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from sloserve.cli import main\n"
        "for args in sys.argv[1:]:\n"
        "    result = CliRunner().invoke(main, args.split())\n"
        "    print(result.exit_code, result.stderr.strip())\n"
        "print('torch' in sys.modules)\n"
    )
    cases = [f"run --model {tmp_path / 'none'} --trace sharegpt", "profile --model random:huge --out x.json",
             f"run --model {tmp_path / 'rwkv'} --trace sharegpt", f"serve --model {tmp_path / 'none'}",
             f"serve --model {tmp_path / 'rwkv'}", f"run --model {tmp_path / 'none.gguf'} --trace sharegpt"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", script, *cases], capture_output=True, text=True, timeout=120)
    *refusals, imported = proc.stdout.strip().splitlines()
    assert refusals[0] == f"2 error: model directory {tmp_path / 'none'} does not exist (models are never downloaded)"
    assert refusals[1].startswith("2 error: unknown random model shape 'huge'")
    assert refusals[2].startswith("2 error: rwkv: unsupported architecture 'rwkv'")
    assert refusals[3] == refusals[0] and refusals[4] == refusals[2]
    assert refusals[5] == f"2 error: --model {tmp_path / 'none.gguf'}: no such GGUF file"
    assert imported == "False", proc.stderr


def test_an_error_whose_text_spans_lines_is_still_one_line():
    """A library's message inside ours (a parser's excerpt, a remote traceback) keeps the CLI's one line."""
    import click
    from click.testing import CliRunner

    from sloserve.cli.app import Command
    from sloserve.core.errors import ConfigError

    @click.command(cls=Command)
    def broken() -> None:
        raise ConfigError("plan.yaml: not YAML (while parsing\n  in line 2\n\n    ^)")

    result = CliRunner().invoke(broken, [])
    assert result.exit_code == 2
    assert result.output == "error: plan.yaml: not YAML (while parsing in line 2 ^)\n"


def test_columns_with_a_workload_is_refused_and_prompt_output_columns_are_recognised(tmp_path: Path):
    proc = run("simulate", "--workload", "bros-sharegpt", "--columns", "prompt=a")
    assert proc.returncode == 2 and "--columns maps a --trace file's columns" in proc.stderr
    trace = tmp_path / "t.csv"
    trace.write_text("prompt,output\n10,5\n20,6\n")
    proc = run("simulate", "--trace", str(trace), "--offline", "--num-requests", "4", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["completed"] == 4, proc.stderr
    trace.write_text("question,answer\n10,5\n")
    proc = run("simulate", "--trace", str(trace), "--offline")
    assert proc.returncode == 2 and "map one with --columns prompt=NAME" in proc.stderr


@pytest.mark.parametrize(
    "option,field",
    [(["--burstiness", "2"], "arrival (cv)"), (["--max-tokens", "5"], "max_tokens"), (["--offline"], "arrival"),
     (["--trace-arrivals"], "arrival"), (["--slo-ttft", "1"], "slo")],
)  # fmt: skip
def test_trace_options_with_a_workload_are_refused(option: list[str], field: str):
    """Each ran with the spec's own setting instead, silently."""
    proc = run("simulate", "--workload", "bros-sharegpt", "--scheduler", "bros", *option)
    assert proc.returncode == 2, proc.stderr
    assert f"{option[0]} applies to --trace; a workload spec sets each stream's {field}" in proc.stderr


def test_a_context_beyond_the_models_is_simulated_with_a_note():
    """The engine refuses it; a simulation may ask "what if", and is told."""
    proc = run("simulate", "--trace", "sharegpt", "--rate", "5", "--num-requests", "20", "--max-model-len", "100000")
    assert proc.returncode == 0, proc.stderr
    assert (
        "note: --max-model-len 100,000 is above llama-2-7b's context of 4,096 tokens; simulated as given" in proc.stderr
    )


def test_trace_arrivals_replays_the_trace_as_it_is_unless_asked_for_more(tmp_path: Path):
    trace = tmp_path / "t.csv"
    trace.write_text("prompt_tokens,output_tokens,arrival_s\n10,5,0\n20,6,1.0\n30,7,2.5\n")
    proc = run("simulate", "--trace", str(trace), "--trace-arrivals", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["num_requests"] == 3, proc.stderr
    proc = run("simulate", "--trace", str(trace), "--trace-arrivals", "--num-requests", "10", "--json")
    assert json.loads(proc.stdout)["num_requests"] == 10 and "repeats it back to back" in proc.stderr
    # a trace longer than the default 1,000 requests: a window of it, and the run says so
    trace.write_text("prompt_tokens,output_tokens,arrival_s\n" + "".join(f"10,5,{i / 10}\n" for i in range(1500)))
    proc = run("simulate", "--trace", str(trace), "--trace-arrivals", "--json")
    assert json.loads(proc.stdout)["num_requests"] == 1000
    assert "replays 1,000 consecutive rows of the trace's 1,500" in proc.stderr and "--num-requests 1500" in proc.stderr


def test_hardware_prints_the_specs():
    proc = run("hardware")
    assert proc.returncode == 0, proc.stderr
    h100 = next(line for line in proc.stdout.splitlines() if "h100" in line)
    assert "80" in h100 and "989" in h100 and "3.35" in h100  # memory GB, BF16 TFLOP/s, memory TB/s
    llama = next(line for line in proc.stdout.splitlines() if "llama-3-8b" in line)
    assert "32 / 8" in llama and "8,192" in llama and "128" in llama  # heads / KV heads, context, KV KiB


def test_prefix_caching_is_on_for_a_trace_with_prefix_structure_and_can_be_switched_off():
    base = ("simulate", "--trace", "mooncake-conv", "--trace-arrivals", "--num-requests", "80")
    base += ("--model", "llama-3-8b", "--scheduler", "vllm", "--json")
    runs = {}
    for flag in ((), ("--no-enable-prefix-caching",), ("--enable-prefix-caching",)):
        proc = run(*base, *flag)
        assert proc.returncode == 0, proc.stderr
        runs[flag] = json.loads(proc.stdout)
    default, off, on = runs.values()
    assert default["enable_prefix_caching"] is True and default["prefix_cache_hit_rate"] > 0
    assert default["policy"]["num_prefix_cache_hits"] > 0
    assert off["enable_prefix_caching"] is False and off["prefix_cache_hit_rate"] == 0
    assert on["prefix_cache_hit_rate"] == default["prefix_cache_hit_rate"]
    assert default["classes"]["rt"]["cached_tokens"] == default["cached_tokens"] > 0
    # a trace without prefix structure: off by default
    plain = json.loads(run("simulate", "--trace", "sharegpt", "--rate", "5", "--num-requests", "30", "--json").stdout)
    assert plain["enable_prefix_caching"] is False
    # every bundled policy looks the cache up (one registered without it is refused: test_prefix_cache.py)
    proc = run(*base[:-3], "--scheduler", "srtf", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["prefix_cache_hit_rate"] > 0


def test_a_trace_too_short_for_the_requests_asked_and_an_unwritable_out_are_said_plainly(tmp_path):
    one_row = tmp_path / "one.csv"
    one_row.write_text("prompt,output\n100,20\n")
    proc = run("simulate", "--trace", str(one_row), "--num-requests", "10", "--rate", "5", "--json")
    assert proc.returncode == 0
    assert f"warning: trace {one_row} has 1 row and 10 requests were asked for" in proc.stderr
    proc = run("simulate", "--trace", "sharegpt", "--num-requests", "10", "--rate", "5", "--out", "/proc/sloserve-out")
    assert proc.returncode == 2 and "--out /proc/sloserve-out: cannot write in /proc" in proc.stderr
