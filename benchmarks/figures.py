"""Issue 43's table from one run of the GPU runbook: each benchmark records its figures (``record``) as
JSON lines in the file that SLOSERVE_FIGURES names (``gpu_session.sh`` sets it), and

    python benchmarks/figures.py FIGURES.jsonl [DEVICE]   # DEVICE: the run's GPU, named in the table

prints the table with the issue's goals, the first GPU session's figures (2026-11-26, the issue's "now") and
the last one's (2026-12-04; H200s), which the runbook's ``table``, ``stages`` and ``all`` do last. A figure no
stage measured (a stage cut by its time limit, or one not run) shows as "-". Beside an engine figure, its ceiling on the machine of the run
(``engine_speed.py``'s ``Rates.least_step_s``: the step's kernels one after another at the copy and
matmul rates measured there; then with the step's matmuls at the time they took alone there): a goal
beyond it is out of reach of kernels that run in sequence.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def record(figure: str, value: float, **where: int) -> None:
    """Append ``figure``'s ``value`` (and where it was measured: a batch, a context) to the file
    SLOSERVE_FIGURES names; nothing when it names none."""
    path = os.environ.get("SLOSERVE_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"figure": figure, "value": float(value), **where}) + "\n")


def _values(rows: list[dict], figure: str, **where: int) -> list[float]:
    return [r["value"] for r in rows if r["figure"] == figure and all(r.get(k) == v for k, v in where.items())]


def _span(values: list[float], percent: bool = True) -> str:
    if not values:
        return "-"
    show = (lambda v: f"{v:.1%}") if percent else (lambda v: f"{v:.2f}")
    low, high = min(values), max(values)
    return show(low) if low == high else f"{show(low)}-{show(high)}"


def table(rows: list[dict], device: str = "") -> list[str]:
    """Issue 43's rows: figure, the first and the last GPU sessions' (H200s), the goal, this run's (on ``device``),
    its ceiling on the run's machine, whether it meets the goal (the worst of a span must)."""

    def wide(figure: str) -> list[float]:
        return [r["value"] for r in rows if r["figure"] == figure and 64 <= r["batch"] <= 256]

    def long_prompts(figure: str) -> list[float]:
        return [r["value"] for r in rows if r["figure"] == figure and 4096 <= r["tokens"] <= 8192]

    decode_one, decode_wide = _values(rows, "decode_mbu", batch=1), wide("decode_mbu")
    prefill, long_context = long_prompts("prefill_mfu"), _values(rows, "decode_mbu_long")
    mixed = _values(rows, "mixed_over_roofline")
    mixed_overlapped = _values(rows, "mixed_over_roofline_overlapped")

    def ceiling(values, figure: str, percent: bool = True) -> str:
        """At the machine's rates; then with the step's matmuls timed alone (``_timed_matmuls``)."""
        return f"{_span(values(figure), percent)}; {_span(values(figure + '_timed_matmuls'), percent)}"

    ceilings = {
        "decode_one": ceiling(lambda f: _values(rows, f, batch=1), "decode_mbu_ceiling"),
        "decode_wide": ceiling(wide, "decode_mbu_ceiling"),
        "long_context": ceiling(lambda f: _values(rows, f), "decode_mbu_long_ceiling"),
        "prefill": ceiling(long_prompts, "prefill_mfu_ceiling"),
        "mixed": ceiling(lambda f: _values(rows, f), "mixed_over_roofline_floor", percent=False),
    }
    served = _values(rows, "served_throughput_ratio")
    tpot = _values(rows, "served_tpot_added")
    # (the same on the arrivals the served engine saw, both engines on its clock: serve_overhead.py)
    served_same = _span(_values(rows, "served_throughput_ratio_same_arrivals"), percent=False)
    tpot_same = _span(_values(rows, "served_tpot_added_same_arrivals"))
    sent, received = _values(rows, "sim_error_as_sent"), _values(rows, "sim_error_as_received")
    asynchronous = [f"{r['batch']}: {r['value']:.3f}" for r in rows if r["figure"] == "async_on_off"]
    idle_served, idle_local = _values(rows, "served_device_idle_share"), _values(rows, "in_process_device_idle_share")

    def met(values: list[float], ok) -> str:
        return "-" if not values else ("yes" if all(ok(v) for v in values) else "no")

    lines = [
        f"| figure | 2026-11-26 (H200) | 2026-12-04 (H200) | goal | this run{f' ({device})' if device else ''} | "
        "ceiling here (rates; matmuls timed) | met |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| decode MBU, batch 1 | 47.5% | 66.1% | >= 75% | {_span(decode_one)} | {ceilings['decode_one']} | "
        f"{met(decode_one, lambda v: v >= 0.75)} |",
        f"| decode MBU, batch 64-256 | 55-58% | 67.4-70.5% | >= 80% | {_span(decode_wide)} | {ceilings['decode_wide']} | "
        f"{met(decode_wide, lambda v: v >= 0.80)} |",
        f"| decode, batch 8, 32K-token contexts (of bandwidth) | not measured | 79.3% | >= 70% | {_span(long_context)} | "
        f"{ceilings['long_context']} | {met(long_context, lambda v: v >= 0.70)} |",
        f"| prefill MFU at 4-8K tokens | 51.6-53.0% | 60.3-61.1% | >= 65% | {_span(prefill)} | {ceilings['prefill']} | "
        f"{met(prefill, lambda v: v >= 0.65)} |",
        f"| mixed step / its parts' roofline | not measured | 1.58 | <= 1.25x | {_span(mixed, percent=False)} | "
        f"{ceilings['mixed']} | {met(mixed, lambda v: v <= 1.25)} |",
        f"| the same, the chunk's attention on a second stream beside the decodes' (SLOSERVE_OVERLAP_ATTENTION=1) | - | "
        f"- | <= 1.25x | {_span(mixed_overlapped, percent=False)} | {ceilings['mixed']} | "
        f"{met(mixed_overlapped, lambda v: v <= 1.25)} |",
        f"| served / in-process throughput (offline; on the same arrivals) | 0.889 | 0.89; 0.95 | >= 0.97 | "
        f"{_span(served, percent=False)}; {served_same} | - | {met(served, lambda v: v >= 0.97)} |",
        f"| TPOT added by serving (offline; on the same arrivals) | +14% | +4.7%; +3.1% | <= 3% | {_span(tpot)}; {tpot_same} | - | "
        f"{met(tpot, lambda v: v <= 0.03)} |",
        f"| simulator vs served, mean error (as sent / as received) | 18.2% / - | - | <= 5% | {_span(sent)} / "
        f"{_span(received)} | - | {met(sent + received, lambda v: v <= 0.05)} |",
        f"| async scheduling, on / off tok/s by batch (not in the issue's table) | - | 64: 1.089, 256: 1.065 | > 1 | "
        f"{', '.join(asynchronous) or '-'} | - | - |",
        f"| GPU waiting for the host between steps, served; in-process on the same arrivals (not in the issue's "
        f"table) | - | - | - | {_span(idle_served)}; {_span(idle_local)} | - | - |",
    ]
    return lines


def main() -> None:
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python benchmarks/figures.py FIGURES.jsonl [DEVICE]")
    path, device = Path(sys.argv[1]), sys.argv[2] if len(sys.argv) == 3 else ""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    print(f"\nIssue 43's table ({len(rows)} figures recorded in {path}):")
    print("\n".join(table(rows, device)))


if __name__ == "__main__":
    main()
