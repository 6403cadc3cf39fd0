"""``sloserve plan`` (capacity planning) and the parallel executor of ``sweep``: real CLI runs, real
simulations, a real local Ray instance."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

from sloserve.core.errors import ConfigError

SLOSERVE = [sys.executable, "-m", "sloserve.cli"]
# A search small enough for CI: 2 GPUs x 2 TP degrees x 2 layouts x 2 schedulers.
SMALL = ("--trace", "sharegpt", "--qps", "12", "--slo-ttft", "1", "--slo-tpot", "0.1", "--model", "llama-2-7b",
         "--gpus", "a100,h100", "--tp", "1,2", "--schedulers", "vllm,sarathi", "--layouts", "colocated,1:1",
         "--max-gpus", "4", "--num-requests", "200")  # fmt: skip


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*SLOSERVE, *args], capture_output=True, text=True, timeout=600)


def _plan(out, *args: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    proc = _cli("plan", *args, "--out", str(out))
    path = out / "plan.json"
    return proc, json.loads(path.read_text()) if path.exists() else None


@pytest.mark.ray
def test_plan_on_ray_equals_serial_and_its_answer_meets_the_slo_alone(tmp_path):
    pytest.importorskip("ray")
    serial, a = _plan(tmp_path / "serial", *SMALL, "--workers", "1")
    parallel, b = _plan(tmp_path / "ray", *SMALL, "--workers", "2")
    assert serial.returncode == 0, serial.stderr
    assert parallel.returncode == 0, parallel.stderr
    assert (a["search"]["workers"], b["search"]["workers"]) == (1, 2)
    assert a["search"]["runs"] == b["search"]["runs"]
    a.pop("search"), b.pop("search")
    assert a == b  # every probe, every decision, the same answer

    answer = a["answer"]
    assert answer["status"] == "verified" and answer["units"] >= 1
    assert "answer:" in serial.stdout and answer["label"] in serial.stdout
    # The cheapest: no other verified deployment costs less, and a unit fewer missed the target.
    for c in a["candidates"]:
        if c["status"] == "verified":
            assert c["cost_per_hour"] >= answer["cost_per_hour"]
        if c["status"] == "pruned":  # could not cost less than the answer, even by its own estimate
            assert c["estimated_units"][0] * c["unit_price_per_hour"] >= answer["cost_per_hour"] * (1 - 1e-9)
    assert answer["units"] == 1 or any(x["units"] == answer["units"] - 1 and not x["met"] for x in answer["checks"])

    # Re-simulated alone, from the command the plan gives: it meets the SLO at the load.
    command = shlex.split(answer["simulate_command"])
    assert command[:2] == ["sloserve", "simulate"]
    proc = _cli(*command[1:], "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["num_requests"] == 200 * answer["units"]
    assert summary["slo_attainment"] >= 0.9
    assert summary["slo_attainment"] == pytest.approx(answer["verified"]["attainment"])
    for name in ("goodput_per_gpu.png", "cost_vs_goodput.png", "attainment_vs_rate.png"):
        assert (tmp_path / "serial" / name).stat().st_size > 10_000

    # deploy.yaml: the answer as `sloserve serve --config` reads it
    from sloserve.plan.deploy import load_deployment

    deployment = load_deployment(tmp_path / "serial" / "deploy.yaml")
    assert (deployment.gpu, deployment.tensor_parallel, deployment.scheduler) == (
        answer["gpu"],
        answer["tensor_parallel"],
        answer["scheduler"],
    )
    assert deployment.scheduler_options == answer["options"]
    if answer["layout"] == "colocated":
        assert (deployment.replicas, deployment.disaggregate) == (answer["units"], None)
    assert (deployment.slo.ttft_s, deployment.slo.tpot_s) == (1.0, 0.1)
    assert "sloserve serve --config" in (tmp_path / "serial" / "deploy.yaml").read_text()
    assert deployment.router == "round-robin"  # plan's --router default, as simulated


def test_plan_picks_disaggregation_when_only_it_meets_the_slo(tmp_path):
    """Long arXiv prompts stall colocated decodes past a 30 ms TPOT; one prefill and one decode replica
    keep decodes apart and meet it (colocated at the same 2 GPUs: about 93% < 97%)."""
    proc, doc = _plan(
        tmp_path,
        "--trace",
        "arxiv",
        "--qps",
        "3",
        "--slo-ttft",
        "2",
        "--slo-tpot",
        "0.03",
        "--attainment",
        "0.97",
        "--gpus",
        "a100",
        "--tp",
        "1",
        "--max-gpus",
        "2",
        "--schedulers",
        "vllm",
        "--layouts",
        "colocated,1:1",
        "--num-requests",
        "300",
        "--workers",
        "1",
    )
    assert proc.returncode == 0, proc.stderr
    assert doc["answer"]["layout"] == "1P:1D"
    colocated = next(c for c in doc["candidates"] if c["layout"] == "colocated")
    assert colocated["status"] in ("infeasible", "unverifiable")
    assert all(p["attainment"] < 0.97 for p in colocated["probes"] if p["rate"] >= 1.5)


def test_an_impossible_slo_is_reported_with_the_best_reached(tmp_path):
    proc, doc = _plan(
        tmp_path,
        "--trace",
        "sharegpt",
        "--qps",
        "3",
        "--slo-ttft",
        "0.001",
        "--gpus",
        "a100",
        "--tp",
        "1",
        "--max-gpus",
        "2",
        "--schedulers",
        "vllm",
        "--layouts",
        "colocated",
        "--num-requests",
        "100",
        "--workers",
        "1",
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("error: no configuration reaches 90% attainment") and "the best reached" in error
    assert doc["answer"] is None and doc["message"] == error.removeprefix("error: ")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--ray-address", "127.0.0.1:1"), "--ray-address 127.0.0.1:1: cannot connect"),
        (("--gpus", "b300"), "unknown gpu 'b300'"),
        (("--model", "gpt-5"), "unknown model 'gpt-5'"),
        (("--gpus", "a30", "--workers", "1"), "no price for GPU a30: give it with --prices a30="),
        (("--prices", "h100=free"), "--prices expects GPU=USD_PER_HOUR"),
        (("--prices", "h100=2,h100-sxm=3"), "--prices names h100 twice"),
        (("--layouts", "1-1"), "--layouts expects colocated and/or P:D pairs"),
        (("--set-grid", "block_size"), "--set-grid expects KEY=V1,V2"),
        (("--set-grid", "vllm.no_such_option=1,2"), "no_such_option"),
        (("--qps", "0"), "--qps must be a finite number > 0 (requests/s), got 0.0"),
        (("--qps", "inf"), "--qps must be a finite number > 0 (requests/s), got inf"),
        (("--tp", "0"), "--tp expects integers >= 1, got '0'"),
        (("--attainment", "1.5"), "--attainment must be in (0, 1]"),
        # each worker a process of its own: a typo's thousand once started one per run, for want of memory
        (("--workers", str(10**5)), f"--workers 100000: this machine has {os.cpu_count()} cores"),
        (
            ("--model", "llama-3-70b", "--gpus", "a100", "--tp", "1"),
            "no configuration to search (1 left out): "
            "a100-80gb tp1: model llama-3-70b (141 GB of weights) does not fit",
        ),
    ],
)
def test_bad_plan_input_is_one_line_and_exit_2(tmp_path, args, message):
    from click.testing import CliRunner

    from sloserve.cli import main

    base = {"--trace": "sharegpt", "--qps": "3", "--slo-ttft": "1"}
    given = dict(zip(args[::2], args[1::2], strict=True))
    flags = [x for k, v in {**base, **given}.items() for x in (k, v)]
    result = CliRunner().invoke(main, ["plan", *flags, "--out", str(tmp_path / "p")])  # in process: 13 cases
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output


def test_a_schedulers_own_grid_wins_over_one_for_every_scheduler_in_either_order():
    from sloserve.cli.plan import _parse_set_grid

    for pairs in (("vllm.block_size=8", "block_size=16,32"), ("block_size=16,32", "vllm.block_size=8")):
        grid = _parse_set_grid(pairs, ["vllm", "sarathi"])
        assert grid == {"vllm": {"block_size": ["8"]}, "sarathi": {"block_size": ["16", "32"]}}
    with pytest.raises(ConfigError, match="--set-grid block_size is given twice"):
        _parse_set_grid(("block_size=8", "block_size=16"), ["vllm"])


def test_a_plan_without_an_slo_is_refused_and_a_request_logs_slos_are_one(tmp_path):
    proc = _cli("plan", "--trace", "sharegpt", "--qps", "3", "--out", str(tmp_path / "p"))
    assert proc.returncode == 2 and "plan needs an SLO" in proc.stderr
    log = tmp_path / "requests.jsonl"  # what serve --request-log writes: each request's SLO (or none)
    log.write_text("".join(json.dumps({"arrival_s": i / 4, "prompt_tokens": 100 + i, "output_tokens": 50,
                                       "slo_ttft_s": 0.5 if i % 2 else None, "slo_tpot_s": None}) + "\n"
                           for i in range(100)))  # fmt: skip
    # (--workers 1: no local Ray, which a test outside the ray group must not start: tests/conftest.py)
    proc = _cli("plan", "--trace", str(log), "--qps", "3", "--gpus", "a100", "--tp", "1", "--schedulers", "vllm",
                "--num-requests", "100", "--workers", "1", "--out", str(tmp_path / "p"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    answer = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert answer["answer"]["verified"]["met"] and answer["answer"]["verified"]["attainment"] >= 0.9


def _deterministic(value):
    """A summary without what depends on wall time (simulator speed, scheduling time)."""
    if isinstance(value, dict):
        return {k: _deterministic(v) for k, v in value.items() if "wall" not in k and not k.startswith("sched_time")}
    if isinstance(value, list):
        return [_deterministic(v) for v in value]
    return value


@pytest.mark.ray
def test_sweep_on_ray_equals_serial(tmp_path):
    pytest.importorskip("ray")
    args = ("sweep", "--trace", "sharegpt", "--rates", "4,8", "--schedulers", "vllm,sarathi", "--num-requests", "100")
    serial = _cli(*args, "--out", str(tmp_path / "serial"))
    parallel = _cli(*args, "--workers", "2", "--out", str(tmp_path / "ray"))
    assert serial.returncode == 0, serial.stderr
    assert parallel.returncode == 0, parallel.stderr
    a = json.loads((tmp_path / "serial" / "sweep.json").read_text())
    b = json.loads((tmp_path / "ray" / "sweep.json").read_text())
    assert [r["rate"] for r in a["vllm"]] == [4.0, 8.0]
    assert _deterministic(a) == _deterministic(b)


@pytest.mark.ray
def test_plan_on_a_ray_cluster_started_by_ray_start(tmp_path):
    """--ray-address joins a real cluster (`ray start --head` with token authentication, the token
    made before the cluster starts as Ray asks of `ray start`) and returns the plan a local search
    returns."""
    pytest.importorskip("ray")
    import os
    import re
    import secrets

    token = secrets.token_hex(32)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    ray = [sys.executable, "-m", "ray.scripts.scripts"]
    started = subprocess.run(
        [
            *ray,
            "start",
            "--head",
            "--port",
            "0",
            "--num-cpus",
            "2",
            "--include-dashboard=false",
            "--disable-usage-stats",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    try:
        assert started.returncode == 0, started.stderr
        address = re.search(r"ray start --address='([^']+)'", started.stdout + started.stderr).group(1)
        args = ("plan", *SMALL[:-2], "--num-requests", "100", "--out")
        joined = subprocess.run(
            [*SLOSERVE, *args, str(tmp_path / "cluster"), "--ray-address", address],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        assert joined.returncode == 0, joined.stderr
    finally:
        subprocess.run([*ray, "stop", "--force"], capture_output=True, env=env, timeout=120)
    local = _cli(*args, str(tmp_path / "local"), "--workers", "1")
    assert local.returncode == 0, local.stderr
    a = json.loads((tmp_path / "cluster" / "plan.json").read_text())
    b = json.loads((tmp_path / "local" / "plan.json").read_text())
    assert a.pop("search")["workers"] == 2
    b.pop("search")
    assert a == b and a["answer"] is not None
