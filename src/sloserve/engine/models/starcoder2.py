"""StarCoder2 (``starcoder2``: 3B, 7B, 15B): Llama's layers with LayerNorms (with biases), a two-matrix GELU
MLP (``c_fc``, ``c_proj``), biases on every projection where ``use_bias`` (its default), and every layer's
attention within the last ``sliding_window`` positions (4,096). HF parameter names.

NOTE: its layers are Llama's (a norm, attention, a norm, the MLP, each output joining the stream in the
norm after it), so they run on piecewise CUDA graphs as Llama's do."""

from __future__ import annotations

from torch import nn

from sloserve.checkpoint.model_config import ModelConfig
from sloserve.engine.models.gpt2 import GPT2MLP
from sloserve.engine.models.llama import LayerNorm, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Starcoder2DecoderLayer(LlamaDecoderLayer):
    norm_class = LayerNorm

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        return GPT2MLP(config)  # (GPT-2's names and shape)


class Starcoder2Model(LlamaModel):
    layer_class = Starcoder2DecoderLayer
    norm_class = LayerNorm


class Starcoder2ForCausalLM(LlamaForCausalLM):
    model_class = Starcoder2Model
