"""Writing a run's results: summary.json, requests.csv, timeline.csv and plots, all or nothing."""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sloserve.core.request import Request
from sloserve.metrics import plots as plot_module
from sloserve.metrics.summary import request_table
from sloserve.metrics.timeline import Timeline


def _jsonable(value: Any) -> Any:
    """``value`` with NaN / inf floats as None and numpy scalars and arrays as Python values."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    return value


def summary_to_json(summary: dict) -> str:
    """The summary as strict JSON (indent 2); NaN and inf become ``null``."""
    return json.dumps(_jsonable(summary), indent=2, allow_nan=False) + "\n"


def write_columns_csv(path: Path, columns: dict[str, np.ndarray], chunk_rows: int = 8192) -> None:
    """Write equal-length columns as CSV with a header row. NaN is written as an empty field;
    floats use the shortest repr that round-trips.

    NOTE: ``chunk_rows`` rows at a time: a 100k-request run's columns as Python objects all at once
    took ~100 MiB more than the run itself."""
    num_rows = len(next(iter(columns.values()))) if columns else 0
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(list(columns))
        for start in range(0, num_rows, chunk_rows):
            cells: list[list[Any]] = []
            for col in columns.values():
                values = col[start : start + chunk_rows].tolist()
                if col.dtype.kind == "f":
                    values = ["" if v != v else v for v in values]  # NOTE: v != v only for NaN
                cells.append(values)
            writer.writerows(zip(*cells))


# Temporary folders of write_run_outputs: TMP_PREFIX, the writing process's id, "-", a random part.
TMP_PREFIX = ".sloserve-"


def remove_stale_temporaries(folder: Path) -> None:
    """Remove the temporary folders that writers killed mid-write (kill -9) left in ``folder``: those
    whose process is gone. A live writer's folder is kept."""
    for path in folder.glob(f"{TMP_PREFIX}*-*"):
        pid = path.name[len(TMP_PREFIX) :].split("-", 1)[0]
        if not (path.is_dir() and pid.isdigit()):
            continue
        try:
            os.kill(int(pid), 0)  # signal 0: only asks whether the process exists
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:  # alive, another user's
            pass


def write_run_outputs(
    out_dir: Path,
    summary: dict,
    requests: Sequence[Request],
    timeline: Timeline | None,
    *,
    plots: bool = True,
) -> list[Path]:
    """Write ``summary.json``, ``requests.csv``, ``timeline.csv`` and (if ``plots``) the PNG plots
    into ``out_dir``; returns the written paths. Without a ``timeline`` (a load client sees no steps),
    only the requests' files and their latency CDF.

    NOTE: nothing is half-written. Everything goes to a temporary directory next to ``out_dir``
    first and is moved in only when all files were written; on error the temporary directory is
    removed and ``out_dir`` is left as it was. Files of the same names in ``out_dir`` are replaced.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out_dir.parent)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f"{TMP_PREFIX}{os.getpid()}-"))
    try:
        (tmp / "summary.json").write_text(summary_to_json(summary))
        table = request_table(requests)
        write_columns_csv(tmp / "requests.csv", table)
        if timeline is None:
            if plots:
                plot_module.plot_latency_cdf(tmp / "latency_cdf.png", table, title=plot_module.caption(summary))
        else:
            write_columns_csv(tmp / "timeline.csv", timeline.as_dict())
            if plots:
                capacity = summary.get("kv_capacity_tokens")
                plot_module.plot_run(
                    tmp, table, timeline, kv_capacity_tokens=capacity, title=plot_module.caption(summary)
                )
        names = sorted(p.name for p in tmp.iterdir())
        out_dir.mkdir(exist_ok=True)
        for name in names:
            os.replace(tmp / name, out_dir / name)  # same filesystem: each move is atomic
        tmp.rmdir()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [out_dir / name for name in names]
