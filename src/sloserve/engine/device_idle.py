"""The device's waits for the host between steps (issue 43 item 4): how long a GPU sat idle, after a step's
sampling, until the host launched the next step's forward pass, while the engine had requests to run.

With async scheduling the host prepares step t+1 while the device runs step t, so a busy engine's device
should never wait; where the host's work between two steps (scheduling, inputs, publishing, a served
engine's pipe) outlasts the device's step, it does, and the served engine's throughput falls behind the
in-process engine's for it. A profile of the host (py-spy) says where the host is, not whether the device
waited for it; this counts the waits themselves, from CUDA events in the stream: one after each step's
sampling, one before the next step's forward pass. The device reaches the second when it was launched or
when the work queued before it ends, whichever is later, so the time between the two is the device's wait
for that launch (and for the few copies queued before it: a step's inputs, swaps).

NOTE: a wait is counted only between steps of a busy engine: when the engine runs out of requests
(``engine_idle``), the time until the next step's launch is the clients' and not counted. On the CPU the
host is the device: nothing is counted.
"""

from __future__ import annotations

from collections import deque

import torch


class DeviceIdleTime:
    """The seconds a CUDA device waited for the host between a busy engine's steps (``seconds``)."""

    def __init__(self, device: torch.device) -> None:
        self.enabled = device.type == "cuda"
        self._seconds = 0.0
        self._last_end: torch.cuda.Event | None = None  # after the last step's sampling
        # (the end of a step, the next step's forward launch): the waits not yet measured
        self._pending: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()

    def forward_launched(self) -> None:
        """A step's forward pass is about to be launched (its inputs are built)."""
        if not self.enabled:
            return
        self._measure_passed()  # (so that at most a few steps' events are kept)
        launched = _recorded()
        if self._last_end is not None:
            self._pending.append((self._last_end, launched))

    def step_ended(self) -> torch.cuda.Event | None:
        """A step's sampling has been launched: the next step's wait starts where the device ends it. Returns
        the (timing) event recorded there, on CUDA; the executor's step log times the step up to it too."""
        if self.enabled:
            self._last_end = _recorded()
        return self._last_end

    def engine_idle(self) -> None:
        """The engine has no request left to run: the device's wait until the next step is not the host's."""
        self._last_end = None

    @property
    def seconds(self) -> float:
        """The waits so far: those the device has passed (a step or two behind the host)."""
        self._measure_passed()
        return self._seconds

    def _measure_passed(self) -> None:
        while self._pending and self._pending[0][1].query():
            end, launched = self._pending.popleft()
            self._seconds += end.elapsed_time(launched) / 1e3


def _recorded() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
