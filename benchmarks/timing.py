"""How the GPU benchmarks time a call alone (a kernel, a copy, the matmuls of a step): one helper, so
their figures are taken the same way."""

from __future__ import annotations

import time
from collections.abc import Callable

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
