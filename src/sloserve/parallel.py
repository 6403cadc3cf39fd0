"""Independent simulations run one by one in this process or as Ray tasks, with the same results.

``sloserve plan``, ``sweep`` and ``experiment`` hand their runs to an executor as a function and a list
of argument tuples. Every run is deterministic (its workload is rebuilt from the same options and
seed), so the answer does not depend on where or in which order the runs went. Ray is an optional
extra (``pip install 'sloserve[ray]'``): ``ray.init()`` starts a local instance on this machine's
cores, or ``address`` joins a cluster (whose nodes must have the same sloserve installed).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from sloserve.core.errors import ConfigError, SloserveError

OnDone = Callable[[int], None]  # called with the number of runs finished so far


class Executor(Protocol):
    """Runs ``fn(*args)`` for every tuple of ``calls``; the results in the order of ``calls``."""

    workers: int

    def map(self, fn: Callable[..., Any], calls: Sequence[tuple], on_done: OnDone | None = None) -> list: ...

    def close(self) -> None: ...


class SerialExecutor:
    """Every run in this process, one after the other."""

    workers = 1

    def map(self, fn: Callable[..., Any], calls: Sequence[tuple], on_done: OnDone | None = None) -> list:
        results = []
        for args in calls:
            results.append(fn(*args))
            if on_done is not None:
                on_done(len(results))
        return results

    def close(self) -> None:
        pass


SERIAL = SerialExecutor()


def _call(fn: Callable[..., Any], args: tuple) -> Any:
    """The body of every Ray task (``fn`` travels by reference: a module-level function)."""
    return fn(*args)


class RayExecutor:
    """One Ray task (one CPU) per run, on a local Ray instance of ``workers`` CPUs or on the cluster at
    ``address``. A task's ``SloserveError`` is raised again here as itself (one clear line, not a
    remote traceback)."""

    def __init__(self, workers: int | None = None, address: str | None = None) -> None:
        try:
            import ray
        except ImportError:
            raise ConfigError("parallel runs need Ray: pip install 'sloserve[ray]' (or give --workers 1)") from None
        if address and workers is not None:
            raise ConfigError("--workers sets the CPUs of a local Ray; a cluster (--ray-address) uses all of its own")
        if address:
            _check_reachable(address)
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage reports from a planning run
        kwargs: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.ERROR, "log_to_driver": False}
        if address:
            kwargs["address"] = address
        else:  # NOTE: "local" starts a new instance even where `ray start` left one (ray.init() would join it)
            kwargs.update(address="local", num_cpus=workers or os.cpu_count() or 1)
        try:
            ray.init(**kwargs)
        except Exception as err:  # noqa: BLE001 - Ray raises several kinds; each means "could not start"
            if not address:
                raise ConfigError(f"could not start a local Ray instance: {err}") from None
            hint = (
                ""
                if os.environ.get("RAY_AUTH_MODE")
                else (
                    " (a cluster with token authentication needs RAY_AUTH_MODE=token and its token: docs/planning.md)"
                )
            )
            raise ConfigError(f"could not join the Ray cluster at {address}: {err}{hint}") from None
        self._ray = ray
        self._task = ray.remote(num_cpus=1)(_call)
        self.workers = int(ray.cluster_resources().get("CPU", 1))

    def map(self, fn: Callable[..., Any], calls: Sequence[tuple], on_done: OnDone | None = None) -> list:
        ray = self._ray
        refs = [self._task.remote(fn, args) for args in calls]
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            if on_done is not None:
                on_done(len(refs) - len(pending))
        try:
            return ray.get(refs)
        except ray.exceptions.RayTaskError as err:
            if isinstance(err.cause, SloserveError):
                raise err.cause from None
            raise

    def close(self) -> None:
        self._ray.shutdown()


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A ConfigError unless ``host:port`` (or ``ray://host:port``) accepts a TCP connection: Ray
    itself retries an unreachable address for a minute before it says so."""
    if address in ("auto", "local"):
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"--ray-address must be host:port, ray://host:port or auto, got {address!r}")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as err:
        raise ConfigError(f"--ray-address {address}: cannot connect ({err.strerror or err})") from None


def make_executor(workers: int | None, address: str | None = None) -> Executor:
    """``workers`` 1 without ``address``: the serial executor; otherwise Ray (``workers`` None: every
    core of this machine, or of the cluster at ``address``)."""
    if workers is not None and workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {workers}")
    cores = os.cpu_count() or 1
    if workers is not None and workers > cores and not address:
        # NOTE: a simulation is one busy core: more at once only slows each, and every Ray worker holds its
        # own Python (--workers 1000 started a process per run, hundreds for an experiment's grid)
        raise ConfigError(
            f"--workers {workers}: this machine has {cores} cores, and a simulation keeps one busy; give at most "
            f"{cores}, or run on a cluster with --ray-address"
        )
    if workers == 1 and not address:
        return SerialExecutor()
    return RayExecutor(workers, address)
