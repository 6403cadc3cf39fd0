"""GGUF checkpoints (llama.cpp's single-file format): ``--model PATH.gguf``.

``gguf_file`` reads the file: its metadata gives the config, the tokenizer and the chat template; its tensors are
dequantized to float32 (by the ``gguf`` package, ``gguf.quants.dequantize``: Q4_0, Q4_1, Q8_0, K-quants... as
llama.cpp defines them; on a GPU by the same arithmetic in torch there, ``gguf_dequant``) and copied into the model
under their HF names, so the engine runs the same weights transformers does when it loads the file
(``from_pretrained(gguf_file=...)``).

Supported: the Llama architecture (``general.architecture = llama``: Llama 2 and 3.x, SmolLM, Mistral without
sliding windows), SmolLM3, Granite 3, Qwen2, Qwen3, Qwen3-MoE (``qwen3moe``), Qwen2-MoE (``qwen2moe``), Phi-3 and
Phi-4 (``phi3``), OLMo 2 (``olmo2``), StableLM (``stablelm``), StarCoder2 (``starcoder2``), gpt-oss (``gpt-oss``:
its experts in MXFP4 or not, dequantized as the others; its YaRN ramp truncated, as llama.cpp computes it, where the
HF config says ``truncate: false``), Gemma (``gemma``: Gemma 1, CodeGemma), Gemma 2 and Gemma 3's text models, LFM2
and LFM2-MoE (``lfm2``, ``lfm2moe``), Mamba, Falcon Mamba (``mamba``, with ``ssm.dt_b_c_rms``), Mamba-2
(``mamba2``), Granite 4.0-H (``granitehybrid``), Nemotron-H and Nemotron 3 (``nemotron_h``, ``nemotron_h_moe``),
Falcon-H1 (``falcon-h1``), Jamba (``jamba``), Qwen3.5's text models (``qwen35``, ``qwen35moe``) and Qwen3-Next
(``qwen3next``), with a byte-level BPE tokenizer (``tokenizer.ggml.model = gpt2``; the pre-tokenizer's split pattern
by ``tokenizer.ggml.pre``) or a SentencePiece BPE one (``llama``: Llama 2, Mistral 7B, TinyLlama, Phi-3, Gemma).
Llama 3.1's rope scaling comes as llama.cpp stores it, a tensor of frequency factors (``rope_freqs.weight``); linear
and YaRN scaling as ``rope.scaling.*`` keys; Phi-3.5's and Phi-4 mini's LongRoPE as two tensors of factors
(``rope_factors_short/long.weight``).

NOTE: llama.cpp's converter permutes the rows of a Llama (SmolLM3, Granite; Granite 4.0-H's and Nemotron-H's
attention too, though they do not rotate) model's Q and K projections (its RoPE rotates adjacent pairs, HF's rotates
halves); ``_unpermute`` undoes it, as transformers' GGUF loader does. The others are converted unpermuted (llama.cpp
runs them with NEOX-style RoPE, HF's).
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sloserve.checkpoint.gguf_file import ELEMENT_DTYPES, GGUFFile, GGUFTensor, read_gguf_file
from sloserve.core.errors import ConfigError

# GGUF tensor names of the Llama architecture -> HF names ({n}: the layer).
LLAMA_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{n}.attn_norm.weight": "model.layers.{n}.input_layernorm.weight",
    "blk.{n}.ffn_norm.weight": "model.layers.{n}.post_attention_layernorm.weight",
    "blk.{n}.attn_q.weight": "model.layers.{n}.self_attn.q_proj.weight",
    "blk.{n}.attn_k.weight": "model.layers.{n}.self_attn.k_proj.weight",
    "blk.{n}.attn_v.weight": "model.layers.{n}.self_attn.v_proj.weight",
    "blk.{n}.attn_output.weight": "model.layers.{n}.self_attn.o_proj.weight",
    "blk.{n}.ffn_gate.weight": "model.layers.{n}.mlp.gate_proj.weight",
    "blk.{n}.ffn_up.weight": "model.layers.{n}.mlp.up_proj.weight",
    "blk.{n}.ffn_down.weight": "model.layers.{n}.mlp.down_proj.weight",
}
# More tensors of the other architectures
ARCH_TENSORS = {
    "llama": {},
    "gemma": {},  # (Gemma 1, CodeGemma: Llama's tensors, its norms shifted)
    "smollm3": {},
    "granite": {},
    "qwen2": {f"blk.{{n}}.attn_{x}.bias": f"model.layers.{{n}}.self_attn.{x}_proj.bias" for x in ("q", "k", "v")},
    "qwen3": {
        "blk.{n}.attn_q_norm.weight": "model.layers.{n}.self_attn.q_norm.weight",
        "blk.{n}.attn_k_norm.weight": "model.layers.{n}.self_attn.k_norm.weight",
    },
    "qwen3moe": {  # (the experts' stacked tensors: EXPERT_TENSORS)
        "blk.{n}.attn_q_norm.weight": "model.layers.{n}.self_attn.q_norm.weight",
        "blk.{n}.attn_k_norm.weight": "model.layers.{n}.self_attn.k_norm.weight",
        "blk.{n}.ffn_gate_inp.weight": "model.layers.{n}.mlp.gate.weight",
    },
    "qwen2moe": {  # Qwen2's biases; the router, the shared expert and its gate (the experts: EXPERT_TENSORS)
        **{f"blk.{{n}}.attn_{x}.bias": f"model.layers.{{n}}.self_attn.{x}_proj.bias" for x in ("q", "k", "v")},
        "blk.{n}.ffn_gate_inp.weight": "model.layers.{n}.mlp.gate.weight",
        **{
            f"blk.{{n}}.ffn_{x}_shexp.weight": f"model.layers.{{n}}.mlp.shared_expert.{x}_proj.weight"
            for x in ("gate", "up", "down")
        },
        "blk.{n}.ffn_gate_inp_shexp.weight": "model.layers.{n}.mlp.shared_expert_gate.weight",
    },
    "olmo2": {  # no norms before attention and the MLP: after them; query and key norms over whole projections
        "blk.{n}.attn_q_norm.weight": "model.layers.{n}.self_attn.q_norm.weight",
        "blk.{n}.attn_k_norm.weight": "model.layers.{n}.self_attn.k_norm.weight",
        "blk.{n}.post_attention_norm.weight": "model.layers.{n}.post_attention_layernorm.weight",
        "blk.{n}.post_ffw_norm.weight": "model.layers.{n}.post_feedforward_layernorm.weight",
    },
    "phi3": {  # Q/K/V and gate/up fused, as in its HF checkpoints (``FUSED_CHECKPOINTS``)
        "blk.{n}.attn_qkv.weight": "model.layers.{n}.self_attn.qkv_proj.weight",
        "blk.{n}.ffn_up.weight": "model.layers.{n}.mlp.gate_up_proj.weight",
    },
    "gemma2": {
        "blk.{n}.post_attention_norm.weight": "model.layers.{n}.post_attention_layernorm.weight",
        "blk.{n}.ffn_norm.weight": "model.layers.{n}.pre_feedforward_layernorm.weight",  # (Llama's: post_attention_)
        "blk.{n}.post_ffw_norm.weight": "model.layers.{n}.post_feedforward_layernorm.weight",
    },
}
ARCH_TENSORS["gpt-oss"] = {  # (its experts, stacked: GPT_OSS_EXPERTS)
    "blk.{n}.post_attention_norm.weight": "model.layers.{n}.post_attention_layernorm.weight",  # (before the MLP)
    **{f"blk.{{n}}.attn_{x}.bias": f"model.layers.{{n}}.self_attn.{x}_proj.bias" for x in ("q", "k", "v")},
    "blk.{n}.attn_output.bias": "model.layers.{n}.self_attn.o_proj.bias",
    "blk.{n}.attn_sinks.weight": "model.layers.{n}.self_attn.sinks",
    "blk.{n}.ffn_gate_inp.weight": "model.layers.{n}.mlp.router.weight",
    "blk.{n}.ffn_gate_inp.bias": "model.layers.{n}.mlp.router.bias",
}
# gpt-oss's stacked experts as llama.cpp's converter writes them (gate and up apart, each (E, I, H), down
# (E, H, I), biases beside; MXFP4 or not: ``gguf`` dequantizes either) -> (the part of transformers' tensor)
GPT_OSS_EXPERTS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}
GPT_OSS_EXPERT_PARTS = tuple(f"{part}.{kind}" for part in ("gate", "up", "down") for kind in ("weight", "bias"))
# LayerNorms' biases (StableLM's, StarCoder2's)
NORM_BIASES = {
    "blk.{n}.attn_norm.bias": "model.layers.{n}.input_layernorm.bias",
    "blk.{n}.ffn_norm.bias": "model.layers.{n}.post_attention_layernorm.bias",
    "output_norm.bias": "model.norm.bias",
}
ARCH_TENSORS["stablelm"] = {  # (and q/k/v biases where use_qkv_bias)
    **NORM_BIASES,
    **{f"blk.{{n}}.attn_{x}.bias": f"model.layers.{{n}}.self_attn.{x}_proj.bias" for x in ("q", "k", "v")},
}
ARCH_TENSORS["starcoder2"] = {  # (every projection's bias where use_bias; its MLP's two matrices)
    **ARCH_TENSORS["stablelm"],
    "blk.{n}.attn_output.bias": "model.layers.{n}.self_attn.o_proj.bias",
    "blk.{n}.ffn_up.weight": "model.layers.{n}.mlp.c_fc.weight",
    "blk.{n}.ffn_up.bias": "model.layers.{n}.mlp.c_fc.bias",
    "blk.{n}.ffn_down.weight": "model.layers.{n}.mlp.c_proj.weight",
    "blk.{n}.ffn_down.bias": "model.layers.{n}.mlp.c_proj.bias",
}
ARCH_TENSORS["lfm2"] = {  # LFM2's short convolutions (llama.cpp's ``shortconv``), its final norm named after the
    # embeddings (as its checkpoints name it: ``model.embedding_norm``, run after the last layer)
    **ARCH_TENSORS["qwen3"],
    **{
        f"blk.{{n}}.shortconv.{x}.weight": f"model.layers.{{n}}.conv.{x}.weight"
        for x in ("in_proj", "conv", "out_proj")
    },
    "token_embd_norm.weight": "model.norm.weight",
}
ARCH_TENSORS["lfm2moe"] = {  # LFM2-MoE's: LFM2's, the experts' router and its bias (``exp_probs_b``; stacked experts)
    **ARCH_TENSORS["lfm2"],
    "blk.{n}.ffn_gate_inp.weight": "model.layers.{n}.feed_forward.gate.weight",
    "blk.{n}.exp_probs_b.bias": "model.layers.{n}.feed_forward.expert_bias",
}
# Mamba's and Mamba-2's blocks (llama.cpp's ``mamba``: Falcon Mamba's too; ``mamba2``), under their HF names: the norm
# ``attn_norm``; the mixer's A as A = -exp(A_log) (``ssm_a``, read back as A_log), its convolution (C, taps);
# Mamba-2's step bias as ``ssm_dt.bias``, A, D (heads, 1) and its norm's weight by group (groups, d_inner / groups)
MAMBA_MIXER = {"ssm_in": "in_proj", "ssm_conv1d": "conv1d", "ssm_out": "out_proj"}
MAMBA_BACKBONE = {
    "token_embd.weight": "backbone.embeddings.weight",
    "output_norm.weight": "backbone.norm_f.weight",
    "blk.{n}.attn_norm.weight": "backbone.layers.{n}.norm.weight",
}


def _mamba_mixer_tensors(mixer: str, version: int) -> dict[str, str]:
    """llama.cpp's names of a layer's Mamba mixer's tensors -> its HF names under ``mixer`` (with ``{n}``): Mamba's
    (``version`` 1: ``ssm_x`` and the step's ``ssm_dt``) or Mamba-2's (its step's bias ``ssm_dt.bias``, its gated
    norm)."""
    projections = {**MAMBA_MIXER, **({"ssm_x": "x_proj", "ssm_dt": "dt_proj"} if version == 1 else {})}
    tensors = {
        **{
            f"blk.{{n}}.{ours}.{kind}": f"{mixer}.{theirs}.{kind}"
            for ours, theirs in projections.items()
            for kind in ("weight", "bias")
        },
        "blk.{n}.ssm_a": f"{mixer}.A_log",
        "blk.{n}.ssm_d": f"{mixer}.D",
    }
    if version == 2:
        tensors.update({"blk.{n}.ssm_dt.bias": f"{mixer}.dt_bias", "blk.{n}.ssm_norm.weight": f"{mixer}.norm.weight"})
    return tensors


ARCH_TENSORS["mamba"] = {**MAMBA_BACKBONE, **_mamba_mixer_tensors("backbone.layers.{n}.mixer", 1)}
ARCH_TENSORS["mamba2"] = {**MAMBA_BACKBONE, **_mamba_mixer_tensors("backbone.layers.{n}.mixer", 2)}
# Granite 4.0-H's (llama.cpp's ``granitehybrid``): Llama's layers, a Mamba-2 mixer where a layer does not attend (as
# Mamba-2's), its experts' router and stacked experts (Qwen3-MoE's) beside the shared MLP (``*_shexp``; without
# experts the shared MLP is Llama's own, ``ffn_gate``...)
ARCH_TENSORS["granitehybrid"] = {
    **_mamba_mixer_tensors("model.layers.{n}.mamba", 2),
    "blk.{n}.ffn_gate_inp.weight": "model.layers.{n}.mlp.gate.weight",
    "blk.{n}.ffn_down.weight": "model.layers.{n}.shared_mlp.output_linear.weight",
    "blk.{n}.ffn_down_shexp.weight": "model.layers.{n}.shared_mlp.output_linear.weight",
}
# Nemotron-H's (``nemotron_h``): blocks of a norm and one mixer each, under the Hub's names (``backbone.``, ``mixer``):
# a Mamba-2 mixer, attention or a two-matrix MLP
ARCH_TENSORS["nemotron_h"] = {
    **ARCH_TENSORS["mamba2"],
    **{
        f"blk.{{n}}.attn_{ours}.weight": f"backbone.layers.{{n}}.mixer.{theirs}_proj.weight"
        for ours, theirs in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o"))
    },  # fmt: skip
    **{f"blk.{{n}}.ffn_{x}.weight": f"backbone.layers.{{n}}.mixer.{x}_proj.weight" for x in ("up", "down")},
}
# Falcon-H1's (``falcon-h1``): Llama's layers, each with a Mamba-2 mixer beside its attention; its muP multipliers
# already folded into the weights by the converter (as the engine's loader folds a checkpoint's: 1 here)
ARCH_TENSORS["falcon-h1"] = _mamba_mixer_tensors("model.layers.{n}.mamba", 2)
# Jamba's (``jamba``): Llama's layers, Mamba's mixer (Mamba 1's ``ssm_*`` with its norms of the step, B and C) where a
# layer does not attend, experts (stacked: ``EXPERT_TENSORS``) where a layer has a router
ARCH_TENSORS["jamba"] = {
    **_mamba_mixer_tensors("model.layers.{n}.mamba", 1),
    **{f"blk.{{n}}.ssm_{x}_norm.weight": f"model.layers.{{n}}.mamba.{x}_layernorm.weight" for x in ("dt", "b", "c")},
    "blk.{n}.ffn_gate_inp.weight": "model.layers.{n}.mlp.gate.weight",
}
ARCH_TENSORS["nemotron_h_moe"] = {  # (Nemotron 3's: blocks of experts beside a shared one, their router's bias)
    **ARCH_TENSORS["nemotron_h"],
    "blk.{n}.ffn_gate_inp.weight": "backbone.layers.{n}.mixer.gate.weight",
    "blk.{n}.exp_probs_b.bias": "backbone.layers.{n}.mixer.gate.e_score_correction_bias",
    **{
        f"blk.{{n}}.ffn_{x}_shexp.weight": f"backbone.layers.{{n}}.mixer.shared_experts.{x}_proj.weight"
        for x in ("up", "down")
    },
}
# Qwen3.5's (``qwen35``: the dense 0.8B-27B): Qwen3's attention (its Q rows twice as many: each head's gate),
# gated DeltaNets (``linear_attn``) in the other layers, the second norm named ``post_attention_norm``
ARCH_TENSORS["qwen35"] = {
    **ARCH_TENSORS["qwen3"],
    "blk.{n}.post_attention_norm.weight": "model.layers.{n}.post_attention_layernorm.weight",
    **{
        f"blk.{{n}}.{ours}": f"model.layers.{{n}}.linear_attn.{theirs}"
        for ours, theirs in (
            ("attn_qkv.weight", "in_proj_qkv.weight"),
            ("attn_gate.weight", "in_proj_z.weight"),
            ("ssm_alpha.weight", "in_proj_a.weight"),
            ("ssm_beta.weight", "in_proj_b.weight"),
            ("ssm_a", "A_log"),
            ("ssm_dt.bias", "dt_bias"),
            ("ssm_conv1d.weight", "conv1d.weight"),
            ("ssm_norm.weight", "norm.weight"),
            ("ssm_out.weight", "out_proj.weight"),
        )
    },  # fmt: skip
}
# Qwen3.5's MoE (``qwen35moe``: 35B-A3B-397B-A17B): Qwen3.5's layers, experts in every one (stacked:
# ``EXPERT_TENSORS``; the converter splits the checkpoint's gate_up_proj) beside a shared expert and its gate
ARCH_TENSORS["qwen35moe"] = {
    **ARCH_TENSORS["qwen35"],
    "blk.{n}.ffn_gate_inp.weight": "model.layers.{n}.mlp.gate.weight",
    **{
        f"blk.{{n}}.ffn_{x}_shexp.weight": f"model.layers.{{n}}.mlp.shared_expert.{x}_proj.weight"
        for x in ("gate", "up", "down")
    },
    "blk.{n}.ffn_gate_inp_shexp.weight": "model.layers.{n}.mlp.shared_expert_gate.weight",
}
# Qwen3-Next's (``qwen3next``: 80B-A3B): the same, but for its DeltaNets' projections, its checkpoints' grouped by key
# head (each head's q, k, value heads' v, z: ``in_proj_qkvz``; b, a: ``in_proj_ba``). The converter writes q, k and v
# of all heads as ``attn_qkv`` and z as ``attn_gate`` (joined and grouped back: ``_qwen3next_grouped_qkvz``), b and a
# as they were (``ssm_ba``), and reorders no value heads
ARCH_TENSORS["qwen3next"] = {
    **{k: v for k, v in ARCH_TENSORS["qwen35moe"].items() if ".linear_attn.in_proj" not in v},
    "blk.{n}.ssm_ba.weight": "model.layers.{n}.linear_attn.in_proj_ba.weight",
}
QWEN35_ARCHS = ("qwen35", "qwen35moe", "qwen3next")
# Qwen3.5's tensors whose value heads the converter reorders (``_qwen35_value_heads_grouped``)
QWEN35_VALUE_HEAD_TENSORS = ("attn_qkv", "attn_gate", "ssm_alpha", "ssm_beta", "ssm_a", "ssm_dt", "ssm_conv1d",
                             "ssm_out")  # fmt: skip
# The architectures of Mamba-2 mixers (their tensors' shapes: ``MAMBA2_RESHAPED``)
MAMBA2_ARCHS = ("mamba2", "granitehybrid", "nemotron_h", "nemotron_h_moe", "falcon-h1")
# Tensors the converter splits that a checkpoint holds as one: GGUF name -> (HF name, the part's place in it). Granite
# 4.0-H's shared MLP (with experts ``*_shexp``, without them Llama's names): its gate rows, then its up rows, in
# ``shared_mlp.input_linear`` (the engine's ``gate_up_proj``, loaded whole: ``FUSED_CHECKPOINTS``)
JOINED_TENSORS = {
    "granitehybrid": {
        f"blk.{{n}}.ffn_{part}{suffix}.weight": ("model.layers.{n}.shared_mlp.input_linear.weight", place)
        for place, part in enumerate(("gate", "up"))
        for suffix in ("", "_shexp")
    },
    "qwen3next": {
        f"blk.{{n}}.attn_{part}.weight": ("model.layers.{n}.linear_attn.in_proj_qkvz.weight", place)
        for place, part in enumerate(("qkv", "gate"))
    },
}
# Mamba-2's tensors the converter writes in a shape of its own (A and D as (heads, 1); the norm by group): flattened
MAMBA2_RESHAPED = ("ssm_a", "ssm_d", "ssm_norm.weight")
# The architectures whose norms are LayerNorms: the HF config's name of their epsilon
LAYER_NORM_EPS_NAMES = {"stablelm": "layer_norm_eps", "starcoder2": "norm_epsilon"}
# The architectures whose rotary embedding may turn part of a head (``rope.dimension_count``)
PARTIAL_ROTARY_ARCHS = ("phi3", "stablelm", *QWEN35_ARCHS)
ARCH_TENSORS["gemma3"] = {
    **ARCH_TENSORS["gemma2"],
    "blk.{n}.attn_q_norm.weight": "model.layers.{n}.self_attn.q_norm.weight",
    "blk.{n}.attn_k_norm.weight": "model.layers.{n}.self_attn.k_norm.weight",
}
# The mixtures of experts: GGUF architecture -> HF model_type
GGUF_MOE = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe"}
# A mixture of experts' stacked tensors ((E, I, H) gate and up, (E, H, I) down), by the per-expert
# tensors of an HF checkpoint they split into (``mlp.experts.{e}.gate_proj.weight``...)
EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# ... or gate and up as one (E, 2 I, H), the gate's rows first (as llama.cpp's SwiGLU halves it; Qwen3.5-MoE's and
# Qwen3-Next's files may hold them so, as their checkpoints' gate_up_proj)
FUSED_EXPERTS = "ffn_gate_up_exps"
# The architectures whose Q and K rows llama.cpp's converter permutes (its Llama converter's)
PERMUTED = ("llama", "smollm3", "granite", "granitehybrid", "nemotron_h", "nemotron_h_moe")
# SmolLM3's layers without a rotary embedding: every fourth, as llama.cpp's code has it (the file does not say)
SMOLLM3_NO_ROPE_STEP = 4
# The architectures whose norms llama.cpp's converter stores as 1 + weight (Gemma's and Qwen3.5's RMSNorms scale by
# 1 + weight; llama.cpp's by the weight). NOTE: not Qwen3.5's DeltaNets' gated norm (``ssm_norm``), which scales by
# its weight
SHIFTED_NORMS = ("gemma", "gemma2", "gemma3", *QWEN35_ARCHS)
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")  # their SentencePiece vocabularies: see _gemma_vocabulary
# What llama.cpp's code says of a Gemma model that its file does not: which layers slide (every
# pattern-th is global), the layer count of the 27B model (its scores are scaled by (hidden / heads)
# ** -0.5, the others' by head_dim ** -0.5), the caps when the file names none (Gemma 2's)
GEMMA_LAYOUT = {
    "gemma2": {"pattern": 2, "layers_27b": 46, "attn_softcap": 50.0, "final_softcap": 30.0},
    "gemma3": {"pattern": 6, "layers_27b": 62, "attn_softcap": None, "final_softcap": None},
}
# The split pattern of a byte-level BPE pre-tokenizer, by tokenizer.ggml.pre, as transformers' GGUF reader
# sets them: Qwen's; Llama 3's (digits in runs of at most three, as its tokenizer.json has it); Mistral's
# Tekken (Nemo). None: GPT-2's, the ByteLevel pre-tokenizer's own (a file without the key too). NOTE: a
# name not here is refused (``gguf_tokenizer``): split another way, the same text would read as other tokens.
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
LLAMA3_SPLIT = QWEN_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
# Qwen3.5's: Qwen's, a word's combining marks (\p{M}: accents written apart) kept with its letters
QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT4O_SPLIT = (  # (tiktoken's o200k: Tekken's letters with the contractions attached, digits in threes)
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS: dict[str | None, str | None] = {
    None: None,
    "default": None,
    "gpt-2": None,
    # (llama.cpp's other names of GPT-2's pattern: OLMo's GPT-NeoX vocabulary, MPT's, Phi-2's, Jais's)
    **dict.fromkeys(("olmo", "mpt", "phi-2", "jais")),
    "smollm": None,  # NOTE: llama.cpp splits its digits one by one first; its vocabulary has no runs of them
    "starcoder": None,  # (StarCoder2's: as SmolLM's, llama.cpp's case)
    "stablelm2": QWEN_SPLIT,  # (StableLM 2's: Qwen's pattern, llama.cpp's case)
    "qwen2": QWEN_SPLIT,
    "qwen35": QWEN35_SPLIT,  # (Qwen3.5's; llama.cpp's case)
    "deepseek-r1-qwen": QWEN_SPLIT,
    "llama-bpe": LLAMA3_SPLIT,
    "llama3": LLAMA3_SPLIT,
    "llama-v3": LLAMA3_SPLIT,
    "falcon3": LLAMA3_SPLIT,
    "falcon-h1": LLAMA3_SPLIT,  # (Falcon-H1's, llama.cpp's and transformers' case)
    "midm-2.0": LLAMA3_SPLIT,
    "smaug-bpe": LLAMA3_SPLIT,
    "dbrx": LLAMA3_SPLIT,  # (Phi-4's: GPT-4's cl100k split, Llama 3's pattern)
    "pixtral": LLAMA3_SPLIT,
    "tekken": TEKKEN_SPLIT,
    "lfm2": LLAMA3_SPLIT,  # (llama.cpp's: LFM2's pattern is Llama 3's)
    "gpt-4o": GPT4O_SPLIT,  # (Phi-4 mini's)
}
# The pre-tokenizers after whose split llama.cpp takes a piece that is a token whole, merges or not (its
# ``ignore_merges``: Llama 3's and Mistral Nemo's tokenizer.json say so, as tiktoken encodes). NOTE: transformers'
# GGUF reader does not; on a vocabulary whose merges reach every token (a trained one) the two agree.
WHOLE_PIECE_PRE_TOKENIZERS = frozenset(
    {"llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "tekken"}
)
# The ids that end a generation besides EOS (llama.cpp's end-of-generation tokens): Llama 3.1's
# <|eot_id|> (end of turn) and <|eom_id|> (end of a message that called a tool), as its generation config
# lists them
END_OF_GENERATION_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
# ... and the tokens llama.cpp ends a generation at by their text, whatever ids the file names (converters
# write one EOS; a model's generation config lists more: Gemma 3's <end_of_turn> beside <eos>, Qwen's
# <|im_end|> beside <|endoftext|>)
END_OF_GENERATION_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
    "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
})  # fmt: skip
# Llama 3.1's rope scaling, as llama.cpp's converter stores it: per frequency, the factor its wavelength
# is stretched by (1 for the short ones, the scaling factor for the long ones, a ramp between)
ROPE_FREQS = "rope_freqs.weight"
# LongRoPE's factors per frequency (Phi-3.5, Phi-4 mini): HF's name -> the GGUF tensor's
LONGROPE_FACTORS = {"short_factor": "rope_factors_short.weight", "long_factor": "rope_factors_long.weight"}
TOKEN_TYPE_CONTROL = 3  # llama.cpp's token types: 1 normal, 3 control (special), 4 user-defined
TOKEN_TYPE_USER_DEFINED = 4  # an added token that is not special (Qwen3's <think>, <tool_call>)


def is_gguf(model: str) -> bool:
    return model.lower().endswith(".gguf")


def _reader(path: Path) -> GGUFFile:
    if not path.is_file():
        raise ConfigError(f"--model {path}: no such GGUF file")
    try:
        file = read_gguf_file(path)
        if importlib.util.find_spec("gguf") is not None:  # (the engine's install: a cut-off tensor refused now)
            file.check_tensors()
        return file
    except (ValueError, OSError) as e:
        # NOTE: a file that starts as GGUF but does not parse is named as such
        with path.open("rb") as f:
            starts_as_gguf = f.read(4) == b"GGUF"
        what = f"truncated or corrupt: {path.stat().st_size:,} bytes" if starts_as_gguf else "not a GGUF file"
        raise ConfigError(f"--model {path}: not a readable GGUF file ({what}; the reader says: {e})") from None


@dataclass
class GGUFCheckpoint:
    """What a GGUF file holds, in the forms the engine loads from an HF directory."""

    path: Path
    hf_config: dict[str, Any]  # as an HF config.json would give it
    metadata: dict[str, Any]
    reader: GGUFFile | None = field(repr=False, default=None)  # its tensors (views of the memory-mapped file)

    @property
    def chat_template(self) -> str | None:
        return self.metadata.get("tokenizer.chat_template")

    def special_tokens(self) -> dict[str, str]:
        """``bos_token``... as text, for chat templates."""
        tokens = self.metadata.get("tokenizer.ggml.tokens") or []
        named = {}
        for name in ("bos", "eos", "unknown", "padding"):
            token_id = self.metadata.get(f"tokenizer.ggml.{name}_token_id")
            if token_id is not None and token_id < len(tokens):
                named[{"unknown": "unk_token", "padding": "pad_token"}.get(name, f"{name}_token")] = tokens[token_id]
        return named


def read_gguf(path: str | Path) -> GGUFCheckpoint:
    """The config and metadata of a GGUF file (tensors are read by ``gguf_tensors``)."""
    path = Path(path).expanduser()
    stat = path.stat() if path.is_file() else None
    return _read_gguf(path, None if stat is None else (stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=4)
def _read_gguf(path: Path, version: tuple[int, int] | None) -> GGUFCheckpoint:
    """NOTE: cached by (path, mtime, size): the engine, its tokenizer and the chat template each need
    the file, and parsing its metadata (~100k tokens and merges) takes seconds."""
    reader = _reader(path)
    meta = reader.metadata
    arch = meta.get("general.architecture")
    if arch not in ARCH_TENSORS:
        raise ConfigError(f"{path}: GGUF architecture {arch!r} is not supported ({', '.join(ARCH_TENSORS)})")

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in meta:
            raise ConfigError(f"{path}: GGUF metadata has no '{arch}.{key}'")
        return meta[f"{arch}.{key}"]

    hidden = need("embedding_length")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    eos = {meta[key] for key in END_OF_GENERATION_KEYS if meta.get(key) is not None}
    eos |= {token_id for token_id, token in enumerate(tokens) if token in END_OF_GENERATION_TEXTS}
    names = {t.name for t in reader.tensors}
    # (every architecture's: its vocabulary and special ids, float32 weights, an LM head of its own or the embeddings')
    vocabulary = {
        "vocab_size": meta.get(f"{arch}.vocab_size") or len(tokens),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": sorted(eos),
        "torch_dtype": "float32",  # dequantized weights are float32
        "tie_word_embeddings": "output.weight" not in names,
    }
    if arch in ("mamba", "mamba2"):
        return GGUFCheckpoint(path, {**_mamba_config(meta, arch, need, names, path), **vocabulary}, meta, reader)
    heads = need("attention.head_count")
    # (a Qwen3-MoE file may have no dense MLP's length: its every MLP is the experts)
    experts_only = arch in GGUF_MOE or arch in ("gpt-oss", "qwen35moe", "qwen3next")
    dense_mlp = meta.get(f"{arch}.feed_forward_length") if experts_only else need("feed_forward_length")
    config = {
        "model_type": "gemma3_text" if arch == "gemma3" else arch,
        **vocabulary,
        "hidden_size": hidden,
        "intermediate_size": dense_mlp,
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", heads),
        "head_dim": meta.get(f"{arch}.attention.key_length") or hidden // heads,
        "max_position_embeddings": need("context_length"),
        **(
            {LAYER_NORM_EPS_NAMES[arch]: float(need("attention.layer_norm_epsilon"))}
            if arch in LAYER_NORM_EPS_NAMES
            else {"rms_norm_eps": float(need("attention.layer_norm_rms_epsilon"))}
        ),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
    }
    rotated = meta.get(f"{arch}.rope.dimension_count")
    if rotated is not None and rotated != config["head_dim"]:
        # NOTE: Phi-4 mini's partial rotary, as transformers' phi3 reads it, and StableLM's (its other archs
        # rotate whole heads)
        if (
            arch not in PARTIAL_ROTARY_ARCHS
            or not isinstance(rotated, int)
            or int(config["head_dim"] * (rotated / config["head_dim"])) != rotated
        ):
            raise ConfigError(
                f"{path}: GGUF {arch}.rope.dimension_count {rotated} rotates part of a head of {config['head_dim']}; "
                f"partial rotary embeddings are supported for {', '.join(PARTIAL_ROTARY_ARCHS)} only"
            )
        config["partial_rotary_factor"] = rotated / config["head_dim"]
    config["rope_scaling"] = _rope_scaling(meta, arch, path)
    if arch in GEMMA_LAYOUT:
        config.update(_gemma_config(meta, arch, config, path))
    if arch in GGUF_MOE:  # every layer's MLP the experts (llama.cpp's qwen3moe and qwen2moe)
        config.update(
            model_type=GGUF_MOE[arch],
            num_experts=need("expert_count"),
            num_experts_per_tok=need("expert_used_count"),
            moe_intermediate_size=need("expert_feed_forward_length"),
            # NOTE: llama.cpp renormalizes Qwen3-MoE's top weights, not Qwen2-MoE's (as their HF configs say)
            norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm", arch == "qwen3moe")),
        )
        if arch == "qwen2moe":
            config["shared_expert_intermediate_size"] = need("expert_shared_feed_forward_length")
        config["intermediate_size"] = config["intermediate_size"] or config["moe_intermediate_size"]
    if arch == "gpt-oss":  # every layer's MLP the experts; every other layer sliding (llama.cpp's pattern)
        config.update(
            model_type="gpt_oss",
            num_local_experts=need("expert_count"),
            num_experts_per_tok=need("expert_used_count"),
            intermediate_size=need("expert_feed_forward_length"),
            sliding_window=need("attention.sliding_window"),
        )
    # (Granite's scales, under llama.cpp's names; absent: none, as llama.cpp reads it)
    if arch in ("granite", "granitehybrid"):
        scales = {"embedding_multiplier": "embedding_scale", "residual_multiplier": "residual_scale",
                  "attention_multiplier": "attention.scale", "logits_scaling": "logit_scale"}  # fmt: skip
        config.update({hf: float(meta[f"{arch}.{key}"]) for hf, key in scales.items() if meta.get(f"{arch}.{key}")})
    if arch == "granitehybrid":
        config.update(_granite_hybrid_config(meta, config, need, names, path))
    if arch in ("nemotron_h", "nemotron_h_moe"):
        config.update(_nemotron_h_config(meta, arch, config, need, names, path))
    if arch == "falcon-h1":
        config.update(_falcon_h1_config(config, need, names, path))
    if arch in QWEN35_ARCHS:
        config.update(_qwen35_config(meta, arch, config, need, path))
    if arch == "jamba":
        config.update(_jamba_config(meta, config, need, names, path))
    if arch == "smollm3":  # (HF's name: 1 rotates)
        config["no_rope_layers"] = [
            int((i + 1) % SMOLLM3_NO_ROPE_STEP != 0) for i in range(config["num_hidden_layers"])
        ]
    if arch == "olmo2" and meta.get("olmo2.attention.sliding_window"):
        # NOTE: llama.cpp writes Olmo 3 as olmo2 with a window on three layers of four, and runs the sliding
        # layers' rope by rules of its own (not read here: HF's olmo3 checkpoints are)
        raise ConfigError(
            f"{path}: GGUF olmo2 with olmo2.attention.sliding_window {meta['olmo2.attention.sliding_window']} "
            "(Olmo 3's sliding layers) is not supported"
        )
    if arch in ("lfm2", "lfm2moe"):  # KV heads a count a layer, 0 where it convolves (llama.cpp's converter's); the
        # file's MLP length is the one the layers have (not a size to adjust, as its config's)
        kv_heads = _kv_heads_by_layer(arch, config["num_key_value_heads"], config["num_hidden_layers"], path)
        config.update(
            num_key_value_heads=max(kv_heads),
            layer_types=["full_attention" if n else "conv" for n in kv_heads],
            block_auto_adjust_ff_dim=False,
            conv_L_cache=need("shortconv.l_cache"),
        )
    if arch == "lfm2moe":
        config.update(_lfm2_moe_config(meta, need, names, path))
    if arch == "stablelm":  # (its biases and second norms, as the tensors say: transformers' GGUF reader's rule)
        config["use_qkv_bias"] = "blk.0.attn_q.bias" in names
        config["use_parallel_residual"] = bool(
            meta.get("stablelm.use_parallel_residual", "blk.0.ffn_norm.weight" not in names)
        )
        config["partial_rotary_factor"] = config.get("partial_rotary_factor", 1.0)
    if arch == "starcoder2":  # (no window: llama.cpp attends to every position)
        config["use_bias"] = "blk.0.attn_q.bias" in names
    if arch == "phi3":  # every layer's window (Phi-3 mini's 2,047; 0: none, Phi-4's)
        config["sliding_window"] = meta.get("phi3.attention.sliding_window") or None
        if any(t.name in LONGROPE_FACTORS.values() for t in reader.tensors):
            config["rope_scaling"] = _longrope_scaling(meta, reader, rotated or config["head_dim"], path)
    factors = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if factors is not None:
        frequencies = config["head_dim"] // 2
        config["rope_scaling"] = {"rope_type": "frequency_factors",
                                  "factors": _frequency_factors(factors, frequencies, path)}  # fmt: skip
    return GGUFCheckpoint(path, config, meta, reader)


def _mamba_config(meta: dict[str, Any], arch: str, need: Callable[[str], Any], names: set[str], path: Path):
    """Mamba's, Falcon Mamba's or Mamba-2's config from llama.cpp's keys (``ssm.*``; its head count and MLP length 0).
    Falcon Mamba's is ``mamba`` with ``ssm.dt_b_c_rms``: its norms of the step, B and C at the file's one epsilon, as
    llama.cpp runs them (the file has no mixer_rms_eps). The biases where the file has them. The context is not the
    file's (the converter's 2**20, "arbitrary" by its own word): the default of a config that names none."""
    hidden = need("embedding_length")
    eps = float(need("attention.layer_norm_rms_epsilon"))
    config = {
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": need("block_count"),
        "expand": _mamba_expand(arch, hidden, need, path),
        "state_size": need("ssm.state_size"),
        "conv_kernel": need("ssm.conv_kernel"),
        "layer_norm_epsilon": eps,
        "use_bias": "blk.0.ssm_in.bias" in names,
        "use_conv_bias": "blk.0.ssm_conv1d.bias" in names,
    }
    if arch == "mamba":
        config["time_step_rank"] = need("ssm.time_step_rank")
        if meta.get("mamba.ssm.dt_b_c_rms"):
            config.update(model_type="falcon_mamba", mixer_rms_eps=eps)
        return config
    heads, head_dim = _mamba2_heads(arch, need, path)
    config.update(num_heads=heads, head_dim=head_dim, n_groups=need("ssm.group_count"))
    return config


def _lfm2_moe_config(meta: dict[str, Any], need: Callable[[str], Any], names: set[str], path: Path) -> dict[str, Any]:
    """LFM2-MoE's experts (llama.cpp's ``lfm2moe``) as transformers names them: their count, the used, their length,
    the leading dense layers; sigmoid scores (``expert_gating_func`` 2, the only one llama.cpp runs it with) chosen
    with the router's bias where the file has it, renormalized and scaled as ``expert_weights_norm`` and
    ``expert_weights_scale`` say (absent: renormalized, unscaled, llama.cpp's)."""
    gating = meta.get("lfm2moe.expert_gating_func", 2)
    if gating != 2:
        raise ConfigError(f"{path}: GGUF lfm2moe.expert_gating_func {gating!r} is not supported (2: sigmoid)")
    dense = need("leading_dense_block_count")
    return {
        "model_type": "lfm2_moe",
        "num_experts": need("expert_count"),
        "num_experts_per_tok": need("expert_used_count"),
        "moe_intermediate_size": need("expert_feed_forward_length"),
        "num_dense_layers": dense,
        "norm_topk_prob": bool(meta.get("lfm2moe.expert_weights_norm", True)),
        "routed_scaling_factor": float(meta.get("lfm2moe.expert_weights_scale") or 1.0),
        "use_expert_bias": f"blk.{dense}.exp_probs_b.bias" in names,
    }


def _granite_hybrid_config(
    meta: dict[str, Any], config: dict[str, Any], need: Callable[[str], Any], names: set[str], path: Path
) -> dict[str, Any]:
    """Granite 4.0-H's config (llama.cpp's ``granitehybrid``) as transformers names it (``granitemoehybrid``): a
    layer attends where ``attention.head_count_kv`` gives it KV heads, else a Mamba-2 mixer of the ``ssm.*`` keys
    (its heads are ``ssm.time_step_rank``); its experts' count (0: its MLP the shared one) and the shared MLP's
    length; no position embedding, as the 4.0-H models have none. A file that rotates (``rope.scaling.finetuned``:
    Bamba's, converted as Granite's) is refused: its partial rotary embedding would be read as none."""
    if meta.get("granitehybrid.rope.scaling.finetuned"):
        raise ConfigError(
            f"{path}: GGUF granitehybrid with granitehybrid.rope.scaling.finetuned (a rotary embedding: Bamba's) is not "
            "supported; Granite 4.0-H's files (no position embedding) are"
        )
    kv_heads = _kv_heads_by_layer("granitehybrid", config["num_key_value_heads"], config["num_hidden_layers"], path)
    heads, head_dim = _mamba2_heads("granitehybrid", need, path)
    mixer = f"blk.{kv_heads.index(0)}" if 0 in kv_heads else None
    return {
        "model_type": "granitemoehybrid",
        "num_key_value_heads": max(kv_heads),
        "layer_types": ["attention" if n else "mamba" for n in kv_heads],
        "position_embedding_type": "nope",
        "num_local_experts": meta.get("granitehybrid.expert_count") or 0,
        "num_experts_per_tok": meta.get("granitehybrid.expert_used_count") or 0,
        "shared_intermediate_size": need("expert_shared_feed_forward_length"),
        "mamba_n_heads": heads,
        "mamba_d_head": head_dim,
        "mamba_expand": _mamba_expand("granitehybrid", config["hidden_size"], need, path),
        "mamba_d_state": need("ssm.state_size"),
        "mamba_d_conv": need("ssm.conv_kernel"),
        "mamba_n_groups": need("ssm.group_count"),
        "mamba_conv_bias": f"{mixer}.ssm_conv1d.bias" in names,
        "mamba_proj_bias": f"{mixer}.ssm_in.bias" in names,
    }


def _nemotron_h_config(
    meta: dict[str, Any], arch: str, config: dict[str, Any], need: Callable[[str], Any], names: set[str], path: Path
) -> dict[str, Any]:
    """Nemotron-H's config (llama.cpp's ``nemotron_h``: Nemotron-H, Nemotron Nano 2; ``nemotron_h_moe``: Nemotron 3
    Nano) as the Hub names it: each block attention where ``attention.head_count_kv`` gives it KV heads, experts where
    it has a router (``ffn_gate_inp``), an MLP where ``feed_forward_length`` gives it a length, else a Mamba-2 mixer
    (its ``ssm.*`` keys as Granite 4.0-H's). The experts' routing by the ``expert_*`` keys (absent: one group, as
    llama.cpp reads them). The steps unclamped, as llama.cpp runs them (the file has no time_step_min)."""
    layers = config["num_hidden_layers"]
    kv_heads = _kv_heads_by_layer(arch, config["num_key_value_heads"], layers, path)
    lengths = config["intermediate_size"]
    lengths = [lengths] * layers if isinstance(lengths, int) else lengths
    if not (
        isinstance(lengths, list) and len(lengths) == layers and all(isinstance(n, int) and n >= 0 for n in lengths)
    ):
        raise ConfigError(
            f"{path}: GGUF {arch}.feed_forward_length must list each of the {layers} blocks' MLP length (0: not "
            f"an MLP); got {lengths!r}"
        )
    routed = [f"blk.{i}.ffn_gate_inp.weight" in names for i in range(layers)]
    kinds = ["*" if kv else "E" if moe else "-" if n else "M" for kv, moe, n in zip(kv_heads, routed, lengths)]
    heads, head_dim = _mamba2_heads(arch, need, path)
    mixer = f"blk.{kinds.index('M')}" if "M" in kinds else None
    nemotron_h = {
        "model_type": "nemotron_h",
        "hybrid_override_pattern": "".join(kinds),
        "num_key_value_heads": max(kv_heads),
        "intermediate_size": max(lengths),
        "layer_norm_epsilon": config["rms_norm_eps"],
        "mamba_num_heads": heads,
        "mamba_head_dim": head_dim,
        "n_groups": need("ssm.group_count"),
        "ssm_state_size": need("ssm.state_size"),
        "conv_kernel": need("ssm.conv_kernel"),
        "use_conv_bias": f"{mixer}.ssm_conv1d.bias" in names,
        "use_bias": f"{mixer}.ssm_in.bias" in names,
        "time_step_min": 0.0,
    }
    if any(routed):
        if meta.get(f"{arch}.moe_latent_size"):
            raise ConfigError(f"{path}: GGUF {arch}.moe_latent_size (experts on a latent projection) is not supported")
        nemotron_h.update(
            n_routed_experts=need("expert_count"),
            num_experts_per_tok=need("expert_used_count"),
            moe_intermediate_size=need("expert_feed_forward_length"),
            moe_shared_expert_intermediate_size=need("expert_shared_feed_forward_length"),
            norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm", True)),
            routed_scaling_factor=float(meta.get(f"{arch}.expert_weights_scale") or 1.0),
            n_group=meta.get(f"{arch}.expert_group_count") or 1,
            topk_group=meta.get(f"{arch}.expert_group_used_count") or 1,
        )
    return nemotron_h


def _qwen35_config(meta: dict[str, Any], arch: str, config: dict[str, Any], need: Callable[[str], Any], path: Path):
    """Qwen3.5's text model's config (llama.cpp's ``qwen35``; ``qwen35moe``: its experts too, in every layer, with a
    shared expert, the top weights renormalized as transformers' Qwen3.5-MoE does; ``qwen3next``: Qwen3-Next's, the
    same layers) as transformers names it: full attention every
    ``full_attention_interval``-th layer, gated DeltaNets elsewhere (their heads by the ``ssm.*`` keys: the key heads
    ``group_count`` of ``state_size``, the value heads ``time_step_rank`` of ``inner_size`` in all). The
    multi-token-prediction blocks the converter appends (``nextn_predict_layers``) are left out, as the engine runs
    none. NOTE: the file's interleaved MRoPE sections (``rope.dimension_sections``) turn a text's positions as one
    rotary embedding does: its three position ids are equal."""
    interval = need("full_attention_interval")
    layers = config["num_hidden_layers"] - (meta.get(f"{arch}.nextn_predict_layers") or 0)
    value_heads, value_width = need("ssm.time_step_rank"), need("ssm.inner_size")
    key_heads = need("ssm.group_count")
    if not (isinstance(interval, int) and interval >= 1 and layers >= 1 and value_heads % key_heads == 0
            and value_width % value_heads == 0):  # fmt: skip
        raise ConfigError(
            f"{path}: GGUF {arch}'s full_attention_interval {interval!r}, {layers} layers (less the "
            f"nextn_predict_layers), ssm.inner_size {value_width} over ssm.time_step_rank {value_heads} value heads "
            f"over ssm.group_count {key_heads} key heads do not make Qwen3.5's layers"
        )
    experts = {}
    # NOTE: experts in every layer (no decoder_sparse_step, mlp_only_layers: the defaults), as llama.cpp builds them
    if arch in ("qwen35moe", "qwen3next"):
        experts = {
            "num_experts": need("expert_count"),
            "num_experts_per_tok": need("expert_used_count"),
            "moe_intermediate_size": need("expert_feed_forward_length"),
            "shared_expert_intermediate_size": need("expert_shared_feed_forward_length"),
        }
    return {
        "model_type": {"qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text", "qwen3next": "qwen3_next"}[arch],
        **experts,
        "num_hidden_layers": layers,
        "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)],
        "linear_conv_kernel_dim": need("ssm.conv_kernel"),
        "linear_key_head_dim": need("ssm.state_size"),
        "linear_num_key_heads": key_heads,
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": value_width // value_heads,
        "partial_rotary_factor": config.get("partial_rotary_factor", 1.0),
    }


def _qwen35_value_heads_grouped(name: str, weight, config: dict[str, Any]):
    """A Qwen3.5 DeltaNet tensor with its value heads back in transformers' order. NOTE: where a key head has several
    value heads, llama.cpp's converter reorders them from grouped by key head (K0's v0, v1, then K1's) to tiled (K0's
    v0, K1's v0, K0's v1, K1's v1): in the value rows of ``attn_qkv``, the rows of ``attn_gate``, ``ssm_alpha`` and
    ``ssm_beta``, ``ssm_a``, ``ssm_dt``, the value channels of ``ssm_conv1d`` and the columns of ``ssm_out``."""
    import torch

    key_heads, value_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    kind = name.split(".")[2] if name.startswith("blk.") else None
    if key_heads == value_heads or kind not in QWEN35_VALUE_HEAD_TENSORS:
        return weight
    per_key = value_heads // key_heads

    def grouped(x, axis: int, head_width: int):  # (tiled: per_key, key_heads, head_width)
        tiled = x.reshape(*x.shape[:axis], per_key, key_heads, head_width, *x.shape[axis + 1 :])
        return tiled.swapaxes(axis, axis + 1).reshape(x.shape)

    width = config["linear_value_head_dim"]
    if kind in ("attn_qkv", "ssm_conv1d"):  # (the queries' and keys' rows or channels first, as they were)
        keys = 2 * key_heads * config["linear_key_head_dim"]
        return torch.cat([weight[:keys], grouped(weight[keys:], 0, width)])
    if kind == "ssm_out":
        return grouped(weight, 1, width)
    return grouped(weight, 0, width if kind == "attn_gate" else 1)


def _qwen3next_grouped_qkvz(qkv, z, config: dict[str, Any]):
    """Qwen3-Next's ``in_proj_qkvz`` (rows grouped by key head: its q, its k, its value heads' v, then z) from the
    converter's ``attn_qkv`` (all heads' q, then k, v) and ``attn_gate`` (z), as the checkpoint holds it."""
    import torch

    key_heads, key_width = config["linear_num_key_heads"], config["linear_key_head_dim"]
    group_values = config["linear_num_value_heads"] // key_heads * config["linear_value_head_dim"]
    q, k, v = qkv.split([key_heads * key_width] * 2 + [key_heads * group_values])
    parts = [part.reshape(key_heads, -1, qkv.shape[-1]) for part in (q, k, v, z)]  # (k heads, rows, H)
    return torch.cat(parts, dim=1).reshape(-1, qkv.shape[-1])


# How a joined tensor's two parts make the checkpoint's (``JOINED_TENSORS``; else the first's rows, then the second's)
JOINS = {"qwen3next": _qwen3next_grouped_qkvz}


def _falcon_h1_config(
    config: dict[str, Any], need: Callable[[str], Any], names: set[str], path: Path
) -> dict[str, Any]:
    """Falcon-H1's config (llama.cpp's ``falcon-h1``) as transformers names it: its mixers' ``ssm.*`` keys (their heads
    ``ssm.time_step_rank``), their gated norm where the file has its weights, after the gate (as llama.cpp runs it;
    the file does not say ``mamba_norm_before_gate``), the biases where the file has them; every muP multiplier 1,
    the converter having folded them into the weights."""
    heads, head_dim = _mamba2_heads("falcon-h1", need, path)
    return {
        "model_type": "falcon_h1",
        "mamba_d_ssm": heads * head_dim,
        "mamba_n_heads": heads,
        "mamba_d_head": head_dim,
        "mamba_n_groups": need("ssm.group_count"),
        "mamba_d_state": need("ssm.state_size"),
        "mamba_d_conv": need("ssm.conv_kernel"),
        "mamba_rms_norm": "blk.0.ssm_norm.weight" in names,
        "mamba_norm_before_gate": False,
        "mamba_conv_bias": "blk.0.ssm_conv1d.bias" in names,
        "mamba_proj_bias": "blk.0.ssm_in.bias" in names,
        "projectors_bias": "blk.0.ssm_out.bias" in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
    }


def _jamba_config(
    meta: dict[str, Any], config: dict[str, Any], need: Callable[[str], Any], names: set[str], path: Path
) -> dict[str, Any]:
    """Jamba's config (llama.cpp's ``jamba``) as transformers names it: the attention layers those with KV heads
    (``attention.head_count_kv``), the experts' those with a router (``ffn_gate_inp``), each as the period and offset
    of its config (a file of another layout refused); Mamba's mixers of the ``ssm.*`` keys, biases where the file has
    them."""
    layers = config["num_hidden_layers"]
    kv_heads = _kv_heads_by_layer("jamba", config["num_key_value_heads"], layers, path)
    attn_period, attn_offset = _period_and_offset([i for i, n in enumerate(kv_heads) if n], layers, "attention", path)
    routed = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in names]
    experts = need("expert_count") if routed else 1  # (one expert: transformers' dense MLP)
    expert_period, expert_offset = _period_and_offset(routed, layers, "experts'", path) if routed else (1, 0)
    mixer = f"blk.{kv_heads.index(0)}" if 0 in kv_heads else None
    return {
        "num_key_value_heads": max(kv_heads),
        "attn_layer_period": attn_period,
        "attn_layer_offset": attn_offset,
        "num_experts": experts,
        "num_experts_per_tok": meta.get("jamba.expert_used_count") or 1,
        "expert_layer_period": expert_period,
        "expert_layer_offset": expert_offset,
        "mamba_d_state": need("ssm.state_size"),
        "mamba_d_conv": need("ssm.conv_kernel"),
        "mamba_expand": _mamba_expand("jamba", config["hidden_size"], need, path),
        "mamba_dt_rank": need("ssm.time_step_rank"),
        "mamba_conv_bias": f"{mixer}.ssm_conv1d.bias" in names,
        "mamba_proj_bias": f"{mixer}.ssm_in.bias" in names,
    }


