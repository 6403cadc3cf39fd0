"""``FleetEngine``: ``serve --replicas N``'s engine. The OpenAI app, its metrics and its Batch API run
in the server process as with one engine; each accepted request goes through a Ray Serve
``DeploymentHandle`` to one of N ``EngineReplica``s, picked by ``FleetRequestRouter`` with the
routing policy of ``--router``, and its tokens come back on that replica's output stream (one per
replica, replica.py says why).

It is an ``AsyncLLMEngine`` whose pipe to one engine process is replaced by Ray Serve calls: the
checks at ``submit`` (context, queue limit, KV fit), the request's deltas and its end, the
observer's metrics and the request log are the single engine's. What differs:

- Timestamps are taken here when a delta arrives (the latency a client sees), not at the end of
  the replica's step.
- A request whose replica died before it gave a token is sent again (at most ``MAX_RETRIES`` times;
  Ray Serve routes it to a live replica and replaces the dead one); one that had streamed tokens
  ends with "error" and says why.
- Nothing of the cluster is ours: Ray Serve places replicas (``num_gpus=1`` each on CUDA, cores of
  their own on the CPU), health-checks them (``EngineReplica.check_health``) and restarts them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
import uuid
from dataclasses import dataclass

from sloserve.core.errors import ConfigError
from sloserve.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineObserver
from sloserve.engine.engine_core import AddRequest, EngineInfo, EngineSpec, Output
from sloserve.router import ROUTERS

log = logging.getLogger("sloserve.fleet")

# Times a request whose replica died before its first token is sent again.
MAX_RETRIES = 3
# Seconds between Ray Serve's health checks of a replica (its default is 10).
HEALTH_CHECK_PERIOD_S = 2.0


@dataclass(frozen=True)
class FleetOptions:
    """Where and how the replicas run."""

    num_replicas: int = 2
    router: str = "least-outstanding"
    ray_address: str | None = None  # None: a local Ray started for the run
    cpus_per_replica: int | None = None  # CPU only; None: the machine's cores split evenly
    # Seconds to wait for every replica to be placed and load its model: a cluster short of the resources
    # may get them meanwhile (an autoscaler adding nodes); then the start fails, saying what is missing.
    start_timeout_s: float = 600.0

    def check(self) -> None:
        if self.num_replicas < 1:
            raise ConfigError(f"--replicas must be >= 1, got {self.num_replicas}")
        if self.router not in ROUTERS:
            raise ConfigError(f"--router {self.router!r} is not a routing policy; choose one of {', '.join(ROUTERS)}")
        if self.cpus_per_replica is not None and self.cpus_per_replica < 1:
            raise ConfigError(f"--cpus-per-replica must be >= 1, got {self.cpus_per_replica}")
        if not (self.start_timeout_s > 0 and math.isfinite(self.start_timeout_s)):
            raise ConfigError(
                f"--replica-start-timeout must be a finite number of seconds > 0, got {self.start_timeout_s}"
            )


class FleetEngine(AsyncLLMEngine):
    """N replicas of the engine of ``spec`` on Ray Serve, used as one ``AsyncLLMEngine``."""

    def __init__(
        self,
        spec: EngineSpec,
        fleet: FleetOptions,
        *,
        max_queued_requests: int = 1024,
        observer: EngineObserver | None = None,
    ) -> None:
        fleet.check()
        super().__init__(spec, max_queued_requests=max_queued_requests, observer=observer)
        self.fleet = fleet
        self._loop: asyncio.AbstractEventLoop | None = None
        self._calls = None  # the replicas' DeploymentHandle
        # By request id, from submit to its end: what to send again, the replica holding it (by key),
        # the times it was sent again, and those aborted
        self._adds: dict[int, AddRequest] = {}
        self._replica_of: dict[int, str] = {}
        self._num_tries: dict[int, int] = {}
        self._aborted: set[int] = set()
        self._channels: dict[str, asyncio.Task] = {}  # replica key -> the task listening to its outputs
        # NOTE: the loop holds its tasks weakly: an admission no one references may be collected mid-call
        self._admissions: set[asyncio.Task] = set()
        self._started_ray = False
        # NOTE: a name of its own: two servers deploying on one cluster must not replace each other's replicas
        self.app_name = f"sloserve-{uuid.uuid4().hex[:8]}"

    def start(self) -> EngineInfo:
        """Start (or join) Ray, deploy the replicas and wait until each has loaded its model."""
        try:
            import ray
            from ray import serve
            from ray.serve.config import RequestRouterConfig
        except ImportError as exc:
            raise ConfigError(f"--replicas needs the fleet extra: pip install 'sloserve[fleet]' ({exc})") from None
        from sloserve.fleet.replica import EngineReplica
        from sloserve.fleet.routing import STATS_PERIOD_S, FleetRequestRouter

        on_gpu = self.spec.device.startswith("cuda")
        cpus = self.fleet.cpus_per_replica or max(1, (os.cpu_count() or 1) // self.fleet.num_replicas)
        resource, each = ("GPU", 1) if on_gpu else ("CPU", cpus)  # what one replica asks Ray for
        if not ray.is_initialized():
            if self.fleet.ray_address is None:  # NOTE: on a cluster an autoscaler may add nodes; here none comes
                self._check_room(resource, each)
            ray.init(address=self.fleet.ray_address, include_dashboard=False, logging_level=logging.WARNING)
            self._started_ray = True
        serve.start(proxy_location="Disabled")  # NOTE: HTTP is this process's: the same app as one engine
        deployment = serve.deployment(
            EngineReplica,
            name="engine",
            num_replicas=self.fleet.num_replicas,
            ray_actor_options={
                **({"num_gpus": each} if on_gpu else {"num_cpus": each}),
                # NOTE: a replica's calls run on its event loop, not handed to a thread of their own (Ray
                # Serve's throughput-optimized setting): a call costs 3.2-3.6 ms instead of 7.1-8.1
                "runtime_env": {"env_vars": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}},
            },
            # NOTE: the engine queues and refuses (429) itself; Ray Serve must never hold a request back
            max_ongoing_requests=100_000,
            health_check_period_s=HEALTH_CHECK_PERIOD_S,
            max_constructor_retry_count=1,  # NOTE: an engine that cannot be built fails alike every time
            logging_config={"log_level": "WARNING", "enable_access_log": False},
            request_router_config=RequestRouterConfig(
                request_router_class=FleetRequestRouter,
                request_router_kwargs={"policy": self.fleet.router, "cost_model": self.spec.cost_model},
                request_routing_stats_period_s=STATS_PERIOD_S,
            ),
        )
        try:
            handle = serve._run(  # NOTE: not serve.run, which waits for the replicas without a deadline
                deployment.bind(self.spec, self.max_queued_requests, None if on_gpu else cpus),
                name=self.app_name,
                route_prefix=None,
                _blocking=False,
            )
            self._wait_until_running(serve, resource, each)
            info = EngineInfo(**handle.engine_info.remote().result())
        except Exception as exc:  # noqa: BLE001 - a replica that cannot start: say why, leave nothing running
            reason = _replica_failure(serve, self.app_name) or str(exc)
            self._shutdown()
            raise ConfigError(f"the fleet's replicas did not start: {reason}") from None
        self._calls = handle.options(_by_reference=False)  # NOTE: calls over gRPC, not Ray actor calls
        self._started(info)
        return info

    def _wait_until_running(self, serve, resource: str, each: int) -> None:
        """Return once Ray Serve runs every replica. Raises when the deployment fails (the caller reports
        the replica's error), or when the replicas are not all running within ``start_timeout_s``: then
        the error says how many run, what each asks for and what the cluster has free."""
        import ray

        deadline = time.monotonic() + self.fleet.start_timeout_s
        while True:
            application = serve.status().applications.get(self.app_name)
            status = application.status if application is not None else "NOT_STARTED"
            if status == "RUNNING":
                return
            if status in ("DEPLOY_FAILED", "UNHEALTHY"):
                raise RuntimeError(application.message or status)
            if time.monotonic() > deadline:
                deployment = application.deployments.get("engine") if application is not None else None
                running = deployment.replica_states.get("RUNNING", 0) if deployment is not None else 0
                free = ray.available_resources().get(resource, 0)
                raise TimeoutError(
                    f"{running} of {self.fleet.num_replicas} replicas running after "
                    f"{self.fleet.start_timeout_s:g} s (--replica-start-timeout): each asks for {each} {resource}, "
                    f"the cluster has {free:g} free"
                )
            time.sleep(0.2)

    def _check_room(self, resource: str, each: int) -> None:
        """A ConfigError when this machine cannot hold the replicas (a local Ray has its GPUs and cores)."""
        if resource == "GPU":
            import torch

            have = torch.cuda.device_count()
        else:
            have = os.cpu_count() or 1
        need = self.fleet.num_replicas * each
        if need > have:
            raise ConfigError(
                f"--replicas {self.fleet.num_replicas} need {need} {resource}s ({each} each); this machine has {have}"
            )

    async def reset_prefix_cache(self) -> bool:
        """Every replica's ``reset_prefix_cache``: True when each one reset its cache. Each call goes to a
        replica not asked yet (``EveryReplica``); one that answers it was asked says none is left."""
        from sloserve.fleet.routing import EveryReplica

        if self.error is not None or self._calls is None:
            raise EngineDeadError(f"the fleet failed: {self.error or 'not started'}")
        answers: dict[str, bool] = {}
        # NOTE: bounded: Ray Serve may replace a replica meanwhile (a new one is asked too, its cache is empty)
        for _ in range(2 * self.fleet.num_replicas + 1):
            try:
                key, done = await self._calls.reset_prefix_cache.remote(EveryReplica(frozenset(answers)))
            except Exception as exc:  # noqa: BLE001 - the replica died: Ray's errors vary
                raise EngineDeadError(f"a replica failed while resetting its prefix cache: {exc}") from None
            if done is None:
                break
            answers[key] = done
        return all(answers.values())

    # --- the "pipe": Ray Serve calls ------------------------------------------------------------
    def _send(self, message: tuple) -> None:
        kind = message[0]
        if kind == "add":
            self._loop = asyncio.get_running_loop()  # NOTE: submit runs on the server's loop
            add: AddRequest = message[1]
            self._adds[add.request_id] = add
            self._start_admission(add)
        elif kind in ("abort", "abort_all") and self._loop is not None:
            ids = list(self._adds) if kind == "abort_all" else [message[1]]
            try:
                self._loop.call_soon_threadsafe(self._abort, ids)
            except RuntimeError:  # the loop is closed: its requests are gone
                pass
        elif kind == "stop":
            self._shutdown()

    def _start_admission(self, add: AddRequest) -> None:
        """Admit ``add`` in a task of its own, held until it ends."""
        admission = asyncio.get_running_loop().create_task(self._admit(add))
        self._admissions.add(admission)
        admission.add_done_callback(self._admissions.discard)

    async def _admit(self, add: AddRequest) -> None:
        """Route ``add`` to a replica (Ray Serve calls the routing policy) and listen to that replica."""
        from sloserve.fleet.routing import RoutedRequest

        routed = RoutedRequest(
            add.prompt_token_ids, add.params, add.request_class, add.slo, add.priority, add.cache_salt
        )
        try:
            key = await self._calls.admit.remote(routed, add.request_id)
        except Exception as exc:  # noqa: BLE001 - the replica died while admitting it: Ray's errors vary
            self._lost([add.request_id], f"{exc}")
            return
        self._replica_of[add.request_id] = key
        if key not in self._channels:
            self._channels[key] = asyncio.get_running_loop().create_task(self._listen(key))
        if add.request_id in self._aborted:  # aborted while it was being admitted
            self._abort([add.request_id])

    async def _listen(self, key: str) -> None:
        """Hand on the deltas of replica ``key`` until it goes away; then its requests are lost."""
        from sloserve.fleet.routing import ReplicaTarget

        reason = "its replica stopped"
        try:
            async for news in self._calls.outputs.options(stream=True).remote(ReplicaTarget(key)):
                now, outputs = self.clock(), []
                for delta in news.deltas:
                    served = self._served.get(delta.ingress_id)
                    if served is None:
                        continue
                    last = now if delta.token_ids else served.last_token_time
                    finish = now if delta.finish_reason else math.nan
                    outputs.append(
                        Output(
                            delta.ingress_id,
                            delta.text,
                            delta.token_ids,
                            delta.finish_reason,
                            now,
                            last,
                            finish,
                            delta.num_cached_tokens,
                            delta.logprobs,
                            delta.prompt_logprobs,
                            served.arrival_time + delta.queued_s,
                            delta.error,
                            delta.stop_reason,
                        )
                    )
                    if delta.finish_reason is not None:
                        self._forget(delta.ingress_id)
                self._on_step(outputs, news.stats, str(news.rank))
        except Exception as exc:  # noqa: BLE001 - the replica died: Ray's errors vary
            reason = f"its replica failed: {exc}"
        finally:
            del self._channels[key]
            self._lost([i for i, k in self._replica_of.items() if k == key], reason)

    def _lost(self, request_ids: list[int], reason: str) -> None:
        """Requests whose replica went away: sent again if they had no token yet, else ended ("error")."""
        for request_id in request_ids:
            served, add = self._served.get(request_id), self._adds.get(request_id)
            self._replica_of.pop(request_id, None)
            if served is None or add is None or served.finish_reason is not None:
                continue
            retry = not served.num_output_tokens and request_id not in self._aborted and not self.draining
            if retry and self._num_tries.get(request_id, 0) < MAX_RETRIES:
                self._num_tries[request_id] = self._num_tries.get(request_id, 0) + 1
                self._replica_failed("retried")
                log.warning("request %d: its replica went away before its first token; sending it again", request_id)
                self._start_admission(add)
            else:
                self._replica_failed("error")
                self._end(request_id, "error", reason)

    def _abort(self, request_ids: list[int]) -> None:
        from sloserve.fleet.routing import ReplicaTarget

        by_replica: dict[str, list[int]] = {}
        for request_id in request_ids:
            if request_id not in self._adds:
                continue  # ended
            self._aborted.add(request_id)
            key = self._replica_of.get(request_id)
            if key is not None:  # else: not admitted yet; _admit aborts it once it is
                by_replica.setdefault(key, []).append(request_id)
        for key, ids in by_replica.items():
            self._calls.abort.remote(ReplicaTarget(key), ids)

    def _forget(self, request_id: int) -> None:
        for table in (self._adds, self._replica_of, self._num_tries):
            table.pop(request_id, None)
        self._aborted.discard(request_id)

    def _replica_failed(self, outcome: str) -> None:
        report = getattr(self.observer, "on_replica_failure", None)  # the server's metrics have it
        if report is not None:
            report(outcome)

    def _end(self, request_id: int, reason: str, error: str | None) -> None:
        served = self._served.get(request_id)
        self._forget(request_id)
        if served is None or served.finish_reason is not None:
            return
        now = self.clock()
        out = Output(
            request_id, "", [], reason, now, served.last_token_time, now, served.num_cached_tokens, error=error
        )
        self._on_step([out], None)

    def _shutdown(self) -> None:
        """Take the replicas down: with the local Ray this engine started, all of it; on a cluster
        it joined, its application (without waiting: a cluster that is going away must not hold
        the server up)."""
        try:
            import ray
            from ray import serve

            if self._started_ray:
                ray.shutdown()  # NOTE: the replicas' engine processes end when their pipes close
            elif ray.is_initialized():
                serve.delete(self.app_name, _blocking=False)
        finally:
            self._stopped.set()


def _replica_failure(serve, app_name: str) -> str | None:
    """The last line of the error a replica's constructor raised (Ray Serve keeps it in the deployment's
    status), e.g. the engine's ConfigError; None when there is none."""
    try:
        application = serve.status().applications.get(app_name)
        message = application.deployments["engine"].message if application is not None else ""
    except Exception:  # noqa: BLE001 - only to say more: the failure is reported anyway
        return None
    lines = [line.strip() for line in message.splitlines() if "Error: " in line]
    return lines[-1].split("Error: ", 1)[1] if lines else None
