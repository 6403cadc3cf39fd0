"""The papers' experiments as commands (the quick grids; the full ones are run by hand)."""

from __future__ import annotations

import csv
import subprocess
import sys


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sloserve.cli", *args], capture_output=True, text=True, timeout=300)


def test_infermax_fig4_quick_reproduces_low_contention(tmp_path):
    proc = run("experiment", "infermax-fig4", "--quick", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "no evictions at B=32 -> ours: none" in proc.stdout
    assert "ours: vLLM lowest (or tied) in 8/8 cells" in proc.stdout
    with open(tmp_path / "infermax_B32.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 * 2 * 6 and {r["scheduler"] for r in rows} >= {"vllm", "sarathi_nohy"}
    assert (tmp_path / "infermax_B32.png").stat().st_size > 0


def test_experiment_list_and_unknown_name():
    listed = run("experiment", "list")
    assert listed.returncode == 0 and "infermax-fig15" in listed.stdout
    for line in listed.stdout.splitlines():  # every experiment says what it is, in full
        name, _, description = line.partition(": ")
        assert description.rstrip().endswith(".") and len(description) > 20, line
    bad = run("experiment", "nope")
    assert (
        bad.returncode == 2
        and "unknown experiment 'nope'; valid: bros-fig10, bros-fig12, bros-fig13, bros-fig14, bros-token-groups, econoserve-fig13, econoserve-fig15, econoserve-fig9, infermax-fig10"
        in bad.stderr
    )


def test_econoserve_ablation_runs_every_variant_on_a_table2_workload(tmp_path):
    proc = run("experiment", "econoserve-fig13", "--quick", "--trace", "alpaca-like", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    with open(tmp_path / "econoserve_fig13_alpaca-like.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["scheduler"] for r in rows] == [
        "econoserve-d",
        "econoserve-sd",
        "econoserve-sdo",
        "econoserve",
        "econoserve-oracle",
    ]
    assert all(0 <= float(r["ssr"]) <= 1 and float(r["jct_s"]) > 0 for r in rows)
    assert "higher JCT than EconoServe" in proc.stdout
    bad = run("experiment", "econoserve-fig13", "--trace", "nope")
    assert bad.returncode == 2 and "unknown trace 'nope'; valid: alpaca-like, arxiv" in bad.stderr


def test_simulate_and_the_bros_experiments_charge_the_same_copies():
    """One physics: BROS (bidirectional blocks, swap-out dropping) in a squeezed KV cache, run as
    `sloserve simulate` runs it (runs.run_simulation) and as its experiments do (their setting and
    factory): the same steps and the same host-link bytes, which the summary reports. A policy that
    copies KV cannot be built without the model's KV bytes per token (its copies would be free)."""
    import pytest

    from sloserve.core.errors import ConfigError
    from sloserve.core.request import RequestClass
    from sloserve.experiments.bros import _setting
    from sloserve.runs import SimOptions, fresh_workload, run_simulation, setup_from_options
    from sloserve.sched import make_scheduler
    from sloserve.sim import simulate
    from sloserve.workload import workload_from_trace

    model, cost, _ = _setting("opt-13b")
    capacity = 1200
    workload = workload_from_trace("sharegpt", num_requests=30, seed=0, context_len=1024, rate=6.0)
    for r in workload.requests[1::2]:
        r.request_class = RequestClass.BE
    built = []

    def experiment_factory():
        built.append(
            make_scheduler(
                "bros",
                kv_capacity_tokens=capacity,
                max_model_len=model.max_context_len,
                kv_bytes_per_token=model.kv_bytes_per_token,
                cost_model=cost,
            )
        )
        return built[-1]

    requests, chains = fresh_workload(workload)
    result = simulate(requests, experiment_factory, cost, chains=chains)
    setup = setup_from_options(SimOptions(model="opt-13b", gpu="a100-40gb", num_gpus=2, kv_capacity_tokens=capacity))
    summary = run_simulation(setup, "bros", {}, workload)
    copied = sum(s.kv.swapped_bytes for s in built)
    assert copied == sum(s.kv.checkpointed_bytes + s.kv.restored_bytes for s in built) > 0
    assert summary["swapped_bytes"] == copied and summary["num_steps"] == len(result.timeline)
    with pytest.raises(ConfigError, match="kv_manager bidirectional copies KV between GPU and CPU memory"):
        make_scheduler("bros", kv_capacity_tokens=capacity, max_model_len=2048, cost_model=cost)