def _period_and_offset(indices: list[int], layers: int, what: str, path: Path) -> tuple[int, int]:
    """The (period, offset) of Jamba's config whose layers ``i % period == offset`` are ``indices``, or a ConfigError."""
    offset = indices[0] if indices else 0
    period = indices[1] - indices[0] if len(indices) > 1 else layers
    if not indices or [i for i in range(layers) if i % period == offset] != indices:
        raise ConfigError(
            f"{path}: GGUF jamba's {what} layers {indices} are not every period-th layer from an offset (Jamba's layout)"
        )
    return period, offset


def _mamba_expand(arch: str, hidden: Any, need: Callable[[str], Any], path: Path) -> int:
    """A Mamba mixer's channels a hidden one (transformers' ``expand``) from llama.cpp's ``ssm.inner_size``."""
    inner = need("ssm.inner_size")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in (inner, hidden)) or inner % hidden:
        raise ConfigError(
            f"{path}: GGUF {arch}.ssm.inner_size {inner!r} must be a multiple of embedding_length {hidden}"
        )
    return inner // hidden


def _mamba2_heads(arch: str, need: Callable[[str], Any], path: Path) -> tuple[int, int]:
    """A Mamba-2 mixer's (heads, their width) from llama.cpp's ``ssm.time_step_rank`` (its heads: a step each) and
    ``ssm.inner_size``."""
    inner, heads = need("ssm.inner_size"), need("ssm.time_step_rank")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in (inner, heads)) or inner % heads:
        raise ConfigError(
            f"{path}: GGUF {arch}.ssm.inner_size {inner!r} must be a multiple of ssm.time_step_rank {heads!r} (the "
            "mixers' heads)"
        )
    return heads, inner // heads


