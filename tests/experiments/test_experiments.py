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
