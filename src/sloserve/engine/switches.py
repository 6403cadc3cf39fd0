"""Switches for the engine's features that were written without a GPU (issue 43): each is off until a
GPU session has checked and timed it (``benchmarks/gpu_session.sh`` turns them on). One environment
variable each, read when the part that uses it is built: SLOSERVE_DENSE_PREFILL (TritonAttention),
SLOSERVE_PIECEWISE_GRAPHS and SLOSERVE_COMPILE_PIECES (``piecewise_graphs_for``), SLOSERVE_OVERLAP_PUBLISH
(``EngineCore``), SLOSERVE_ASYNC_SCHEDULING (``LLMEngine``)."""

from __future__ import annotations

import os

from sloserve.core.errors import ConfigError


def switch(name: str) -> bool:
    """Whether the environment variable ``name`` turns its feature on: "1" on, "0" or unset off; any
    other value is a ConfigError naming the variable and the value."""
    value = os.environ.get(name, "0")
    if value not in ("0", "1"):
        raise ConfigError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"