def _kv_heads_by_layer(arch: str, counts: Any, layers: int, path: Path) -> list[int]:
    """LFM2's, Granite 4.0-H's and Nemotron-H's ``attention.head_count_kv``: a count a layer, 0 for a layer that does
    not attend (a short convolution's, a Mamba-2 mixer's, an MLP block's; one count: every layer's)."""
    if isinstance(counts, int):
        counts = [counts] * layers
    if not (
        isinstance(counts, list)
        and len(counts) == layers
        and all(isinstance(n, int) and n >= 0 for n in counts)
        and any(counts)
    ):
        raise ConfigError(
            f"{path}: GGUF {arch}.attention.head_count_kv must list each of the {layers} layers' KV heads (0: a layer "
            f"that does not attend), some of them positive; got {counts!r}"
        )
    if len({n for n in counts if n}) > 1:
        raise ConfigError(f"{path}: GGUF {arch}.attention.head_count_kv {counts}: attention layers of different counts")
    return counts


def _rope_scaling(meta: dict[str, Any], arch: str, path: Path) -> dict[str, Any] | None:
    """The HF rope scaling of the file's ``rope.scaling.*`` keys (what llama.cpp's converter wrote from
    the model's config.json, read back): linear, or YaRN with its pretrained context and options."""
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind in ("none", None):
        return None
    if kind not in ("linear", "yarn"):
        raise ConfigError(
            f"{path}: GGUF rope scaling {kind!r} ({arch}.rope.scaling.type) is not supported (linear, yarn)"
        )
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if not isinstance(factor, (int, float)) or not factor >= 1:
        raise ConfigError(f"{path}: GGUF {arch}.rope.scaling.factor is {factor!r}; {kind} rope scaling needs one >= 1")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if not original:
        raise ConfigError(f"{path}: GGUF yarn rope scaling needs {arch}.rope.scaling.original_context_length")
    for key, neutral in (("yarn_ext_factor", 1.0), ("yarn_log_multiplier", 0.0)):
        # NOTE: not an HF YaRN setting (ext_factor: a blend llama.cpp alone has; log_multiplier: DeepSeek's
        # mscale, under another rule); a file with either would run other frequencies than it was converted from
        if meta.get(f"{arch}.rope.scaling.{key}", neutral) != neutral:
            raise ConfigError(f"{path}: GGUF yarn rope scaling with {arch}.rope.scaling.{key} is not supported")
    scaling = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original)}
    # the converter writes HF's attention_factor, beta_fast and beta_slow under these names
    for key, hf_key in (("yarn_attn_factor", "attention_factor"), ("yarn_beta_fast", "beta_fast"),
                        ("yarn_beta_slow", "beta_slow")):  # fmt: skip
        if meta.get(f"{arch}.rope.scaling.{key}") is not None:
            scaling[hf_key] = float(meta[f"{arch}.rope.scaling.{key}"])
    return scaling


