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
    StreamSpec,
    TraceSource,
    LogNormalSource,
    UniformSource,
    WorkloadSpec,
    list_workloads,
    load_workload_spec,
    parse_workload_spec,
    with_rt_rate,
)
from sloserve.workload.traces import TRACES, TraceData, TraceInfo, load_trace, trace_summary

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
