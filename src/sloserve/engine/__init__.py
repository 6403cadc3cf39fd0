"""The real engine (PyTorch): models, slot-addressed KV cache, attention backends, sampler, executor.

Needs the ``engine`` extra (``pip install 'sloserve[engine]'``); the simulator never imports it.
What a model file says (its shape, its GGUF tensors and tokenizer) is read by ``sloserve.checkpoint``,
which needs no torch: the simulator reads an engine model's shape through it.
"""

from __future__ import annotations

__all__ = ["LLM", "BeamSearchParams", "CompletionOutput", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str):
    """``LLM``, ``SamplingParams`` and the output classes load torch on first use."""
    if name not in __all__:
        raise AttributeError(f"module 'sloserve.engine' has no attribute {name!r}")
    try:
        import torch  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the install
        from sloserve.core.errors import ConfigError

        raise ConfigError(
            "the engine needs PyTorch: pip install 'sloserve[engine]' (torch, safetensors, tokenizers)"
        ) from e
    from sloserve.engine import beam_search, llm, sampler

    if name == "BeamSearchParams":
        return beam_search.BeamSearchParams
    return getattr(sampler if name in ("SamplingParams", "StructuredOutputsParams") else llm, name)