def _gemma_config(meta: dict[str, Any], arch: str, config: dict[str, Any], path: Path) -> dict[str, Any]:
    """What a Gemma config.json says that its GGUF file leaves to llama.cpp's code (``GEMMA_LAYOUT``):
    Gemma 3's every sixth layer global, the others sliding (unless the file has no window, or names its
    pattern), their rope base 10,000 (the global layers' is the file's, scaled); Gemma 2's every other
    layer, one rope base, scores capped at 50 and logits at 30 unless the file says; scores scaled by
    head_dim ** -0.5, but for 27B's by (hidden / heads) ** -0.5 (its query_pre_attn_scalar: Gemma 3's
    168, Gemma 2's 144), as llama.cpp decides."""
    layout = GEMMA_LAYOUT[arch]
    layers = config["num_hidden_layers"]
    window = meta.get(f"{arch}.attention.sliding_window")
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", layout["pattern"])
    if not window:
        sliding = [False] * layers
    elif isinstance(pattern, int):  # every pattern-th layer global (llama.cpp's set_swa_pattern)
        sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
    elif isinstance(pattern, list) and len(pattern) == layers:  # a flag a layer: sliding or not
        sliding = [bool(b) for b in pattern]
    else:
        raise ConfigError(
            f"{path}: GGUF {arch}.attention.sliding_window_pattern is {pattern!r}; it needs a period or one flag "
            f"a layer ({layers})"
        )
    big = layers == layout["layers_27b"]
    gemma = {
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "sliding_window": window or None,
        "query_pre_attn_scalar": config["hidden_size"] // config["num_attention_heads"] if big else config["head_dim"],
        "attn_logit_softcapping": meta.get(f"{arch}.attn_logit_softcapping", layout["attn_softcap"]) or None,
        "final_logit_softcapping": meta.get(f"{arch}.final_logit_softcapping", layout["final_softcap"]) or None,
    }
    if arch == "gemma3":
        gemma["rope_local_base_freq"] = float(meta.get("gemma3.rope.freq_base_swa", 10_000.0))
    return gemma


