"""Mamba, Falcon Mamba and Mamba-2 (``mamba``, ``falcon_mamba``, ``mamba2``: Mamba 130M-2.8B, Falcon Mamba 7B,
Mamba-2 130M-2.7B, Mamba-Codestral 7B): models of no attention. A stack of Nemotron-H's blocks, every one an RMSNorm
and a Mamba mixer (Mamba's selective scan, ``models/mamba1.py``, Falcon Mamba's with its step, B and C normalized;
or Mamba-2's, ``models/mamba2.py``), under Nemotron-H's checkpoint names (``backbone.``, ``mixer``).

A request's context is its states alone (``state_cache.StateCache``: each layer's convolution inputs and h), a
fixed size whatever its length: its tokens take no KV cache (``ModelConfig.num_kv_layers`` 0), and no position
embedding ends the context it may grow to.

The residual stream is float32 where ``residual_in_fp32`` says (every released model), as transformers keeps it:
each block's norm reads it rounded to the model's dtype, and the mixer's output joins it in float32.
"""

from __future__ import annotations

import torch

from sloserve.checkpoint.model_config import ModelConfig
from sloserve.engine.attention import AttentionBackend
from sloserve.engine.models.llama import LlamaForCausalLM, LlamaModel, RMSNorm
from sloserve.engine.models.nemotron_h import NemotronHBlock


class StreamNorm(RMSNorm):
    """RMSNorm of a residual stream that may be float32 (the model's dtype in, the model's dtype out)."""

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(this norm of ``x + residual`` rounded to the weights' dtype, ``x + residual``: float32 where the
        residual is), each (T, H)."""
        summed = x + residual
        return self(summed.to(self.weight.dtype)), summed


class MambaBlock(NemotronHBlock):
    """A norm and a Mamba mixer (``NemotronHBlock`` of a MAMBA layer), the stream it passes on float32 where the
    config's ``residual_in_fp32`` says."""

    norm_class = StreamNorm

    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__(config, backend, layer)
        self.residual_in_fp32 = config.mamba["residual_in_fp32"]

    def forward(self, x, residual, cos, sin, k_cache, v_cache, meta):
        """``LlamaDecoderLayer.forward``'s contract: (the mixer's output, the stream before it)."""
        h, residual = (
            (self.input_layernorm(x), x) if residual is None else self.input_layernorm.add_and_norm(x, residual)
        )
        return self.mamba(h, meta.states), residual.float() if self.residual_in_fp32 else residual


class MambaModel(LlamaModel):
    layer_class = MambaBlock
    norm_class = StreamNorm


class MambaForCausalLM(LlamaForCausalLM):
    model_class = MambaModel
