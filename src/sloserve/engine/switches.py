"""Switches for the engine's features written without a GPU (issue 43), one environment variable each,
read when the part that uses it is built. Off until a GPU session has checked and timed it
(``benchmarks/gpu_session.sh`` turns it on): SLOSERVE_COMPILE_PIECES (``piecewise_graphs_for``) and
SLOSERVE_OVERLAP_ATTENTION (TritonAttention: a mixed step's prefill attention on a second stream) and
SLOSERVE_COMBINE_SPLITS_IN_KERNEL (TritonAttention: split decodes merged by the decode kernel). On since
one did, unless set to 0: SLOSERVE_ASYNC_SCHEDULING (``LLMEngine``, on CUDA) and SLOSERVE_FUSED_KERNELS
(``load_model``) since 2026-11-29; SLOSERVE_DENSE_PREFILL (TritonAttention), SLOSERVE_PIECEWISE_GRAPHS
(``piecewise_graphs_for``, with CUDA graphs), SLOSERVE_OVERLAP_PUBLISH (``EngineCore``, on CUDA) and
SLOSERVE_FUSED_MOE (``load_model``: ``fused_moe``, on CUDA) since 2026-12-04 (H200s; benchmarks/RESULTS.md). Flash decoding's SLOSERVE_DECODE_SPLITS, a count or "auto" (the
default), and the SDPA backend a dense prefill asks for first, SLOSERVE_DENSE_PREFILL_SDPA, are read in
``triton_attention``."""

from __future__ import annotations

import os

from sloserve.core.errors import ConfigError


def switch(name: str, default: bool = False) -> bool:
    """Whether the environment variable ``name`` turns its feature on: "1" on, "0" off, unset ``default``;
    any other value is a ConfigError naming the variable and the value."""
    value = os.environ.get(name, "1" if default else "0")
    if value not in ("0", "1"):
        raise ConfigError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"