def _frequency_factors(tensor: Any, frequencies: int, path: Path) -> list[float]:
    """The rope frequency factors of ``tensor`` (``rope_freqs.weight``, ``rope_factors_*.weight``): one a
    frequency of a head, each finite and > 0."""
    if tensor.type_id in ELEMENT_DTYPES:  # (F32 as the converter writes them: no gguf package needed)
        factors = tensor.data.astype(np.float64).reshape(-1)
    else:
        import gguf

        factors = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float64).reshape(-1)
    if len(factors) != frequencies:
        raise ConfigError(
            f"{path}: GGUF tensor {tensor.name} holds {len(factors)} factors; a head has {frequencies} frequencies"
        )
    if not (np.isfinite(factors).all() and (factors > 0).all()):
        raise ConfigError(f"{path}: GGUF tensor {tensor.name} holds factors that are not finite and > 0")
    return factors.tolist()


def _longrope_scaling(meta: dict[str, Any], reader: Any, rotary_dim: int, path: Path) -> dict[str, Any]:
    """Phi-3.5's and Phi-4 mini's LongRoPE as llama.cpp's converter stores it (the short and long factors as
    tensors, the pretrained context and the cos/sin scale as keys), read back as the HF settings."""
    tensors = {t.name: t for t in reader.tensors}
    missing = [name for name in LONGROPE_FACTORS.values() if name not in tensors]
    original = meta.get("phi3.rope.scaling.original_context_length")
    if missing or not isinstance(original, int) or original < 1:
        raise ConfigError(
            f"{path}: GGUF longrope scaling needs tensors {' and '.join(LONGROPE_FACTORS.values())} and "
            f"phi3.rope.scaling.original_context_length (missing: {', '.join(missing) or 'the context length'})"
        )
    scaling = {key: _frequency_factors(tensors[name], rotary_dim // 2, path) for key, name in LONGROPE_FACTORS.items()}
    # NOTE: llama.cpp scales cos and sin by attn_factor, 1 where the file has none (the converter writes it)
    attention_factor = float(meta.get("phi3.rope.scaling.attn_factor", 1.0))
    return {"rope_type": "longrope", **scaling, "original_max_position_embeddings": original,
            "attention_factor": attention_factor}  # fmt: skip


def _unpermute(weight, num_heads: int):
    """Undo llama.cpp's row permutation of a Q or K projection (out_features, in_features)."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_tensors(checkpoint: GGUFCheckpoint, device: Any = "cpu", *, torch_dequantizes: bool | None = None):
    """(HF name, float32 tensor on ``device``) for each tensor of the file, dequantized, Q and K unpermuted.
    ``torch_dequantizes``: dequantize with torch on ``device`` each tensor whose format it reads
    (``gguf_dequant.DEQUANTIZED``: the bytes go there quantized), gguf-py on the CPU the others; ``None`` (the
    default): off the CPU only, gguf-py being faster on it (``gguf_dequant``). Bit-equal either way."""
    import torch

    device = torch.device(device)
    if torch_dequantizes is None:
        torch_dequantizes = device.type != "cpu"
    config = checkpoint.hf_config
    arch = checkpoint.metadata["general.architecture"]
    patterns = {}
    for gguf_name, hf_name in {**LLAMA_TENSORS, **ARCH_TENSORS[arch]}.items():
        if "{n}" in gguf_name:
            for n in range(config["num_hidden_layers"]):
                patterns[gguf_name.format(n=n)] = hf_name.format(n=n)
        else:
            patterns[gguf_name] = hf_name
    joins = {
        gguf_name.format(n=n): (hf_name.format(n=n), place)
        for gguf_name, (hf_name, place) in JOINED_TENSORS.get(arch, {}).items()
        for n in range(config["num_hidden_layers"])
    }
    joined: dict[str, dict[int, torch.Tensor]] = {}  # HF name -> the parts of it read so far, by place
    layers = config["num_hidden_layers"]
    # (the experts' count under transformers' names: Qwen's, Granite's, Nemotron-H's)
    num_experts = config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts")
    gpt_oss_experts: dict[str, dict[str, torch.Tensor]] = {}  # layer -> its experts' parts ("gate.weight"...)
    for tensor in checkpoint.reader.tensors:
        if tensor.name == ROPE_FREQS or tensor.name in LONGROPE_FACTORS.values():
            continue  # NOTE: the config's rope scaling (read_gguf), not a weight
        if arch in QWEN35_ARCHS and int(tensor.name.split(".")[1] if tensor.name.startswith("blk.") else 0) >= layers:
            continue  # NOTE: Qwen3.5's multi-token-prediction blocks, after its layers (_qwen35_config)
        weight = _dequantized(tensor, device, torch_dequantizes)
        if arch == "gpt-oss" and tensor.name.split(".")[2:3] and tensor.name.split(".")[2] in GPT_OSS_EXPERTS:
            _, n, kind, suffix = tensor.name.split(".")
            parts = gpt_oss_experts.setdefault(n, {})
            parts[f"{GPT_OSS_EXPERTS[kind]}.{suffix}"] = weight
            if len(parts) == len(GPT_OSS_EXPERT_PARTS):  # NOTE: a layer's experts yielded whole, then let go
                yield from _gpt_oss_experts(n, gpt_oss_experts.pop(n))
            continue
        if tensor.name in joins:  # NOTE: yielded once its two parts are read (gate and up; Qwen3-Next's qkv, z)
            name, place = joins[tensor.name]
            parts = joined.setdefault(name, {})
            parts[place] = weight
            if len(parts) == 2:
                first, second = parts[0], parts[1]
                yield name, JOINS[arch](first, second, config) if arch in JOINS else torch.cat([first, second])
                del joined[name]
            continue
        block, _, kind = tensor.name.removesuffix(".weight").rpartition(".")
        if kind in (*EXPERT_TENSORS, FUSED_EXPERTS) and num_experts and block.startswith("blk."):
            prefix = f"model.layers.{block.removeprefix('blk.')}.mlp.experts"  # (weight: (E, rows, cols))
            if kind == FUSED_EXPERTS:
                stacked = dict(zip(("gate_proj", "up_proj"), weight.chunk(2, dim=1)))
            else:
                stacked = {EXPERT_TENSORS[kind]: weight}
            for e in range(weight.shape[0]):
                yield from ((f"{prefix}.{e}.{part}.weight", experts[e]) for part, experts in stacked.items())
            continue
        if tensor.name not in patterns:
            raise ConfigError(f"{checkpoint.path}: unexpected GGUF tensor {tensor.name!r} for a {arch} model")
        if arch in ("qwen35", "qwen35moe"):
            weight = _qwen35_value_heads_grouped(tensor.name, weight, config)
        if arch in PERMUTED and tensor.name.endswith("attn_q.weight"):
            weight = _unpermute(weight, config["num_attention_heads"])
        elif arch in PERMUTED and tensor.name.endswith("attn_k.weight"):
            weight = _unpermute(weight, config["num_key_value_heads"])
        elif (
            arch in SHIFTED_NORMS
            and tensor.name.endswith("norm.weight")
            and not tensor.name.endswith("ssm_norm.weight")
        ):
            weight -= 1.0
        elif tensor.name.endswith("ffn_gate_inp_shexp.weight"):
            weight = weight.reshape(1, -1)  # NOTE: llama.cpp's is a vector (n_embd), HF's a (1, H) projection
        elif tensor.name.endswith(("shortconv.conv.weight", "ssm_conv1d.weight")):
            weight = weight[:, None, :]  # NOTE: llama.cpp's (C, taps), a depthwise Conv1d's (C, 1, taps)
        if arch in MAMBA2_ARCHS and tensor.name.endswith(MAMBA2_RESHAPED):
            weight = weight.reshape(-1)
        if tensor.name.endswith(".ssm_a"):
            weight = torch.log(-weight)  # NOTE: the converter's A = -exp(A_log), back to A_log
        yield patterns[tensor.name], weight
    for name in joined:  # (a tensor of which the file has one part)
        raise ConfigError(f"{checkpoint.path}: GGUF {arch} has half of {name!r} (its gate rows or its up rows)")
    for n, parts in gpt_oss_experts.items():  # (a layer that lacks some)
        gguf_names = {part: name for name, part in GPT_OSS_EXPERTS.items()}
        missing = [
            f"blk.{n}.{gguf_names[p.split('.')[0]]}.{p.split('.')[1]}" for p in GPT_OSS_EXPERT_PARTS if p not in parts
        ]
        raise ConfigError(f"{checkpoint.path}: GGUF gpt-oss layer {n}'s experts have no {', '.join(missing)}")


def _dequantized(tensor: GGUFTensor, device, torch_dequantizes: bool):
    """A tensor's weights as a float32 torch tensor of its own (writable) on ``device``."""
    import torch

    from sloserve.checkpoint.gguf_dequant import DEQUANTIZED, dequantize

    if torch_dequantizes and tensor.type_id in DEQUANTIZED:
        with warnings.catch_warnings():  # NOTE: a read-only view of the file, read only (dequantize's output is new)
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(tensor.data.reshape(-1).view(np.uint8))
        return dequantize(raw.to(device), tensor.type_id, tensor.shape)
    import gguf

    weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    if weights.dtype != np.float32 or not weights.flags.writeable:  # (an F32 tensor is a view of the file)
        weights = weights.astype(np.float32)
    return torch.from_numpy(weights).to(device)


def _gpt_oss_experts(n: str, parts: dict):
    """transformers' gpt-oss expert tensors of layer ``n`` from llama.cpp's ``parts`` ("gate.weight"...): gate
    and up (E, I, H) each interleaved into ``gate_up_proj`` (E, H, 2 I), gate in the even columns, their biases
    (E, I) into ``gate_up_proj_bias`` (E, 2 I); down (E, H, I) transposed to ``down_proj`` (E, I, H), its bias
    kept."""
    import torch

    gate, up = parts["gate.weight"], parts["up.weight"]
    experts, rows, hidden = gate.shape
    gate_up = torch.empty((experts, hidden, 2 * rows), dtype=torch.float32, device=gate.device)
    gate_up[:, :, ::2], gate_up[:, :, 1::2] = gate.transpose(1, 2), up.transpose(1, 2)
    bias = torch.empty((experts, 2 * rows), dtype=torch.float32, device=gate.device)
    bias[:, ::2], bias[:, 1::2] = parts["gate.bias"], parts["up.bias"]
    prefix = f"model.layers.{n}.mlp.experts"
    yield f"{prefix}.gate_up_proj", gate_up
    yield f"{prefix}.gate_up_proj_bias", bias
    yield f"{prefix}.down_proj", parts["down.weight"].transpose(1, 2).contiguous()
    yield f"{prefix}.down_proj_bias", parts["down.bias"]


def gguf_tokenizer(checkpoint: GGUFCheckpoint):
    """The file's tokenizer as a ``tokenizers.Tokenizer``, as transformers' GGUF reader builds it: a
    byte-level BPE (``tokenizer.ggml.model = gpt2``) or a SentencePiece BPE (``llama``: Llama 2, Mistral,
    TinyLlama); control tokens as special tokens, user-defined ones as added tokens, BOS added when the
    file says so (a SentencePiece file that does not say: added, as llama.cpp does)."""
    from tokenizers import AddedToken, processors

    meta = checkpoint.metadata
    kind = meta.get("tokenizer.ggml.model")
    if not meta.get("tokenizer.ggml.tokens"):
        raise ConfigError(f"{checkpoint.path}: GGUF metadata has no tokenizer.ggml.tokens (the vocabulary)")
    tokens = list(meta["tokenizer.ggml.tokens"])
    if kind == "gpt2":
        tok = _byte_level_bpe(checkpoint, tokens)
    elif kind == "llama":
        scores = list(meta.get("tokenizer.ggml.scores") or [])
        if len(scores) != len(tokens):
            raise ConfigError(
                f"{checkpoint.path}: a GGUF SentencePiece tokenizer needs tokenizer.ggml.scores, one a token "
                f"({len(tokens)}); the file has {len(scores)}"
            )
        arch = meta.get("general.architecture")
        if arch in GEMMA_ARCHITECTURES:
            tokens, scores = _gemma_vocabulary(tokens)
        prefix_space = meta.get("tokenizer.ggml.add_space_prefix", True)
        # NOTE: Phi-3's tokenizer puts a space before any text (one that starts with spaces too), as
        # transformers' GGUF reader builds it; Llama 2's only before text that does not start with one
        tok = _sentencepiece_bpe(
            tokens, scores, prefix_space="always" if prefix_space and arch == "phi3" else prefix_space
        )
    else:
        raise ConfigError(
            f"{checkpoint.path}: GGUF tokenizer {kind!r} is not supported (gpt2: byte-level BPE; llama: SentencePiece)"
        )
    types = meta.get("tokenizer.ggml.token_type") or []
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, token_type in zip(tokens, types, strict=False)
            if token_type == TOKEN_TYPE_CONTROL
        ]
    )
    # NOTE: read whole in any text, as llama.cpp and transformers do (else cut into pieces: a chat
    # template's <tool_call> would read as other tokens than the model wrote); kept when decoding. (Not
    # Gemma's runs of spaces: transformers reads them as the vocabulary's pieces, respelled as "▁"s.)
    respelled = set(tokens)
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, token_type in zip(meta["tokenizer.ggml.tokens"], types, strict=False)
            if token_type == TOKEN_TYPE_USER_DEFINED and t in respelled
        ]
    )
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if bos is not None and not 0 <= bos < len(tokens):
        raise ConfigError(
            f"{checkpoint.path}: GGUF tokenizer.ggml.bos_token_id {bos} is outside the vocabulary [0, {len(tokens)})"
        )
    if meta.get("tokenizer.ggml.add_bos_token", kind == "llama") and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", special_tokens=[(tokens[bos], bos)]
        )
    elif kind == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _byte_level_bpe(checkpoint: GGUFCheckpoint, tokens: list[str]):
    """GPT-2's byte-level BPE, split first as ``tokenizer.ggml.pre`` names."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    meta = checkpoint.metadata
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    bad = next((i for i, merge in enumerate(merges) if len(merge) != 2), None)
    if bad is not None:
        raise ConfigError(
            f"{checkpoint.path}: GGUF merge {bad} of tokenizer.ggml.merges is {meta['tokenizer.ggml.merges'][bad]!r}, "
            "not two tokens separated by a space"
        )
    pre = meta.get("tokenizer.ggml.pre")
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, ignore_merges=pre in WHOLE_PIECE_PRE_TOKENIZERS))
    if pre not in PRE_TOKENIZER_SPLITS:
        known = ", ".join(name for name in PRE_TOKENIZER_SPLITS if name is not None)
        raise ConfigError(
            f"{checkpoint.path}: GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported ({known})"
        )
    split = PRE_TOKENIZER_SPLITS[pre]
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(tokens: list[str], scores: list[float], prefix_space: bool | str = True):
    """SentencePiece's BPE as Llama 2's tokenizer runs it: spaces as "▁", one before the text unless it
    starts with one (``prefix_space`` "always": before any text, Phi-3's; False: none, Gemma's), characters
    outside the vocabulary as their UTF-8 bytes (the ``<0xNN>`` tokens), merges from the scores."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tokens)}  # NOTE: a token listed twice: its last id, as llama.cpp's
    tok = Tokenizer(models.BPE(vocab, merges_from_scores(tokens, scores), fuse_unk=True, byte_fallback=True))
    if prefix_space == "always":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    else:
        prepend = "first" if prefix_space else "never"
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=prepend, split=False)
    strip = [decoders.Strip(" ", 1, 0)] if prefix_space else []  # the space put before the text
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return tok


