"""The discrete-event simulator: replicas (the step loop of ``sloserve.replica``), a router and the
cost-model executor."""

from sloserve.cost.base import batch_shape
from sloserve.replica import Replica, SimulationStuckError
from sloserve.router import ROUTERS
from sloserve.sim.executor import SimExecutor
from sloserve.sim.simulator import SimResult, simulate
from sloserve.sim.stretch import StretchPlanner

__all__ = [
    "ROUTERS",
    "Replica",
    "SimExecutor",
    "SimResult",
    "SimulationStuckError",
    "StretchPlanner",
    "batch_shape",
    "simulate",
]
