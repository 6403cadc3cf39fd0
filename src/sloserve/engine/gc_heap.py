"""The garbage collector of a serving process (the engine core's, the server's, ``sloserve run``'s): the heap it
starts with frozen, and its full collections timed (issue 43 item 4: the served path's pauses).

Python's cyclic collector scans, in a full (oldest-generation) collection, every object it tracks. A serving
process starts with a few hundred thousand of them (torch's, FastAPI's and pydantic's modules, the model's),
which stay alive to its end; each full collection scans them again while the process stands still: the engine
core launches nothing, the server admits and streams nothing. vLLM freezes them once started (``gc.freeze``:
moved to a permanent generation the collector skips), in its engine core and its API server; so does sloserve
(``frozen_heap``): while the engine core's process serves (``EngineCore.run``), while ``sloserve serve`` serves
and while ``sloserve run`` runs; ``SLOSERVE_FREEZE_GC=0`` turns it off (``freeze_switch``). The collections of
younger generations scan only what was made since, and are not changed.

``FullCollections`` counts and times a process's full collections; the server exports its own and each
engine's (``sloserve_gc_full_collections_total{process}``, ``sloserve_gc_full_collection_seconds_total``), and
``benchmarks/gc_pauses.py`` compares them with the heap frozen and not (``SLOSERVE_FREEZE_GC=0``).

NOTE: a frozen object is never collected while frozen, even once it is garbage in a cycle: ``frozen_heap``
freezes what is alive where a process starts serving (what lives as long as the serving: the app, the engine),
and unfreezes at its end, so that a process that serves again (tests run servers in theirs) frees what the
last one left.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator

from sloserve.engine.switches import switch

# The generation a full collection collects (gc.callbacks' "generation"; 2 in CPython 3.11-3.13)
OLDEST_GENERATION = len(gc.get_threshold()) - 1


def freeze_switch() -> bool:
    """Whether serving processes freeze their heap: SLOSERVE_FREEZE_GC, on unless "0" (read where a process
    starts, so that a bad value stops it with the variable's name before it serves)."""
    return switch("SLOSERVE_FREEZE_GC", default=True)


@contextlib.contextmanager
def frozen_heap(enabled: bool = True) -> Iterator[None]:
    """What is alive now frozen out of the collector's scans until the block ends (where ``enabled``): a
    collection first, so that no garbage is frozen. NOTE: not nested: the inner block's end thaws all."""
    if not enabled:
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class FullCollections:
    """This process's full garbage collections from now on (until ``close``): how many, and their seconds in all.

    NOTE: the collector calls back from whatever thread allocates, possibly inside a lock that thread holds
    (a Prometheus metric's): the callback only adds to two numbers, which the usual path reads (a step's
    stats, the metrics' exposition)."""

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self._started_at: float | None = None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if info["generation"] != OLDEST_GENERATION:
            return
        if phase == "start":
            self._started_at = time.perf_counter()
        elif self._started_at is not None:
            self.seconds += time.perf_counter() - self._started_at
            self.count += 1
            self._started_at = None

    def close(self) -> None:
        with contextlib.suppress(ValueError):  # (closed twice)
            gc.callbacks.remove(self._callback)