def _gemma_vocabulary(tokens: list[str]) -> tuple[list[str], list[float]]:
    """A Gemma GGUF vocabulary as transformers' GGUF reader reads it: the tokens that are runs of spaces
    (the converter writes "  ") spelled as the "▁"s the text becomes, and ranked by their place in the
    file (Gemma's scores do not follow its merges' order; the file's order does)."""
    respelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]  # (transformers' test)
    return respelled, [-float(i) for i in range(len(tokens))]


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies (its file stores none): every two tokens that make a
    third, ranked by the score of the token they make, best first (llama.cpp merges the best-scored pair
    first); ties by the longer left part, then the longer right part, then the token's place (as
    transformers' ``generate_merges`` ranks them)."""
    ids = {t: i for i, t in enumerate(tokens)}
    score_of = dict(zip(tokens, scores, strict=True))  # NOTE: a token listed twice: its last score
    ranked = []
    for token, score in score_of.items():
        pairs = [(token[:cut], token[cut:]) for cut in range(1, len(token))]
        pairs = sorted((p for p in pairs if p[0] in ids and p[1] in ids), key=lambda p: (ids[p[0]], ids[p[1]]))
        ranked.extend((score, len(left), len(right), left, right) for left, right in pairs)
    ranked.sort(key=lambda m: m[:3], reverse=True)  # NOTE: stable: equal keys keep the order above
    return [(left, right) for _, _, _, left, right in ranked]
