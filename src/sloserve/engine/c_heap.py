"""The C heap of an engine on the CPU: a step's large tensors take the memory the step before freed, instead of
pages the kernel maps, faults in and zeroes again each step (issue 43 item 1: the host's work).

PyTorch's CPU allocator takes every tensor from the C library's ``malloc``. glibc serves a block of more than
M_MMAP_THRESHOLD bytes (128 KiB at the start) from pages it maps for that block alone and unmaps when it is freed,
and gives the heap's free top back to the kernel once it passes M_TRIM_THRESHOLD. It raises both as it sees large
blocks freed (to the size freed, and twice that), but a step's mix of sizes (a decode batch's gathered keys and
values, their scores and outputs: megabytes each, made and freed in every layer) brings blocks back above them: each
such block's pages are faulted in and zeroed again, at every layer of every step. ``keep_freed_memory`` fixes both
at the largest M_MMAP_THRESHOLD glibc takes and twice that, as glibc's own rule would: blocks up to 32 MiB come from
the heap and go back to it (``benchmarks/RESULTS.md``, 2026-12-05: the CPU engine's decode steps past 40K context
tokens, whose time jumped 2-3x where the linear cost model fitted to them saw nothing). vLLM's CPU backend
recommends preloading TCMalloc for the same reason.

``load_model`` calls it for a model on the CPU unless ``SLOSERVE_KEEP_FREED_MEMORY=0``, or the process's own
settings say otherwise (glibc's MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_, or GLIBC_TUNABLES naming either).
NOTE: the process keeps up to TRIM_THRESHOLD_BYTES of freed heap at its top (and whatever frees below it) rather
than give it back: a serving process's memory stays at its busiest step's.
"""

from __future__ import annotations

import ctypes
import os

# glibc's largest M_MMAP_THRESHOLD on a 64-bit machine (HEAP_MAX_SIZE / 2): larger blocks are mapped as before
MMAP_THRESHOLD_BYTES = 32 << 20
# Twice the mapping threshold, as glibc sets it itself when it raises that threshold
TRIM_THRESHOLD_BYTES = 2 * MMAP_THRESHOLD_BYTES
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (<malloc.h>)
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_memory() -> bool:
    """Fix glibc's thresholds for this whole process (see the module's docstring); calling again changes nothing.
    True where they are set now, False where the C library is not glibc or the process's environment sets them."""
    if not _is_glibc():
        return False
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if (
        any(name in os.environ for name in _USER_SETTINGS)
        or "mmap_threshold" in tunables
        or "trim_threshold" in tunables
    ):
        return False
    libc = ctypes.CDLL(None)
    # NOTE: the mapping threshold first: setting either turns off glibc's raising of both
    return bool(
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )


def _is_glibc() -> bool:
    """Whether this process runs on glibc (elsewhere, macOS or musl, the name is unknown or unset)."""
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (ValueError, OSError):  # (the name unknown here, or not set)
        return False
