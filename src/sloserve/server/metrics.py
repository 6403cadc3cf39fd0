"""``/metrics`` (Prometheus) and the request log of a served engine: the online engine reports each
step and each finished request here (``EngineObserver``), from its reader thread.

Latencies use the simulator's definitions (``metrics.summary``): TTFT = first token - arrival,
TPOT = (last token - first token) / (output tokens - 1), end-to-end = finish - arrival; a request meets
its SLO when every objective set on it is met. Aborted requests (the client left) count by outcome
but not in latencies or SLO attainment.
"""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path
from typing import IO

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sloserve.core.errors import ConfigError
from sloserve.core.prefix import salted_root_key, segment_hash_ids
from sloserve.engine.async_engine import EngineStats, ServedRequest
from sloserve.engine.gc_heap import FullCollections
from sloserve.metrics.summary import SLO_TOLERANCE_S
from sloserve.server.vllm_metrics import VllmNames

LATENCY_BUCKETS_S = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0)
# Request lengths in tokens (vLLM's 1-2-5 series)
LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10_000, 20_000, 50_000, 100_000)
TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


def served_latencies(served: ServedRequest) -> tuple[float, float, float]:
    """(TTFT, TPOT, end-to-end) in seconds; TPOT is NaN for fewer than two output tokens."""
    ttft = served.first_token_time - served.arrival_time
    n = served.num_output_tokens
    tpot = (served.last_token_time - served.first_token_time) / (n - 1) if n > 1 else math.nan
    return ttft, tpot, served.finish_time - served.arrival_time


def slo_met(served: ServedRequest) -> bool:
    ttft, tpot, _ = served_latencies(served)
    slo = served.slo
    ok = slo.ttft_s is None or ttft <= slo.ttft_s + SLO_TOLERANCE_S
    return ok and (slo.tpot_s is None or math.isnan(tpot) or tpot <= slo.tpot_s + SLO_TOLERANCE_S)


