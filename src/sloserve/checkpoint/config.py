"""Model configuration for the engine: read from a HuggingFace ``config.json`` or a named random shape.

Supported architectures (``ARCHITECTURES``): the Llama family (Llama-2/3, Mistral-style GQA, Phi-3 and
Phi-4, SmolLM3, Granite 3), Qwen2 / Qwen2.5 (QKV biases), Qwen3 (per-head RMSNorm of queries and keys, no QKV
biases), Qwen3-MoE and Mixtral (their MLPs mixtures of experts), OLMo 2 (norms after attention and the
MLP), Gemma 2 and Gemma 3 text models
(``gemma3_text``: sliding-window layers beside global ones) and OPT (learned positions, LayerNorm, ReLU);
and the language model of multimodal checkpoints (``MULTIMODAL``: Gemma 3 4B-27B, Mistral Small 3.1, Qwen2-VL,
Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, LFM2-VL, LFM3-VL, EXAONE 4.5, Qwen3.5, GLM-4.1V, 4.5V, 4.6V and Llama 4), served
as text.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sloserve.checkpoint.generation_config import generation_eos_ids
from sloserve.core.errors import ConfigError, UnknownNameError
from sloserve.cost.specs import MODELS, ModelSpec

# HF ``model_type`` -> our architecture (the module that implements it).
ARCHITECTURES: dict[str, str] = {
    "llama": "llama",
    "iquestcoder": "llama",  # (IQuest-Coder-V1 40B: Llama's)
    "internlm3": "llama",  # (InternLM3-8B: Llama's, biases where qkv_bias and bias say)
    "exaone": "exaone",  # (EXAONE 3.0 and 3.5, 2.4B-32B: Llama's layers under GPT-2's names on the Hub)
    "helium": "llama",  # (Helium 1 2B: Llama's layers, every head rotated by adjacent pairs)
    "mistral": "llama",
    "ministral": "llama",  # (Ministral 8B: Mistral's layers, each sliding or full as layer_types says)
    # (Ministral 3: Mistral's layers, queries past the pretrained context scaled up, as Llama 4's)
    "ministral3": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "qwen3_moe": "llama",  # (Qwen3's layers, their MLPs sparse mixtures of experts: ``engine/models/moe.py``)
    "qwen2_moe": "llama",  # (Qwen2's layers, their MLPs mixtures of experts beside a gated shared expert)
    # (gpt-oss: Llama's layers with attention sinks, every other one sliding; its experts' clamped SwiGLU)
    "gpt_oss": "llama",
    "mixtral": "llama",  # (Mistral's layers, their MLPs mixtures of experts)
    # (Phi-3.5-MoE: Llama's layers with LayerNorms and biases, Mixtral's experts routed by SparseMixer)
    "phimoe": "phimoe",
    "phi3": "llama",  # (Phi-3, Phi-4: Llama's layers, their Q/K/V and gate/up stored fused)
    "smollm3": "llama",  # (Llama's layers, every fourth without a rotary embedding)
    "granite": "llama",  # (Llama's layers, scaled: ModelConfig's multipliers)
    # (HyperCLOVA X SEED: Granite's scaled layers, each part's output normalized before it joins the stream)
    "hyperclovax": "hyperclovax",
    # (Granite's layers, most sliding, each head with gpt-oss's attention sink, a rope base a layer or none)
    "granite_swa": "llama",
    "granitemoe": "llama",  # (Granite 3 MoE: Granite's layers, their MLPs mixtures of experts)
    # (Granite 4.0: Granite's layers, NoPE where it says, a shared MLP (beside any experts); Micro's all attention,
    # the 4.0-H models' mostly Mamba-2 mixers)
    "granitemoehybrid": "granitemoehybrid",
    # (Granite MoE Shared: Granite MoE's layers, an ungated shared MLP beside the experts; Granite Swash (MoE SWA,
    # 3B-A600M): those with Granite SWA's attention, most layers sliding, each head a sink)
    "granitemoeshared": "granitemoehybrid",
    "granitemoe_swa": "granitemoehybrid",
    # (Bamba 9B: Llama's layers, Mamba-2 mixers in most of them, half of each attention head rotated)
    "bamba": "bamba",
    # (Jamba 1.5, 1.7 Mini and Large: Llama's layers, Mamba's selective state spaces in seven of eight, attention
    # without rope in the eighth; every other MLP Mixtral's experts)
    "jamba": "jamba",
    # (Nemotron-H, Nemotron Nano 2: blocks of one mixer each, Mamba-2, attention without rope or a squared-ReLU MLP)
    "nemotron_h": "nemotron_h",
    # (Mamba 130M-2.8B, Falcon Mamba 7B (its step, B and C normalized), Mamba-2 130M-2.7B, Mamba-Codestral 7B: no
    # attention; Nemotron-H's blocks, every one a Mamba mixer)
    "mamba": "mamba",
    "falcon_mamba": "mamba",
    "mamba2": "mamba",
    # (Falcon-H1 0.5B-34B: Llama's layers with a Mamba-2 mixer beside each attention, muP multipliers)
    "falcon_h1": "falcon_h1",
    # (LFM2 350M-2.6B: Llama's layers, most mixing by a gated short convolution instead of attention, Qwen3's
    # query and key norms in the others)
    "lfm2": "lfm2",
    "lfm2_moe": "lfm2",  # (LFM2-8B-A1B: those layers, the MLPs after the first few sigmoid-routed experts)
    # (LFM3: LFM2's layers, some attention sliding, each layer's outputs normalized, each head's output gated)
    "lfm3": "lfm3",
    # (Qwen3-Next 80B-A3B: three layers of four mixing by gated DeltaNet, a linear attention of the delta rule
    # (``ModelConfig.gated_delta_net``), the fourth by attention with its output gated; norms of 1 + weight; experts
    # beside a gated shared one)
    "qwen3_next": "qwen3_next",
    "qwen3_5_text": "qwen3_next",  # (Qwen3.5 0.8B-27B's language models: those layers with dense MLPs)
    "qwen3_5_moe_text": "qwen3_next",  # (Qwen3.5 35B-A3B-397B-A17B's: those layers, experts in every one)
    # (OLMo Hybrid 7B: OLMo 3's attention layers, one of four, without rope as released; gated DeltaNets in the others,
    # in Llama's order)
    "olmo_hybrid": "olmo_hybrid",
    # (Kimi Linear 48B-A3B: DeepSeek-V3's outline, its attention (MLA) without rope in one layer of four, Kimi Delta
    # Attention in the others: a gated DeltaNet with a decay a key channel)
    "kimi_linear": "kimi_linear",
    # (Hunyuan 0.5B-7B: Llama's layers, each query and key head normalized after the rotary embedding)
    "hunyuan_v1_dense": "hunyuan",
    # (Hunyuan-A13B: those layers, each MLP a softmax-routed mixture of experts beside an ungated shared one)
    "hunyuan_v1_moe": "hunyuan",
    "gemma3_text": "gemma3",
    "gemma": "gemma",  # (Gemma 1, CodeGemma: Llama's layers with Gemma's norms, GeGLU MLP and scaled embeddings)
    "gemma2": "gemma3",  # (Gemma 3's layers without query/key norms, with capped scores)
    "vaultgemma": "gemma3",  # (VaultGemma 1B: Gemma 2's layers without the norms of each part's output)
    "olmo2": "olmo2",
    "olmo3": "olmo2",  # (OLMo 2's layers, three of four sliding, the others' rope scaled)
    "olmoe": "llama",  # (Llama's layers, OLMo 2's query and key norms, Qwen3-MoE's experts)
    "flex_olmo": "olmo2",  # (FlexOlmo 7x7B: OLMo 2's layers, their MLPs OLMoE's experts)
    "seed_oss": "llama",  # (Seed-OSS-36B: Llama's layers with biases)
    "ernie4_5": "llama",  # (ERNIE 4.5's dense models: Llama's layers, every head rotated by adjacent pairs)
    # (ERNIE 4.5's MoE models: those layers with experts chosen by softmax scores plus a bias, beside shared ones)
    "ernie4_5_moe": "ernie4_5_moe",
    # (EXAONE 4: OLMo 2's layers with Qwen3's query and key norms; three of four sliding, the others unrotated)
    "exaone4": "olmo2",
    # (K-EXAONE 236B-A23B: EXAONE 4's attention in Llama's layers (norms before each part), DeepSeek-V3's experts
    # beside a shared one after a dense first MLP; its multi-token prediction (``mtp.``) not read)
    "exaone_moe": "exaone_moe",
    "glm": "llama",  # (GLM-4 of 2024: Llama's layers, half of each head rotated by adjacent pairs)
    "glm4": "glm4",  # (GLM-4-0414: those layers with a norm after attention and after the MLP too)
    "gpt_neox": "gpt_neox",  # (Pythia, GPT-NeoX-20B: LayerNorms, a GELU MLP, attention and MLP in parallel)
    "cohere": "cohere",  # (Command R: attention and MLP in parallel from one LayerNorm, rope by adjacent pairs)
    "cohere2": "cohere",  # (Command R7B, A: those layers, three of four sliding with rope, the fourth without)
    # (Command A+: those layers, their MLPs experts after dense ones, beside a shared MLP; its norms RMSNorms or not)
    "cohere2_moe": "cohere",
    "opt": "opt",
    "gpt2": "gpt2",  # (GPT-2: learned positions, LayerNorms, a GELU MLP, Conv1D weights stored (in, out))
    # (Falcon 7B, 40B, 180B, Falcon 2 11B: LayerNorms, attention and a GELU MLP in parallel, one or a few KV heads;
    # Falcon-RW 1B, 7B: attention then the MLP, ALiBi)
    "falcon": "falcon",
    # (BLOOM 560M-176B, BLOOMZ: Falcon-RW's layers, a LayerNorm of the embeddings, GELU by tanh's approximation)
    "bloom": "falcon",
    "mpt": "mpt",  # (MPT-7B, 30B: ALiBi, LayerNorms and projections without biases, a GELU MLP)
    # (nanochat: Llama's layers, norms of no weight (the rotated heads' too), a squared-ReLU MLP, capped logits)
    "nanochat": "nanochat",
    # (StarCoder 1, SantaCoder, WizardCoder 15B, SQLCoder: GPT-2's layers, one KV head (multi_query), Linear weights)
    "gpt_bigcode": "gpt2",
    "phi": "phi",  # (Phi-1, 1.5, 2: attention and a GELU MLP in parallel from one LayerNorm, partial rotary)
    # (DeepSeek-V2, V2-Lite: multi-head latent attention, experts beside shared ones)
    "deepseek_v2": "deepseek_v2",
    # (DeepSeek-V3's outline, Moonlight, Kimi K2: V2's layers, experts chosen by sigmoid scores with a bias)
    "deepseek_v3": "deepseek_v2",
    # (Mistral Small 4: DeepSeek-V3's outline, its experts chosen by softmax scores, queries scaled by Llama 4's rule)
    "mistral4": "deepseek_v2",
    # (GLM-4.7-Flash: DeepSeek-V3's attention (MLA) with GLM-4.5's experts, dense or sparse as mlp_layer_types says)
    "glm4_moe_lite": "deepseek_v2",
    "youtu": "deepseek_v2",  # (Youtu-LLM 2B: DeepSeek-V3's attention (MLA) with a dense MLP in every layer)
    # (MiniCPM3 4B: DeepSeek-V2's attention (MLA, rope by halves) with dense MLPs, its embeddings, outputs and logits
    # scaled: Granite's multipliers)
    "minicpm3": "deepseek_v2",
    # (MiniMax-M2: Llama's layers, queries and keys normalized over their whole projections, half of each head
    # rotated, every MLP experts chosen by sigmoid scores plus a bias)
    "minimax_m2": "minimax_m2",
    # (GLM-4.5, 4.6, 4.5-Air: Llama's layers, half of each head rotated, DeepSeek-V3's experts beside a shared one)
    "glm4_moe": "glm4_moe",
    # (dots.llm1 142B-A14B: Qwen3's attention, DeepSeek-V3's experts beside shared ones after dense first MLPs; layers
    # from max_window_layers on sliding)
    "dots1": "glm4_moe",
    # (Solar Open 100B: Llama's attention, every MLP GLM-4.5's experts beside a shared one)
    "solar_open": "glm4_moe",
    # (Sarvam-30B, 105B: GLM-4.5's layers, whole heads rotated, query and key norms; the Hub's names of its own)
    "sarvam_moe": "sarvam_moe",
    # (Hunyuan 3: Llama's layers with Qwen3's query and key norms, a dense first MLP, then experts chosen by sigmoid
    # scores plus a bias beside a shared one; its multi-token-prediction layer not read)
    "hy_v3": "hy_v3",
    # (Arcee's Trinity: a norm before and after attention and the MLP, three layers of four sliding and rotated, the
    # fourth global without rope, each head's output gated, DeepSeek-V3's routing beside shared experts)
    "afmoe": "afmoe",
    "stablelm": "stablelm",  # (StableLM 2 1.6B, 3B: Llama's layers with LayerNorms, a quarter of each head rotated)
    "olmo": "olmo",  # (OLMo 1: Llama's layers with LayerNorms of no weight, clip_qkv)
    "nemotron": "nemotron",  # (Minitron: LayerNorms of 1 + weight, a squared-ReLU MLP of two matrices, half rotated)
    "arcee": "arcee",  # (AFM-4.5B: Llama's layers with a squared-ReLU MLP of two matrices)
    "jais2": "jais2",  # (Jais 2: Arcee's layers with LayerNorms and biases)
    # (CWM 32B: Llama's layers, three of four sliding, the first of each four full)
    "cwm": "llama",
    "starcoder2": "starcoder2",  # (StarCoder2: Llama's layers with LayerNorms, a GELU MLP, biases, a window)
    # (Llama 4 Scout 17B-16E, Maverick 17B-128E: Llama's layers, three of four rotated by adjacent pairs and seeing
    # only their chunk of 8,192 positions, the fourth unrotated and seeing all; experts fed tokens scaled by their
    # router's sigmoid, beside a shared one)
    "llama4_text": "llama4",
    "apertus": "apertus",  # (Apertus 8B, 70B: Llama's layers with query/key norms, a two-matrix xIELU MLP)
}
# Multimodal checkpoints served as text: their config.json's text_config is the language model's
# (Gemma 3 4B-27B: Gemma3ForConditionalGeneration; its vision tower is not read, ``LANGUAGE_MODEL_PREFIXES``)
MULTIMODAL = {
    "gemma3": "gemma3_text",
    "mistral3": "mistral",  # (Mistral Small 3.1, 3.2)
    "qwen2_vl": "qwen2_vl_text",
    "qwen2_5_vl": "qwen2_5_vl_text",
    "qwen3_vl": "qwen3_vl_text",
    "qwen3_vl_moe": "qwen3_vl_moe_text",
    "lfm2_vl": "lfm2",  # (LFM2-VL 450M-3B)
    "lfm3_vl": "lfm3",
    "exaone4_5": "exaone4",  # (EXAONE 4.5: EXAONE 4's layers beside a vision tower)
    # (Qwen3.5: Qwen3-Next's layers; their interleaved MRoPE gives a text token one position in every section,
    # which is plain RoPE, as for Qwen3-VL's)
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
    # (GLM-4.1V 9B: GLM-4-0414's layers; GLM-4.5V and 4.6V: GLM-4.5's MoE layers; their MRoPE plain RoPE on text)
    "glm4v": "glm4v_text",
    "glm4v_moe": "glm4v_moe_text",
    "glm46v": "glm4v_text",
    "llama4": "llama4_text",  # (Llama 4 Scout, Maverick: Llama4ForConditionalGeneration)
}
# Those whose Hub configs hold the language model's settings at the top level, beside vision_config (Qwen2-VL's
# and Qwen2.5-VL's; transformers 5 saves them in a text_config)
FLAT_MULTIMODAL = ("qwen2_vl", "qwen2_5_vl")
# The language models of those that are another architecture's, and transformers' defaults of theirs that differ:
# Qwen3-VL's is Qwen3's layers, and its interleaved MRoPE gives a text token the same position in each of its
# sections (temporal, height, width), which is Qwen3's RoPE (as vLLM serves a prompt without images); Qwen3-VL-MoE's
# is Qwen3-MoE's, its top weights always renormalized; Qwen2-VL's and Qwen2.5-VL's are Qwen2's, their MRoPE (its
# sections side by side) likewise Qwen2's RoPE on text
TEXT_MODEL_TYPES = {
    "qwen2_vl_text": ("qwen2", {"rope_theta": 1_000_000.0, "rms_norm_eps": 1e-5}),
    "qwen2_5_vl_text": ("qwen2", {"rope_theta": 1_000_000.0, "rms_norm_eps": 1e-5}),
    "qwen3_vl_text": ("qwen3", {"rope_theta": 500_000.0}),
    "qwen3_vl_moe_text": ("qwen3_moe", {"rope_theta": 500_000.0, "norm_topk_prob": True}),
    "exaone4_5_text": ("exaone4", {}),  # (the Hub's name of EXAONE 4.5's; transformers reads it as exaone4)
    # (GLM-4.1V's: its rope turns whole heads where its settings do not say, its q/k/v biases always there)
    "glm4v_text": ("glm4", {"rms_norm_eps": 1e-5, "partial_rotary_factor": 1.0}),
    "glm4v_moe_text": ("glm4_moe", {"attention_bias": True}),  # (GLM-4.5V's, 4.6V's: q/k/v biases by default)
}
# transformers' Gemma3TextConfig defaults: a Gemma 3 text_config lists only what differs from them
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6, "bos_token_id": 2, "eos_token_id": 1,
}  # fmt: skip
# transformers' Gemma2Config defaults (Gemma 2 2B's shape; every other layer global, scores capped at 50,
# logits at 30)
GEMMA2_DEFAULTS = {
    **GEMMA3_TEXT_DEFAULTS, "vocab_size": 256_000, "max_position_embeddings": 8192, "sliding_window_pattern": 2,
    "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
}  # fmt: skip
# DeepSeek-V2's MLA sizes, transformers' defaults (V2's; V2-Lite's config says q_lora_rank null)
DEEPSEEK_MLA_DEFAULTS = {
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}
# The mixtures of experts, and transformers' defaults for what their configs may leave out
MOE_DEFAULTS = {
    "qwen3_moe": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768},
    "qwen2_moe": {"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408},
    "mixtral": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": None},  # (intermediate_size)
    "gpt_oss": {"num_experts": 128, "num_experts_per_tok": 4, "moe_intermediate_size": None},  # (intermediate_size)
    "olmoe": {"num_experts": 64, "num_experts_per_tok": 8, "moe_intermediate_size": None},  # (intermediate_size)
    "flex_olmo": {"num_experts": 7, "num_experts_per_tok": 5, "moe_intermediate_size": None},  # (intermediate_size)
    "granitemoe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": None},  # (intermediate_size)
    "granitemoehybrid": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": None},  # (likewise)
    "granitemoeshared": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": None},  # (likewise)
    "granitemoe_swa": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": None},  # (likewise)
    "deepseek_v2": {"num_experts": 64, "num_experts_per_tok": None, "moe_intermediate_size": 1407},
    "deepseek_v3": {"num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048},
    "glm4_moe": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1408},
    "dots1": {"num_experts": None, "num_experts_per_tok": None, "moe_intermediate_size": 1408},
    "solar_open": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1280},
    "sarvam_moe": {"num_experts": 128, "num_experts_per_tok": 6, "moe_intermediate_size": 1024},
    "hy_v3": {"num_experts": 192, "num_experts_per_tok": 8, "moe_intermediate_size": 1536},
    "afmoe": {"num_experts": 64, "num_experts_per_tok": 6, "moe_intermediate_size": 1408},
    "ernie4_5_moe": {"num_experts": 64, "num_experts_per_tok": 6, "moe_intermediate_size": 1536},
    # (Hunyuan's experts: of intermediate_size)
    "hunyuan_v1_moe": {"num_experts": 1, "num_experts_per_tok": 1, "moe_intermediate_size": None},
    "lfm2_moe": {"num_experts": 32, "num_experts_per_tok": 4, "moe_intermediate_size": 1792},
    "mistral4": {"num_experts": 128, "num_experts_per_tok": 4, "moe_intermediate_size": 2048},
    "glm4_moe_lite": {"num_experts": 64, "num_experts_per_tok": 4, "moe_intermediate_size": 1536},
    "minimax_m2": {"num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": None},  # (intermediate_size)
    "kimi_linear": {"num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 1024},
    "exaone_moe": {"num_experts": 64, "num_experts_per_tok": 8, "moe_intermediate_size": 1024},
    "qwen3_next": {"num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512},
    "qwen3_5_moe_text": {"num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512},
    "llama4_text": {"num_experts": 16, "num_experts_per_tok": 1, "moe_intermediate_size": None},  # (intermediate_size)
    "phimoe": {"num_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": None},  # (intermediate_size)
    "jamba": {"num_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": None},  # (intermediate_size)
    "cohere2_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": None},  # (likewise)
}
# The mixtures of experts beside a shared expert gated by a sigmoid of the token (Qwen2-MoE's), and transformers'
# default size of that expert
GATED_SHARED_EXPERTS = {"qwen2_moe": 5632, "qwen3_next": 512, "qwen3_5_moe_text": 512}
# The models of multi-head latent attention
DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3", "mistral4", "glm4_moe_lite", "kimi_linear", "youtu", "minicpm3")
# transformers' GraniteMoeHybridConfig defaults of its Mamba-2 mixers (``mamba_*`` in a config), and FalconH1Config's
MAMBA2_DEFAULTS = {
    "n_heads": 128, "n_groups": 1, "d_state": 256, "d_head": "auto", "d_conv": 4, "expand": 2, "chunk_size": 256,
    "conv_bias": True, "proj_bias": False,
}  # fmt: skip
FALCON_H1_MAMBA_DEFAULTS = {**MAMBA2_DEFAULTS, "d_ssm": 1024, "rms_norm": False, "norm_before_gate": True}
# transformers' defaults of their routing where it differs by version: (n_shared_experts, routed_scaling_factor,
# topk_method, n_group, topk_group, norm_topk_prob, first_k_dense_replace)
DEEPSEEK_ROUTING_DEFAULTS = {
    "deepseek_v2": {"n_shared_experts": 2, "routed_scaling_factor": 1.0, "topk_method": "greedy", "n_group": None,
                    "topk_group": None, "norm_topk_prob": False, "first_k_dense_replace": 0},
    "deepseek_v3": {"n_shared_experts": 1, "routed_scaling_factor": 2.5, "topk_method": "noaux_tc", "n_group": 8,
                    "topk_group": 4, "norm_topk_prob": True, "first_k_dense_replace": 3},
    "solar_open": {"n_shared_experts": 1, "routed_scaling_factor": 1.0, "topk_method": "noaux_tc", "n_group": 1,
                   "topk_group": 1, "norm_topk_prob": True, "first_k_dense_replace": 0},
    "afmoe": {"n_shared_experts": 2, "routed_scaling_factor": 1.0, "topk_method": "noaux_tc", "n_group": 1,
              "topk_group": 1, "norm_topk_prob": True, "first_k_dense_replace": 1},
    "hy_v3": {"n_shared_experts": 1, "routed_scaling_factor": 2.826, "topk_method": "noaux_tc", "n_group": 1,
              "topk_group": 1, "norm_topk_prob": True, "first_k_dense_replace": 1},
    "sarvam_moe": {"n_shared_experts": 1, "routed_scaling_factor": 2.5, "topk_method": "noaux_tc", "n_group": 1,
                   "topk_group": 1, "norm_topk_prob": True, "first_k_dense_replace": 1},
    "dots1": {"n_shared_experts": None, "routed_scaling_factor": 1.0, "topk_method": "noaux_tc", "n_group": 1,
              "topk_group": 1, "norm_topk_prob": False, "first_k_dense_replace": 0},
    "glm4_moe": {"n_shared_experts": 1, "routed_scaling_factor": 1.0, "topk_method": "noaux_tc", "n_group": 1,
                 "topk_group": 1, "norm_topk_prob": True, "first_k_dense_replace": 1},
    "ernie4_5_moe": {"n_shared_experts": 2, "routed_scaling_factor": 1.0, "topk_method": "softmax_with_bias",
                     "n_group": None, "topk_group": None, "norm_topk_prob": True},
    "hunyuan_v1_moe": {"n_shared_experts": 1, "routed_scaling_factor": 1.0, "topk_method": "greedy", "n_group": None,
                       "topk_group": None, "norm_topk_prob": True, "first_k_dense_replace": 0},
    # (LFM2-MoE's: DeepSeek-V3's sigmoid scores with a bias, one group, no shared expert, 1e-6 in the renormalization)
    "lfm2_moe": {"n_shared_experts": 0, "routed_scaling_factor": 1.0, "topk_method": "noaux_tc", "n_group": 1,
                 "topk_group": 1, "norm_topk_prob": True, "first_k_dense_replace": 2, "norm_topk_eps": 1e-6},
    "mistral4": {"n_shared_experts": 1, "routed_scaling_factor": 1.0, "topk_method": "softmax_top2_groups",
                 "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "first_k_dense_replace": 0},
    "kimi_linear": {"n_shared_experts": 1, "routed_scaling_factor": 2.446, "topk_method": "noaux_tc", "n_group": 1,
                    "topk_group": 1, "norm_topk_prob": True, "first_k_dense_replace": 1},
    "exaone_moe": {"n_shared_experts": 1, "routed_scaling_factor": 2.5, "topk_method": "noaux_tc", "n_group": 1,
                   "topk_group": 1, "norm_topk_prob": True, "first_k_dense_replace": 1},
    "glm4_moe_lite": {"n_shared_experts": 1, "routed_scaling_factor": 1.8, "topk_method": "noaux_tc", "n_group": 1,
                      "topk_group": 1, "norm_topk_prob": True, "first_k_dense_replace": 1},
    # (MiniMax-M2's: V3's sigmoid scores with a bias, one group, no shared expert, the top weights' sum alone)
    "minimax_m2": {"n_shared_experts": 0, "routed_scaling_factor": 1.0, "topk_method": "noaux_tc", "n_group": 1,
                   "topk_group": 1, "norm_topk_prob": True, "first_k_dense_replace": 0, "norm_topk_eps": 0.0},
}  # fmt: skip
# ERNIE 4.5's and Hunyuan's names of those settings (transformers' attribute_maps' and their own)
MOE_SETTING_NAMES = {
    "ernie4_5_moe": {"moe_num_experts": "n_routed_experts", "moe_k": "num_experts_per_tok",
                     "moe_num_shared_experts": "n_shared_experts"},
    "hunyuan_v1_moe": {"num_experts": "n_routed_experts", "moe_topk": "num_experts_per_tok"},
    "lfm2_moe": {"num_experts": "n_routed_experts", "num_dense_layers": "first_k_dense_replace"},
    "minimax_m2": {"num_local_experts": "n_routed_experts"},
    "exaone_moe": {"num_experts": "n_routed_experts", "num_shared_experts": "n_shared_experts"},
    "sarvam_moe": {"num_experts": "n_routed_experts", "num_local_experts": "n_routed_experts",
                   "num_shared_experts": "n_shared_experts"},
    "afmoe": {"num_experts": "n_routed_experts", "num_shared_experts": "n_shared_experts",
              "route_scale": "routed_scaling_factor", "num_dense_layers": "first_k_dense_replace"},
    "hy_v3": {"num_experts": "n_routed_experts", "num_local_experts": "n_routed_experts",
              "num_shared_experts": "n_shared_experts", "router_scaling_factor": "routed_scaling_factor"},
}  # fmt: skip
# The mixtures of experts routed as DeepSeek's
DEEPSEEK_ROUTED = tuple(DEEPSEEK_ROUTING_DEFAULTS)
# Each one's routings (``moe.DeepseekMoE``): V3's and GLM-4.5's sigmoid scores with a bias (the Hub's configs say
# noaux_tc), ERNIE 4.5's softmax scores with a bias
ROUTING_METHODS = {
    "deepseek_v2": ("greedy", "group_limited_greedy"),
    "deepseek_v3": ("noaux_tc",),
    "glm4_moe": ("noaux_tc",),
    "dots1": ("noaux_tc",),
    "solar_open": ("noaux_tc",),
    "sarvam_moe": ("noaux_tc",),
    "hy_v3": ("noaux_tc",),
    "afmoe": ("noaux_tc",),
    "ernie4_5_moe": ("softmax_with_bias",),
    "hunyuan_v1_moe": ("greedy",),
    "lfm2_moe": ("noaux_tc",),
    # (softmax scores; the groups by their two best scores, V3's rule without its bias)
    "mistral4": ("softmax_top2_groups",),
    "glm4_moe_lite": ("noaux_tc",),
    "minimax_m2": ("noaux_tc",),
    "kimi_linear": ("noaux_tc",),
    "exaone_moe": ("noaux_tc",),
}
# The routings whose choice adds the router's bias (``e_score_correction_bias``) to the scores: DeepSeek-V3's
# (sigmoid scores) and ERNIE 4.5's (softmax scores)
BIASED_ROUTINGS = ("noaux_tc", "softmax_with_bias")
MOE_TYPES = tuple(MOE_DEFAULTS)
# The models whose q/k/v projections have biases where their configs do not say (transformers' defaults)
QKV_BIASED = ("qwen2", "gpt_oss", "glm", "glm4", "seed_oss", "phi")
# InternLM3's and EXAONE 3's names of settings (transformers' attribute maps)
SETTING_NAMES = {
    "internlm3": {"qkv_bias": "attention_bias", "bias": "mlp_bias"},
    "sarvam_moe": {"use_qkv_bias": "attention_bias"},
    "exaone": {"num_layers": "num_hidden_layers", "layer_norm_epsilon": "rms_norm_eps",
               "activation_function": "hidden_act"},
    "bloom": {"n_layer": "num_hidden_layers", "n_head": "num_attention_heads", "n_embed": "hidden_size",
              "seq_length": "max_position_embeddings"},
    "mpt": {"n_layers": "num_hidden_layers", "n_heads": "num_attention_heads", "d_model": "hidden_size",
            "max_seq_len": "max_position_embeddings"},
}  # fmt: skip
# The OLMo models (their query and key norms over the whole projections)
OLMO_TYPES = ("olmo2", "olmo3", "olmoe", "olmo_hybrid", "flex_olmo")
# The models whose attention output projection has a bias where the q/k/v projections have them
OUTPUT_BIASED = ("gpt_oss", "exaone4", "exaone_moe", "internlm3", "phimoe", "jais2", "cohere", "cohere2",
                 "cohere2_moe", "phi", "nemotron", "arcee", "falcon_h1", *OLMO_TYPES)  # fmt: skip
# The models whose queries and keys are RMS-normalized (each head: Qwen3's; OLMo's whole projections)
QK_NORMED = ("qwen3", "qwen3_moe", "dots1", "hy_v3", "afmoe", "lfm2", "lfm2_moe", "lfm3", "exaone4", "exaone_moe",
             "hunyuan_v1_dense", "hunyuan_v1_moe", "apertus", "minimax_m2", *OLMO_TYPES)  # fmt: skip
# transformers' rope bases where a config has none
DEFAULT_ROPE_THETA = {
    "gpt_oss": 150_000.0,
    "olmo3": 500_000.0,
    "flex_olmo": 500_000.0,
    "ernie4_5": 500_000.0,
    "ernie4_5_moe": 500_000.0,
    "apertus": 12_000_000.0,
    "lfm2": 1_000_000.0,
    "lfm2_moe": 1_000_000.0,
    "minimax_m2": 5_000_000.0,
    "mixtral": 1_000_000.0,
    "smollm3": 2_000_000.0,
    "cohere": 500_000.0,
    "llama4_text": 500_000.0,
    "exaone": 500_000.0,
    "helium": 100_000.0,
    "phimoe": 1_000_000.0,
    "cwm": 1_000_000.0,
    "solar_open": 1_000_000.0,
    "sarvam_moe": 8_000_000.0,
    "hy_v3": 11_158_840.0,
}
# transformers' rope settings of the models whose default rope is scaled, where a config says nothing of its rope
DEFAULT_ROPE_PARAMETERS = {
    "apertus": {"rope_type": "llama3", "rope_theta": 12_000_000.0, "factor": 8.0,
                "original_max_position_embeddings": 8192, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    "gpt_oss": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096, "rope_theta": 150_000.0},
    "ministral3": {"type": "yarn", "rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 16.0,
                   "original_max_position_embeddings": 16384, "max_position_embeddings": 262144, "beta_fast": 32.0,
                   "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1},
    "cwm": {"rope_type": "llama3", "rope_theta": 1_000_000.0, "factor": 16.0, "high_freq_factor": 4.0,
            "low_freq_factor": 1.0, "original_max_position_embeddings": 8192},
    "mistral4": {"type": "yarn", "rope_type": "yarn", "rope_theta": 10_000.0, "factor": 128.0,
                 "original_max_position_embeddings": 8192, "max_position_embeddings": 1048576,
                 "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
                 "llama_4_scaling_beta": 0.1, "partial_rotary_factor": 0.5},
}  # fmt: skip
# transformers' defaults where theirs differ from the generic reading (a head_dim of 128, not hidden / heads; an
# MLP's activation other than SiLU, which a GGUF file does not name)
CONFIG_DEFAULTS = {
    # (GLM-4.7-Flash's latent sizes and norms' epsilon, transformers' Glm4MoeLiteConfig defaults)
    "glm4_moe_lite": {
        "q_lora_rank": 768,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 192,
        "qk_rope_head_dim": 64,
        "v_head_dim": 256,
        "rms_norm_eps": 1e-5,
    },  # fmt: skip
    # (Mistral Small 4's latent sizes, transformers' Mistral4Config defaults)
    "mistral4": {
        "q_lora_rank": 1024,
        "kv_lora_rank": 256,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
    },
    # (Kimi Linear's latent sizes, norms' epsilon and KDA heads, transformers' KimiLinearConfig defaults)
    "kimi_linear": {
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "rms_norm_eps": 1e-5,
        "linear_head_dim": 128,
        "linear_num_heads": 32,
        "linear_conv_kernel_dim": 4,
    },
    # (LFM3's rope by layer type: the sliding layers' plain, the full ones' on half of each head's pairs)
    "lfm3": {
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "proportional", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5},
        },
        "sliding_window": 256,
    },
    "ernie4_5": {"head_dim": 128, "tie_word_embeddings": True},
    "internlm3": {"head_dim": 128},
    "iquestcoder": {"head_dim": 128},
    "helium": {"head_dim": 128},
    "solar_open": {"head_dim": 128},
    "youtu": {"tie_word_embeddings": True},
    # (MiniCPM3's latent sizes and scales, transformers' MiniCPM3Config defaults; its v_head_dim: hidden / heads)
    "minicpm3": {
        "q_lora_rank": 768,
        "kv_lora_rank": 256,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-5,
        "scale_emb": 12,
        "scale_depth": 1.4,
        "dim_model_base": 256,
    },
    "hy_v3": {"head_dim": 128},
    "afmoe": {"head_dim": 128},
    "sarvam_moe": {"head_dim": 64},
    # (Llama 4's: its experts' and shared expert's size, its dense MLPs', its chunks')
    "llama4_text": {
        "head_dim": 128,
        "intermediate_size": 8192,
        "intermediate_size_mlp": 16384,
        "attention_chunk_size": 8192,
    },
    # (transformers' defaults of what a model's own reading would otherwise take from its other sizes)
    "qwen3_next": {"head_dim": 256},
    "qwen3_5_text": {"head_dim": 256},
    "qwen3_5_moe_text": {"head_dim": 256},
    "minimax_m2": {"head_dim": 128},
    "gpt_oss": {"head_dim": 64},
    "granite_swa": {"tie_word_embeddings": True},
    "mistral": {"sliding_window": 4096},  # (Mistral 7B v0.1's window; later Mistrals' configs say null)
    "ministral": {"sliding_window": 4096},
    "smollm3": {"tie_word_embeddings": True},
    "ernie4_5_moe": {"tie_word_embeddings": True},
    "seed_oss": {"head_dim": 128},
    "cohere": {"tie_word_embeddings": True, "logit_scale": 0.0625},
    "cohere2": {"tie_word_embeddings": True, "logit_scale": 0.0625},
    "cohere2_moe": {"tie_word_embeddings": True, "logit_scale": 0.0625},
    "gpt2": {"tie_word_embeddings": True},
    "gpt_bigcode": {"tie_word_embeddings": True},
    "falcon": {"tie_word_embeddings": True},
    # (BLOOM's config has no context length: vLLM's default where a config names none, BLOOM's training context)
    "bloom": {"tie_word_embeddings": True, "max_position_embeddings": 2048},
    "mpt": {"tie_word_embeddings": True, "max_position_embeddings": 2048},
    "nanochat": {"hidden_act": "relu2", "final_logit_softcapping": 15.0},
    "starcoder2": {"tie_word_embeddings": True, "hidden_act": "gelu_pytorch_tanh"},
    "phi": {"hidden_act": "gelu_new"},
    "nemotron": {"hidden_act": "relu2"},
    "arcee": {"hidden_act": "relu2"},
    "jais2": {"hidden_act": "relu2", "head_dim": 128, "attention_bias": True, "mlp_bias": True},
    "cwm": {"head_dim": 128, "sliding_window": 8192},
    "apertus": {"hidden_act": "xielu"},
    "gemma": {"head_dim": 256, "tie_word_embeddings": True, "hidden_act": "gelu_pytorch_tanh"},
}
# transformers' RMSNorm epsilons where a config has none, where they are not 1e-6
RMS_NORM_EPS_DEFAULTS = {
    **dict.fromkeys(("apertus", "arcee", "bamba", "ernie4_5", "ernie4_5_moe", "exaone4", "exaone_moe", "falcon_h1",
                     "glm4_moe", "gpt_oss", "granite_swa", "hunyuan_v1_dense", "hunyuan_v1_moe", "llama4_text",
                     "ministral3", "mixtral", "olmo2", "olmo3", "olmoe", "phi3", "exaone", "internlm3", "iquestcoder",
                     "phimoe", "solar_open", "hy_v3", "afmoe", "cwm"),
                   1e-5),
    "glm": 1.5625e-07, "glm4": 1.5625e-07, "helium": 1e-8,
}  # fmt: skip
# GPT-2's config names for the common ones (transformers' GPT2Config.attribute_map)
GPT2_NAMES = {
    "n_embd": "hidden_size",
    "n_layer": "num_hidden_layers",
    "n_head": "num_attention_heads",
    "n_positions": "max_position_embeddings",
}
# The two-matrix MLPs' activations (GPT-2's ``activation_function``, Phi's ``hidden_act``: transformers'
# names; engine/models/gpt2.py)
GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu", "relu")
# The rotated share of a head where a config does not say, by model type (transformers' defaults)
PARTIAL_ROTARY_DEFAULTS = {
    "glm": 0.5, "glm4": 0.5, "glm4_moe": 0.5, "phi": 0.5, "stablelm": 0.25, "nemotron": 0.5, "bamba": 0.5,
    "qwen3_next": 0.25, "qwen3_5_text": 0.25, "qwen3_5_moe_text": 0.25,
}  # fmt: skip
# The models whose rotary embedding may turn part of each head (partial_rotary_factor), as transformers' do:
# those with a default share, and Phi-3's (whole heads unless its config says)
PARTIAL_ROTARY = ("phi3", "minimax_m2", *PARTIAL_ROTARY_DEFAULTS)
# The models with sliding layers by default: (window, every pattern-th layer global), transformers' defaults
SLIDING_PATTERNS = {"gpt_oss": (128, 2), "olmo3": (4096, 4), "exaone4": (4096, 4), "exaone_moe": (4096, 4),
                    "cohere2": (4096, 4)}  # fmt: skip
# The norms (of a weight each) of a layer, by model type or architecture (Llama's: 2)
NORMS_PER_LAYER = {"gemma3": 4, "glm4": 4, "cohere": 1, "phi": 1, "afmoe": 4, "vaultgemma": 2}
# The MLP activations of the models of Llama's outline whose MLP is not SwiGLU (transformers' names)
MLP_ACTIVATIONS = {
    "phi": GPT2_ACTIVATIONS,
    "starcoder2": GPT2_ACTIVATIONS,
    "gemma": ("gelu_pytorch_tanh",),
    "nemotron": ("relu2",),
    "nanochat": ("relu2",),
    "arcee": ("relu2",),
    "jais2": ("relu2",),
    "apertus": ("xielu",),
}
# The models whose MLP is two matrices (up, an activation, down), not a gated three
TWO_MATRIX_MLPS = ("opt", "gpt_neox", "gpt2", "phi", "starcoder2", "nemotron", "arcee", "apertus", "jais2", "nanochat")
# Cohere's models (Command R, R7B and A, A+: a logit scale; rope by adjacent pairs)
COHERE_TYPES = ("cohere", "cohere2", "cohere2_moe")
# The models of Llama's outline whose norms are LayerNorms with biases
LAYER_NORMS = ("phi", "starcoder2", "stablelm", "nemotron", "phimoe", "jais2")
# The models of Llama's outline whose norms have no weights (OLMo 1's)
WEIGHTLESS_NORMS = ("olmo", "nanochat")
# A layer type of ModelConfig.layer_types that sees only the last sliding_window positions
SLIDING = "sliding_attention"
CHUNKED = "chunked_attention"  # (Llama 4's: only the positions of its own chunk of attention_chunk_size)
MAMBA = "mamba"  # (a layer of Mamba-2's mixer: ``ModelConfig.mamba``)
MLP_LAYER = "mlp"  # (Nemotron-H's layers of an MLP alone)
MOE_LAYER = "moe"  # (Nemotron 3's layers of experts alone)
PARALLEL_HYBRID = "attention_and_mamba"  # (Falcon-H1's layers: attention and a Mamba-2 mixer side by side)
SHORT_CONV = "conv"  # (LFM2's layers of a gated short convolution: ``ModelConfig.short_conv``)
LINEAR_ATTENTION = "linear_attention"  # (Qwen3-Next's layers of gated DeltaNet: ``ModelConfig.gated_delta_net``)
GRANITE_SCALED = (
    "granite",
    "granitemoe",
    "granitemoehybrid",
    "granite_swa",
    "granitemoeshared",
    "granitemoe_swa",
    "hyperclovax",
)
# The mixtures of experts beside a shared MLP every token runs, unscaled (Granite's ``shared_mlp``)
UNGATED_SHARED_EXPERTS = ("granitemoehybrid", "granitemoeshared", "granitemoe_swa")
LFM_TYPES = ("lfm2", "lfm2_moe", "lfm3")  # (Liquid AI's models of short convolutions and attention)
MAMBA_TYPES = ("mamba", "falcon_mamba", "mamba2")  # (no attention: every layer a Mamba mixer)
# The context of a model whose config names none (Mamba's: no position embedding ends it), vLLM's default
UNNAMED_CONTEXT_TOKENS = 2048
MAMBA2_SIZES = {"num_heads": 128, "head_dim": 64, "n_groups": 8, "chunk_size": 256}  # (Mamba2Config's defaults)
QWEN3_NEXT_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")  # (gated DeltaNet and gated attention)
GATED_DELTA_NET_TYPES = (*QWEN3_NEXT_TYPES, "olmo_hybrid")  # (the models with gated DeltaNet layers)
# Byte-level tokenizer of random models: ids 0..255 are bytes, then BOS and EOS.
BYTE_BOS_ID, BYTE_EOS_ID = 256, 257
RANDOM_PREFIX = "random:"
# OPT's learned position table starts at index 2 (a fairseq leftover, kept by HF).
OPT_POSITION_OFFSET = 2
# Bytes per weight of a checkpoint's torch_dtype (the simulator's weight and KV sizes).
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class ModelConfig:
    """The architecture numbers the engine needs (names as in HF ``config.json``).

    ``model_type`` is the HF name (llama, mistral, qwen2, opt); ``architecture`` the module that runs
    it. ``rope_scaling`` is the HF dict (``rope_type`` default, linear, llama3, yarn or longrope; a GGUF
    file's ``frequency_factors``) or None.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    # Phi-4 mini: the rotary embedding turns the first partial_rotary_dim of each head (96 of 128), the
    # rest pass through (None: the whole head)
    partial_rotary_dim: int | None = None
    # GLM: the rotary embedding turns adjacent pairs of those dimensions (GPT-J's layout), not halves; the
    # engine loads its Q and K rows reordered so that its rotate-half computes the same scores
    rotary_interleaved: bool = False
    # Ministral 3 (Llama 4's attention scaling): a query at position p is scaled by
    # 1 + beta ln(1 + floor(p / the rope's original_max_position_embeddings)) (None: not)
    llama4_scaling_beta: float | None = None
    attention_bias: bool = False  # q/k/v biases (Qwen2: True)
    attention_output_bias: bool = False  # an o_proj bias (gpt-oss)
    # gpt-oss: a learned logit per head joins each query's softmax (a key with no value: "attention sinks")
    attention_sinks: bool = False
    qk_norm: bool = False  # an RMSNorm of each query and key head before the rotary embedding (Qwen3)
    # ... of the whole query and key projections (heads x head_dim) instead (OLMo 2, 3, OLMoE)
    qk_norm_whole_projection: bool = False
    qk_norm_after_rotary: bool = False  # Hunyuan: each query and key head normalized after the rotary embedding
    # Llama 4: each rotated query and key head divided by its root mean square after the rotary embedding, no weight
    # (transformers' Llama4TextL2Norm)
    qk_unweighted_norm: bool = False
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to [-clip_qkv, clip_qkv] (None: not)
    # ALiBi (``engine/alibi.py``: BLOOM's, Falcon-RW's) in place of a rotary embedding: each head's scores biased by its
    # slope times the distance; its slopes Press et al.'s, or MPT's by alibi_bias_max (None: Press et al.'s)
    alibi: bool = False
    alibi_bias_max: float | None = None
    parallel_residual: bool = False  # GPT-NeoX: x + attn(ln1(x)) + mlp(ln2(x)), not one after the other
    mlp_bias: bool = False
    lm_head_bias: bool = False  # (Phi-1 to 2's; Phi-3.5-MoE's where its config says)
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    # Gemma 3: scores scaled by query_pre_attn_scalar ** -0.5 (None: head_dim's); each layer's type
    # (SLIDING: it sees the last sliding_window positions, its rope base rope_local_theta; else all, at
    # rope_theta with rope_scaling); the final scores capped by tanh (None: not)
    query_pre_attn_scalar: float | None = None
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    rope_local_theta: float | None = None
    # Llama 4: the layers of layer_types CHUNKED see only the positions of their own chunk of attention_chunk_size (a
    # query at position p: p - p % attention_chunk_size .. p); None: no chunked layer
    attention_chunk_size: int | None = None
    # Llama 4's attention temperature: the queries of the layers that do not rotate scaled by
    # 1 + attn_scale ln(1 + floor((p + 1) / floor_scale)) at position p (None: not scaled)
    attn_scale: float | None = None
    floor_scale: int = 8192
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None  # Gemma 2: scores capped by tanh (None: not)
    # SmolLM3: whether each layer rotates its queries and keys (its NoPE layers do not); empty: all do
    rotary_layers: tuple[bool, ...] = ()
    # Granite: the embeddings times embedding_multiplier, each layer's attention and MLP outputs times
    # residual_multiplier before they join the residual stream, scores scaled by attention_multiplier
    # (None: head_dim ** -0.5), the logits divided by logits_scaling
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # A mixture of experts (Qwen3-MoE, Qwen2-MoE, Mixtral): num_experts, num_experts_per_tok,
    # moe_intermediate_size, norm_topk_prob, moe_layers (whether each layer's MLP is the experts; else a
    # dense one of intermediate_size) and shared_expert_intermediate_size (Qwen2-MoE's expert that every
    # token runs, gated; 0: none); None: every MLP dense
    moe: dict[str, Any] | None = None
    # DeepSeek-V2's multi-head latent attention: q_lora_rank (None: one query projection), kv_lora_rank (the
    # latent's size, d_c), qk_nope_head_dim, qk_rope_head_dim (d_h^R) and v_head_dim; None: not
    mla: dict[str, Any] | None = None
    # Mamba-2 mixers in place of attention in the layers whose layer_types entry is MAMBA (Granite 4.0-H, Bamba,
    # Nemotron-H), beside it in PARALLEL_HYBRID ones (Falcon-H1): n_heads, head_dim, n_groups, d_state, d_conv,
    # d_inner, chunk_size, conv_bias, proj_bias, out_proj_bias, rms_norm, norm_before_gate, time_step_limit. Mamba's
    # mixers (version 1: Jamba's, Mamba's, Falcon Mamba's): d_inner, d_state, d_conv, dt_rank, conv_bias, proj_bias and
    # the norms of the step, B and C (dt_bc_norms, dt_bc_norm_weights, dt_bc_norm_eps: None for norm_eps). A model of
    # Mamba layers alone: residual_in_fp32 too. None: none
    mamba: dict[str, Any] | None = None
    # LFM2's gated short convolutions in place of attention in the layers whose layer_types entry is SHORT_CONV:
    # width (its taps, the config's conv_L_cache) and bias (its projections' and convolution's); None: none
    short_conv: dict[str, Any] | None = None
    # Qwen3-Next's gated DeltaNet in place of attention in the layers whose layer_types entry is LINEAR_ATTENTION:
    # num_k_heads, num_v_heads (a multiple of them), head_k_dim, head_v_dim, width (its convolution's taps, the
    # config's linear_conv_kernel_dim), beta_scale (OLMo Hybrid's 2: beta in (0, 2)), norm_eps (its gated norm's
    # epsilon) and, for Kimi's KDA layers, channel_decay (a decay a key channel, its low-rank gates); None: none
    gated_delta_net: dict[str, Any] | None = None
    # OPT only
    word_embed_proj_dim: int | None = None
    do_layer_norm_before: bool = True
    enable_bias: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    name: str = "model"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.model_type not in ARCHITECTURES:
            raise ConfigError(
                f"model {self.name}: unsupported architecture {self.model_type!r}; "
                f"supported: {', '.join(sorted(ARCHITECTURES))}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"model {self.name}: {name} must be a positive integer, got {value!r}")
        rotated = self.partial_rotary_dim
        if rotated is not None and not (0 < rotated <= self.head_dim and rotated % 2 == 0):
            raise ConfigError(
                f"model {self.name}: the rotary embedding turns {rotated} of a head's {self.head_dim} dimensions; "
                "it needs an even number of them"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"model {self.name}: num_key_value_heads {self.num_key_value_heads} must divide "
                f"num_attention_heads {self.num_attention_heads}"
            )

    @property
    def architecture(self) -> str:
        return ARCHITECTURES[self.model_type]

    @property
    def rotary_dim(self) -> int:
        """The dimensions of a head the rotary embedding turns (the leading ones)."""
        return self.partial_rotary_dim or self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    @property
    def moe_experts_gated(self) -> bool:
        """Whether the experts are SwiGLU MLPs (``fused_moe``'s kernels run those): all but Nemotron-H's."""
        return self.model_type != "nemotron_h"

    @property
    def kv_cache_heads(self) -> int:
        """The heads of one token's K (and V) in the KV cache: MLA's one latent, else the KV heads."""
        return 1 if self.mla is not None else self.num_key_value_heads

    @property
    def kv_cache_head_dim(self) -> int:
        """The numbers of each: MLA's latent and rotated key [c_KV; k_R], else a head's."""
        return self.head_dim if self.mla is None else self.mla["kv_lora_rank"] + self.mla["qk_rope_head_dim"]

    @property
    def kv_cache_tensors(self) -> int:
        """The KV cache's tensors a token and layer: K and V (2), or MLA's keys alone (1: ``kv_cache_value_dim``)."""
        return 2 if self.kv_cache_value_dim is None else 1

    @property
    def attention_value_dim(self) -> int:
        """A head's attention output: MLA's values by head (``v_head_dim``), else ``head_dim``."""
        return self.head_dim if self.mla is None else self.mla["v_head_dim"]

    @property
    def kv_cache_value_dim(self) -> int | None:
        """MLA's: the cache holds keys only, and a key's first ``kv_lora_rank`` numbers (its latent c_KV) are
        its value; None where the cache holds values of their own."""
        return None if self.mla is None else self.mla["kv_lora_rank"]

    def layer_is_moe(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is a mixture of experts."""
        return self.moe is not None and self.moe["moe_layers"][layer]

    def layer_rotates(self, layer: int) -> bool:
        """Whether layer ``layer`` applies the rotary embedding to its queries and keys."""
        return not self.rotary_layers or self.rotary_layers[layer]

    def layer_window(self, layer: int) -> int | None:
        """The positions layer ``layer`` sees (None: all of them)."""
        return self.sliding_window if self.layer_types and self.layer_types[layer] == SLIDING else None

    def layer_chunk(self, layer: int) -> int | None:
        """The length of the chunks whose positions alone a query of layer ``layer`` sees (None: not chunked)."""
        return self.attention_chunk_size if self.layer_types and self.layer_types[layer] == CHUNKED else None

    @property
    def rotary_table_rows(self) -> int:
        """The rows of the rotary tables a step's token has (``Rotary.for_positions``): 2 where the queries are scaled
        by position (Ministral 3's tables, the queries' then the keys'; Llama 4's, the rotation's then the unrotated
        layers' query scale), else 1."""
        return 1 if self.llama4_scaling_beta is None and self.attn_scale is None else 2

    def layer_is_mamba(self, layer: int) -> bool:
        """Whether layer ``layer`` mixes its tokens with a Mamba-2 mixer (instead of attention, or beside it:
        Falcon-H1's)."""
        return self.mamba is not None and self.layer_types[layer] in (MAMBA, PARALLEL_HYBRID)

    def layer_has_states(self, layer: int) -> bool:
        """Whether layer ``layer`` keeps a request's states from one step to the next (``engine/state_cache.py``):
        a Mamba-2 mixer's, a short convolution's or a gated DeltaNet's."""
        if self.layer_is_mamba(layer):
            return True
        kind = self.layer_types[layer] if self.layer_types else None
        return (self.short_conv is not None and kind == SHORT_CONV) or (
            self.gated_delta_net is not None and kind == LINEAR_ATTENTION
        )

    def layer_has_kv(self, layer: int) -> bool:
        """Whether layer ``layer`` attends (and has a KV cache): not a Mamba layer, nor a short convolution's, nor a
        gated DeltaNet's, nor Nemotron-H's MLP and experts' ones."""
        kinds = (MAMBA, MLP_LAYER, MOE_LAYER, SHORT_CONV, LINEAR_ATTENTION)
        return not self.layer_types or self.layer_types[layer] not in kinds

    def kv_layer_index(self, layer: int) -> int | None:
        """Layer ``layer``'s index among the layers with a KV cache (the attention layers); None for another."""
        if not self.layer_has_kv(layer):
            return None
        return sum(self.layer_has_kv(i) for i in range(layer))

    @property
    def num_kv_layers(self) -> int:
        """The layers with a KV cache: the attention layers."""
        return sum(self.layer_has_kv(i) for i in range(self.num_hidden_layers))

    @property
    def num_mamba_layers(self) -> int:
        """The layers of a Mamba-2 mixer (each with a request's states)."""
        return sum(self.layer_is_mamba(i) for i in range(self.num_hidden_layers))

    @property
    def has_request_states(self) -> bool:
        """Whether some layers keep a request's states (Mamba-2 mixers, short convolutions, gated DeltaNets): the
        engine keeps them in slots, one a running request (``StateCache``)."""
        return self.mamba is not None or self.short_conv is not None or self.gated_delta_net is not None

    def state_layer_index(self, layer: int) -> int:
        """Layer ``layer``'s place among the layers with states (its states' in ``StateCache``)."""
        return sum(self.layer_has_states(i) for i in range(layer))

    @property
    def num_state_layers(self) -> int:
        """The layers with states (``layer_has_states``)."""
        return self.state_layer_index(self.num_hidden_layers)

    @property
    def state_conv_dim(self) -> int:
        """The channels of the causal convolution a state layer runs (its last inputs are a request's state): a
        Mamba-2 mixer's x, B and C; a short convolution's hidden size; a gated DeltaNet's q, k and v."""
        if self.mamba is not None:
            return self.mamba_conv_dim
        if self.gated_delta_net is not None:
            net = self.gated_delta_net
            return 2 * net["num_k_heads"] * net["head_k_dim"] + net["num_v_heads"] * net["head_v_dim"]
        return self.hidden_size

    @property
    def state_conv_width(self) -> int:
        """That convolution's taps (Mamba-2's d_conv, LFM2's conv_L_cache, Qwen3-Next's linear_conv_kernel_dim)."""
        if self.mamba is not None:
            return self.mamba["d_conv"]
        return (self.gated_delta_net or self.short_conv)["width"]

    @property
    def state_recurrence_shape(self) -> tuple[int, int, int] | None:
        """A state layer's recurrent state of one request (float32), beside its convolution's: a Mamba-2 mixer's h of
        each head (n_heads, head_dim, d_state); a gated DeltaNet's S of each value head (num_v_heads, head_k_dim,
        head_v_dim); None for a short convolution (its convolution's alone)."""
        if self.mamba is not None and self.mamba.get("version") == 1:  # (Mamba's: a state of d_state a channel)
            return 1, self.mamba["d_inner"], self.mamba["d_state"]
        if self.mamba is not None:
            return self.mamba["n_heads"], self.mamba["head_dim"], self.mamba["d_state"]
        if self.gated_delta_net is not None:
            net = self.gated_delta_net
            return net["num_v_heads"], net["head_k_dim"], net["head_v_dim"]
        return None

    @property
    def mamba_conv_dim(self) -> int:
        """The channels a Mamba-2 mixer's convolution runs over: its x, B and C (d_inner + 2 n_groups d_state); Mamba's,
        its x (d_inner)."""
        if self.mamba.get("version") == 1:
            return self.mamba["d_inner"]
        return self.mamba["d_inner"] + 2 * self.mamba["n_groups"] * self.mamba["d_state"]

    @property
    def mamba_params(self) -> int:
        """A Mamba-2 mixer's parameters: in_proj, conv1d, dt_bias, A_log, D, the gated norm, out_proj; Mamba's:
        in_proj, conv1d, x_proj, dt_proj, A_log, D, the norms of the step, B and C, out_proj."""
        m, h, conv_dim = self.mamba, self.hidden_size, self.mamba_conv_dim
        if m.get("version") == 1:
            d, n, rank, bias = m["d_inner"], m["d_state"], m["dt_rank"], m["proj_bias"]
            in_out = 2 * h * d + 2 * d * bias + d * h + h * bias
            conv = d * m["d_conv"] + d * m["conv_bias"]
            return (
                in_out + conv + d * (rank + 2 * n) + rank * d + d + d * n + d + (rank + 2 * n) * m["dt_bc_norm_weights"]
            )
        in_proj = h * (m["d_inner"] + conv_dim + m["n_heads"]) + m["proj_bias"] * (
            m["d_inner"] + conv_dim + m["n_heads"]
        )
        conv = conv_dim * m["d_conv"] + conv_dim * m["conv_bias"]
        norm = m["d_inner"] * m["rms_norm"]
        return in_proj + conv + 3 * m["n_heads"] + norm + m["d_inner"] * h + m["out_proj_bias"] * h

    @property
    def gated_delta_net_params(self) -> int:
        """A gated DeltaNet's parameters: its input projection (q, k, v, the gate z, b and a), its convolution (no
        bias), dt_bias and A_log a value head, its gated norm (a head's width, shared), out_proj. Kimi's KDA: q, k,
        v, the convolution, the decay's low-rank projections (f_a, f_b) with dt_bias a channel and A_log a head,
        b_proj, the gate's low-rank projections (g_a, g_b), the norm, o_proj."""
        net, h = self.gated_delta_net, self.hidden_size
        value_dim = net["num_v_heads"] * net["head_v_dim"]
        if net.get("channel_decay"):
            heads, width = net["num_v_heads"], net["head_k_dim"]
            low_rank = 2 * (h * width + width * value_dim)  # (f_a, f_b; g_a, g_b)
            conv = self.state_conv_dim * (h + net["width"])
            return conv + low_rank + value_dim + heads + h * heads + width + value_dim * h
        in_proj = h * (self.state_conv_dim + value_dim + 2 * net["num_v_heads"])
        return in_proj + self.state_conv_dim * net["width"] + 2 * net["num_v_heads"] + net["head_v_dim"] + value_dim * h

    def request_state_bytes(self, dtype_bytes: float) -> int:
        """A request's states, every state layer's: its convolution's last inputs (``dtype_bytes`` a number) and its
        recurrent state (``state_recurrence_shape``, float32); 0 for a model without such layers."""
        if not self.has_request_states:
            return 0
        per_layer = self.state_conv_dim * (self.state_conv_width - 1) * dtype_bytes
        if self.state_recurrence_shape is not None:
            heads, rows, columns = self.state_recurrence_shape
            per_layer += heads * rows * columns * 4
        return int(self.num_state_layers * per_layer)

    @property
    def num_params(self) -> int:
        """Parameters of the engine's model of this shape (a tied LM head counted once)."""
        h, i, v, layers = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_hidden_layers
        if self.architecture == "opt":
            proj = self.word_embed_proj_dim or h
            bias = int(self.enable_bias)
            # q, k, v, out projections and fc1, fc2 (with biases), two LayerNorms (weight and bias)
            layer = 4 * (h * h + bias * h) + (h * i + bias * i) + (i * h + bias * h) + 2 * 2 * h
            final_norm = 2 * h if self.do_layer_norm_before and not self.extra.get("remove_final_layer_norm") else 0
            embeddings = v * proj + (self.max_position_embeddings + OPT_POSITION_OFFSET) * h
            projections = 2 * proj * h if proj != h else 0
            lm_head = 0 if self.tie_word_embeddings else v * proj
            return embeddings + projections + layers * layer + final_norm + lm_head
        if self.architecture == "gpt2":  # c_attn and c_proj, c_fc and c_proj (with biases), two LayerNorms
            qkv = h + 2 * self.num_key_value_heads * self.head_dim  # (GPT-BigCode's: one KV head)
            layer = h * qkv + qkv + h * h + h + 2 * h * i + i + h + 2 * 2 * h
            embeddings = v * h + self.max_position_embeddings * h
            return embeddings + layers * layer + 2 * h + (0 if self.tie_word_embeddings else v * h)
        if self.mla is not None:
            return self._deepseek_num_params()
        if self.architecture in ("nemotron_h", "mamba"):  # a norm and one mixer a block
            q_width, kv_width = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
            mixers = {
                MAMBA: self.mamba_params,
                "full_attention": 2 * h * q_width + 2 * h * kv_width,
                MLP_LAYER: 2 * h * i + (i + h if self.mlp_bias else 0),
            }
            if self.moe is not None:  # the router and its bias, two-matrix experts, the shared one
                e, moe_i = self.moe["num_experts"], self.moe["moe_intermediate_size"]
                mixers[MOE_LAYER] = e * h + e + e * 2 * h * moe_i + 2 * h * self.moe["shared_expert_intermediate_size"]
            blocks = sum(h + mixers[kind] for kind in self.layer_types)
            return v * h + blocks + h + (0 if self.tie_word_embeddings else v * h)
        if self.architecture == "gpt_neox":  # q/k/v and dense (biases where attention_bias), a two-matrix
            # MLP with biases, two LayerNorms a layer and a final one (weight and bias)
            layer = 4 * h * h + 4 * h * self.attention_bias + 2 * h * i + i + h + 2 * 2 * h
            return v * h + layers * layer + 2 * h + (0 if self.tie_word_embeddings else v * h)
        if self.architecture == "mpt":  # Wqkv and out_proj, a two-matrix MLP, two LayerNorms a layer and a final one,
            # no biases
            return v * h + layers * (4 * h * h + 2 * h * i + 2 * h) + h + (0 if self.tie_word_embeddings else v * h)
        if self.architecture == "falcon":  # query_key_value and dense, a two-matrix MLP (biases where bias), its norms
            qkv, bias = h + 2 * self.num_key_value_heads * self.head_dim, self.attention_bias
            norms = 2 * 2 * h if self.extra["falcon_norms"] != "input" else 2 * h
            layer = h * qkv + h * h + 2 * h * i + bias * (qkv + h + i + h) + norms
            embedding_norm = 2 * h if self.extra["embedding_norm"] else 0  # (BLOOM's)
            return v * h + embedding_norm + layers * layer + 2 * h + (0 if self.tie_word_embeddings else v * h)
        q_width, kv_width = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        attention = h * q_width + 2 * h * kv_width + q_width * h
        if self.attention_bias:
            attention += q_width + 2 * kv_width
        if self.qk_norm:
            attention += q_width + kv_width if self.qk_norm_whole_projection else 2 * self.head_dim
        attention += h * self.attention_output_bias + self.num_attention_heads * self.attention_sinks
        attention += h * q_width * (self.architecture in ("qwen3_next", "afmoe"))  # (the gate of each head's output)
        if self.model_type in TWO_MATRIX_MLPS:  # up, down
            mlp = 2 * h * i + (i + h if self.mlp_bias else 0)
            mlp += 4 * (self.model_type == "apertus")  # (xIELU's alpha_p, alpha_n, beta and eps)
        else:  # gate, up, down
            mlp = 3 * h * i + (2 * i + h if self.mlp_bias else 0)
        # (a LayerNorm's bias; OLMo 1's norms: no weight)
        norm = 2 * h if self.model_type in LAYER_NORMS else 0 if self.model_type in WEIGHTLESS_NORMS else h
        norms = NORMS_PER_LAYER.get(self.model_type, NORMS_PER_LAYER.get(self.architecture, 2))  # (by type, else arch)
        layer = attention + mlp + norms * norm
        total = v * h + layers * layer + norm + (0 if self.tie_word_embeddings else v * h)
        total += v * self.lm_head_bias
        if self.moe is not None:  # a MoE layer: the router and every expert instead of the dense MLP
            experts = self.moe["num_experts"] * (h + 3 * h * self.moe["moe_intermediate_size"])
            if self.moe["shared_expert_intermediate_size"]:  # and the shared experts (Qwen2-MoE's with a gate)
                gated = self.model_type in GATED_SHARED_EXPERTS  # (its gate: a row of h)
                experts += 3 * h * self.moe["shared_expert_intermediate_size"] + h * gated
            if self.moe.get("topk_method") in BIASED_ROUTINGS:  # (the router's bias: GLM-4.5's, ERNIE 4.5's)
                experts += self.moe["num_experts"]
            if "swiglu_limit" in self.moe:  # gpt-oss: the router's and the experts' biases
                experts += self.moe["num_experts"] * (1 + 2 * self.moe["moe_intermediate_size"] + h)
            total += sum(self.moe["moe_layers"]) * (experts - mlp)
        if self.mamba is not None:  # a Mamba layer: the mixer instead of the attention (Falcon-H1's: beside it)
            total += (
                self.num_mamba_layers * self.mamba_params - (self.num_hidden_layers - self.num_kv_layers) * attention
            )
        if self.short_conv is not None:  # a short convolution's layer: in_proj (B, C, x), its taps, out_proj
            bias = self.short_conv["bias"]
            conv = 3 * h * h + h * self.short_conv["width"] + h * h + bias * (3 * h + h + h)
            total += (self.num_hidden_layers - self.num_kv_layers) * (conv - attention)
        if self.gated_delta_net is not None:  # a gated DeltaNet's layer instead of attention
            total += (self.num_hidden_layers - self.num_kv_layers) * (self.gated_delta_net_params - attention)
        if self.model_type == "lfm3":  # (its norms of each operator's and MLP's output; each head's gate)
            total += self.extra["use_sandwich_norm"] * layers * 2 * h
            total += self.extra["use_attention_gate"] * self.num_kv_layers * h * self.num_attention_heads
        if self.model_type == "hyperclovax":  # (its norms of each part's output)
            total += self.extra["use_post_norm"] * layers * 2 * h
        return total

    def _deepseek_num_params(self) -> int:
        """DeepSeek-V2's and V3's: MLA's projections and norms, dense MLPs before ``moe_layers`` start, then the
        router, the experts and the shared ones."""
        h, v, nh, mla, moe = self.hidden_size, self.vocab_size, self.num_attention_heads, self.mla, self.moe
        qk = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
        q = h * nh * qk if mla["q_lora_rank"] is None else (h + 1 + nh * qk) * mla["q_lora_rank"]
        latent = mla["kv_lora_rank"]
        kv = (
            h * (latent + mla["qk_rope_head_dim"])
            + latent
            + latent * nh * (mla["qk_nope_head_dim"] + mla["v_head_dim"])
        )
        bias = (mla["q_lora_rank"] or 0) + latent + mla["qk_rope_head_dim"] + h if self.attention_bias else 0
        attention = q + kv + nh * mla["v_head_dim"] * h + bias
        dense = 3 * h * self.intermediate_size
        experts = 0 if moe is None else moe["num_experts"] * (h + 3 * h * moe["moe_intermediate_size"])
        experts += 0 if moe is None or moe["topk_method"] != "noaux_tc" else moe["num_experts"]  # (V3's router bias)
        experts += 0 if moe is None else 3 * h * moe["shared_expert_intermediate_size"]
        mlps = sum(experts if self.layer_is_moe(i) else dense for i in range(self.num_hidden_layers))
        mixers = self.num_kv_layers * attention  # (Kimi Linear's KDA layers: no MLA)
        mixers += 0 if self.gated_delta_net is None else self.num_state_layers * self.gated_delta_net_params
        total = v * h + self.num_hidden_layers * 2 * h + mixers + mlps + h
        return total + (0 if self.tie_word_embeddings else v * h)

    def spec(self) -> ModelSpec:
        """The simulator's view of this model (``simulate --model`` with a directory or ``random:NAME``).

        A mixture of experts: all its parameters in memory, a token's experts in its compute, and the experts a
        step's tokens reach in the weights it reads (``ModelSpec.num_experts``...: the roofline's)."""
        two_matrices = self.model_type in TWO_MATRIX_MLPS or self.architecture in ("falcon", "gpt2", "mpt")
        mlp_kind = "relu" if two_matrices else "gated"  # (two matrices, whatever their activation)
        extra = {}  # (the fields a dense model with Llama's attention leaves at 0)
        if self.moe is not None:  # (each routed expert's SwiGLU; gpt-oss's with its biases)
            h, inner, moe = self.hidden_size, self.moe["moe_intermediate_size"], self.moe
            matrices = 3 if self.moe_experts_gated else 2  # (gate, up, down; Nemotron-H's up and down)
            per_expert = matrices * h * inner + (2 * inner + h if "swiglu_limit" in moe else 0)
            extra.update(
                num_experts=moe["num_experts"],
                experts_per_token=moe["num_experts_per_tok"],
                expert_params=sum(moe["moe_layers"]) * moe["num_experts"] * per_expert,
            )
        if self.mla is not None:  # (prefills by head: the engine's ``PrefillsByHead``)
            mla, nh = self.mla, self.num_attention_heads
            up_projection = 2 * mla["kv_lora_rank"] * nh * (mla["qk_nope_head_dim"] + mla["v_head_dim"])
            extra.update(
                prefill_head_dim=self.head_dim, prefill_kv_flops_per_token=self.num_hidden_layers * up_projection
            )
        # Sliding-window and chunked layers: their count and W (the longer, were a model to have both)
        windows = [self.layer_window(i) or self.layer_chunk(i) for i in range(self.num_hidden_layers)]
        windows = [w for w in windows if w]
        if windows:
            extra.update(window_layers=len(windows), window_tokens=max(windows))
        return ModelSpec(
            name=self.name,
            num_layers=self.num_hidden_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_kv_heads=self.kv_cache_heads,
            head_dim=self.kv_cache_head_dim,  # NOTE: MLA's attention runs on its latent, 576 wide (V2)
            keys_only_kv=self.kv_cache_tensors == 1,  # (MLA's values are its keys' latent)
            kv_layers=self.num_kv_layers,  # (0: a model of no attention, Mamba's: its requests' states hold them)
            state_bytes_per_sequence=self.request_state_bytes(DTYPE_BYTES.get(self.torch_dtype, 2)),
            **extra,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            num_params=self.num_params,
            max_context_len=self.max_position_embeddings,
            dtype_bytes=DTYPE_BYTES.get(self.torch_dtype, 2),
            mlp_kind=mlp_kind,
            tied_embeddings=self.tie_word_embeddings,
        )


def from_hf_config(raw: dict[str, Any], name: str = "model") -> ModelConfig:
    """A ``ModelConfig`` from the dict of an HF ``config.json``; unsupported ones are a ConfigError."""
    model_type = raw.get("model_type")
    if model_type in MULTIMODAL:
        return _language_model_config(raw, name)
    if model_type not in ARCHITECTURES:
        raise ConfigError(
            f"{name}: unsupported architecture {model_type!r} (config.json model_type); "
            f"supported: {', '.join(sorted([*ARCHITECTURES, *MULTIMODAL]))}"
        )
    if model_type == "gemma3_text":
        raw = {**GEMMA3_TEXT_DEFAULTS, **raw}
    elif model_type in ("gemma2", "vaultgemma"):
        raw = {**GEMMA2_DEFAULTS, **raw}
    elif model_type in ("gpt2", "gpt_bigcode"):
        raw = {GPT2_NAMES.get(key, key): value for key, value in raw.items()}
    elif model_type in SETTING_NAMES:  # (a config's own names of the common settings win, as transformers reads them)
        raw = {**raw, **{ours: raw[theirs] for theirs, ours in SETTING_NAMES[model_type].items() if theirs in raw}}
    elif model_type in MAMBA_TYPES:  # (no attention: one nominal head; no positions: the default context)
        tied = model_type != "mamba2"  # (transformers' defaults)
        raw = {
            "num_attention_heads": 1,
            "max_position_embeddings": UNNAMED_CONTEXT_TOKENS,
            "tie_word_embeddings": tied,
            **raw,
        }
    elif model_type == "nemotron_h":  # (its blocks' count is its pattern's length)
        raw = {**raw, "num_hidden_layers": len(_nemotron_h_kinds(raw, name))}
    elif model_type == "kimi_linear":
        raw = _kimi_linear_names(raw, name)
    elif model_type in LFM_TYPES:  # (the Hub's names, as transformers reads them: over the generic ones)
        raw = {
            **raw,
            "tie_word_embeddings": raw.get("tie_embedding", raw.get("tie_word_embeddings", True)),
            "intermediate_size": raw.get("block_ff_dim", raw.get("intermediate_size")),
            "rms_norm_eps": raw.get("norm_eps", raw.get("rms_norm_eps", 1e-5)),
        }
    raw = {**CONFIG_DEFAULTS.get(model_type, {}), **raw}
    if model_type in DEFAULT_ROPE_PARAMETERS and not any(
        raw.get(k) for k in ("rope_parameters", "rope_scaling", "rope_theta")
    ):
        raw = {**raw, "rope_parameters": DEFAULT_ROPE_PARAMETERS[model_type]}
    fp8_block = _fp8_weight_block(raw.get("quantization_config"), model_type, name)
    config = _config_of(raw, model_type, name)
    if fp8_block is None:
        return config
    return dataclasses.replace(config, extra={**config.extra, "fp8_weight_block": fp8_block})


def _fp8_weight_block(quantization: Any, model_type: str, name: str) -> tuple[int, int] | None:
    """The (rows, columns) of a block-wise FP8 checkpoint's weight blocks (``quant_method`` fp8 with a
    ``weight_block_size``: DeepSeek-V3's, Qwen3's and GLM-4.5's FP8 releases; their weights are dequantized
    as they load, ``models.dequantize_fp8_blocks``); None for an unquantized one (or gpt-oss's MXFP4 experts,
    dequantized as they load too). Any other quantization is a ConfigError: its tensors (AWQ's packed ints,
    per-tensor FP8) would load as plain weights."""
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if not quantization or (model_type == "gpt_oss" and method == "mxfp4"):
        return None
    block = quantization.get("weight_block_size") if method == "fp8" else None
    if block is None:
        raise ConfigError(
            f"{name}: quantized checkpoints are not supported (config.json quantization_config, quant_method "
            f"{method!r}{' without weight_block_size' if method == 'fp8' else ''}); use the unquantized model, "
            "a block-wise FP8 one, or a GGUF file of it"
        )
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError(f"{name}: quantization_config weight_block_size must be two positive integers, got {block!r}")
    for key, value in (("fmt", "e4m3"), ("activation_scheme", "dynamic")):
        if quantization.get(key, value) != value:
            raise ConfigError(f"{name}: FP8 quantization_config {key} {quantization[key]!r} is not supported ({value})")
    return block[0], block[1]


def _config_of(raw: dict[str, Any], model_type: str, name: str) -> ModelConfig:
    """``from_hf_config``'s reading of a supported, unquantized-as-held ``raw`` of ``model_type``."""

    def need(key: str) -> Any:
        if key not in raw:  # (under the config's own name where it has one: BLOOM's n_head)
            theirs = [t for t, ours in SETTING_NAMES.get(model_type, {}).items() if ours == key]
            raise ConfigError(f"{name}: config.json has no {theirs[0] if theirs else key!r}")
        return raw[key]

    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    heads = need("num_attention_heads")
    hidden = need("hidden_size")
    common = dict(
        model_type=model_type,
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        num_hidden_layers=need("num_hidden_layers"),
        num_attention_heads=heads,
        max_position_embeddings=need("max_position_embeddings"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", model_type == "opt")),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        name=name,
    )
    if model_type == "opt":
        if raw.get("activation_function", "relu") not in ("relu", "gelu"):
            raise ConfigError(f"{name}: OPT activation {raw.get('activation_function')!r} is not supported")
        return ModelConfig(
            **common,
            intermediate_size=need("ffn_dim"),
            num_key_value_heads=heads,
            head_dim=hidden // heads,
            norm_eps=1e-5,
            hidden_act=raw.get("activation_function", "relu"),
            word_embed_proj_dim=raw.get("word_embed_proj_dim", hidden),
            do_layer_norm_before=bool(raw.get("do_layer_norm_before", True)),
            enable_bias=bool(raw.get("enable_bias", True)),
            extra={"remove_final_layer_norm": bool(raw.get("_remove_final_layer_norm", False))},
        )
    if model_type in ("gemma3_text", "gemma2", "vaultgemma"):
        return _gemma3_config(raw, common, name, need)
    if model_type == "gpt_neox":
        return _gpt_neox_config(raw, common, name, need)
    if model_type in ("falcon", "bloom"):
        return _falcon_config(raw, common, name)
    if model_type == "mpt":
        return _mpt_config(raw, common, name)
    if model_type in ("gpt2", "gpt_bigcode"):
        return _gpt2_config(raw, common, name)
    if model_type in DEEPSEEK_TYPES:
        return _deepseek_config(raw, common, name, need)
    if model_type == "nemotron_h":
        return _nemotron_h_config(raw, common, name, need)
    if model_type in MAMBA_TYPES:
        return _mamba_config(raw, common, name)
    # transformers >= 5 keeps rope settings in rope_parameters; older configs at the top level.
    rope = dict(raw.get("rope_parameters") or {})
    default_theta = DEFAULT_ROPE_THETA.get(model_type, 10000.0)
    local_theta = None
    if model_type in ("olmo3", "lfm3"):  # (transformers 5: one dict a layer type; the scaling the full layers' only)
        local_theta = float((rope.get(SLIDING) or {}).get("rope_theta", raw.get("rope_theta", default_theta)))
        rope = dict(rope.get("full_attention") or {})
    rope_theta = rope.get("rope_theta", raw.get("rope_theta", default_theta))
    no_rope = model_type == "olmo_hybrid" and rope_theta is None  # (OLMo Hybrid as released: no position embedding)
    rope_theta = default_theta if no_rope else float(rope_theta)
    head_dim = raw.get("head_dim") or hidden // heads
    if model_type in ("hunyuan_v1_dense", "hunyuan_v1_moe"):
        rope_theta, rope, raw = _ntk_alpha(raw, rope, rope_theta, head_dim, name)
    scaling = _config_rope_scaling(raw, rope, name)
    if raw.get("use_sliding_window"):
        raise ConfigError(f"{name}: sliding-window attention (use_sliding_window) is not supported for {model_type}")
    glm = model_type in ("glm", "glm4")
    cohere = model_type in COHERE_TYPES
    rotated = rope.get(
        "partial_rotary_factor", raw.get("partial_rotary_factor", PARTIAL_ROTARY_DEFAULTS.get(model_type, 1.0))
    )
    if model_type == "bamba":  # (transformers' Bamba rotates half of each head whatever its config says)
        rotated = 0.5
    if model_type == "minimax_m2" and raw.get("rotary_dim"):  # (the Hub's: the dimensions turned, 64 of 128)
        rotated = raw["rotary_dim"] / head_dim
    if scaling is not None and scaling.get("rope_type") == "proportional":  # (whole heads, some pairs unturned)
        rotated = 1.0
    if rotated != 1.0 and model_type not in PARTIAL_ROTARY:  # NOTE: transformers' Llama rotates whole heads
        raise ConfigError(
            f"{name}: partial_rotary_factor {rotated} (a rotary embedding on part of a head) is not supported "
            f"for {model_type} ({', '.join(PARTIAL_ROTARY)} only)"
        )
    if not isinstance(rotated, (int, float)) or not 0 < rotated <= 1:
        raise ConfigError(f"{name}: partial_rotary_factor must be in (0, 1], got {rotated!r}")
    rotary_dim = int(head_dim * rotated)  # (transformers' rounding)
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "longrope":
        scaling = _longrope(scaling, raw, rotary_dim, name)
        for key in ("short_mscale", "long_mscale") if model_type == "phimoe" else ():  # (Phi-3.5-MoE's cos/sin scales)
            if isinstance(scaling.get(key), bool) or not isinstance(scaling.get(key), (int, float)):
                raise ConfigError(f"{name}: phimoe's longrope rope scaling needs {key}, a number")
    # NOTE: Mistral 7B v0.1's and Phi-3 mini's every layer sees the last sliding_window positions (later
    # Mistrals, Phi-4: null; a window as long as the context changes nothing); Qwen's sliding_window is
    # unused unless use_sliding_window
    window = (
        raw.get("sliding_window")
        if model_type in ("mistral", "ministral3", "mixtral", "phi3", "starcoder2", "phimoe")
        else None
    )
    if window is not None and window >= common["max_position_embeddings"]:
        window = None
    layer_types = (SLIDING,) * common["num_hidden_layers"] if window else ()
    if model_type == "dots1":  # (without layer_types: those from max_window_layers on sliding, as transformers')
        window, first_sliding = raw.get("sliding_window", 4096), raw.get("max_window_layers", 62)
        layer_types, window = _sliding_layers(raw, window, lambda i: window is not None and i >= first_sliding, name)
    if model_type == "cwm":  # (without layer_types: layers 0, 4, 8... full, the others sliding, as transformers')
        layer_types, window = _sliding_layers(raw, raw.get("sliding_window"), lambda i: i % 4 != 0, name)
    if model_type == "ministral":  # (without layer_types: every layer sliding where there is a window)
        window = raw.get("sliding_window")
        layer_types, window = _sliding_layers(raw, window, lambda i: bool(window), name)
    if model_type in SLIDING_PATTERNS:  # gpt-oss: every other layer sees the last 128 positions; OLMo 3: 3 of 4
        window, pattern = SLIDING_PATTERNS[model_type]
        window, pattern = raw.get("sliding_window", window), raw.get("sliding_window_pattern", pattern)
        if not raw.get("layer_types") and not (isinstance(pattern, int) and pattern > 0):
            raise ConfigError(f"{name}: sliding_window_pattern {pattern!r} needs layer_types (or a positive integer)")
        layer_types = tuple(raw.get("layer_types") or [SLIDING if (i + 1) % pattern else "full_attention"
                                                       for i in range(common["num_hidden_layers"])])  # fmt: skip
        if len(layer_types) != common["num_hidden_layers"]:
            raise ConfigError(
                f"{name}: layer_types has {len(layer_types)} entries; the model has {common['num_hidden_layers']} layers"
            )
    rotary_layers = raw.get("no_rope_layers") if model_type == "smollm3" else None  # (HF's name: 1 rotates)
    if no_rope:
        rotary_layers = [False] * common["num_hidden_layers"]
    if model_type in ("qwen3_5_moe_text", "solar_open"):  # (no dense MLP: its experts' size stands for one, unbuilt)
        intermediate = raw.get("moe_intermediate_size", MOE_DEFAULTS[model_type]["moe_intermediate_size"])
    else:
        intermediate = need("intermediate_size")
    mamba, short_conv, extra = None, None, {}
    if model_type == "jamba":  # (attention in one layer of attn_layer_period, without rope; Mamba's mixers elsewhere)
        layer_types, mamba = _jamba_layers(raw, common["num_hidden_layers"], name)
        rotary_layers = [False] * common["num_hidden_layers"]
    if model_type in LFM_TYPES:
        layer_types, intermediate, short_conv = _lfm2_layers(raw, common["num_hidden_layers"], model_type, name)
        window = raw.get("sliding_window") if SLIDING in layer_types else None
        if model_type == "lfm3":  # (each operator's and MLP's output normalized; each head's output gated)
            extra = {key: bool(raw.get(key, True)) for key in ("use_sandwich_norm", "use_attention_gate")}
    if model_type == "cohere2_moe":  # (its layers' kinds and rotations; RMSNorms where it gives their epsilon)
        layer_types, window, rotary_layers = _cohere2_moe_layers(raw, common["num_hidden_layers"], name)
        intermediate = raw.get("prefix_dense_intermediate_size") or intermediate  # (its dense MLPs')
        extra = {"rms_norm": raw.get("rms_norm_eps") is not None}
    if model_type == "hyperclovax":  # (each part's output normalized before it joins the stream)
        extra = {"use_post_norm": bool(raw.get("use_post_norm", True))}
    if model_type == "granitemoehybrid":
        rotary_layers, intermediate, layer_types, mamba = _granite_4_layers(raw, common["num_hidden_layers"], name)
    elif model_type == "bamba":  # (attention at attn_layer_indices, Mamba-2 elsewhere)
        layer_types, mamba = _bamba_layers(raw, common["num_hidden_layers"], name)
    elif model_type == "falcon_h1":  # (both in every layer; its multipliers folded into the weights as they load)
        layer_types = (PARALLEL_HYBRID,) * common["num_hidden_layers"]
        mamba = _mamba2(raw, name, FALCON_H1_MAMBA_DEFAULTS)
        extra = {"falcon_h1_multipliers": _falcon_h1_multipliers(raw, name)}
    gated_delta_net = None
    if model_type in GATED_DELTA_NET_TYPES:
        layer_types, gated_delta_net = _gated_delta_net_layers(raw, common["num_hidden_layers"], model_type, name)
    if model_type in ("granite_swa", "granitemoe_swa"):
        layer_types, window, rotary_layers, rope_theta = _granite_swa_layers(raw, common["num_hidden_layers"],
                                                                              rope_theta, name)  # fmt: skip
    if model_type in ("exaone4", "exaone_moe") and window:  # (its hybrid attention: the global layers without rope)
        rotary_layers = [layer_type == SLIDING for layer_type in layer_types]
    if model_type == "cohere2":  # (only its sliding layers rotate: none where it has no window)
        rotary_layers = [layer_type == SLIDING and bool(window) for layer_type in layer_types]
    chunk, llama4 = None, {}
    if model_type == "nanochat":  # (Llama 4's unweighted norms of the rotated heads, Gemma 2's capped logits)
        llama4 = {"qk_unweighted_norm": True, "final_logit_softcapping": raw["final_logit_softcapping"]}
    if model_type == "llama4_text":  # (chunked layers that rotate, global ones that do not; the dense MLPs' size)
        layer_types, rotary_layers, chunk = _llama4_layers(raw, common["num_hidden_layers"], name)
        intermediate, llama4 = raw["intermediate_size_mlp"], _llama4_attention(raw, name)
    mup = {}
    if model_type == "afmoe":  # (layer_types, or every global_attn_every_n_layers-th global; only the sliding rotate)
        every = raw.get("global_attn_every_n_layers", 4)
        _check_positive_ints({"global_attn_every_n_layers": every}, ("global_attn_every_n_layers",), name)
        layer_types, window = _sliding_layers(raw, raw.get("sliding_window", 1024), lambda i: (i + 1) % every, name)
        rotary_layers = [kind == SLIDING for kind in layer_types]
        if raw.get("mup_enabled"):  # (the embeddings times sqrt(hidden_size))
            mup = {"embedding_multiplier": hidden**0.5}
    if cohere and not (isinstance(raw["logit_scale"], (int, float)) and raw["logit_scale"] > 0):
        raise ConfigError(f"{name}: logit_scale must be a positive number, got {raw['logit_scale']!r}")
    if cohere and raw.get("use_qk_norm"):
        # NOTE: Command R+'s query and key LayerNorms (a weight per head and dimension) would be left out
        raise ConfigError(f"{name}: use_qk_norm (Command R+'s query and key LayerNorms) is not supported")
    if rotary_layers is not None and len(rotary_layers) != common["num_hidden_layers"]:
        raise ConfigError(
            f"{name}: no_rope_layers has {len(rotary_layers)} flags; the model has {common['num_hidden_layers']} layers"
        )
    activation = raw.get("hidden_act", "silu")
    if model_type == "gemma" and activation == "gelu":  # (Gemma's first configs' name of it, as transformers reads it)
        activation = "gelu_pytorch_tanh"
    activations = MLP_ACTIVATIONS.get(model_type, ("silu",))
    if activation not in activations:
        raise ConfigError(f"{name}: hidden_act {activation!r} is not supported ({', '.join(activations)})")
    if model_type in ("phi", "stablelm") and raw.get("qk_layernorm"):
        # NOTE: their query and key LayerNorms (one for every head) would be left out
        raise ConfigError(f"{name}: qk_layernorm (query and key LayerNorms) is not supported for {model_type}")
    if model_type == "stablelm" and raw.get("use_parallel_residual"):
        raise ConfigError(f"{name}: use_parallel_residual (StableLM 2 12B's layers) is not supported")
    return ModelConfig(
        **common,
        intermediate_size=intermediate,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        norm_eps=float(_norm_eps(raw, model_type)),
        hidden_act=activation,
        rope_theta=rope_theta,
        rope_scaling=scaling,
        rope_local_theta=local_theta,
        partial_rotary_dim=rotary_dim if rotary_dim != head_dim else None,
        rotary_interleaved=glm or model_type in ("ernie4_5", "ernie4_5_moe", *COHERE_TYPES, "llama4_text", "helium"),
        llama4_scaling_beta=_llama4_scaling_beta(model_type, scaling, rope, name),
        **_biases(raw, model_type),
        lm_head_bias=model_type == "phi" or (model_type == "phimoe" and bool(raw.get("lm_head_bias", False))),
        attention_sinks=model_type in ("gpt_oss", "granite_swa", "granitemoe_swa"),
        qk_norm=model_type in (*QK_NORMED, *QWEN3_NEXT_TYPES)
        or (model_type in ("glm4_moe", "sarvam_moe") and bool(raw.get("use_qk_norm", model_type == "sarvam_moe"))),
        qk_norm_after_rotary=model_type in ("hunyuan_v1_dense", "hunyuan_v1_moe"),
        qk_norm_whole_projection=model_type in (*OLMO_TYPES, "minimax_m2"),
        clip_qkv=raw.get("clip_qkv") if model_type in ("olmoe", "olmo") else None,
        moe=_moe(raw, common["num_hidden_layers"], name) if model_type in MOE_TYPES else None,
        layer_types=layer_types,
        sliding_window=int(window) if window else None,
        attention_chunk_size=chunk,
        **llama4,
        rotary_layers=tuple(bool(flag) for flag in rotary_layers or ()),
        mamba=mamba,
        short_conv=short_conv,
        gated_delta_net=gated_delta_net,
        **(_granite_multipliers(raw) if model_type in GRANITE_SCALED else {}),
        **mup,
        **(_falcon_h1_scales(raw, name) if model_type == "falcon_h1" else {}),
        extra=extra,
        # NOTE: Cohere's logits times logit_scale, as its inverse's quotient (the Hub's: powers of two, exact)
        **({"logits_scaling": 1 / float(raw["logit_scale"])} if cohere else {}),
    )


def _gpt_neox_config(raw: dict[str, Any], common: dict[str, Any], name: str, need) -> ModelConfig:
    """GPT-NeoX's config (transformers 5's ``rope_parameters``, or the Hub's ``rotary_pct`` and
    ``rotary_emb_base``; transformers' defaults 0.25 and 10,000)."""
    if raw.get("hidden_act", "gelu") != "gelu":
        raise ConfigError(f"{name}: GPT-NeoX hidden_act {raw.get('hidden_act')!r} is not supported (gelu)")
    rope = dict(raw.get("rope_parameters") or {})
    head_dim = common["hidden_size"] // common["num_attention_heads"]
    rotated = rope.get("partial_rotary_factor", raw.get("rotary_pct", 0.25))
    if not isinstance(rotated, (int, float)) or not 0 < rotated <= 1:
        raise ConfigError(f"{name}: rotary_pct must be in (0, 1], got {rotated!r}")
    rotary_dim = int(head_dim * rotated)
    return ModelConfig(
        **common,
        intermediate_size=need("intermediate_size"),
        num_key_value_heads=common["num_attention_heads"],
        head_dim=head_dim,
        norm_eps=float(raw.get("layer_norm_eps", 1e-5)),
        rope_theta=float(rope.get("rope_theta", raw.get("rotary_emb_base", 10000.0))),
        rope_scaling=_config_rope_scaling(raw, rope, name),
        partial_rotary_dim=rotary_dim if rotary_dim != head_dim else None,
        hidden_act="gelu",
        attention_bias=bool(raw.get("attention_bias", True)),
        parallel_residual=bool(raw.get("use_parallel_residual", True)),
    )


def _falcon_config(raw: dict[str, Any], common: dict[str, Any], name: str) -> ModelConfig:
    """Falcon's config (``models/falcon.py``), transformers' FalconConfig defaults where it has none: its KV heads
    (``num_kv_heads`` with ``new_decoder_architecture``, one with ``multi_query``, else every head's), its norms,
    its MLP (4 x hidden), ALiBi where ``alibi``. BLOOM's (``bloom``): Falcon-RW's, as transformers' BloomConfig
    has it."""
    if common["model_type"] == "bloom":
        if raw.get("apply_residual_connection_post_layernorm"):
            raise ConfigError(f"{name}: apply_residual_connection_post_layernorm (the normed stream as the residual) "
                              "is not supported")  # fmt: skip
        raw = {**raw, "alibi": True, "bias": True, "multi_query": False, "parallel_attn": False,
               "new_decoder_architecture": False}  # fmt: skip
    if raw.get("activation", "gelu") != "gelu":
        raise ConfigError(f"{name}: Falcon activation {raw.get('activation')!r} is not supported (gelu)")
    hidden, heads = common["hidden_size"], common["num_attention_heads"]
    new, parallel = bool(raw.get("new_decoder_architecture", False)), bool(raw.get("parallel_attn", True))
    kv_heads = (raw.get("num_kv_heads") or heads) if new else 1 if raw.get("multi_query", True) else heads
    if hidden % heads or heads % kv_heads:
        raise ConfigError(
            f"{name}: num_attention_heads {heads} must divide hidden_size {hidden}, and num_kv_heads {kv_heads} "
            "divide them"
        )
    if new and not parallel:
        raise ConfigError(f"{name}: new_decoder_architecture without parallel_attn is not supported")
    if new and raw.get("num_ln_in_parallel_attn") in (None, 2):
        norms = "ln_attn, ln_mlp"
    else:
        norms = "input" if parallel else "input, post_attention"
    rope = dict(raw.get("rope_parameters") or {})
    bias, bloom = bool(raw.get("bias", False)), common["model_type"] == "bloom"
    return ModelConfig(
        **common,
        intermediate_size=raw.get("ffn_hidden_size") or 4 * hidden,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        norm_eps=float(raw.get("layer_norm_epsilon") or 1e-5),
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
        rope_scaling=_config_rope_scaling(raw, rope, name),
        hidden_act="gelu_pytorch_tanh" if bloom else "gelu",
        attention_bias=bias,
        attention_output_bias=bias,
        mlp_bias=bias,
        parallel_residual=parallel,
        alibi=bool(raw.get("alibi", False)),
        # (BLOOM: a LayerNorm of the embeddings)
        extra={"falcon_norms": norms, "embedding_norm": bloom},
    )


def _mpt_config(raw: dict[str, Any], common: dict[str, Any], name: str) -> ModelConfig:
    """MPT's config (``models/mpt.py``), transformers' MptConfig defaults where it has none (``attn_config``'s too). What
    transformers' MPT does not read is refused rather than run otherwise than its checkpoints were trained."""
    attn = {"alibi": True, "alibi_bias_max": 8, "clip_qkv": None, "softmax_scale": None, "qk_ln": False,
            "prefix_lm": False, "attn_uses_sequence_id": False, "attn_type": "multihead_attention",
            **(raw.get("attn_config") or {})}  # fmt: skip
    refused = {
        "attn_config.alibi false (learned position embeddings)": not attn["alibi"],
        "no_bias false (biases)": not raw.get("no_bias", True),
        "attn_config.qk_ln (LayerNorms of the queries and keys)": attn["qk_ln"],
        "logit_scale": raw.get("logit_scale") is not None,
        "attn_config.prefix_lm": attn["prefix_lm"],
        "attn_config.attn_uses_sequence_id": attn["attn_uses_sequence_id"],
        f"attn_config.attn_type {attn['attn_type']!r}": attn["attn_type"] != "multihead_attention",
    }
    for setting, given in refused.items():
        if given:
            raise ConfigError(f"{name}: MPT's {setting} is not supported (transformers' MPT does not read it)")
    hidden, heads = common["hidden_size"], common["num_attention_heads"]
    if hidden % heads:
        raise ConfigError(f"{name}: n_heads {heads} must divide d_model {hidden}")
    _check_positive_ints({"expansion_ratio": raw.get("expansion_ratio", 4)}, ("expansion_ratio",), name)
    # (0: no clamp, as transformers reads it)
    clip = _json_float(attn["clip_qkv"], "attn_config.clip_qkv", name) if attn["clip_qkv"] else None
    return ModelConfig(
        **common,
        intermediate_size=raw.get("expansion_ratio", 4) * hidden,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
        hidden_act="gelu",
        clip_qkv=clip,
        attention_multiplier=None if attn["softmax_scale"] is None else float(attn["softmax_scale"]),
        alibi=True,
        # (as MPT's own code reads it; transformers' always takes 8, which every released MPT says)
        alibi_bias_max=_json_float(attn["alibi_bias_max"], "attn_config.alibi_bias_max", name),
    )


def _deepseek_config(raw: dict[str, Any], common: dict[str, Any], name: str, need) -> ModelConfig:
    """DeepSeek-V2's and V3's config: the MLA sizes (``mla``), the experts (``_moe``), transformers' defaults
    where it has none. NOTE: transformers' config.json says ``head_dim`` for the rotated part of a query (64)."""
    if raw["model_type"] == "minicpm3" and raw.get("v_head_dim") is None:  # (transformers' default)
        raw = {**raw, "v_head_dim": common["hidden_size"] // common["num_attention_heads"]}
    mla = {key: raw.get(key, default) for key, default in DEEPSEEK_MLA_DEFAULTS.items()}
    for key, value in mla.items():
        if not (value is None and key == "q_lora_rank") and not (
            isinstance(value, int) and not isinstance(value, bool) and value > 0
        ):
            raise ConfigError(f"{name}: {key} must be a positive integer, got {value!r}")
    if mla["qk_rope_head_dim"] % 2:
        raise ConfigError(f"{name}: qk_rope_head_dim {mla['qk_rope_head_dim']} must be even (rotated in pairs)")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{name}: hidden_act {raw.get('hidden_act')!r} is not supported (silu)")
    rope = dict(raw.get("rope_parameters") or {})
    qk = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
    scaling = _config_rope_scaling(raw, rope, name)
    kimi = raw["model_type"] == "kimi_linear"  # (its attention layers without rope, its KDA layers' states)
    layers = common["num_hidden_layers"]
    layer_types, kda = _kimi_linear_layers(raw, layers, name) if kimi else ((), None)
    return ModelConfig(
        **common,
        intermediate_size=need("intermediate_size"),
        num_key_value_heads=common["num_attention_heads"],
        head_dim=qk,  # (a query's and a key's; the rotary embedding turns the last qk_rope_head_dim of it)
        partial_rotary_dim=mla["qk_rope_head_dim"],
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
        rope_scaling=scaling,
        llama4_scaling_beta=_llama4_scaling_beta(raw["model_type"], scaling, rope, name),
        attention_bias=bool(raw.get("attention_bias", False)),
        moe=_moe(raw, common["num_hidden_layers"], name) if raw["model_type"] in MOE_TYPES else None,
        # (V2's checkpoints rotate adjacent pairs of q_R and k_R; V3's where rope_interleave says, its default;
        # MiniCPM3's halves)
        mla={
            **mla,
            "rope_interleave": raw["model_type"] == "deepseek_v2"
            or bool(raw.get("rope_interleave", not kimi and raw["model_type"] != "minicpm3")),
        },
        layer_types=layer_types,
        rotary_layers=(False,) * layers if kimi else (),
        gated_delta_net=kda,
        **(_minicpm3_scales(raw, common) if raw["model_type"] == "minicpm3" else {}),
    )


def _minicpm3_scales(raw: dict[str, Any], common: dict[str, Any]) -> dict[str, float]:
    """MiniCPM3's scales as Granite's multipliers: the embeddings times ``scale_emb``, each output times
    ``scale_depth`` / sqrt(layers) as it joins the stream, the logits over hidden_size / ``dim_model_base``
    (transformers divides the final hidden states, the engine the logits: equal up to rounding)."""
    layers, hidden, name = common["num_hidden_layers"], common["hidden_size"], common["name"]
    depth, base = raw.get("scale_depth"), raw.get("dim_model_base")  # (None: no scaling, as transformers reads it)
    depth = layers**0.5 if depth is None else _json_float(depth, "scale_depth", name)
    base = hidden if base is None else _json_float(base, "dim_model_base", name)
    return {
        "embedding_multiplier": _json_float(raw["scale_emb"], "scale_emb", name),
        "residual_multiplier": depth / layers**0.5,
        "logits_scaling": hidden / base,
    }


# Kimi Linear's config names on the Hub (transformers' attribute_map) for the generic ones, and its linear_attn_config's
KIMI_LINEAR_NAMES = {
    "model_max_length": "max_position_embeddings", "moe_renormalize": "norm_topk_prob",
    "num_expert_group": "n_group", "num_experts": "n_routed_experts", "num_local_experts": "n_routed_experts",
    "num_experts_per_token": "num_experts_per_tok", "num_shared_experts": "n_shared_experts",
}  # fmt: skip
KIMI_LINEAR_ATTENTION_NAMES = {
    "head_dim": "linear_head_dim", "num_heads": "linear_num_heads", "short_conv_kernel_size": "linear_conv_kernel_dim",
}  # fmt: skip


def _kimi_linear_names(raw: dict[str, Any], name: str) -> dict[str, Any]:
    """Kimi Linear's config under the generic names, as transformers reads it: the Hub's names of its sizes and
    routing (``KIMI_LINEAR_NAMES``), its ``linear_attn_config``'s KDA sizes and layers (1-indexed there)."""
    renamed = {KIMI_LINEAR_NAMES.get(key, key): value for key, value in raw.items()}
    linear = raw.get("linear_attn_config") or {}
    if not isinstance(linear, dict):
        raise ConfigError(f"{name}: linear_attn_config must be an object, got {linear!r}")
    renamed.update({ours: linear[theirs] for theirs, ours in KIMI_LINEAR_ATTENTION_NAMES.items() if theirs in linear})
    layers = renamed.get("num_hidden_layers")
    if renamed.get("layer_types") is None and "full_attn_layers" in linear and "kda_layers" in linear:
        _check_positive_ints({"num_hidden_layers": layers}, ("num_hidden_layers",), name)
        kinds: list[Any] = [None] * layers
        for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", LINEAR_ATTENTION)):
            for layer in linear[key] if isinstance(linear[key], list) else [linear[key]]:
                if not (isinstance(layer, int) and 1 <= layer <= layers):
                    raise ConfigError(f"{name}: linear_attn_config {key} holds {layer!r}, not a layer in 1..{layers}")
                kinds[layer - 1] = kind
        renamed["layer_types"] = kinds
    return renamed


def _kimi_linear_layers(raw: dict[str, Any], layers: int, name: str) -> tuple[tuple[str, ...], dict[str, Any]]:
    """Kimi Linear's (each layer's type: transformers' default, every fourth but the first attending, where the
    config has none; its KDA layers' settings: as many key as value heads, of one width)."""
    kinds = raw.get("layer_types")
    if kinds is None:
        kinds = ["full_attention" if i and i % 4 == 0 else LINEAR_ATTENTION for i in range(layers)]
    kinds = _checked_layer_types(kinds, layers, (LINEAR_ATTENTION, "full_attention"), raw["model_type"], name)
    sizes = {key: raw.get(key) for key in ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim")}
    _check_positive_ints(sizes, tuple(sizes), name)
    heads, width = sizes["linear_num_heads"], sizes["linear_head_dim"]
    eps = _json_float(raw.get("rms_norm_eps"), "rms_norm_eps", name)
    kda = {"num_k_heads": heads, "num_v_heads": heads, "head_k_dim": width, "head_v_dim": width,
           "width": sizes["linear_conv_kernel_dim"], "beta_scale": 1.0, "norm_eps": eps,
           "channel_decay": True}  # fmt: skip
    return kinds, kda


def _gpt2_config(raw: dict[str, Any], common: dict[str, Any], name: str) -> ModelConfig:
    """GPT-2's config, transformers' GPT2Config defaults where it has none (an MLP 4 times as wide, gelu_new);
    GPT-BigCode's (``gpt_bigcode``): one KV head where ``multi_query`` (its default), GELU by tanh's approximation."""
    bigcode = common["model_type"] == "gpt_bigcode"
    activation = raw.get("activation_function", "gelu_pytorch_tanh" if bigcode else "gelu_new")
    if activation not in GPT2_ACTIVATIONS:
        raise ConfigError(
            f"{name}: GPT-2 activation_function {activation!r} is not supported ({', '.join(GPT2_ACTIVATIONS)})"
        )
    if raw.get("add_cross_attention"):
        raise ConfigError(f"{name}: add_cross_attention (GPT-2 as an encoder-decoder's decoder) is not supported")
    hidden, heads = common["hidden_size"], common["num_attention_heads"]
    if hidden % heads:
        raise ConfigError(f"{name}: n_head {heads} must divide n_embd {hidden}")
    return ModelConfig(
        **common,
        intermediate_size=raw.get("n_inner") or 4 * hidden,
        num_key_value_heads=1 if bigcode and raw.get("multi_query", True) else heads,
        head_dim=hidden // heads,
        norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
        hidden_act=activation,
        attention_bias=True,
        attention_output_bias=True,
        mlp_bias=True,
        # (None: head_dim ** -0.5)
        attention_multiplier=None if raw.get("scale_attn_weights", True) else 1.0,
        extra={"scale_attn_by_inverse_layer_idx": bool(raw.get("scale_attn_by_inverse_layer_idx", False))},
    )


def _norm_eps(raw: dict[str, Any], model_type: str) -> float:
    """The norms' epsilon under each config's name, transformers' default where it has none."""
    if model_type == "cohere2_moe" and raw.get("rms_norm_eps") is not None:  # (its RMSNorms; else LayerNorms)
        return raw["rms_norm_eps"]
    if model_type in (*COHERE_TYPES, "phi", "stablelm", "jais2"):
        return raw.get("layer_norm_eps", 1e-5)
    if model_type == "nemotron":
        return raw.get("norm_eps", 1e-5)
    if model_type == "starcoder2":
        return raw.get("norm_epsilon", 1e-5)
    return raw.get("rms_norm_eps", RMS_NORM_EPS_DEFAULTS.get(model_type, 1e-6))


def _biases(raw: dict[str, Any], model_type: str) -> dict[str, bool]:
    """Which projections have biases, by each config's names and transformers' defaults: ``attention_bias``
    is the q/k/v projections' (Qwen2's config has no key: always; Qwen2-MoE's says ``qkv_bias``, StableLM's
    ``use_qkv_bias``), and the output projection's too for gpt-oss, EXAONE 4, OLMo, Nemotron and Arcee;
    Seed-OSS names the latter ``attention_out_bias``; ERNIE 4.5's and StarCoder2's ``use_bias`` is every
    linear layer's."""
    if model_type in ("ernie4_5", "ernie4_5_moe", "starcoder2"):
        every = bool(raw.get("use_bias", model_type == "starcoder2"))
        return {"attention_bias": every, "attention_output_bias": every, "mlp_bias": every}
    if model_type == "qwen2_moe":
        qkv = raw.get("qkv_bias", True)
    elif model_type == "stablelm":
        qkv = raw.get("use_qkv_bias", False)
    else:
        qkv = raw.get("attention_bias", model_type in QKV_BIASED)
    if model_type == "seed_oss":
        output = raw.get("attention_out_bias", False)
    else:
        output = model_type in OUTPUT_BIASED and qkv
    return {
        "attention_bias": bool(qkv),
        "attention_output_bias": bool(output),
        "mlp_bias": bool(raw.get("mlp_bias", model_type == "phi")),
    }


def _granite_4_layers(
    raw: dict[str, Any], layers: int, name: str
) -> tuple[list[bool], int, tuple[str, ...], dict[str, Any] | None]:
    """Granite 4.0's (``granitemoehybrid``): (whether each layer rotates, the dense MLP's size, each layer's type:
    attention or MAMBA, the Mamba-2 mixers' settings: None without them). Its layers are attention (the Hub's
    "attention", transformers 5's "full_attention") or Mamba-2 (the Hub's "mamba", transformers 5's
    "linear_attention": the 4.0-H models); a rotary embedding only where ``position_embedding_type`` is "rope"
    (None, transformers' default, or "nope": none, the 4.0-H models'); without experts its MLP is the shared
    one (``shared_intermediate_size``; ``intermediate_size`` is the experts'). transformers' defaults where the
    config has none."""
    kinds = raw.get("layer_types") or raw.get("layers_block_type") or [MAMBA] * layers
    if len(kinds) != layers:
        raise ConfigError(f"{name}: layer_types has {len(kinds)} entries; the model has {layers} layers")
    unknown = sorted({kind for kind in kinds if kind not in ("attention", "full_attention", MAMBA, "linear_attention")})
    if unknown:
        raise ConfigError(
            f"{name}: granitemoehybrid layer type {unknown[0]!r} is not supported (attention, full_attention, mamba, "
            "linear_attention)"
        )
    layer_types = tuple(MAMBA if kind in (MAMBA, "linear_attention") else "full_attention" for kind in kinds)
    position = raw.get("position_embedding_type")
    if position not in (None, "rope", "nope"):
        raise ConfigError(f"{name}: position_embedding_type {position!r} is not supported (rope, nope or null)")
    dense = not raw.get("num_local_experts", MOE_DEFAULTS["granitemoehybrid"]["num_experts"])
    intermediate = raw.get("shared_intermediate_size", 1024) if dense else raw["intermediate_size"]
    mamba = _mamba2(raw, name) if MAMBA in layer_types else None
    return [position == "rope"] * layers, intermediate, layer_types, mamba


def _granite_swa_layers(
    raw: dict[str, Any], layers: int, rope_theta: float, name: str
) -> tuple[tuple[str, ...], int, list[bool], float]:
    """Granite SWA's (each layer's type, by ``layer_types`` or transformers' pattern: full attention where
    i % 4 == 0, sliding elsewhere; the window; whether each layer rotates; the rope base). ``layer_rope_theta``
    gives each layer its base, 0 for none (NoPE); the engine runs one base, so the others must agree."""
    kinds = raw.get("layer_types") or ["full_attention" if i % 4 == 0 else SLIDING for i in range(layers)]
    kinds = _checked_layer_types(kinds, layers, ("full_attention", SLIDING), raw["model_type"], name)
    thetas = raw.get("layer_rope_theta") or [rope_theta] * layers
    if len(thetas) != layers or not all(isinstance(t, (int, float)) and t >= 0 for t in thetas):
        raise ConfigError(f"{name}: layer_rope_theta must be {layers} numbers >= 0, got {thetas!r}")
    bases = sorted({float(t) for t in thetas if t})
    if len(bases) > 1:
        raise ConfigError(f"{name}: layer_rope_theta with more than one rope base ({bases}) is not supported")
    window = raw.get("sliding_window", 128)
    return kinds, window, [bool(t) for t in thetas], bases[0] if bases else rope_theta


def _lfm2_layers(
    raw: dict[str, Any], layers: int, model_type: str, name: str
) -> tuple[tuple[str, ...], int, dict[str, Any]]:
    """LFM2's (each layer's type: full_attention or SHORT_CONV, by ``layer_types`` or the Hub's ``full_attn_idxs``;
    the MLP's size; its short convolutions' settings). NOTE: transformers' size rule for LFM2's (not LFM2-MoE's
    dense MLPs, of intermediate_size): with ``block_auto_adjust_ff_dim``, 2/3 of intermediate_size, times
    ``block_ffn_dim_multiplier``, rounded up to a multiple of ``block_multiple_of`` (only with a multiplier)."""
    kinds, known = raw.get("layer_types"), {"full_attention", SHORT_CONV}
    if model_type == "lfm3":  # (its sliding layers; transformers' pattern where the config has none)
        known.add(SLIDING)
        if kinds is None:
            kinds = [
                "full_attention" if i % 4 == 2 else SLIDING if i % 4 == 0 and i else SHORT_CONV for i in range(layers)
            ]
    if kinds is None:
        attending = raw.get("full_attn_idxs")
        attending = range(layers) if attending is None else attending
        kinds = ["full_attention" if i in attending else SHORT_CONV for i in range(layers)]
    kinds = _checked_layer_types(kinds, layers, known, model_type, name)
    intermediate = raw.get("intermediate_size")
    if not isinstance(intermediate, int) or intermediate < 1:
        raise ConfigError(
            f"{name}: {model_type} block_ff_dim (intermediate_size) must be a positive integer, got {intermediate!r}"
        )
    if model_type == "lfm2" and raw.get("block_auto_adjust_ff_dim", True):
        intermediate = int(2 * intermediate / 3)
        multiplier, multiple = raw.get("block_ffn_dim_multiplier", 1.0), raw.get("block_multiple_of", 256)
        if multiplier is not None:
            _check_positive_ints({"block_multiple_of": multiple}, ("block_multiple_of",), name)
            intermediate = int(_json_float(multiplier, "block_ffn_dim_multiplier", name) * intermediate)
            intermediate = multiple * -(-intermediate // multiple)
    width = raw.get("conv_L_cache", 7 if model_type == "lfm3" else 3)  # (transformers' defaults)
    _check_positive_ints({"conv_L_cache": width}, ("conv_L_cache",), name)
    short_conv = {"width": width, "bias": bool(raw.get("conv_bias", False))}
    return kinds, intermediate, short_conv if SHORT_CONV in kinds else None


def _gated_delta_net_layers(
    raw: dict[str, Any], layers: int, model_type: str, name: str
) -> tuple[tuple[str, ...], dict[str, Any]]:
    """Qwen3-Next's, Qwen3.5's and OLMo Hybrid's (each layer's type: LINEAR_ATTENTION or full_attention, by
    ``layer_types`` or, as transformers reads a config without them, every ``full_attention_interval``-th layer
    attending (4; OLMo Hybrid's every fourth, its last where it has fewer layers); the gated DeltaNets' settings,
    transformers' defaults where the config has none: OLMo Hybrid's heads as many as attention's, keys 3/4 of the
    hidden size over them, values twice a key, beta in (0, 2) unless ``linear_allow_neg_eigval`` is false, its
    gated norm's epsilon 1e-5, the reference kernels')."""
    olmo = model_type == "olmo_hybrid"
    interval = 4 if olmo else raw.get("full_attention_interval", 4)
    kinds = raw.get("layer_types")
    if kinds is None:
        _check_positive_ints({"full_attention_interval": interval}, ("full_attention_interval",), name)
        kinds = [LINEAR_ATTENTION if (i + 1) % interval else "full_attention" for i in range(layers)]
        if olmo and "full_attention" not in kinds:
            kinds[-1] = "full_attention"
    kinds = _checked_layer_types(kinds, layers, (LINEAR_ATTENTION, "full_attention"), model_type, name)
    sizes = {"num_k_heads": "linear_num_key_heads", "num_v_heads": "linear_num_value_heads",
             "head_k_dim": "linear_key_head_dim", "head_v_dim": "linear_value_head_dim",
             "width": "linear_conv_kernel_dim"}  # fmt: skip
    defaults = {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}  # fmt: skip
    given = {key: raw.get(key) for key in defaults}
    if olmo:  # (its defaults follow its attention's: checked first)
        _check_positive_ints(raw, ("num_attention_heads", "hidden_size"), name)
        defaults["linear_num_key_heads"] = defaults["linear_num_value_heads"] = raw["num_attention_heads"]
        key_heads = given["linear_num_key_heads"] or raw["num_attention_heads"]
        key_dim = int(0.75 * raw["hidden_size"] / key_heads) if isinstance(key_heads, int) and key_heads > 0 else 0
        defaults["linear_key_head_dim"] = key_dim
        defaults["linear_value_head_dim"] = 2 * (given["linear_key_head_dim"] or key_dim)
    given = {key: default if given[key] is None else given[key] for key, default in defaults.items()}
    _check_positive_ints(given, tuple(given), name)
    net = {ours: given[theirs] for ours, theirs in sizes.items()}
    net["beta_scale"] = 2.0 if olmo and raw.get("linear_allow_neg_eigval", True) else 1.0
    net["norm_eps"] = 1e-5 if olmo else _json_float(raw.get("rms_norm_eps", 1e-6), "rms_norm_eps", name)
    if net["num_v_heads"] % net["num_k_heads"]:
        raise ConfigError(
            f"{name}: linear_num_key_heads {net['num_k_heads']} must divide linear_num_value_heads {net['num_v_heads']}"
        )
    return kinds, net


def _sliding_layers(
    raw: dict[str, Any], window: Any, slides: Callable[[int], Any], name: str
) -> tuple[tuple[str, ...], Any]:
    """(each layer's type, the window): ``layer_types`` (sliding or full) where the config gives them, else layer i
    sliding where ``slides(i)`` (transformers' reading of a config without them); the window None where no layer
    slides."""
    layers = raw["num_hidden_layers"]
    kinds = raw.get("layer_types") or [SLIDING if slides(i) else "full_attention" for i in range(layers)]
    kinds = _checked_layer_types(kinds, layers, (SLIDING, "full_attention"), raw["model_type"], name)
    return kinds, window if SLIDING in kinds else None


def _cohere2_moe_layers(raw: dict[str, Any], layers: int, name: str) -> tuple[tuple[str, ...], Any, list[bool]]:
    """Command A+'s (each layer's type, the window, whether each rotates), as transformers reads them: ``layer_types``,
    else the first ``first_k_dense_replace`` layers (those of dense MLPs) every ``prefix_dense_sliding_window_pattern``
    -th global and the others every ``sliding_window_pattern``-th; the sliding layers rotate where there is a window,
    and the dense ones where their pattern is 1 (each of them global)."""
    first_dense = _layer_index(raw, "first_k_dense_replace", 0, name)
    prefix, rest = raw.get("prefix_dense_sliding_window_pattern", 1), raw.get("sliding_window_pattern", 4)
    _check_positive_ints({"prefix_dense_sliding_window_pattern": prefix, "sliding_window_pattern": rest},
                         ("prefix_dense_sliding_window_pattern", "sliding_window_pattern"), name)  # fmt: skip
    kinds = raw.get("layer_types") or [
        SLIDING if (i + 1) % (prefix if i < first_dense else rest) else "full_attention"
        for i in (*range(first_dense), *range(layers - first_dense))
    ]
    kinds = _checked_layer_types(kinds, layers, (SLIDING, "full_attention"), "cohere2_moe", name)
    dense = _dense_layers(raw["mlp_layer_types"], layers, name) if raw.get("mlp_layer_types") else range(first_dense)
    window = raw.get("sliding_window", 4096) if SLIDING in kinds else None
    rotary = [(kind == SLIDING and bool(window)) or (i in dense and prefix == 1) for i, kind in enumerate(kinds)]
    return kinds, window, rotary


def _llama4_layers(raw: dict[str, Any], layers: int, name: str) -> tuple[tuple[str, ...], list[bool], int | None]:
    """Llama 4's (each layer's type, whether each rotates, the chunks' length). A layer rotates where
    ``no_rope_layers`` says 1 (transformers' name), or, where the config lists none, all but every
    ``no_rope_layer_interval``-th; ``layer_types`` (CHUNKED or full) where it gives them, else, as transformers
    reads a config without them, the rotated layers chunked where ``attention_chunk_size`` is not null."""
    interval = raw.get("no_rope_layer_interval", 4)
    _check_positive_ints({"no_rope_layer_interval": interval}, ("no_rope_layer_interval",), name)
    rotary = raw.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    if not isinstance(rotary, list) or len(rotary) != layers or not set(rotary) <= {0, 1}:
        raise ConfigError(f"{name}: no_rope_layers must be {layers} flags of 0 or 1, got {rotary!r}")
    chunk = raw.get("attention_chunk_size")
    kinds = raw.get("layer_types") or [CHUNKED if flag and chunk is not None else "full_attention" for flag in rotary]
    kinds = _checked_layer_types(kinds, layers, (CHUNKED, "full_attention"), "llama4_text", name)
    if CHUNKED not in kinds:
        return kinds, [bool(flag) for flag in rotary], None
    _check_positive_ints({"attention_chunk_size": chunk}, ("attention_chunk_size",), name)
    return kinds, [bool(flag) for flag in rotary], chunk


def _llama4_attention(raw: dict[str, Any], name: str) -> dict[str, Any]:
    """Llama 4's query and key norms (``use_qk_norm``) and its unrotated layers' attention temperature
    (``attn_temperature_tuning``, with ``attn_scale`` and ``floor_scale``): ModelConfig's fields, transformers'
    defaults where the config has none."""
    tuned = raw.get("attn_temperature_tuning", True)  # (the Hub's Scout config: 4, a true value)
    scale, floor = raw.get("attn_scale", 0.1), raw.get("floor_scale", 8192)
    if tuned:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise ConfigError(f"{name}: attn_scale must be a number, got {scale!r}")
        _check_positive_ints({"floor_scale": floor}, ("floor_scale",), name)
    return {
        "qk_unweighted_norm": bool(raw.get("use_qk_norm", True)),
        "attn_scale": float(scale) if tuned else None,
        "floor_scale": floor if tuned else 8192,
    }


def _checked_layer_types(kinds: Any, layers: int, known, model_type: str, name: str) -> tuple[str, ...]:
    """A config's ``layer_types`` (``kinds``): ``layers`` entries, each one of ``known``; else a ConfigError naming
    them."""
    if not isinstance(kinds, (list, tuple)) or len(kinds) != layers or not set(kinds) <= set(known):
        raise ConfigError(
            f"{name}: {model_type} layer_types must be {layers} entries of {', '.join(sorted(known))}, got {kinds!r}"
        )
    return tuple(kinds)


def _bamba_layers(raw: dict[str, Any], layers: int, name: str) -> tuple[tuple[str, ...], dict[str, Any] | None]:
    """Bamba's (each layer's type, its Mamba-2 mixers' settings): attention at ``attn_layer_indices``, a mixer in
    every other layer (transformers' ``layers_block_type``)."""
    indices = raw.get("attn_layer_indices") or []
    if not isinstance(indices, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers
                                            for i in indices):  # fmt: skip
        raise ConfigError(f"{name}: attn_layer_indices must be layer indices below {layers}, got {indices!r}")
    layer_types = tuple("full_attention" if i in indices else MAMBA for i in range(layers))
    return layer_types, _mamba2(raw, name) if MAMBA in layer_types else None


def _check_layer_period(period: Any, offset: Any, setting: str, name: str) -> None:
    """A ConfigError naming Jamba's ``{setting}_period`` or ``{setting}_offset`` unless 0 <= offset < period."""
    _check_positive_ints({f"{setting}_period": period}, (f"{setting}_period",), name)
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < period:
        raise ConfigError(f"{name}: {setting}_offset must be an integer in 0..{period - 1}, got {offset!r}")


def _jamba_layers(raw: dict[str, Any], layers: int, name: str) -> tuple[tuple[str, ...], dict[str, Any] | None]:
    """Jamba's (each layer's type: attention where i % attn_layer_period is attn_layer_offset, Mamba's mixer
    elsewhere; the mixers' settings, ``mamba_*``, transformers' JambaConfig defaults where it has none)."""
    period, offset = raw.get("attn_layer_period", 8), raw.get("attn_layer_offset", 4)
    _check_layer_period(period, offset, "attn_layer", name)
    kinds = tuple("full_attention" if i % period == offset else MAMBA for i in range(layers))
    if MAMBA not in kinds:
        return kinds, None
    hidden = raw["hidden_size"]
    settings = {key: raw.get(f"mamba_{key}", default) for key, default in
                (("d_state", 16), ("d_conv", 4), ("expand", 2), ("dt_rank", "auto"))}  # fmt: skip
    if settings["dt_rank"] == "auto":  # (transformers' rule)
        settings["dt_rank"] = math.ceil(hidden / 16)
    _check_positive_ints(settings, ("d_state", "d_conv", "expand", "dt_rank"), name, "mamba_")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{name}: hidden_act {raw.get('hidden_act')!r} is not supported with Mamba layers (silu)")
    return kinds, {
        "version": 1,  # (Mamba's selective state spaces, not Mamba-2's: ``models/mamba1.py``)
        "d_inner": settings.pop("expand") * hidden,
        **settings,
        "conv_bias": bool(raw.get("mamba_conv_bias", True)),
        "proj_bias": bool(raw.get("mamba_proj_bias", False)),
        # (Jamba's RMSNorms of the step, B and C, with weights, at the model's norm_eps)
        "dt_bc_norms": True,
        "dt_bc_norm_weights": True,
        "dt_bc_norm_eps": None,
    }


def _mamba2(raw: dict[str, Any], name: str, defaults: dict[str, Any] = MAMBA2_DEFAULTS) -> dict[str, Any]:
    """The Mamba-2 mixers' settings of a Granite 4.0-H, Bamba or Falcon-H1 config (``mamba_*``, its transformers
    class's defaults: ``defaults``), checked. ``d_ssm``: the mixer's width where given (Falcon-H1's), else
    ``expand`` x hidden."""
    hidden = raw["hidden_size"]
    settings = {key: raw.get(f"mamba_{key}", default) for key, default in defaults.items()}
    _check_positive_ints(settings, ("n_heads", "n_groups", "d_state", "d_conv", "expand", "chunk_size"), name, "mamba_")
    d_inner = settings.pop("d_ssm", None) or settings["expand"] * hidden
    settings.pop("expand")
    heads, head_dim = settings["n_heads"], settings.pop("d_head")
    if head_dim == "auto":
        head_dim = d_inner // heads
    if head_dim * heads != d_inner or heads % settings["n_groups"]:
        raise ConfigError(
            f"{name}: mamba_n_heads {heads} x mamba_d_head {head_dim} must be mamba_expand x hidden_size {d_inner}, "
            f"and mamba_n_groups {settings['n_groups']} must divide the heads"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{name}: hidden_act {raw.get('hidden_act')!r} is not supported with Mamba layers (silu)")
    limit = [_json_float(bound, "time_step_limit", name) for bound in raw.get("time_step_limit") or (0.0, float("inf"))]
    if len(limit) != 2:
        raise ConfigError(f"{name}: time_step_limit must be two numbers (the steps' least and most), got {limit!r}")
    return {
        **settings,
        "head_dim": head_dim,
        "d_inner": d_inner,
        "conv_bias": bool(settings["conv_bias"]),
        "proj_bias": bool(settings["proj_bias"]),
        # (the out projection's bias: Falcon-H1's projectors_bias, else in_proj's)
        "out_proj_bias": bool(raw.get("projectors_bias", settings["proj_bias"])),
        # (the output gated and RMS-normalized by group, the gate after the norm where norm_before_gate; else
        # only gated: Falcon-H1's default)
        "rms_norm": bool(settings.pop("rms_norm", True)),
        "norm_before_gate": bool(settings.pop("norm_before_gate", False)),
        "time_step_limit": tuple(limit),
    }


# Nemotron-H's blocks by the Hub's pattern letters (``hybrid_override_pattern``) and by transformers 5's names
NEMOTRON_H_KINDS = {"M": MAMBA, "*": "full_attention", "-": MLP_LAYER, "E": MOE_LAYER}
NEMOTRON_H_NAMES = {"linear_attention": MAMBA, "full_attention": "full_attention", "mlp": MLP_LAYER, "moe": MOE_LAYER}


def _nemotron_h_kinds(raw: dict[str, Any], name: str) -> list[str]:
    """Nemotron-H's blocks, each a Mamba-2 mixer, attention, an MLP or experts: ``layers_block_type`` (transformers
    5) or the Hub's ``hybrid_override_pattern`` ("M-M-M-MM*-...": a letter a block)."""
    listed = raw.get("layers_block_type") or raw.get("layer_types")
    if listed:
        kinds = [NEMOTRON_H_NAMES.get(kind) for kind in listed]
        bad = next((kind for kind, ours in zip(listed, kinds) if ours is None), None)
    else:
        pattern = raw.get("hybrid_override_pattern")
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(f"{name}: a nemotron_h config.json needs layers_block_type or hybrid_override_pattern")
        kinds = [NEMOTRON_H_KINDS.get(letter) for letter in pattern]
        bad = next((letter for letter, ours in zip(pattern, kinds) if ours is None), None)
    if bad is not None:
        raise ConfigError(
            f"{name}: nemotron_h block type {bad!r} is not one of M, *, -, E (mamba, attention, mlp, moe)"
        )
    return kinds


def _nemotron_h_moe(raw: dict[str, Any], kinds: list[str], name: str) -> dict[str, Any] | None:
    """Nemotron-H's experts' blocks (Nemotron 3 Nano's): DeepSeek-V3's routing (sigmoid scores chosen with the
    router's bias from the best groups, renormalized, scaled), two-matrix squared-ReLU experts beside a shared one;
    transformers' defaults. None without them."""
    if MOE_LAYER not in kinds:
        return None
    if raw.get("moe_latent_size") is not None:
        raise ConfigError(f"{name}: moe_latent_size (experts on a latent projection) is not supported")
    moe = {
        "num_experts": raw.get("n_routed_experts", raw.get("num_local_experts", 8)),
        "num_experts_per_tok": raw.get("num_experts_per_tok", 2),
        "moe_intermediate_size": raw.get("moe_intermediate_size", 7688),
        "norm_topk_prob": bool(raw.get("norm_topk_prob", True)),
        "moe_layers": tuple(kind == MOE_LAYER for kind in kinds),
        # (transformers' NemotronHMoE runs its shared expert whatever n_shared_experts says)
        "shared_expert_intermediate_size": raw.get("moe_shared_expert_intermediate_size", 7688),
        "routed_scaling_factor": _json_float(raw.get("routed_scaling_factor", 1.0), "routed_scaling_factor", name),
        "topk_method": "noaux_tc",
        "n_group": raw.get("n_group", 1),
        "topk_group": raw.get("topk_group", 1),
    }
    _check_positive_ints(moe, ("shared_expert_intermediate_size",), name)  # (transformers builds it always)
    _check_moe_sizes(moe, name)
    _check_group_routing(moe, ("noaux_tc",), name)
    return moe


def _nemotron_h_config(raw: dict[str, Any], common: dict[str, Any], name: str, need) -> ModelConfig:
    """Nemotron-H's config: its blocks (``_nemotron_h_kinds``), its Mamba-2 mixers (transformers' names and the
    Hub's ``mamba_*`` ones; d_inner is heads x head_dim; the steps at least ``time_step_min``, as transformers
    clamps them), attention without a position embedding, a squared-ReLU MLP; transformers' defaults."""
    for key, want in (("mamba_hidden_act", "silu"), ("mlp_hidden_act", "relu2")):
        if raw.get(key, want) != want:
            raise ConfigError(f"{name}: {key} {raw[key]!r} is not supported ({want})")
    heads, head_dim = raw.get("mamba_num_heads", 128), raw.get("mamba_head_dim", 64)
    mamba = {
        "n_heads": heads,
        "head_dim": head_dim,
        "n_groups": raw.get("n_groups", raw.get("mamba_n_groups", 8)),
        "d_state": raw.get("ssm_state_size", 128),
        "d_conv": raw.get("conv_kernel", raw.get("mamba_d_conv", 4)),
        "chunk_size": raw.get("chunk_size", raw.get("mamba_chunk_size", 128)),
    }
    _check_positive_ints(mamba, tuple(mamba), name, "nemotron_h Mamba ")
    if heads % mamba["n_groups"]:
        raise ConfigError(f"{name}: n_groups {mamba['n_groups']} must divide mamba_num_heads {heads}")
    least = _json_float(raw.get("time_step_min", raw.get("mamba_dt_min", 0.001)), "time_step_min", name)
    mamba.update(
        d_inner=heads * head_dim,
        conv_bias=bool(raw.get("use_conv_bias", raw.get("mamba_conv_bias", True))),
        proj_bias=bool(raw.get("use_bias", False)),
        out_proj_bias=bool(raw.get("use_bias", False)),
        rms_norm=True,
        norm_before_gate=False,
        time_step_limit=(least, float("inf")),
    )
    layers, kinds = common["num_hidden_layers"], _nemotron_h_kinds(raw, name)
    return ModelConfig(
        **common,
        intermediate_size=need("intermediate_size"),
        num_key_value_heads=raw.get("num_key_value_heads") or common["num_attention_heads"],
        head_dim=raw.get("head_dim") or common["hidden_size"] // common["num_attention_heads"],
        norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
        hidden_act="relu2",
        mlp_bias=bool(raw.get("mlp_bias", False)),  # (its attention has no biases whatever the config says)
        layer_types=tuple(kinds),
        rotary_layers=(False,) * layers,  # (no position embedding: the Mamba layers order the tokens)
        mamba=mamba,
        moe=_nemotron_h_moe(raw, kinds, name),
    )


def _mamba_config(raw: dict[str, Any], common: dict[str, Any], name: str) -> ModelConfig:
    """Mamba's, Falcon Mamba's or Mamba-2's config (transformers' names and defaults): every layer an RMSNorm and a
    mixer of ``expand`` x hidden_size channels, Mamba's (``models/mamba1.py``; Falcon Mamba's with its step, B and C
    RMS-normalized without weights, at ``mixer_rms_eps``) or Mamba-2's (``models/mamba2.py``), the residual stream in
    float32 where ``residual_in_fp32``. No layer attends: the one nominal head (of two numbers) is read by none."""
    model_type, hidden = common["model_type"], common["hidden_size"]
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{name}: hidden_act {raw.get('hidden_act')!r} is not supported for {model_type} (silu)")
    version = 2 if model_type == "mamba2" else 1
    rank = raw.get("time_step_rank", "auto")
    sizes = {  # (the config's names, transformers' defaults)
        "state_size": raw.get("state_size", 128 if version == 2 else 16),
        "conv_kernel": raw.get("conv_kernel", 4),
        "expand": raw.get("expand", 2),
        **({"time_step_rank": math.ceil(hidden / 16) if rank == "auto" else rank} if version == 1 else {}),
        **({key: raw.get(key, default) for key, default in MAMBA2_SIZES.items()} if version == 2 else {}),
    }
    _check_positive_ints(sizes, tuple(sizes), name)
    d_inner, bias = sizes["expand"] * hidden, bool(raw.get("use_bias", False))
    mamba = {"d_inner": d_inner, "d_state": sizes["state_size"], "d_conv": sizes["conv_kernel"],
             "conv_bias": bool(raw.get("use_conv_bias", True)), "proj_bias": bias}  # fmt: skip
    if version == 1:
        falcon = model_type == "falcon_mamba"
        eps = _json_float(raw.get("mixer_rms_eps", 1e-6), "mixer_rms_eps", name) if falcon else None
        mamba.update(version=1, dt_rank=sizes["time_step_rank"], dt_bc_norms=falcon, dt_bc_norm_weights=False,
                     dt_bc_norm_eps=eps)  # fmt: skip
    else:
        heads, head_dim, groups = sizes["num_heads"], sizes["head_dim"], sizes["n_groups"]
        if heads * head_dim != d_inner or heads % groups:
            raise ConfigError(
                f"{name}: num_heads {heads} x head_dim {head_dim} must be expand x hidden_size {d_inner}, and "
                f"n_groups {groups} must divide the heads"
            )
        limit = [_json_float(bound, "time_step_limit", name) for bound in raw.get("time_step_limit") or (0.0, math.inf)]
        if len(limit) != 2:
            raise ConfigError(f"{name}: time_step_limit must be two numbers (the steps' least and most), got {limit!r}")
        mamba.update(n_heads=heads, head_dim=head_dim, n_groups=groups, chunk_size=sizes["chunk_size"],
                     out_proj_bias=bias, rms_norm=True, norm_before_gate=False, time_step_limit=tuple(limit))  # fmt: skip
    mamba["residual_in_fp32"] = bool(raw.get("residual_in_fp32", True))
    layers = common["num_hidden_layers"]
    return ModelConfig(
        **common,
        intermediate_size=d_inner,
        num_key_value_heads=1,
        head_dim=2,
        norm_eps=_json_float(raw.get("layer_norm_epsilon", 1e-5), "layer_norm_epsilon", name),
        layer_types=(MAMBA,) * layers,
        rotary_layers=(False,) * layers,
        mamba=mamba,
    )


def _falcon_h1_scales(raw: dict[str, Any], name: str) -> dict[str, float]:
    """Falcon-H1's embeddings times ``embedding_multiplier``, its logits times ``lm_head_multiplier`` (Granite's
    fields: the logits divided by its inverse)."""
    head = _json_float(raw.get("lm_head_multiplier", 1.0), "lm_head_multiplier", name)
    if not head:
        raise ConfigError(f"{name}: lm_head_multiplier must not be 0")
    return {
        "embedding_multiplier": _json_float(raw.get("embedding_multiplier", 1.0), "embedding_multiplier", name),
        "logits_scaling": 1 / head,
    }


def _falcon_h1_multipliers(raw: dict[str, Any], name: str) -> dict[str, Any]:
    """Falcon-H1's muP multipliers of its projections (the loader folds them into the weights,
    ``models/falcon_h1.py``): attention's input, keys and output, the mixer's input, its in_proj's five parts (z,
    x, B, C, dt) and output, the MLP's gate and down projection; transformers' defaults (1)."""
    scalars = {
        key: _json_float(raw.get(key, 1.0), key, name)
        for key in ("attention_in_multiplier", "key_multiplier", "attention_out_multiplier", "ssm_in_multiplier",
                    "ssm_out_multiplier")
    }  # fmt: skip
    lists = {"ssm_multipliers": 5, "mlp_multipliers": 2}
    for key, size in lists.items():
        values = raw.get(key) or [1.0] * size
        if not isinstance(values, list) or len(values) != size:
            raise ConfigError(f"{name}: {key} must be {size} numbers, got {values!r}")
        scalars[key] = [_json_float(v, key, name) for v in values]
    return scalars


def _json_float(value: Any, key: str, name: str) -> float:
    """A config's number, or transformers 5's JSON spelling of a non-finite one ({"__float__": "Infinity"})."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        value = value["__float__"]
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: {key} must hold numbers, got {value!r}") from None


def _granite_multipliers(raw: dict[str, Any]) -> dict[str, float | None]:
    """Granite's scales, transformers' GraniteConfig defaults (1) where the config has none; HyperCLOVA X's, whose
    ``logits_scaling`` multiplies (the engine divides by its inverse: equal up to rounding) and whose attention
    scale is head_dim ** -0.5 where its config has none."""
    hyperclova = raw["model_type"] == "hyperclovax"
    attention = raw.get("attention_multiplier", None if hyperclova else 1.0)
    logits = float(raw.get("logits_scaling", 1.0))
    return {
        "embedding_multiplier": float(raw.get("embedding_multiplier", 1.0)),
        "residual_multiplier": float(raw.get("residual_multiplier", 1.0)),
        "attention_multiplier": None if attention is None else float(attention),
        "logits_scaling": 1 / logits if hyperclova else logits,
    }


def _language_model_config(raw: dict[str, Any], name: str) -> ModelConfig:
    """The language model of a multimodal checkpoint (``MULTIMODAL``): its ``text_config``, with what the
    top level says of generation (EOS: Gemma 3's [1, 106]) and of the weights' dtype. (Whether its LM head
    is tied, the weights say: ``loader.load_model``.)"""
    text = raw.get("text_config")
    if text is None and raw["model_type"] in FLAT_MULTIMODAL:  # (the top level is the language model's)
        text = {key: value for key, value in raw.items() if key not in ("model_type", "vision_config")}
    if not isinstance(text, dict):
        raise ConfigError(f"{name}: a {raw['model_type']} config.json needs a text_config (its language model's)")
    # (Ministral 3's text_config says ministral3; Gemma 3's and Mistral Small's may say nothing: their own)
    kind = text.get("model_type") or MULTIMODAL[raw["model_type"]]
    if kind in TEXT_MODEL_TYPES:  # (a setting the text_config leaves null: the default's)
        kind, defaults = TEXT_MODEL_TYPES[kind]
        text = {**defaults, **{key: value for key, value in text.items() if value is not None}}
    if kind not in ARCHITECTURES:
        raise ConfigError(
            f"{name}: unsupported architecture {kind!r} (config.json text_config model_type); "
            f"supported: {', '.join(sorted([*ARCHITECTURES, *MULTIMODAL]))}"
        )
    merged = {**text, "model_type": kind}
    for key in ("eos_token_id", "bos_token_id", "torch_dtype", "dtype"):
        if raw.get(key) is not None and (key == "eos_token_id" or key not in text):
            merged[key] = raw[key]
    config = from_hf_config(merged, name)
    return dataclasses.replace(config, extra={**config.extra, "multimodal_checkpoint": True})


def _moe(raw: dict[str, Any], layers: int, name: str) -> dict[str, Any] | None:
    """Qwen3-MoE's and Qwen2-MoE's experts, as transformers' decoder layers place them: every
    ``decoder_sparse_step``-th layer not in ``mlp_only_layers`` (Qwen2-MoE's beside a shared expert);
    Mixtral's, gpt-oss's, OLMoE's and Granite MoE's: every layer, each expert of ``intermediate_size``
    (Mixtral's and Granite's top weights always renormalized); DeepSeek's: every layer after the first
    ``first_k_dense_replace``, beside shared experts, with their routing's settings (GLM-4.5's as V3's, Hunyuan's
    greedy); ERNIE 4.5's: every ``moe_layer_interval``-th layer between its start and end indices. ERNIE's and
    Hunyuan's settings have names of their own (``MOE_SETTING_NAMES``; Hunyuan's a value a layer, read as one).
    The defaults where a config has none are transformers'."""
    kind = raw["model_type"]
    experts_of_intermediate_size = kind in (
        "mixtral",
        "minimax_m2",
        "gpt_oss",
        "olmoe",
        "flex_olmo",
        "granitemoe",
        *UNGATED_SHARED_EXPERTS,
        "hunyuan_v1_moe",
        "llama4_text",
        "phimoe",
        "jamba",
        "cohere2_moe",
    )
    # NOTE: transformers 5 saves Qwen3-MoE's count as num_local_experts (Mixtral's name), the Hub as num_experts
    experts = raw.get("num_experts", raw.get("num_local_experts", MOE_DEFAULTS[kind]["num_experts"]))
    if kind in MOE_SETTING_NAMES:
        raw = {MOE_SETTING_NAMES[kind].get(key, key): value for key, value in raw.items()}
    if kind == "hunyuan_v1_moe":  # (its configs give a value a layer; transformers' reads one for all)
        raw = {
            **raw,
            **{key: _one_for_all_layers(raw, key, name) for key in ("n_routed_experts", "num_experts_per_tok")},
        }
    if kind in DEEPSEEK_ROUTED:
        raw = {**DEEPSEEK_ROUTING_DEFAULTS[kind], **raw}
        experts = raw.get("n_routed_experts", MOE_DEFAULTS[kind]["num_experts"])
    if not experts:
        return None
    step, dense = raw.get("decoder_sparse_step", 1), set(raw.get("mlp_only_layers") or ())
    if kind == "ernie4_5_moe":  # (every moe_layer_interval-th layer from the start index to the end one's)
        start = _layer_index(raw, "moe_layer_start_index", 1, name)
        end = _layer_index(raw, "moe_layer_end_index", -1, name)
        step, end = raw.get("moe_layer_interval", 1), layers - 1 if end == -1 else end
        dense = {i for i in range(layers) if not start <= i <= end}
    elif kind in ("glm4_moe_lite", "kimi_linear", "exaone_moe", "hy_v3", "cohere2_moe") and raw.get(
        "mlp_layer_types"
    ):  # ("dense", "sparse")
        dense = _dense_layers(raw["mlp_layer_types"], layers, name)
    elif kind in (*DEEPSEEK_ROUTED, "cohere2_moe"):  # (its first first_k_dense_replace layers' MLPs dense)
        dense = set(range(_layer_index(raw, "first_k_dense_replace", 0, name)))
    elif kind == "jamba":  # (its experts where i % expert_layer_period is expert_layer_offset; one expert: none)
        period, offset = raw.get("expert_layer_period", 2), raw.get("expert_layer_offset", 1)
        _check_layer_period(period, offset, "expert_layer", name)
        if experts == 1:
            return None
        dense = {i for i in range(layers) if i % period != offset}
    elif kind == "llama4_text":  # (its experts at moe_layers, else every interleave_moe_layer_step-th layer)
        step = 1 if raw.get("moe_layers") is not None else raw.get("interleave_moe_layer_step", 1)
        dense = _llama4_dense_layers(raw, layers, name)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        setting = {"ernie4_5_moe": "moe_layer_interval", "llama4_text": "interleave_moe_layer_step"}.get(
            kind, "decoder_sparse_step"
        )
        raise ConfigError(f"{name}: {setting} must be a positive integer, got {step!r}")
    moe = {
        "num_experts": experts,
        "num_experts_per_tok": raw.get("num_experts_per_tok", MOE_DEFAULTS[kind]["num_experts_per_tok"]),
        "moe_intermediate_size": raw.get("intermediate_size")
        if experts_of_intermediate_size
        else raw.get("moe_intermediate_size", MOE_DEFAULTS[kind]["moe_intermediate_size"]),
        # (Granite's: the softmax of the top k logits, the same weights; Qwen3-Next's by default)
        "norm_topk_prob": kind
        in ("mixtral", "granitemoe", *UNGATED_SHARED_EXPERTS, "hunyuan_v1_moe", "qwen3_5_moe_text")
        or bool(raw.get("norm_topk_prob", kind == "qwen3_next")),
        "moe_layers": tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)),
        "shared_expert_intermediate_size": raw.get("shared_expert_intermediate_size", GATED_SHARED_EXPERTS[kind])
        if kind in GATED_SHARED_EXPERTS
        else 0,
    }
    if kind == "phimoe":  # (SparseMixer's: two experts a token, their logits' margin)
        if moe["num_experts_per_tok"] != 2:
            raise ConfigError(f"{name}: phimoe routes each token to 2 experts (SparseMixer), got num_experts_per_tok "
                              f"{moe['num_experts_per_tok']!r}")  # fmt: skip
        moe["router_jitter_noise"] = float(raw.get("router_jitter_noise", 0.01))
    if kind == "cohere2_moe":  # (the softmax of the top k logits or their sigmoids; its shared MLPs as one)
        moe.update(_cohere2_moe_routing(raw, name), shared_expert_intermediate_size=raw.get("intermediate_size")
                   * _layer_index(raw, "num_shared_experts", 0, name))  # fmt: skip
    if kind == "llama4_text":  # (its shared expert, ungated, as wide as each routed one)
        moe["shared_expert_intermediate_size"] = raw.get("intermediate_size")
    if kind in UNGATED_SHARED_EXPERTS:  # (its shared MLP, ungated, beside the experts; Granite 4.0's 1,024 wide)
        default = 1024 if kind == "granitemoehybrid" else 0
        moe["shared_expert_intermediate_size"] = raw.get("shared_intermediate_size", default)
    if kind in DEEPSEEK_ROUTED:  # its shared experts, one MLP (ungated); its routing (moe.DeepseekMoE)
        scaling = raw["routed_scaling_factor"]
        if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not 0 < scaling < float("inf"):
            raise ConfigError(f"{name}: routed_scaling_factor must be a positive number, got {scaling!r}")
        moe.update(
            shared_expert_intermediate_size=moe["moe_intermediate_size"] * (raw["n_shared_experts"] or 0),
            routed_scaling_factor=float(raw["routed_scaling_factor"]),
            # (a model type of one method takes it whatever its config says: transformers' rule)
            topk_method=ROUTING_METHODS[kind][0] if len(ROUTING_METHODS[kind]) == 1 else raw["topk_method"],
            n_group=raw["n_group"],
            topk_group=raw["topk_group"],
            norm_topk_eps=raw.get("norm_topk_eps", 1e-20),  # (transformers' guard: LFM2-MoE's 1e-6)
        )
        if kind == "lfm2_moe" and not raw.get("use_expert_bias", True):
            raise ConfigError(f"{name}: use_expert_bias false (sigmoid routing without its bias) is not supported")
        _check_group_routing(moe, ROUTING_METHODS[kind], name)
        if moe["norm_topk_prob"] and kind == "deepseek_v2":
            # NOTE: DeepSeek's code renormalizes V2's top weights, transformers' does not: neither is chosen
            raise ConfigError(f"{name}: norm_topk_prob (renormalized top weights) is not supported for deepseek_v2")
    if kind == "gpt_oss":  # softmax over the top k router logits (with biases); the experts' clamped SwiGLU
        moe.update(
            norm_topk_prob=True,
            swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
        )
    _check_moe_sizes(moe, name)
    return moe


def _cohere2_moe_routing(raw: dict[str, Any], name: str) -> dict[str, Any]:
    """Command A+'s routing settings (``moe.Cohere2MoE``): ``expert_selection_fn`` (softmax of the top k logits, or
    their sigmoids, renormalized where ``norm_topk_prob``) and ``shared_expert_combination_strategy`` (the shared
    MLP's output added to the routed one's, or their mean)."""
    selection = raw.get("expert_selection_fn", "softmax")
    combination = raw.get("shared_expert_combination_strategy", "average")
    if selection not in ("softmax", "sigmoid"):
        raise ConfigError(f"{name}: expert_selection_fn must be softmax or sigmoid, got {selection!r}")
    if combination not in ("sum", "average"):
        raise ConfigError(f"{name}: shared_expert_combination_strategy must be sum or average, got {combination!r}")
    norm = selection == "softmax" or bool(raw.get("norm_topk_prob", True))
    return {"expert_selection": selection, "norm_topk_prob": norm, "shared_expert_combination": combination}


def _llama4_dense_layers(raw: dict[str, Any], layers: int, name: str) -> set[int]:
    """The layers whose MLP is dense by Llama 4's ``moe_layers`` (the indices of those of experts; none: all by
    ``interleave_moe_layer_step``)."""
    listed = raw.get("moe_layers")
    if listed is None:
        return set()
    if not isinstance(listed, list) or not all(isinstance(i, int) and 0 <= i < layers for i in listed):
        raise ConfigError(f"{name}: moe_layers must be layer indices below {layers}, got {listed!r}")
    return set(range(layers)) - set(listed)


def _dense_layers(kinds: Any, layers: int, name: str) -> set[int]:
    """The layers whose MLP ``mlp_layer_types`` says is dense (GLM-4.7-Flash's: "dense" or "sparse" a layer)."""
    if not isinstance(kinds, list) or len(kinds) != layers or not set(kinds) <= {"dense", "sparse"}:
        raise ConfigError(f"{name}: mlp_layer_types must be {layers} entries of dense or sparse, got {kinds!r}")
    return {i for i, kind in enumerate(kinds) if kind == "dense"}


def _check_positive_ints(settings: dict[str, Any], keys: tuple[str, ...], name: str, label: str = "") -> None:
    """A ConfigError naming the first of ``keys`` whose value in ``settings`` is not a positive integer (``label``:
    its name's prefix in the config)."""
    for key in keys:
        value = settings[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}: {label}{key} must be a positive integer, got {value!r}")


def _check_moe_sizes(moe: dict[str, Any], name: str) -> None:
    """A mixture of experts' sizes: positive counts and widths, a shared expert's width >= 0 (0: none), a
    token's experts among them."""
    _check_positive_ints(moe, ("num_experts", "num_experts_per_tok", "moe_intermediate_size"), name)
    shared = moe["shared_expert_intermediate_size"]
    if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
        raise ConfigError(f"{name}: shared_expert_intermediate_size must be an integer >= 0, got {shared!r}")
    if moe["num_experts_per_tok"] > moe["num_experts"]:
        raise ConfigError(
            f"{name}: num_experts_per_tok {moe['num_experts_per_tok']} exceeds num_experts {moe['num_experts']}"
        )


def _ntk_alpha(
    raw: dict[str, Any], rope: dict[str, Any], theta: float, head_dim: int, name: str
) -> tuple[float, dict[str, Any], dict[str, Any]]:
    """Hunyuan's rope scaling, "dynamic" with a fixed ``alpha`` (NTK-aware): its base times alpha ** (d / (d - 2)),
    the same at every length (transformers' ``ntk_alpha``). Returns (the base, rope settings and config
    without the scaling). Dynamic scaling without an alpha (by the sequence's length) is refused."""
    scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "dynamic":
        return theta, rope, raw
    alpha = scaling.get("alpha")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise ConfigError(f"{name}: dynamic rope scaling needs a positive alpha (Hunyuan's NTK-alpha), got {alpha!r}")
    theta = theta * alpha ** (head_dim / (head_dim - 2))
    return theta, {k: v for k, v in rope.items() if k != "rope_type"}, {**raw, "rope_scaling": None}


def _one_for_all_layers(raw: dict[str, Any], key: str, name: str) -> Any:
    """``raw[key]``, given as one value or one a layer (Hunyuan's): the value, where every layer's is the same."""
    value = raw.get(key)
    if not isinstance(value, list):
        return value
    if not value or any(v != value[0] for v in value):
        raise ConfigError(f"{name}: {key} differs between layers ({value!r}); one value for all is supported")
    return value[0]


def _layer_index(raw: dict[str, Any], key: str, default: int, name: str) -> int:
    """The layer index (or count) ``raw[key]``: an integer >= 0, or -1 (the last layer) where the default is."""
    value = raw.get(key, default)
    if value is None and default == 0:  # (DeepSeek's configs may say null: none)
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < min(default, 0):
        allowed = "an integer >= 0" + (" or -1" if default == -1 else "")
        raise ConfigError(f"{name}: {key} must be {allowed}, got {value!r}")
    return value


def _check_group_routing(moe: dict[str, Any], methods: tuple[str, ...], name: str) -> None:
    """DeepSeek's routing: greedy, or group-limited (the experts in ``n_group`` groups, a token's picked from
    its ``topk_group`` best groups: V2's group_limited_greedy, V3's noaux_tc), with groups that divide the
    experts and hold the top k; ``methods``: the model's."""
    method = moe["topk_method"]
    if method not in methods:
        raise ConfigError(f"{name}: topk_method {method!r} is not supported ({', '.join(methods)})")
    if method in ("greedy", "softmax_with_bias"):  # (no groups)
        return
    groups, picked = moe["n_group"], moe["topk_group"]
    for key, value in (("n_group", groups), ("topk_group", picked)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name}: {method} needs {key}, a positive integer; got {value!r}")
    if moe["num_experts"] % groups or picked > groups:
        raise ConfigError(
            f"{name}: n_group {groups} must divide the {moe['num_experts']} experts, and topk_group {picked} "
            "be at most n_group"
        )
    if picked * (moe["num_experts"] // groups) < moe["num_experts_per_tok"]:
        raise ConfigError(f"{name}: topk_group {picked} groups hold fewer experts than num_experts_per_tok")


def _config_rope_scaling(raw: dict[str, Any], rope: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The rope scaling of a config: ``rope_scaling`` (before transformers 5), else its ``rope_parameters``
    (``rope``) where they name a type other than default."""
    return _rope_scaling(
        raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None), name
    )


def _rope_scaling(scaling: dict[str, Any] | None, name: str) -> dict[str, Any] | None:
    """An HF rope scaling dict if it is one the engine applies (None: plain rope)."""
    if scaling is None:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "mrope":  # (Qwen2-VL's first name of its MRoPE: on text, plain RoPE; transformers reads it so)
        kind = "default"
    if kind == "su":  # (LongRoPE's first name, in the first 128K Phi-3 configs; transformers reads it so)
        scaling, kind = {**scaling, "rope_type": "longrope"}, "longrope"
    # NOTE: dynamic NTK (InternLM3's) stretches the rope's base only for a sequence past max_position_embeddings, which
    # the engine never serves (``resolve_max_model_len``): within it transformers' is plain rope, and so is the engine's
    # (vLLM's scales the base whatever the length, and serves factor x the positions)
    if kind == "dynamic":
        kind = "default"
    # NOTE: frequency_factors is a GGUF file's (llama.cpp's rope_freqs tensor), not an HF config's
    if kind not in ("default", "linear", "llama3", "yarn", "longrope", "frequency_factors", "proportional"):
        raise ConfigError(
            f"{name}: rope scaling {kind!r} is not supported (default, linear, llama3, yarn, longrope, proportional, "
            "dynamic)"
        )
    if kind == "yarn" and not scaling.get("original_max_position_embeddings"):
        raise ConfigError(f"{name}: yarn rope scaling needs original_max_position_embeddings (the pretrained context)")
    return None if kind == "default" else scaling


def _llama4_scaling_beta(model_type: str, scaling: dict | None, rope: dict, name: str) -> float | None:
    """Ministral 3's query scale, beta (its rope settings' ``llama_4_scaling_beta``), checked: it scales
    by the positions past the rope's pretrained context, and needs that context."""
    beta = (scaling or rope).get("llama_4_scaling_beta") if model_type in ("ministral3", "mistral4") else None
    if beta is None:
        return None
    if not isinstance(beta, (int, float)) or isinstance(beta, bool):
        raise ConfigError(f"{name}: llama_4_scaling_beta must be a number, got {beta!r}")
    if not (scaling or {}).get("original_max_position_embeddings"):
        raise ConfigError(f"{name}: llama_4_scaling_beta needs the rope's original_max_position_embeddings")
    return float(beta)


def _longrope(scaling: dict[str, Any], raw: dict[str, Any], rotary_dim: int, name: str) -> dict[str, Any]:
    """LongRoPE's settings (Phi-3.5, Phi-4 mini, the 128K Phi-3s), checked: a short and a long factor per
    frequency, and the pretrained context (Phi-3 keeps it at the top level of its config; transformers'
    Phi3Config default 4,096 where it has none)."""
    original = scaling.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings")
    if original is None:
        original = 4096 if raw.get("model_type") == "phi3" else raw.get("max_position_embeddings")
    for key in ("short_factor", "long_factor"):
        factors = scaling.get(key)
        if not isinstance(factors, list) or not all(
            isinstance(f, (int, float)) and not isinstance(f, bool) and f > 0 for f in factors
        ):
            raise ConfigError(f"{name}: longrope rope scaling needs {key}, a list of positive numbers")
        if len(factors) != rotary_dim // 2:
            raise ConfigError(
                f"{name}: longrope {key} has {len(factors)} factors; the rotary embedding has {rotary_dim // 2} "
                "frequencies"
            )
    if not isinstance(original, int) or isinstance(original, bool) or original < 1:
        raise ConfigError(
            f"{name}: longrope original_max_position_embeddings must be a positive integer, got {original!r}"
        )
    return {**scaling, "rope_type": "longrope", "original_max_position_embeddings": original}


def _gemma3_config(raw: dict[str, Any], common: dict[str, Any], name: str, need) -> ModelConfig:
    """A Gemma 3 text model's config (transformers 5's ``rope_parameters`` per layer type, or the
    older ``rope_theta``, ``rope_local_base_freq``, ``rope_scaling`` and ``sliding_window_pattern``), or
    Gemma 2's (no query/key norms; one rope base for every layer; scores capped), VaultGemma's (Gemma 2's without
    the norms of each part's output: ``extra["output_norms"]``)."""
    gemma2 = raw["model_type"] in ("gemma2", "vaultgemma")
    activation = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise ConfigError(f"{name}: hidden_activation {activation!r} is not supported (gelu_pytorch_tanh)")
    if raw.get("use_bidirectional_attention"):
        raise ConfigError(f"{name}: bidirectional attention is not supported")
    layers = need("num_hidden_layers")
    layer_types = raw.get("layer_types")
    if layer_types is None:  # every pattern-th layer is global
        pattern = int(raw.get("sliding_window_pattern", 6))
        layer_types = [SLIDING if (i + 1) % pattern else "full_attention" for i in range(layers)]
    rope = raw.get("rope_parameters") or {}
    full = dict(rope.get("full_attention") or (rope if gemma2 else {}))
    local = dict(rope.get(SLIDING) or (full if gemma2 else {}))
    if gemma2 and "rope_theta" in raw:  # (before transformers 5: at the top level, for every layer)
        full.setdefault("rope_theta", raw["rope_theta"])
        local.setdefault("rope_theta", raw["rope_theta"])
    return ModelConfig(
        **{**common, "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True))},
        intermediate_size=need("intermediate_size"),
        num_key_value_heads=raw.get("num_key_value_heads") or common["num_attention_heads"],
        head_dim=raw.get("head_dim") or 256,
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(full.get("rope_theta", raw.get("rope_theta", 10_000.0 if gemma2 else 1_000_000.0))),
        rope_scaling=_rope_scaling(
            full if full.get("rope_type", "default") != "default" else raw.get("rope_scaling"), name
        ),
        rope_local_theta=float(local.get("rope_theta", raw.get("rope_local_base_freq", 10_000.0))),
        attention_bias=bool(raw.get("attention_bias", False)),
        hidden_act=activation,
        qk_norm=not gemma2,
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
        layer_types=tuple(layer_types),
        sliding_window=int(raw.get("sliding_window") or 4096),
        final_logit_softcapping=raw.get("final_logit_softcapping"),
        attn_logit_softcapping=raw.get("attn_logit_softcapping"),
        extra={"output_norms": raw["model_type"] != "vaultgemma"},
    )


def load_hf_config(path: str | Path) -> ModelConfig:
    """Read ``config.json`` of a local HF model directory."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"model directory {path} does not exist (models are never downloaded)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"model directory {path} has no config.json")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{config_file}: not valid JSON ({e})") from None
    config = from_hf_config(raw, name=path.name)
    # NOTE: a generation config's EOS ids end a generation too, as in vLLM (it adds them to every request's
    # stop ids): Qwen2.5/Qwen3 Instruct's config.json names <|im_end|>, their generation config <|endoftext|>
    # too; some checkpoints keep EOS there alone
    more = [i for i in generation_eos_ids(path / "generation_config.json") if i not in config.eos_token_ids]
    if more:
        config = dataclasses.replace(config, eos_token_ids=(*config.eos_token_ids, *more))
    return config


def _tiny(model_type: str, **overrides: Any) -> ModelConfig:
    values = dict(
        model_type=model_type,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2 if model_type != "opt" else 4,
        head_dim=16,
        max_position_embeddings=1024,
        name=f"tiny-{model_type}",
    )
    values.update(overrides)
    return ModelConfig(**values)


def _from_spec(spec_name: str, model_type: str, **overrides: Any) -> ModelConfig:
    """A random model with the shape of a bundled cost-model spec (one source of the numbers)."""
    s = MODELS[spec_name]
    values = dict(
        model_type=model_type,
        vocab_size=s.vocab_size,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        max_position_embeddings=s.max_context_len,
        tie_word_embeddings=s.tied_embeddings,
        torch_dtype="bfloat16",
        name=spec_name,
    )
    values.update(overrides)
    return ModelConfig(**values)


# Named shapes for ``random:NAME`` models (benchmarks and tests); weights are random, the tokenizer
# is byte-level (ids 0..255, BOS 256, EOS 257).
RANDOM_SHAPES: dict[str, ModelConfig] = {
    "tiny-llama": _tiny("llama"),
    "tiny-qwen2": _tiny("qwen2", attention_bias=True, norm_eps=1e-6, rope_theta=1e6),
    "tiny-opt": _tiny("opt", hidden_act="relu", word_embed_proj_dim=64, tie_word_embeddings=True),
    # Steps of 3-20 ms on one CPU core (batch 1-32), as a 7-8B model's on a GPU: where a served request's
    # host work (HTTP, a fleet's calls) is as small a share of a step as it is there
    "small-llama": _tiny(
        "llama",
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        name="small-llama",
    ),
    "llama-2-7b": _from_spec("llama-2-7b", "llama"),
    "llama-3-8b": _from_spec("llama-3-8b", "llama", rope_theta=500000.0),
    "tiny-qwen3": _tiny("qwen3", qk_norm=True, norm_eps=1e-6, rope_theta=1e6),
    "tiny-gemma3": _tiny(
        "gemma3_text",
        qk_norm=True,
        hidden_act="gelu_pytorch_tanh",
        norm_eps=1e-6,
        rope_theta=1e6,
        rope_local_theta=1e4,
        query_pre_attn_scalar=16.0,
        layer_types=("sliding_attention", "full_attention"),
        sliding_window=64,
        tie_word_embeddings=True,
        name="tiny-gemma3",
    ),
    # Mistral 7B v0.1's sliding window on every layer, shorter than most test contexts
    "tiny-mistral": _tiny("mistral", layer_types=(SLIDING, SLIDING), sliding_window=16),
    # Granite 3.3 8B's scales (its attention's for head_dim 16)
    "tiny-granite": _tiny(
        "granite", embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=16.0
    ),
    # Phi-4 mini's rotary embedding: 12 of each head's 16 dimensions turn, LongRoPE past 256 positions
    "tiny-phi4-mini": _tiny(
        "phi3",
        tie_word_embeddings=True,
        partial_rotary_dim=12,
        rope_scaling={
            "rope_type": "longrope",
            "original_max_position_embeddings": 256,
            "short_factor": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5],
            "long_factor": [1.0, 4.0, 8.0, 12.0, 16.0, 20.0],
        },
        name="tiny-phi4-mini",
    ),
    # Ministral 3's queries scaled past the rope's pretrained 64 positions (Llama 4's attention scaling)
    "tiny-ministral3": _tiny(
        "ministral3",
        rope_scaling={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64},
        llama4_scaling_beta=0.5,
    ),
    # Gemma 1's norms, GeGLU MLP and scaled embeddings on Llama's layers
    "tiny-gemma": _tiny("gemma", hidden_act="gelu_pytorch_tanh", norm_eps=1e-6, tie_word_embeddings=True),
    # StarCoder2's LayerNorms, GELU MLP and biases, every layer's window shorter than most test contexts
    "tiny-starcoder2": _tiny(
        "starcoder2",
        attention_bias=True,
        attention_output_bias=True,
        mlp_bias=True,
        hidden_act="gelu_pytorch_tanh",
        layer_types=(SLIDING, SLIDING),
        sliding_window=16,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b": _from_spec("qwen2.5-7b", "qwen2", attention_bias=True, norm_eps=1e-6, rope_theta=1e6),
    "opt-13b": _from_spec("opt-13b", "opt", hidden_act="relu", word_embed_proj_dim=5120),
}


def random_config(name: str) -> ModelConfig:
    """The shape registered as ``random:NAME``, with the byte tokenizer's special ids."""
    if name not in RANDOM_SHAPES:
        raise UnknownNameError("random model shape", name, list(RANDOM_SHAPES))
    return dataclasses.replace(RANDOM_SHAPES[name], bos_token_id=BYTE_BOS_ID, eos_token_ids=(BYTE_EOS_ID,))
