"""``/metrics`` under vLLM's names as well as ours, so that vLLM's Grafana dashboard and alerts work
on a sloserve server unchanged: each family below is exported a second time as vLLM names it
(``vllm:`` prefix), with vLLM's labels (``model_name`` added; ``replica`` is vLLM's ``engine``, a
request's ``outcome`` its ``finished_reason``). KV usage is a fraction in [0, 1] under both names, as
vLLM's ``_perc`` gauges are despite their name.

NOTE: one set of collectors (``ServerMetrics``); the vLLM families are renamed copies of their
samples, made at each scrape, so the two sets can never disagree.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

# our family -> vLLM's names for it (v1's, then the older v0 names dashboards still use)
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "sloserve_num_requests_waiting": ("vllm:num_requests_waiting",),
    "sloserve_num_requests_running": ("vllm:num_requests_running",),
    "sloserve_num_requests_swapped": ("vllm:num_requests_swapped",),
    "sloserve_kv_cache_usage_ratio": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "sloserve_preemptions": ("vllm:num_preemptions",),
    "sloserve_prompt_tokens": ("vllm:prompt_tokens",),
    "sloserve_generation_tokens": ("vllm:generation_tokens",),
    "sloserve_prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "sloserve_prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "sloserve_requests": ("vllm:request_success",),
    "sloserve_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "sloserve_time_per_output_token_seconds": (
        "vllm:time_per_output_token_seconds",
        "vllm:inter_token_latency_seconds",
    ),
    "sloserve_e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "sloserve_request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    "sloserve_request_prefill_time_seconds": ("vllm:request_prefill_time_seconds",),
    "sloserve_request_decode_time_seconds": ("vllm:request_decode_time_seconds",),
    "sloserve_request_inference_time_seconds": ("vllm:request_inference_time_seconds",),
    "sloserve_request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "sloserve_request_generation_tokens": ("vllm:request_generation_tokens",),
}
# our label -> vLLM's
VLLM_LABELS = {"replica": "engine", "outcome": "finished_reason"}


class VllmNames:
    """A Prometheus collector: the families of ``source`` that vLLM has, under vLLM's names and labels."""

    def __init__(self, source: CollectorRegistry, model_name: str) -> None:
        self.source = source
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            for name in VLLM_NAMES.get(family.name, ()):
                renamed = Metric(name, family.documentation, family.type)
                for sample in family.samples:
                    if sample.name.endswith("_created"):  # a client library's detail: vLLM's have none either
                        continue
                    labels = {VLLM_LABELS.get(k, k): v for k, v in sample.labels.items()}
                    renamed.add_sample(
                        name + sample.name[len(family.name) :],
                        {"model_name": self.model_name, **labels},
                        sample.value,
                        sample.timestamp,
                        sample.exemplar,
                    )
                yield renamed