class ServerMetrics:
    """The Prometheus collectors of one server (their own registry, so servers in one process, as in
    tests, do not share counts)."""

    def __init__(self, model_name: str, request_log: Path | None = None) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "sloserve_requests",
            "Requests ended, by class and finish reason (stop, length, abort, error)",
            ["request_class", "outcome"],
            registry=r,
        )
        self.rejected = Counter(
            "sloserve_requests_rejected",
            "Requests refused before they were accepted, by reason (invalid, queue_full, shutting_down, unauthorized)",
            ["reason"],
            registry=r,
        )
        # What an engine reports after each step, by replica ("0" for one engine; vLLM's engine label)
        per_replica = ["replica"]
        self.waiting = Gauge(
            "sloserve_num_requests_waiting", "Requests holding no KV, waiting to run", per_replica, registry=r
        )
        self.running = Gauge(
            "sloserve_num_requests_running", "Requests holding KV on the device", per_replica, registry=r
        )
        self.swapped = Gauge(
            "sloserve_num_requests_swapped", "Requests whose KV is in CPU swap space", per_replica, registry=r
        )
        self.kv_usage = Gauge(
            "sloserve_kv_cache_usage_ratio", "Tokens holding KV / KV capacity", per_replica, registry=r
        )
        self.kv_allocated = Gauge(
            "sloserve_kv_cache_allocated_ratio", "KV slots allocated / KV capacity", per_replica, registry=r
        )
        self.kv_used_tokens = Gauge("sloserve_kv_cache_used_tokens", "Tokens holding KV", per_replica, registry=r)
        self.preemptions = Counter(
            "sloserve_preemptions", "Requests preempted (recompute or swap)", per_replica, registry=r
        )
        self.prompt_tokens = Counter("sloserve_prompt_tokens", "Prompt tokens of ended requests", registry=r)
        self.generation_tokens = Counter("sloserve_generation_tokens", "Output tokens sent", registry=r)
        # vLLM's prefix_cache_queries / prefix_cache_hits: prompt tokens looked up at admission, and found
        self.prefix_cache_queries = Counter(
            "sloserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", per_replica, registry=r
        )
        self.prefix_cache_hits = Counter(
            "sloserve_prefix_cache_hits", "Prompt tokens found in the prefix cache", per_replica, registry=r
        )
        self.device_idle = Counter(
            "sloserve_device_idle_seconds",
            "Seconds a GPU waited for the host between steps while requests were running",
            per_replica,
            registry=r,
        )
        # The full garbage collections of this process ("server") and of each engine's ("engine-REPLICA"),
        # during which that process stood still (engine/gc_heap.py)
        by_process = ["process"]
        self.gc_full_collections = Counter(
            "sloserve_gc_full_collections",
            "Full (oldest-generation) garbage collections of a serving process: server, engine-REPLICA",
            by_process,
            registry=r,
        )
        self.gc_full_collection_seconds = Counter(
            "sloserve_gc_full_collection_seconds",
            "Seconds a serving process spent in full garbage collections",
            by_process,
            registry=r,
        )
        self._full_collections = FullCollections()  # this process's
        self._server_gc_counted = (0, 0.0)  # (collections, seconds) of it the counters hold
        self.replica_failures = Counter(
            "sloserve_replica_failures",
            "Requests whose replica failed under them, by what became of them (retried, error)",
            ["outcome"],
            registry=r,
        )
        labels = ["request_class"]

        def per_class(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, documentation, labels, buckets=buckets, registry=r)

        self.ttft = per_class("sloserve_time_to_first_token_seconds", "TTFT", LATENCY_BUCKETS_S)
        self.tpot = per_class("sloserve_time_per_output_token_seconds", "TPOT", TOKEN_BUCKETS_S)
        self.e2e = per_class("sloserve_e2e_request_latency_seconds", "End-to-end latency", LATENCY_BUCKETS_S)
        # Where a completed request's time went (vLLM's request phases): waiting for its first
        # schedule, from then to its first token, from its first token to its last, and both
        self.queue_time = per_class(
            "sloserve_request_queue_time_seconds", "Arrival to first scheduled", LATENCY_BUCKETS_S
        )
        self.prefill_time = per_class(
            "sloserve_request_prefill_time_seconds", "First scheduled to first token", LATENCY_BUCKETS_S
        )
        self.decode_time = per_class(
            "sloserve_request_decode_time_seconds", "First token to last token", LATENCY_BUCKETS_S
        )
        self.inference_time = per_class(
            "sloserve_request_inference_time_seconds", "First scheduled to last token", LATENCY_BUCKETS_S
        )
        self.prompt_lengths = per_class(
            "sloserve_request_prompt_tokens", "Prompt tokens of completed requests", LENGTH_BUCKETS
        )
        self.generation_lengths = per_class(
            "sloserve_request_generation_tokens", "Output tokens of completed requests", LENGTH_BUCKETS
        )
        self.slo = Counter(
            "sloserve_slo_requests",
            "Completed requests with an SLO, by whether they met it",
            ["request_class", "met"],
            registry=r,
        )
        self.attainment = Gauge(
            "sloserve_slo_attainment_ratio", "Share of completed requests with an SLO that met it", labels, registry=r
        )
        self.batch_lines = Counter(
            "sloserve_batch_lines", "Batch API lines answered, by outcome (completed, failed)", ["outcome"], registry=r
        )
        self.batch_lines_in_engine = Gauge(
            "sloserve_batch_lines_in_engine", "Batch API lines in the engine now", registry=r
        )
        # The same families under vLLM's names (vllm_metrics.py), for vLLM's dashboards
        self.vllm_registry = CollectorRegistry()
        self.vllm_registry.register(VllmNames(r, model_name))
        self._slo_counts: dict[str, list[int]] = {}  # class -> [met, all]
        self._last_totals: dict[str, EngineStats] = {}  # replica -> its last stats (counters take what grew)
        self._log: IO[str] | None = None
        self._log_lock = threading.Lock()
        if request_log is not None:
            try:
                self._log = open(request_log, "a", encoding="utf-8")  # noqa: SIM115 - open for the server's life
            except OSError as e:
                raise ConfigError(f"--request-log {request_log}: cannot open for appending ({e.strerror})") from None

    def exposition(self) -> bytes:
        """The text ``/metrics`` answers: our families, then vLLM's names for those it has."""
        # NOTE: this process's collections are counted here (the engines' come with their stats, ``on_step``)
        gc, (counted, counted_s) = self._full_collections, self._server_gc_counted
        self.gc_full_collections.labels("server").inc(gc.count - counted)
        self.gc_full_collection_seconds.labels("server").inc(gc.seconds - counted_s)
        self._server_gc_counted = (gc.count, gc.seconds)
        return generate_latest(self.registry) + generate_latest(self.vllm_registry)

    def on_step(self, stats: EngineStats, replica: str = "0") -> None:
        self.waiting.labels(replica).set(stats.num_waiting)
        self.running.labels(replica).set(stats.num_running)
        self.swapped.labels(replica).set(stats.num_swapped)
        self.kv_usage.labels(replica).set(stats.kv_used_tokens / stats.kv_capacity_tokens)
        self.kv_allocated.labels(replica).set(stats.kv_allocated_tokens / stats.kv_capacity_tokens)
        self.kv_used_tokens.labels(replica).set(stats.kv_used_tokens)
        # NOTE: the engine reports totals since it started; a counter takes what they grew by, and a
        # replica restarted by Ray Serve starts again from 0
        last = self._last_totals.get(replica)
        engine = f"engine-{replica}"  # (the garbage collections' label: the process)
        for counter, name, label in (
            (self.preemptions, "num_preemptions", replica),
            (self.prefix_cache_queries, "prefix_cache_queries", replica),
            (self.prefix_cache_hits, "prefix_cache_hits", replica),
            (self.device_idle, "device_idle_s", replica),
            (self.gc_full_collections, "gc_full_collections", engine),
            (self.gc_full_collection_seconds, "gc_full_collection_s", engine),
        ):
            now, before = getattr(stats, name), getattr(last, name, 0)
            counter.labels(label).inc(now - before if now >= before else now)
        self._last_totals[replica] = stats

    def on_replica_failure(self, outcome: str) -> None:
        """A fleet's replica failed under a request, which was sent again ("retried") or ended ("error")."""
        self.replica_failures.labels(outcome).inc()

    def on_finish(self, served: ServedRequest) -> None:
        cls = served.request_class.value
        outcome = served.finish_reason or "error"
        self.requests.labels(cls, outcome).inc()
        self.prompt_tokens.inc(served.num_prompt_tokens)
        self.generation_tokens.inc(served.num_output_tokens)
        if outcome in ("stop", "length") and served.num_output_tokens:
            ttft, tpot, e2e = served_latencies(served)
            self.ttft.labels(cls).observe(ttft)
            if not math.isnan(tpot):
                self.tpot.labels(cls).observe(tpot)
            self.e2e.labels(cls).observe(e2e)
            self.prompt_lengths.labels(cls).observe(served.num_prompt_tokens)
            self.generation_lengths.labels(cls).observe(served.num_output_tokens)
            scheduled = served.first_scheduled_time
            if not math.isnan(scheduled):
                self.queue_time.labels(cls).observe(scheduled - served.arrival_time)
                self.prefill_time.labels(cls).observe(served.first_token_time - scheduled)
                self.inference_time.labels(cls).observe(served.last_token_time - scheduled)
            self.decode_time.labels(cls).observe(served.last_token_time - served.first_token_time)
            slo = served.slo
            if slo.ttft_s is not None or slo.tpot_s is not None:
                met = slo_met(served)
                self.slo.labels(cls, str(met).lower()).inc()
                counts = self._slo_counts.setdefault(cls, [0, 0])
                counts[0] += met
                counts[1] += 1
                self.attainment.labels(cls).set(counts[0] / counts[1])
        if self._log is not None and served.num_output_tokens:
            self._write_log(served)

    def _write_log(self, served: ServedRequest) -> None:
        """One JSONL line per request that got at least one token, in the order they end: readable by
        ``--trace`` (prompt_tokens, output_tokens, arrival_s, and hash_ids: its prompt's prefix
        structure), so a served day can be simulated with its real sharing. A
        request that ended before its first token (aborted, refused at shutdown) has no output
        length to simulate: /metrics counts it."""

        def seconds(value: float) -> float | None:
            return None if math.isnan(value) else round(value, 6)

        line = {
            "request_id": served.request_id,
            "submitted_unix_s": round(served.submitted_unix_s, 6),
            "arrival_s": seconds(served.arrival_time),
            "first_token_s": seconds(served.first_token_time),
            "finish_s": seconds(served.finish_time),
            "prompt_tokens": served.num_prompt_tokens,
            "output_tokens": served.num_output_tokens,
            "cached_tokens": served.num_cached_tokens,
            # Mooncake's format: 512-token segments; a salted prompt's share nothing with another salt's
            "hash_ids": segment_hash_ids(served.prompt_token_ids, root_key=salted_root_key(served.cache_salt)),
            "max_tokens": served.params.max_tokens,
            "request_class": served.request_class.value,
            "priority": served.priority,
            "slo_ttft_s": served.slo.ttft_s,
            "slo_tpot_s": served.slo.tpot_s,
            "finish_reason": served.finish_reason,
        }
        with self._log_lock:
            assert self._log is not None
            self._log.write(json.dumps(line) + "\n")
            self._log.flush()

    def close(self) -> None:
        self._full_collections.close()
        if self._log is not None:
            self._log.close()
            self._log = None
