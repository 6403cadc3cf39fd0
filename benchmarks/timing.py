"""How the GPU benchmarks time a call alone (a kernel, a copy, the matmuls of a step): one helper, so
their figures are taken the same way."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch


def median_s(fn: Callable[[], object], device: torch.device, *, warmup_ms: int = 50, rep_ms: int = 300) -> float:
    """Median seconds of ``fn``: on CUDA, CUDA-event timings through Triton's ``do_bench`` (its runs
    over ``warmup_ms``, then over ``rep_ms``, its L2 cache flushed before each); on the CPU one run,
    a check of the script rather than a figure (Triton's interpreter runs the kernels there)."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") / 1e3
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def graphed_median_s(fns: Sequence[Callable[[], object]], device: torch.device, *, rep_ms: int = 100) -> float:
    """Median seconds of one call of ``fns`` (calls alike but for their data), captured one after another in
    one CUDA graph and replayed: the kernels' time without the host's launches between them, as a captured
    engine step runs them (``median_s`` times a small kernel's launch: tens of microseconds). Each replay
    starts with the L2 cache flushed (``do_bench``); ``fns`` that read data of their own (an engine's layers
    do) keep one call from finding the last one's in the cache. On the CPU, ``median_s`` of the first."""
    if device.type != "cuda":
        return median_s(fns[0], device)
    from sloserve.engine.cuda_graphs import capture_graph

    graph, _ = capture_graph(lambda: [fn() for fn in fns], None, device)
    return median_s(graph.replay, device, warmup_ms=10, rep_ms=rep_ms) / len(fns)


def copy_rate_bytes_s(device: torch.device) -> float:
    """A device-to-device copy's rate, bytes read and written a second: a 2 GiB copy (``median_s``)."""
    src = torch.randn(1 << 30, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    return 2 * (2 << 30) / median_s(lambda: dst.copy_(src), device)
