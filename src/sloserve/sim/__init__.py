"""The discrete-event simulator: replicas, a router and the cost-model executor."""

from sloserve.sim.executor import SimExecutor, batch_shape
from sloserve.sim.simulator import ROUTERS, Replica, SimResult, SimulationStuckError, simulate

__all__ = ["ROUTERS", "Replica", "SimExecutor", "SimResult", "SimulationStuckError", "batch_shape", "simulate"]
