"""Scheduling policies behind one ``Scheduler`` contract and a registry."""

from sloserve.sched import presets  # noqa: F401  (registers the bundled schedulers)
from sloserve.sched.base import Scheduler
from sloserve.sched.cohort import CohortScheduler
from sloserve.sched.decode_cohort import DecodeCohort
from sloserve.sched.registry import (
    SCHEDULERS,
    SchedulerSpec,
    build_config,
    make_scheduler,
    parse_set_options,
    register,
    scheduler_names,
    supports_disaggregation,
    supports_prefix_caching,
)
from sloserve.sched.unified import UnifiedConfig, UnifiedScheduler

__all__ = [
    "SCHEDULERS",
    "CohortScheduler",
    "DecodeCohort",
    "Scheduler",
    "SchedulerSpec",
    "UnifiedConfig",
    "UnifiedScheduler",
    "build_config",
    "make_scheduler",
    "parse_set_options",
    "register",
    "scheduler_names",
    "supports_disaggregation",
    "supports_prefix_caching",
]
