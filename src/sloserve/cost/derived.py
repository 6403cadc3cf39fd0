"""Quantities derived from a cost model: EconoServe's target forward size and JCT SLO."""

from __future__ import annotations

from sloserve.core.errors import ConfigError

from .base import BatchShape, CostModel


def prefill_shape(num_tokens: int, prompt_tokens: int) -> BatchShape:
    """A prefill-only batch of ``num_tokens`` made of prompts of ``prompt_tokens`` (the last shorter)."""
    full, rest = divmod(num_tokens, prompt_tokens)
    chunks = [prompt_tokens] * full + ([rest] if rest else [])
    return BatchShape(
        num_prefill=len(chunks), prefill_tokens=num_tokens, prefill_attention_work=sum(c * c for c in chunks)
    )


def saturating_forward_size(
    cost_model: CostModel, max_tokens: int, *, fraction: float = 0.95, prompt_tokens: int = 128, step: int = 16
) -> int:
    """EconoServe's target forward size (TFS, §2.1: "the forward size that saturates GPU
    utilization"): the smallest forward size (a multiple of ``step``, at most ``max_tokens``) whose
    throughput in tokens/s reaches ``fraction`` of the best over all sizes up to ``max_tokens``.

    NOTE: the paper measures GPU utilization; a cost model gives throughput, which saturates where
    utilization does. Batches are prompts of ``prompt_tokens`` so attention stays a minor term.
    """
    if not 0 < fraction <= 1:
        raise ConfigError(f"TFS saturation fraction must be in (0, 1], got {fraction}")
    if max_tokens < step:
        raise ConfigError(f"max_num_batched_tokens {max_tokens} is below one TFS step of {step} tokens")
    sizes = range(step, max_tokens + 1, step)
    throughput = [n / cost_model.batch_time(prefill_shape(n, prompt_tokens)).total_s for n in sizes]
    best = max(throughput)
    return next(n for n, tps in zip(sizes, throughput) if tps >= fraction * best)


def prompt_latency_s(cost_model: CostModel, num_prompt_tokens: int) -> float:
    """t_p: the prompt processed alone."""
    return cost_model.batch_time(prefill_shape(num_prompt_tokens, num_prompt_tokens)).total_s


def token_latency_s(cost_model: CostModel, context_tokens: int) -> float:
    """t_g: one decode step of one request reading ``context_tokens`` of KV."""
    return cost_model.batch_time(BatchShape(num_decode=1, decode_kv_tokens=context_tokens)).total_s


def jct_slo_s(cost_model: CostModel, num_prompt_tokens: int, num_output_tokens: int, scale: float) -> float:
    """EconoServe §4: JCT SLO = SLO-scale x (t_p + t_g x l_g).

    NOTE: the paper measures t_p and t_g as averages over a dataset's run; we take them per request
    from the cost model, unloaded: t_p the request's prompt alone, t_g one decode step of it alone at
    the context halfway through its output. The SLO thus means "scale x the latency it would have
    on an idle GPU", which a rate sweep can meet at low load and misses under overload.
    """
    if not scale > 0:
        raise ConfigError(f"SLO scale must be > 0, got {scale}")
    t_p = prompt_latency_s(cost_model, num_prompt_tokens)
    t_g = token_latency_s(cost_model, num_prompt_tokens + num_output_tokens // 2)
    return scale * (t_p + t_g * num_output_tokens)


def kv_bound_throughput_rps(
    cost_model: CostModel, prompts: list[int], outputs: list[int], kv_capacity_tokens: int
) -> float:
    """The KV bound: requests/s of a GPU whose KV cache is full of decoding requests at every step.

    A request of I prompt and O output tokens holds I + t tokens of KV at its t-th decode step
    (t = 0 .. O-1). Weighted by steps, a running request therefore holds
    C = sum(O * (I + (O - 1) / 2)) / sum(O) tokens on average. A full cache of M tokens then runs
    B = M / C decodes per step, each step reading M tokens, and a step takes tau = the cost model's time
    for that decode batch. The output rate is B / tau tokens/s, and dividing by mean(O) gives requests/s.

    NOTE: no schedule does better when step time grows at most linearly in the batch (B / tau(B)
    then rises with B, and it is concave, so a cache full on average does no better than one full
    every step). Prefills only add time, and empty slots only shrink B. Caps on the batch (token
    budget, max_num_seqs) are a scheduler's choice and are not applied.
    """
    if not prompts or len(prompts) != len(outputs):
        raise ConfigError("the KV bound needs one output length per prompt, and at least one request")
    if kv_capacity_tokens < 1:
        raise ConfigError(f"kv_capacity_tokens must be >= 1, got {kv_capacity_tokens}")
    steps = sum(outputs)
    held = sum(o * (i + (o - 1) / 2) for i, o in zip(prompts, outputs, strict=True)) / steps
    batch = kv_capacity_tokens / held
    shape = BatchShape(num_decode=max(1, round(batch)), decode_kv_tokens=kv_capacity_tokens)
    tokens_per_s = batch / cost_model.batch_time(shape).total_s
    return tokens_per_s / (steps / len(outputs))
