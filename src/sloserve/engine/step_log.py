"""The served engine's steps, one CSV row each (``sloserve serve --step-log``): where a served step's time goes
(issue 43 item 4), beside what the same batch costs in-process.

A row is a profile CSV's (``cost.fit.PROFILE_HEADER``: the step's shape as the cost model sees it and
``time_s``, the executor's measured time, as ``sloserve run --out`` writes in ``steps.csv``, so ``sloserve
fit-cost`` reads the file too), then the engine loop's parts around it:

    start_s        the step's start on the engine's clock (the request log's clock)
    engine_step_s  ``LLMEngine.step``: scheduling, the executor's step, the update after it
    publish_s      the step's tokens sent to the server after it (on a GPU that publishes during the next
                   forward pass, what is left of that: ``EngineCore.flush``)
    between_s      from the step before's end (or the end of an idle wait) to this step: the loop's polling
                   and the commands it applied

On the CPU ``time_s`` is part of ``engine_step_s``. On a GPU a step launched early (async scheduling) has its
device time as ``time_s`` and comes back with the next step's tokens: its row is written then.
"""

from __future__ import annotations

import collections
import csv
from pathlib import Path

from sloserve.core.errors import ConfigError
from sloserve.cost.fit import PROFILE_HEADER, profile_row

LOOP_COLUMNS = ("start_s", "engine_step_s", "publish_s", "between_s")
STEP_LOG_HEADER = (*PROFILE_HEADER, *LOOP_COLUMNS)


def check_step_log_path(path: str | Path) -> None:
    """Create (or empty) ``path`` as ``StepLog`` will: a ConfigError naming it where it cannot be written."""
    try:
        Path(path).open("w").close()
    except OSError as e:
        raise ConfigError(f"--step-log {path}: cannot open for writing ({e.strerror})") from None


class StepLog:
    """Rows of the executor's steps (its ``step_log``, turned on here) with the loop's parts of each
    (``record``), written to ``path`` afresh."""

    def __init__(self, path: str | Path, executor) -> None:
        self.executor = executor
        executor.step_log = []
        self._file = Path(path).open("w", newline="")  # noqa: SIM115 - open for the engine's life
        self._writer = csv.writer(self._file)
        self._writer.writerow(STEP_LOG_HEADER)
        self._loop_parts: collections.deque[tuple[float, ...]] = collections.deque()  # the entries' not yet written
        self._num_entries = 0  # the executor's entries the parts above are for

    def record(self, start_s: float, engine_step_s: float, publish_s: float, between_s: float) -> None:
        """After a loop's step: its parts, if it ran a step (an engine step may schedule nothing), and the
        rows of the steps whose times are final."""
        if len(self.executor.step_log) > self._num_entries:
            self._loop_parts.append((start_s, engine_step_s, publish_s, between_s))
        self._write()

    def flush(self) -> None:
        """Write every final row and hand them to the file (an idle engine's: a reader finds its last steps)."""
        self._write()
        self._file.flush()

    def close(self) -> None:
        self.flush()
        self._file.close()

    def _write(self) -> None:
        for shape, time_s in self.executor.take_step_log():
            parts = self._loop_parts.popleft()
            self._writer.writerow([*profile_row(shape, time_s), *(repr(part) for part in parts)])
        self._num_entries = len(self.executor.step_log)
