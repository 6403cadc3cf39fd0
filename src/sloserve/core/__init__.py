"""Shared types: requests, scheduler outputs, step results, errors."""

from sloserve.core.errors import ConfigError, SloserveError, UnknownNameError
from sloserve.core.outputs import (
    BlockCopy,
    Preemption,
    PreemptionMode,
    ScheduledChunk,
    SchedulerOutput,
    StepResult,
)
from sloserve.core.request import SLO, Request, RequestClass, RequestStatus

__all__ = [
    "SLO",
    "BlockCopy",
    "ConfigError",
    "Preemption",
    "PreemptionMode",
    "Request",
    "RequestClass",
    "RequestStatus",
    "ScheduledChunk",
    "SchedulerOutput",
    "SloserveError",
    "StepResult",
    "UnknownNameError",
]
