"""The real engine (PyTorch): models, slot-addressed KV cache, attention backends, sampler, executor.

Needs the ``engine`` extra (``pip install 'sloserve[engine]'``); the simulator never imports it.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the install
    from sloserve.core.errors import ConfigError

    raise ConfigError("the engine needs PyTorch: pip install 'sloserve[engine]' (torch, safetensors, tokenizers)") from e

from sloserve.engine.llm import LLM, CompletionOutput, RequestOutput
from sloserve.engine.sampler import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
