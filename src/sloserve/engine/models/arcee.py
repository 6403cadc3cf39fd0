"""Arcee (``arcee``: AFM-4.5B): Llama's layers with a two-matrix MLP of squared ReLU (Nemotron's
``UpDownMLP``); Jais 2 (``jais2``): those layers with LayerNorms (with biases) and biases everywhere. HF parameter
names; piecewise graphs as Llama's."""

from __future__ import annotations

from torch import nn

from sloserve.checkpoint.model_config import ModelConfig
from sloserve.engine.models.llama import LayerNorm, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from sloserve.engine.models.nemotron import UpDownMLP


class ArceeDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        return UpDownMLP(config)


class ArceeModel(LlamaModel):
    layer_class = ArceeDecoderLayer


class ArceeForCausalLM(LlamaForCausalLM):
    model_class = ArceeModel


class Jais2DecoderLayer(ArceeDecoderLayer):
    norm_class = LayerNorm


class Jais2Model(LlamaModel):
    layer_class = Jais2DecoderLayer
    norm_class = LayerNorm


class Jais2ForCausalLM(LlamaForCausalLM):
    model_class = Jais2Model
