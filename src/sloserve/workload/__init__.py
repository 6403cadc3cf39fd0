"""Workloads: bundled request traces, arrival processes, YAML workload specs and request lists.

Typical use::

    from sloserve.workload import load_workload_spec, build_workload
    wl = build_workload(load_workload_spec("sharegpt-poisson"), seed=0, context_len=4096)
"""

from sloserve.workload.arrivals import gamma, jitter, offline, poisson, trace_replay
from sloserve.workload.build import (
    Workload,
    build_workload,
    synthetic_workload,
    workload_from_trace,
)
from sloserve.workload.spec import (
    ArrivalSpec,
    FixedSource,
    LogNormalSource,
    StreamSpec,
    TraceSource,
    UniformSource,
    WorkloadSpec,
    list_workloads,
    with_rt_rate,
)
from sloserve.workload.traces import TRACES, TraceData, TraceInfo, load_trace, trace_summary


def __getattr__(name: str):
    """``load_workload_spec`` and ``parse_workload_spec``, imported when first asked for: they load
    pydantic, which a run from a trace does not need."""
    if name in ("load_workload_spec", "parse_workload_spec"):
        from sloserve.workload import spec_yaml

        return getattr(spec_yaml, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "TRACES",
    "ArrivalSpec",
    "FixedSource",
    "StreamSpec",
    "TraceData",
    "TraceInfo",
    "TraceSource",
    "LogNormalSource",
    "UniformSource",
    "Workload",
    "WorkloadSpec",
    "build_workload",
    "gamma",
    "jitter",
    "list_workloads",
    "load_trace",
    "load_workload_spec",
    "offline",
    "parse_workload_spec",
    "poisson",
    "synthetic_workload",
    "trace_replay",
    "trace_summary",
    "with_rt_rate",
    "workload_from_trace",
]
