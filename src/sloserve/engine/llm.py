"""The offline entry point vLLM users know: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sloserve.core.errors import ConfigError
from sloserve.cost.base import CostModel
from sloserve.engine.llm_engine import LLMEngine
from sloserve.engine.loader import load_model
from sloserve.engine.sampler import Logprobs, SamplingParams, cumulative_logprob

Prompt = str | dict[str, Any]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS) or "length" (max_tokens)
    # With SamplingParams.logprobs: each token's log-probabilities, and their sum
    logprobs: list[Logprobs] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    """One prompt's result (vLLM's shape: ``outputs[0].token_ids`` / ``.text``)."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (vLLM's field)
    # With SamplingParams.prompt_logprobs: None for the first prompt token, then each one's
    prompt_logprobs: list[Logprobs | None] | None = None


class LLM:
    """A model served by a registered scheduler, for offline batches.

    Args:
        model: a local HF directory (config.json, *.safetensors, tokenizer.json) or ``random:NAME``.
        scheduler: a registered policy (``sloserve schedulers``); ``**scheduler_options`` set its
            knobs as ``--set`` does (e.g. ``preemption="swap"``, ``block_size=8``).
        device: ``cpu`` or ``cuda``. kv_capacity_tokens: KV slots (default: see LLMEngine).
        dtype: ``auto`` (float32 on CPU, the checkpoint's on CUDA), float32, float16, bfloat16.
        cost_model: what a policy that estimates batch times (BROS) uses: a preset or a JSON file.
        attention_backend: ``auto`` (Triton kernels on CUDA when triton is installed, else the
            PyTorch reference), ``torch`` or ``triton``.
        cuda_graphs: replay decode-only steps as CUDA graphs (``cuda_graphs``; needs cuda and the
            triton backend). ``None`` (the default): on wherever supported, as vLLM captures by default.
        enable_prefix_caching: share the KV blocks of prompts' common prefixes (and of answers a
            conversation resends). ``None`` (the default): on wherever the scheduler supports it, as
            vLLM v1; ``True`` with one that does not is an error.
    """

    def __init__(
        self,
        model: str,
        scheduler: str = "vllm",
        device: str = "cpu",
        kv_capacity_tokens: int | None = None,
        *,
        dtype: str = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
        swap_space_tokens: int | None = None,
        cost_model: str | CostModel | None = None,
        attention_backend: str = "auto",
        cuda_graphs: bool | None = None,
        enable_prefix_caching: bool | None = None,
        **scheduler_options: Any,
    ) -> None:
        self.loaded = load_model(
            model, device=device, dtype=dtype, seed=seed, attention_backend=attention_backend, cuda_graphs=cuda_graphs
        )
        self.engine = LLMEngine(
            self.loaded,
            scheduler,
            kv_capacity_tokens=kv_capacity_tokens,
            swap_space_tokens=swap_space_tokens,
            max_model_len=max_model_len,
            cost_model=cost_model,
            seed=seed,
            scheduler_options=scheduler_options,
            enable_prefix_caching=enable_prefix_caching,
        )

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    def _token_ids(self, prompt: Prompt, index: int) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.loaded.tokenizer is None:
                raise ConfigError(
                    f"prompt {index}: the model has no tokenizer.json; pass {{'prompt_token_ids': [...]}}"
                )
            return prompt, self.loaded.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return None, list(prompt["prompt_token_ids"])
        raise ConfigError(
            f"prompt {index}: expected a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}"
        )

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results in input order. Every prompt is checked before any runs."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ConfigError(f"{len(params)} sampling params for {len(prompts)} prompts")
        encoded = [self._token_ids(p, i) for i, p in enumerate(prompts)]
        params = [
            self.engine.check_request(ids, p, where=f"prompt {i}")
            for i, ((_, ids), p) in enumerate(zip(encoded, params))
        ]
        engine = self.engine
        requests = [engine.add_request(ids, p) for (_, ids), p in zip(encoded, params, strict=True)]
        while engine.has_unfinished():
            engine.step()
        outputs = []
        for request, (text, ids) in zip(requests, encoded, strict=True):
            seq = engine.release(request)
            token_ids = seq.output_token_ids
            decoded = self.loaded.tokenizer.decode(token_ids) if self.loaded.tokenizer is not None else ""
            cumulative = None if seq.logprobs is None else cumulative_logprob(seq.logprobs)
            completion = CompletionOutput(
                0, decoded, token_ids, seq.finish_reason or "length", seq.logprobs, cumulative
            )
            prompt_logprobs = None if seq.prompt_logprobs is None else [None, *seq.prompt_logprobs]
            outputs.append(
                RequestOutput(request.request_id, text, ids, [completion], request.num_cached_tokens, prompt_logprobs)
            )
        return outputs
