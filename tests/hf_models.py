"""Tiny random HuggingFace models (transformers) the engine's and the server's tests compare with, and the
prompts the engine's tests generate from (``PROMPTS``: ``greedy_tokens`` on the engine, ``reference`` on
transformers)."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers

VOCAB = 300
PROMPTS = [
    [5, 17, 33, 2, 99, 120, 7],
    [250, 3, 3],
    [i * 7 % VOCAB for i in range(1, 31)],
    [42] * 12,
    [11, 22, 33, 44, 55],
    list(range(100, 117)),
]
MAX_TOKENS = [12, 5, 20, 8, 16, 10]
SEEDS = {"llama": 0, "qwen2": 1, "opt": 2, "qwen3": 3, "gemma3": 5, "mistral": 7, "phi3": 9, "smollm3": 10, "gemma2": 11,
         "qwen3_moe": 12, "mixtral": 13, "granite": 14, "olmo2": 15, "phi4_mini": 16,
         "qwen2_moe": 17, "gpt_oss": 18,
         "olmo3": 19, "olmoe": 20, "glm": 21, "glm4": 22,
         "ministral3": 23, "exaone4": 24, "seed_oss": 25, "ernie4_5": 26,
         "gpt_neox": 27, "cohere": 28, "cohere2": 29, "gpt2": 30, "phi": 31, "starcoder2": 32, "gemma": 33, "deepseek_v2": 34, "deepseek_v3": 35,
         "stablelm": 36, "olmo": 37, "nemotron": 38, "arcee": 39, "granitemoe": 40, "hunyuan": 41,
         "glm4_moe": 42, "ernie4_5_moe": 43, "apertus": 44, "hunyuan_moe": 45, "granitemoehybrid": 46,
         "granitemoehybrid_moe": 47, "granite_4_h": 48, "nemotron_h": 49, "bamba": 50, "nemotron_h_moe": 51,
         "falcon_h1": 52, "falcon_h1_norm": 53, "lfm2": 54, "lfm2_moe": 55, "lfm3": 56, "granite_swa": 57, "mistral4": 58, "glm4_moe_lite": 59, "minimax_m2": 60,
         "qwen3_next": 61, "qwen3_5": 62, "qwen3_5_moe": 63, "olmo_hybrid": 64, "kimi_linear": 65,
         "exaone_moe": 66, "granitemoeshared": 67, "granitemoe_swa": 68, "llama4": 69, "llama4_maverick": 70,
         "exaone": 71, "internlm3": 72, "iquestcoder": 73, "ministral": 74, "helium": 75, "dots1": 76, "phimoe": 77, "solar_open": 78, "sarvam_moe": 79, "youtu": 80, "hy_v3": 81, "afmoe": 82, "jamba": 83, "gpt_bigcode": 84,
         "gpt_bigcode_mha": 85, "falcon": 86, "falcon_40b": 87, "falcon_11b": 88, "falcon_rw": 89, "minicpm3": 90, "jais2": 91,
         "cwm": 92, "vaultgemma": 93, "hyperclovax": 94,
         "cohere2_moe": 95, "cohere2_moe_sigmoid": 96, "bloom": 97, "bloom_6_heads": 98, "falcon_rw_alibi": 99,
         "mpt": 100, "mpt_6_heads": 101, "flex_olmo": 102, "nanochat": 103, "mamba": 104, "falcon_mamba": 105,
         "mamba2": 106}  # fmt: skip
# The first transformers release that builds an architecture's reference as the tests know it: 5.23 normalizes Mamba-2's
# gated RMSNorm by group, as mamba_ssm's kernels and the engine do (before: over the whole width, another function where
# a model has several groups: Mamba-2's, Granite 4.0-H's, Bamba's), draws ERNIE 4.5 MoE's router weights at random
# (another tiny model) and brings LFM3 and InternLM3; 5.24 EXAONE and Sarvam MoE. An older one (the GPU image's 5.17 on
# 2026-12-04) skips their tests.
NEEDS_TRANSFORMERS = {"mamba2": (5, 23), "granite_4_h": (5, 23), "bamba": (5, 23), "ernie4_5_moe": (5, 23),
                      "lfm3": (5, 23), "internlm3": (5, 23), "exaone": (5, 24), "sarvam_moe": (5, 24)}  # fmt: skip
# The models of delta-rule layers (their decays made mild: states that last past a chunk)
DELTA_RULE_ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid", "kimi_linear")
# Phi-4 mini's LongRoPE, scaled down: a pretrained context of 64 positions (of 256), a factor per frequency
# of the 12 dimensions of 16 its rotary embedding turns (partial_rotary_factor 3/4)
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.15, 1.3, 1.45, 1.6, 1.75], "long_factor": [1.0, 8.0, 15.0, 22.0, 29.0, 36.0]}  # fmt: skip
LONGROPE_PRETRAINED_CONTEXT = 64


def hf_model(arch: str):
    needs = NEEDS_TRANSFORMERS.get(arch)
    if needs is not None and tuple(int(n) for n in transformers.__version__.split(".")[:2]) < needs:
        pytest.skip(
            f"{arch}'s reference needs transformers >= {'.'.join(map(str, needs))}, not {transformers.__version__}"
        )
    common = dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256
    )
    if arch == "llama":
        config = transformers.LlamaConfig(**common, intermediate_size=128, num_key_value_heads=2, initializer_range=0.2)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen3":
        config = transformers.Qwen3Config(
            **common, intermediate_size=128, num_key_value_heads=2, head_dim=32, initializer_range=0.2
        )
        cls = transformers.Qwen3ForCausalLM
    elif arch == "gemma3":
        # a sliding layer (window 8: shorter than most test contexts) and a global one
        config = transformers.Gemma3TextConfig(
            **common, intermediate_size=128, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
            sliding_window=8, layer_types=["sliding_attention", "full_attention"], initializer_range=0.2,
        )  # fmt: skip
        cls = transformers.Gemma3ForCausalLM
    elif arch == "gemma2":
        # a sliding layer and a global one (window 8), scores capped at 2 and logits at 5: caps that bite
        config = transformers.Gemma2Config(
            **common, intermediate_size=128, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
            sliding_window=8, attn_logit_softcapping=2.0, final_logit_softcapping=5.0, initializer_range=0.2,
        )  # fmt: skip
        cls = transformers.Gemma2ForCausalLM
    elif arch == "mistral":  # Mistral 7B v0.1's sliding window, on every layer (8: shorter than most test contexts)
        config = transformers.MistralConfig(
            **common, intermediate_size=128, num_key_value_heads=2, sliding_window=8, initializer_range=0.2
        )
        cls = transformers.MistralForCausalLM
    elif arch == "phi3":  # Phi-3 mini's window on every layer (8: shorter than most test contexts), fused weights
        config = transformers.Phi3Config(
            **common, intermediate_size=128, num_key_value_heads=2, sliding_window=8, initializer_range=0.2,
            pad_token_id=0,
        )  # fmt: skip
        cls = transformers.Phi3ForCausalLM
    elif arch == "ministral3":  # YaRN past 16 positions, queries scaled past them (Llama 4's scaling, beta 0.5)
        config = transformers.Ministral3Config(
            **common, intermediate_size=128, num_key_value_heads=2, head_dim=16, initializer_range=0.2, pad_token_id=0,
            rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 16,
                             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "llama_4_scaling_beta": 0.5},
        )  # fmt: skip
        cls = transformers.Ministral3ForCausalLM
    elif arch == "phi4_mini":  # partial rotary, LongRoPE, the LM head tied, no window: Phi-4 mini's
        config = transformers.Phi3Config(
            **common, intermediate_size=128, num_key_value_heads=2, initializer_range=0.2, pad_token_id=0,
            tie_word_embeddings=True, partial_rotary_factor=0.75, rope_parameters=dict(LONGROPE),
            original_max_position_embeddings=LONGROPE_PRETRAINED_CONTEXT,
        )  # fmt: skip
        cls = transformers.Phi3ForCausalLM
    elif arch == "smollm3":  # its second layer without a rotary embedding (the real ones: every fourth)
        config = transformers.SmolLM3Config(
            **common, intermediate_size=128, num_key_value_heads=2, no_rope_layers=[1, 0], initializer_range=0.2,
            pad_token_id=0,
        )  # fmt: skip
        cls = transformers.SmolLM3ForCausalLM
    elif arch == "qwen3_moe":  # 8 experts, 2 a token, the second layer's MLP dense (mlp_only_layers)
        config = transformers.Qwen3MoeConfig(
            **common, intermediate_size=128, num_key_value_heads=2, head_dim=16, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1],
            initializer_range=0.2,
        )  # fmt: skip
        cls = transformers.Qwen3MoeForCausalLM
    elif arch == "qwen2_moe":  # 8 experts, 2 a token (not renormalized) beside the shared one; layer 2 dense
        config = transformers.Qwen2MoeConfig(
            **common, intermediate_size=128, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[1], initializer_range=0.2,
        )  # fmt: skip
        cls = transformers.Qwen2MoeForCausalLM
    elif arch == "gpt_oss":  # 4 experts, 2 a token; sinks; the first layer sliding (8), YaRN past 64 positions
        config = transformers.GptOssConfig(
            **common, intermediate_size=32, num_key_value_heads=2, head_dim=16, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=8, initializer_range=0.2, pad_token_id=0,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                             "original_max_position_embeddings": 64, "rope_theta": 150000.0},
        )  # fmt: skip
        cls = transformers.GptOssForCausalLM
    elif arch == "mixtral":  # 4 experts, 2 a token
        config = transformers.MixtralConfig(
            **common, intermediate_size=32, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
            initializer_range=0.2,
        )  # fmt: skip
        cls = transformers.MixtralForCausalLM
    elif arch == "granite":  # Granite 3.3 8B's scales (the attention's for head_dim 16)
        config = transformers.GraniteConfig(
            **common, intermediate_size=128, num_key_value_heads=2, initializer_range=0.2, embedding_multiplier=12.0,
            residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=16.0,
        )  # fmt: skip
        cls = transformers.GraniteForCausalLM
    elif arch == "minimax_m2":  # MiniMax-M2's outline: whole-projection q/k norms, half of each head rotated, experts
        config = transformers.MiniMaxM2Config(
            **common, num_key_value_heads=2, head_dim=16, intermediate_size=32, num_local_experts=8,
            num_experts_per_tok=2, rotary_dim=8, initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        cls = transformers.MiniMaxM2ForCausalLM
    elif arch == "glm4_moe_lite":  # GLM-4.7-Flash's outline: MLA, GLM-4.5's biased sigmoid routing, MLPs by list
        config = transformers.Glm4MoeLiteConfig(
            **{**common, "num_hidden_layers": 3}, num_key_value_heads=4, intermediate_size=128,
            moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=32,
            q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_group=2, topk_group=1,
            mlp_layer_types=["dense", "sparse", "dense"], initializer_range=0.2, pad_token_id=0, bos_token_id=1,
            eos_token_id=2,
        )  # fmt: skip
        cls = transformers.Glm4MoeLiteForCausalLM
    elif arch == "mistral4":  # Mistral Small 4's outline: MLA, YaRN, queries scaled past 32 positions, 2 groups
        config = transformers.Mistral4Config(
            **common, num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_group=2, topk_group=1, routed_scaling_factor=2.0,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                             "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0,
                             "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.5},
            initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        cls = transformers.Mistral4ForCausalLM
    elif arch == "granite_swa":  # Granite's scales, a full layer without rope, three sliding (window 8), sinks
        config = transformers.GraniteSWAConfig(
            **{**common, "num_hidden_layers": 4}, intermediate_size=128, num_key_value_heads=2, initializer_range=0.2,
            embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=16.0,
            sliding_window=8, layer_rope_theta=[0, 10000.0, 10000.0, 10000.0], pad_token_id=0, bos_token_id=1,
            eos_token_id=2,
        )  # fmt: skip
        cls = transformers.GraniteSWAForCausalLM
    elif arch == "olmo3":  # three sliding layers (window 8) then a full one, its rope YaRN-scaled past 64
        config = transformers.Olmo3Config(
            **{**common, "num_hidden_layers": 4}, intermediate_size=128, num_key_value_heads=2, initializer_range=0.2,
            sliding_window=8, pad_token_id=0,
            rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                                "rope_theta": 500000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}},
        )  # fmt: skip
        cls = transformers.Olmo3ForCausalLM
    elif arch == "olmoe":  # 8 experts, 2 a token (not renormalized); q, k and v clipped at 0.8 (clip_qkv: bites)
        config = transformers.OlmoeConfig(
            **common, intermediate_size=32, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
            clip_qkv=0.8, initializer_range=0.2, pad_token_id=0,
        )  # fmt: skip
        cls = transformers.OlmoeForCausalLM
    elif arch == "nanochat":  # weightless norms, the rotation by -theta, logits capped at 2 (the cap bites)
        config = transformers.NanoChatConfig(
            **common, intermediate_size=128, num_key_value_heads=2, final_logit_softcapping=2.0,
            initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        cls = transformers.NanoChatForCausalLM
    elif arch == "flex_olmo":  # OLMo 2's layers, 7 experts (its default), 3 a token, not renormalized
        config = transformers.FlexOlmoConfig(
            **common, intermediate_size=32, num_key_value_heads=2, num_experts_per_tok=3, initializer_range=0.2,
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        cls = transformers.FlexOlmoForCausalLM
    elif arch in ("glm", "glm4"):  # half of each head rotated by adjacent pairs; GLM-4-0414's sandwich norms
        cls = transformers.GlmForCausalLM if arch == "glm" else transformers.Glm4ForCausalLM
        config = (transformers.GlmConfig if arch == "glm" else transformers.Glm4Config)(
            **common, intermediate_size=128, num_key_value_heads=2, head_dim=16, initializer_range=0.2, pad_token_id=0,
        )  # fmt: skip
    elif arch == "exaone4":  # three sliding layers (window 8) with rope, then a full one without
        config = transformers.Exaone4Config(
            **{**common, "num_hidden_layers": 4}, intermediate_size=128, num_key_value_heads=2, sliding_window=8,
            initializer_range=0.2, pad_token_id=0,
        )  # fmt: skip
        cls = transformers.Exaone4ForCausalLM
    elif arch == "seed_oss":  # biases on q/k/v (its default), o (attention_out_bias) and the MLP
        config = transformers.SeedOssConfig(
            **common, intermediate_size=128, num_key_value_heads=2, head_dim=16, attention_out_bias=True,
            mlp_bias=True, initializer_range=0.2, pad_token_id=0,
        )  # fmt: skip
        cls = transformers.SeedOssForCausalLM
    elif arch == "ernie4_5":  # every head rotated by adjacent pairs; every linear layer biased (use_bias)
        config = transformers.Ernie4_5Config(
            **common, intermediate_size=128, num_key_value_heads=2, head_dim=16, use_bias=True, initializer_range=0.2,
            pad_token_id=0,
        )  # fmt: skip
        cls = transformers.Ernie4_5ForCausalLM
    elif arch == "gpt_neox":  # Pythia's: a quarter of each head rotated, attention and MLP in parallel
        config = transformers.GPTNeoXConfig(**common, intermediate_size=256, initializer_range=0.2, pad_token_id=0)
        cls = transformers.GPTNeoXForCausalLM
    elif arch in ("cohere", "cohere2"):  # Command R; R7B's three sliding layers (window 8) with rope, then one without
        cls = transformers.CohereForCausalLM if arch == "cohere" else transformers.Cohere2ForCausalLM
        config = (transformers.CohereConfig if arch == "cohere" else transformers.Cohere2Config)(
            **{**common, "num_hidden_layers": 4}, intermediate_size=128, num_key_value_heads=2, initializer_range=0.2,
            pad_token_id=0, logit_scale=0.25, **({"sliding_window": 8} if arch == "cohere2" else {}),
        )  # fmt: skip
    elif arch == "cohere2_moe":  # Command A+'s: a dense first layer (global, rotated), then 4 of experts (3 sliding)
        config = transformers.Cohere2MoeConfig(
            **{**common, "num_hidden_layers": 5}, intermediate_size=32, prefix_dense_intermediate_size=96,
            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, num_shared_experts=1, first_k_dense_replace=1,
            sliding_window=8, initializer_range=0.2, pad_token_id=0, logit_scale=0.25,
        )  # fmt: skip
        cls = transformers.Cohere2MoeForCausalLM
    elif arch == "cohere2_moe_sigmoid":  # sigmoid routing, RMSNorms, two shared experts summed, every layer experts
        config = transformers.Cohere2MoeConfig(
            **common, intermediate_size=32, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
            num_shared_experts=2, shared_expert_combination_strategy="sum", expert_selection_fn="sigmoid",
            rms_norm_eps=1e-6, sliding_window=8, sliding_window_pattern=2, initializer_range=0.2, pad_token_id=0,
            logit_scale=0.25,
        )  # fmt: skip
        cls = transformers.Cohere2MoeForCausalLM
    elif arch == "phi":  # Phi-2's: 0.4 of each head rotated, attention and MLP in parallel, an LM head with a bias
        config = transformers.PhiConfig(
            **common, intermediate_size=256, partial_rotary_factor=0.4, initializer_range=0.2, pad_token_id=0,
        )  # fmt: skip
        cls = transformers.PhiForCausalLM
    elif (
        arch == "deepseek_v2"
    ):  # MLA (queries through a latent too), YaRN, a dense layer then experts beside shared ones
        config = transformers.DeepseekV2Config(
            **common, intermediate_size=128, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
            first_k_dense_replace=1, routed_scaling_factor=1.5, initializer_range=0.2, pad_token_id=0,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.8,
                             "mscale_all_dim": 0.8, "original_max_position_embeddings": 64},
        )  # fmt: skip
        cls = transformers.DeepseekV2ForCausalLM
    elif arch == "deepseek_v3":  # sigmoid scores with a bias, from the best of 2 groups, renormalized; pairs rotated
        config = transformers.DeepseekV3Config(
            **common, intermediate_size=128, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
            moe_intermediate_size=32, first_k_dense_replace=1, n_group=2, topk_group=1, initializer_range=0.2,
            pad_token_id=0,
        )  # fmt: skip
        cls = transformers.DeepseekV3ForCausalLM
    elif arch == "glm4_moe":  # DeepSeek-V3's routing (the best of 2 groups), a shared expert; qk norms, biases,
        # half of each head rotated (rotate-half)
        config = transformers.Glm4MoeConfig(
            **common, intermediate_size=128, num_key_value_heads=2, head_dim=16, n_routed_experts=8,
            num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1, n_group=2,
            topk_group=1, use_qk_norm=True, attention_bias=True, routed_scaling_factor=1.5, initializer_range=0.2,
            pad_token_id=0,
        )  # fmt: skip
        cls = transformers.Glm4MoeForCausalLM
    elif arch == "ernie4_5_moe":  # softmax scores, chosen with a bias; a shared expert; the first layer dense;
        # every head rotated by adjacent pairs
        config = transformers.Ernie4_5_MoeConfig(
            **common, intermediate_size=128, num_key_value_heads=2, moe_num_experts=8, moe_k=2,
            moe_num_shared_experts=1, moe_intermediate_size=32, moe_layer_start_index=1, initializer_range=0.2,
        )  # fmt: skip
        cls = transformers.Ernie4_5_MoeForCausalLM
    elif arch == "apertus":  # query/key norms, a two-matrix xIELU MLP, Llama 3's rope scaling
        config = transformers.ApertusConfig(
            **common, intermediate_size=128, num_key_value_heads=2, initializer_range=0.2, pad_token_id=0,
            bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        )  # fmt: skip
        cls = transformers.ApertusForCausalLM
    elif arch == "hunyuan_moe":  # Hunyuan's layers, 8 experts (2 a token) beside a shared one; NTK alpha 1000
        config = transformers.HunYuanMoEV1Config(
            **common, intermediate_size=48, num_key_value_heads=2, head_dim=16, num_experts=8, moe_topk=2,
            initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "rope_theta": 10000.0, "factor": 1.0},
        )  # fmt: skip
        cls = transformers.HunYuanMoEV1ForCausalLM
    elif arch == "hunyuan":  # query and key heads normalized after the rotary embedding; NTK alpha 1000 on the base
        config = transformers.HunYuanDenseV1Config(
            **common, intermediate_size=128, num_key_value_heads=2, head_dim=16, initializer_range=0.2,
            rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "rope_theta": 10000.0, "factor": 1.0},
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        cls = transformers.HunYuanDenseV1ForCausalLM
    elif arch == "granitemoe":  # Granite's scales; 4 experts, 2 a token, stored stacked (input_linear, output_linear)
        config = transformers.GraniteMoeConfig(
            **common, intermediate_size=32, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
            embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=4.0,
            initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        cls = transformers.GraniteMoeForCausalLM
    elif arch in ("granitemoehybrid", "granitemoehybrid_moe"):
        # Granite 4.0 Micro's outline: Granite's scales, attention layers only, rope, a shared MLP (of its own size,
        # not intermediate_size's); the MoE one's 4 experts beside it, NoPE (the 4.0-H models' position embedding)
        experts = 4 if arch == "granitemoehybrid_moe" else 0
        config = transformers.GraniteMoeHybridConfig(
            **common, intermediate_size=32, shared_intermediate_size=48, num_key_value_heads=2,
            num_local_experts=experts, num_experts_per_tok=2 if experts else 0, layer_types=["attention"] * 2,
            position_embedding_type=None if experts else "rope", embedding_multiplier=12.0, residual_multiplier=0.22,
            attention_multiplier=0.0625, logits_scaling=4.0, initializer_range=0.2, pad_token_id=0, bos_token_id=1,
            eos_token_id=2,
        )  # fmt: skip
        cls = transformers.GraniteMoeHybridForCausalLM
    elif arch == "granite_4_h":  # Granite 4.0-H's outline: Mamba-2 layers around an attention one, NoPE, experts
        config = transformers.GraniteMoeHybridConfig(
            **{**common, "num_hidden_layers": 3}, intermediate_size=32, shared_intermediate_size=48,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
            layer_types=["mamba", "attention", "mamba"], position_embedding_type=None, mamba_n_heads=8,
            mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=8, embedding_multiplier=12.0,
            residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=4.0, initializer_range=0.2,
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        cls = transformers.GraniteMoeHybridForCausalLM
    elif arch in ("nemotron_h", "nemotron_h_moe"):
        # Nemotron Nano 2's outline: Mamba-2, MLP and attention blocks, no position embedding; Nemotron 3 Nano's:
        # experts' blocks in the MLPs' places (8 experts, 2 a token from the best of 2 groups, a shared one)
        mlp = "moe" if arch == "nemotron_h_moe" else "mlp"
        config = transformers.NemotronHConfig(
            **{k: v for k, v in common.items() if k != "num_hidden_layers"}, intermediate_size=128,
            num_key_value_heads=2, head_dim=16,
            layers_block_type=["linear_attention", mlp, "full_attention", mlp, "linear_attention"],
            mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, chunk_size=8, initializer_range=0.2,
            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
            n_group=2, topk_group=1, routed_scaling_factor=2.5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        cls = transformers.NemotronHForCausalLM
    elif arch in ("falcon_h1", "falcon_h1_norm"):
        # Falcon-H1's outline: a Mamba-2 mixer beside each attention, every muP multiplier away from 1; its mixers'
        # output only gated (its default), or RMS-normalized by group before the gate
        config = transformers.FalconH1Config(
            **common, intermediate_size=128, num_key_value_heads=2, head_dim=16, mamba_d_ssm=128, mamba_n_heads=8,
            mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=8,
            mamba_rms_norm=arch == "falcon_h1_norm", mamba_norm_before_gate=True, attention_in_multiplier=0.8,
            key_multiplier=1.3, attention_out_multiplier=0.7, ssm_in_multiplier=1.2, ssm_out_multiplier=0.9,
            ssm_multipliers=[0.5, 1.5, 0.8, 1.1, 0.7], mlp_multipliers=[1.2, 0.8], embedding_multiplier=2.0,
            lm_head_multiplier=0.5, initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        cls = transformers.FalconH1ForCausalLM
    elif arch == "lfm2":  # LFM2's outline: short convolutions around an attention layer (biases, its option)
        config = transformers.Lfm2Config(
            **{**common, "num_hidden_layers": 3}, intermediate_size=96, block_multiple_of=32, num_key_value_heads=2,
            layer_types=["conv", "full_attention", "conv"], conv_bias=True, initializer_range=0.2, pad_token_id=0,
            bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        cls = transformers.Lfm2ForCausalLM
    elif arch == "lfm3":  # LFM3's outline: convolutions of 7 taps, a sliding layer (window 8), a full one
        config = transformers.Lfm3Config(
            **{**common, "num_hidden_layers": 4}, intermediate_size=96, num_key_value_heads=2, head_dim=16,
            layer_types=["conv", "sliding_attention", "full_attention", "conv"], sliding_window=8,
            initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        cls = transformers.Lfm3ForCausalLM
    elif arch == "lfm2_moe":  # LFM2-8B-A1B's outline: a dense MLP, then 8 experts (2 a token, scaled by 2)
        config = transformers.Lfm2MoeConfig(
            **{**common, "num_hidden_layers": 3}, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
            num_experts_per_tok=2, num_dense_layers=1, routed_scaling_factor=2.0, num_key_value_heads=2,
            layer_types=["conv", "full_attention", "conv"], initializer_range=0.2, pad_token_id=0, bos_token_id=1,
            eos_token_id=2,
        )  # fmt: skip
        cls = transformers.Lfm2MoeForCausalLM
    elif arch in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        # Qwen3-Next's and Qwen3.5's outline: gated DeltaNets (2 query/key heads of 8, 4 value heads of 12) around a
        # gated attention layer; Qwen3-Next's first MLP dense, then 8 experts (2 a token) beside a gated shared one. No
        # pad token: token 0's embedding not zeros (the decode graphs' padding rows run it: test_mamba.py)
        sizes = dict(
            **{**common, "num_hidden_layers": 3}, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
            layer_types=["linear_attention", "full_attention", "linear_attention"], initializer_range=0.2,
            bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        experts = dict(
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48
        )
        if arch == "qwen3_next":
            config = transformers.Qwen3NextConfig(**sizes, **experts, intermediate_size=96, mlp_only_layers=[0])
            cls = transformers.Qwen3NextForCausalLM
        elif arch == "qwen3_5":
            config = transformers.Qwen3_5TextConfig(**sizes, intermediate_size=96)
            cls = transformers.Qwen3_5ForCausalLM
        else:
            config = transformers.Qwen3_5MoeTextConfig(**sizes, **experts)
            cls = transformers.Qwen3_5MoeForCausalLM
    elif arch in ("granitemoeshared", "granitemoe_swa"):
        # Granite MoE's experts (8, 2 a token) beside an ungated shared MLP; Granite Swash's attention too: a window of
        # 8 in three layers of four, each head a sink, one rope base
        sizes = dict(
            **common, intermediate_size=32, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
            shared_intermediate_size=48, embedding_multiplier=2.0, residual_multiplier=0.8, attention_multiplier=0.2,
            logits_scaling=1.5, initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        if arch == "granitemoeshared":
            config, cls = transformers.GraniteMoeSharedConfig(**sizes), transformers.GraniteMoeSharedForCausalLM
        else:
            config = transformers.GraniteMoeSWAConfig(
                **{**sizes, "num_hidden_layers": 4}, sliding_window=8,
                layer_types=["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"],
            )  # fmt: skip
            cls = transformers.GraniteMoeSWAForCausalLM
    elif arch == "exaone_moe":  # K-EXAONE's outline: EXAONE 4's attention (3 sliding, 1 global), a dense MLP, experts
        config = transformers.ExaoneMoeConfig(
            **{**common, "num_hidden_layers": 4}, intermediate_size=96, num_key_value_heads=2, sliding_window=8,
            moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, num_shared_experts=1,
            initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )  # fmt: skip
        cls = transformers.ExaoneMoeForCausalLM
    elif arch in ("exaone", "internlm3", "iquestcoder"):  # transformers' Llama under their configs
        sizes = dict(**common, intermediate_size=128, num_key_value_heads=2, head_dim=16, initializer_range=0.2)
        if arch == "exaone":
            config = transformers.ExaoneConfig(**sizes)
        elif arch == "internlm3":  # (biases everywhere; its dynamic NTK rope, plain within the context)
            config = transformers.InternLM3Config(
                **sizes, qkv_bias=True, bias=True, rope_parameters={"rope_type": "dynamic", "factor": 6.0,
                                                                    "rope_theta": 50_000_000.0},
            )  # fmt: skip
        else:
            config = transformers.IQuestCoderConfig(**sizes)
        cls = transformers.LlamaForCausalLM
    elif (
        arch == "solar_open"
    ):  # Solar Open's outline: Llama's attention (q/k/v biases), every MLP experts (8, 2 a token)
        config = transformers.SolarOpenConfig(
            **common, num_key_value_heads=2, head_dim=16, moe_intermediate_size=16, n_routed_experts=8,
            num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.0,
            attention_bias=True, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )  # fmt: skip
        cls = transformers.SolarOpenForCausalLM
    elif arch == "hyperclovax":  # Granite's scales (logits multiplied), each part's output normalized
        config = transformers.HyperCLOVAXConfig(
            **common, intermediate_size=128, num_key_value_heads=2, embedding_multiplier=2.0, residual_multiplier=0.8,
            logits_scaling=0.5, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )  # fmt: skip
        cls = transformers.HyperCLOVAXForCausalLM
    elif arch == "vaultgemma":  # Gemma 2's layers without their outputs' norms: a sliding layer (8), a global one
        config = transformers.VaultGemmaConfig(
            **common, intermediate_size=128, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
            sliding_window=8, attn_logit_softcapping=2.0, final_logit_softcapping=5.0, initializer_range=0.2,
        )  # fmt: skip
        cls = transformers.VaultGemmaForCausalLM
    elif arch == "jais2":  # Jais 2's outline: LayerNorms, a squared-ReLU MLP of two matrices, biases everywhere
        config = transformers.Jais2Config(
            **common, intermediate_size=128, num_key_value_heads=2, head_dim=16, initializer_range=0.2,
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )  # fmt: skip
        cls = transformers.Jais2ForCausalLM
    elif arch == "cwm":  # CWM's outline: the first layer of four full, the others sliding (8), Llama 3's rope
        config = transformers.CwmConfig(
            **{**common, "num_hidden_layers": 4}, intermediate_size=128, num_key_value_heads=2, head_dim=16,
            sliding_window=8, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            rope_parameters={"rope_type": "llama3", "rope_theta": 1e6, "factor": 16.0, "high_freq_factor": 4.0,
                             "low_freq_factor": 1.0, "original_max_position_embeddings": 16},
        )  # fmt: skip
        cls = transformers.CwmForCausalLM
    elif arch == "minicpm3":  # MiniCPM3's outline: DeepSeek-V2's MLA (rope by halves), dense MLPs, its three scales
        config = transformers.MiniCPM3Config(
            **common, intermediate_size=96, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24,
            qk_nope_head_dim=8, qk_rope_head_dim=8, scale_emb=3.0, scale_depth=3.0, dim_model_base=16,
            initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )  # fmt: skip
        cls = transformers.MiniCPM3ForCausalLM
    elif arch in ("falcon", "falcon_40b", "falcon_11b", "falcon_rw", "falcon_rw_alibi"):
        # Falcon 7B's outline (one KV head, one norm); 40B's and 180B's (2 KV heads, a norm before each part); Falcon
        # 2 11B's (2 KV heads, one norm); Falcon-RW's (every head's KV, not in parallel, biases), rotary or ALiBi
        options = {
            "falcon": dict(multi_query=True),
            "falcon_40b": dict(new_decoder_architecture=True, num_kv_heads=2),
            "falcon_11b": dict(new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1),
            "falcon_rw": dict(multi_query=False, parallel_attn=False, bias=True),
            "falcon_rw_alibi": dict(multi_query=False, parallel_attn=False, bias=True, alibi=True),
        }[arch]
        config = transformers.FalconConfig(
            **common, **options, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0
        )
        cls = transformers.FalconForCausalLM
    elif arch in ("bloom", "bloom_6_heads"):  # BLOOM's layers: ALiBi, 4 heads (slopes 2^-2h) or 6 (2^-8h/4, then odd)
        config = transformers.BloomConfig(
            vocab_size=VOCAB, hidden_size=64 if arch == "bloom" else 48, n_layer=2, n_head=4 if arch == "bloom" else 6,
            initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )  # fmt: skip
        cls = transformers.BloomForCausalLM
    elif arch in ("mpt", "mpt_6_heads"):  # MPT-7B's layers: ALiBi, 4 heads (slopes 2^-2h) or 6 (of 8's, odd first)
        six = arch == "mpt_6_heads"  # (its Q/K/V clamped, its scores scaled otherwise)
        config = transformers.MptConfig(
            vocab_size=VOCAB, d_model=48 if six else 64, n_layers=2, n_heads=6 if six else 4, max_seq_len=256,
            attn_config={"clip_qkv": 0.5, "softmax_scale": 0.2} if six else {}, initializer_range=0.2,
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )  # fmt: skip
        cls = transformers.MptForCausalLM
    elif arch in ("gpt_bigcode", "gpt_bigcode_mha"):  # StarCoder 1's layers: one KV head (multi_query), or all
        config = transformers.GPTBigCodeConfig(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, initializer_range=0.2,
            multi_query=arch == "gpt_bigcode", bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )  # fmt: skip
        cls = transformers.GPTBigCodeForCausalLM
    elif arch == "jamba":
        # Jamba's outline: Mamba's mixers (16 channels of 2 x 64, 8 states each) around an attention layer without rope,
        # every other MLP experts (4, 2 a token)
        config = transformers.JambaConfig(
            **{**common, "num_hidden_layers": 4}, intermediate_size=64, num_key_value_heads=2, num_experts=4,
            num_experts_per_tok=2, attn_layer_period=4, attn_layer_offset=1, mamba_d_state=8, mamba_dt_rank=8,
            initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        cls = transformers.JambaForCausalLM
    elif arch in ("mamba", "falcon_mamba"):
        # Mamba's outline, no attention: 128 channels (2 x 64) of 8 states each, a step of rank 8; Falcon Mamba's with
        # its step, B and C RMS-normalized (no weights)
        cls = transformers.MambaForCausalLM if arch == "mamba" else transformers.FalconMambaForCausalLM
        config = (transformers.MambaConfig if arch == "mamba" else transformers.FalconMambaConfig)(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, state_size=8, time_step_rank=8, use_bias=True,
            initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
    elif arch == "mamba2":  # Mamba-2's: 8 heads of 16 in 2 groups, 16 states, chunks of 8, an untied LM head
        config = transformers.Mamba2Config(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_heads=8, head_dim=16, n_groups=2, state_size=16,
            chunk_size=8, initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        cls = transformers.Mamba2ForCausalLM
    elif arch == "afmoe":
        # Trinity's outline: norms around each part, three layers of four sliding (8) and rotated, gated heads, a
        # dense first MLP then experts (8, 2, scaled by 2) beside a shared one, the embeddings scaled (mup)
        config = transformers.AfmoeConfig(
            **{**common, "num_hidden_layers": 4}, intermediate_size=96, num_key_value_heads=2, head_dim=16,
            moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, num_shared_experts=1, route_scale=2.0,
            sliding_window=8, mup_enabled=True, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )  # fmt: skip
        cls = transformers.AfmoeForCausalLM
    elif arch == "hy_v3":
        # Hunyuan 3's outline: query/key norms, a dense first MLP, then experts (8, 2) beside a shared one
        config = transformers.HYV3Config(
            **{**common, "num_hidden_layers": 3}, intermediate_size=96, num_key_value_heads=2, head_dim=16,
            moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, num_shared_experts=1,
            initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )  # fmt: skip
        cls = transformers.HYV3ForCausalLM
    elif (
        arch == "youtu"
    ):  # Youtu-LLM's outline: DeepSeek-V3's MLA (q through a latent, rope by adjacent pairs), dense MLPs
        config = transformers.YoutuConfig(
            **common, intermediate_size=96, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=8, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )  # fmt: skip
        cls = transformers.YoutuForCausalLM
    elif arch == "sarvam_moe":  # Sarvam's outline: GLM-4.5's layers with norms, whole heads rotated, experts (8, 2)
        config = transformers.SarvamMoEConfig(
            **{**common, "num_hidden_layers": 3}, intermediate_size=96, num_key_value_heads=2, head_dim=16,
            moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
            use_qkv_bias=True, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )  # fmt: skip
        cls = transformers.Glm4MoeForCausalLM
    elif arch == "phimoe":
        # Phi-3.5-MoE's outline: LayerNorms, biases (its LM head's too), 4 experts routed by SparseMixer, its margin
        # wide enough (0.3) that the softmax of each choice counts more than one logit
        config = transformers.PhimoeConfig(
            **common, intermediate_size=32, num_key_value_heads=2, num_local_experts=4, router_jitter_noise=0.3,
            attention_bias=True, lm_head_bias=True, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        cls = transformers.PhimoeForCausalLM
    elif arch == "dots1":
        # dots.llm1's outline: Qwen3's attention, a dense first MLP, then experts (8, 2 a token, V3's sigmoid routing in
        # 2 groups) beside a shared one; the last layer sliding (8) from max_window_layers
        config = transformers.Dots1Config(
            **{**common, "num_hidden_layers": 3}, intermediate_size=96, num_key_value_heads=2, head_dim=16,
            moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
            first_k_dense_replace=1, n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
            sliding_window=8, max_window_layers=2, initializer_range=0.2, pad_token_id=0, bos_token_id=1,
            eos_token_id=2,
        )  # fmt: skip
        cls = transformers.Dots1ForCausalLM
    elif arch == "ministral":  # Ministral 8B's outline: layers sliding (8) and full as layer_types says
        config = transformers.MinistralConfig(
            **{**common, "num_hidden_layers": 3}, intermediate_size=128, num_key_value_heads=2, head_dim=16,
            sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            initializer_range=0.2,
        )  # fmt: skip
        cls = transformers.MinistralForCausalLM
    elif arch == "helium":  # rotated by adjacent pairs, q/k/v biases
        config = transformers.HeliumConfig(
            **common, intermediate_size=128, num_key_value_heads=2, head_dim=16, attention_bias=True,
            initializer_range=0.2,
        )  # fmt: skip
        cls = transformers.HeliumForCausalLM
    elif arch in ("llama4", "llama4_maverick"):
        # Llama 4's outline: three layers of four rotated (adjacent pairs) and chunked (chunks of 8: most prompts span
        # several), the fourth unrotated, its queries scaled past position 2 (floor_scale 4); Scout's: every MLP experts
        # (4, 1 a token) beside a shared one, queries and keys normalized; Maverick's: every other MLP dense, no norms
        # (and 2 experts a token here, where Maverick routes to 1)
        maverick = arch == "llama4_maverick"
        config = transformers.Llama4TextConfig(
            **{**common, "num_hidden_layers": 4}, num_key_value_heads=2, head_dim=16, intermediate_size=48,
            intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=2 if maverick else 1,
            interleave_moe_layer_step=2 if maverick else 1, use_qk_norm=not maverick, attention_chunk_size=8,
            floor_scale=4, attn_scale=0.5, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
            "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
            initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        cls = transformers.Llama4ForCausalLM
    elif arch == "kimi_linear":  # Kimi Linear's outline: KDA layers around an MLA one (no rope), a dense MLP, experts
        config = transformers.KimiLinearConfig(
            **{**common, "num_hidden_layers": 3}, intermediate_size=96, moe_intermediate_size=16, num_local_experts=8,
            num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=8, linear_head_dim=16, linear_num_heads=2,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            mlp_layer_types=["dense", "sparse", "sparse"], initializer_range=0.2, pad_token_id=None, bos_token_id=1,
            eos_token_id=2,
        )  # fmt: skip
        cls = transformers.KimiLinearForCausalLM
    elif arch == "olmo_hybrid":  # OLMo Hybrid's outline: gated DeltaNets around an OLMo 3 attention layer, no rope
        config = transformers.OlmoHybridConfig(
            **{**common, "num_hidden_layers": 3}, intermediate_size=96, num_key_value_heads=2, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12, rope_theta=None,
            layer_types=["linear_attention", "full_attention", "linear_attention"], initializer_range=0.2,
            pad_token_id=None, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        cls = transformers.OlmoHybridForCausalLM
    elif arch == "bamba":  # Bamba 9B's outline: attention in one layer of three, Mamba-2 in the others, half rotary
        config = transformers.BambaConfig(
            **{**common, "num_hidden_layers": 3}, intermediate_size=128, num_key_value_heads=2, attn_layer_indices=[1],
            mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=8, initializer_range=0.2,
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        cls = transformers.BambaForCausalLM
    elif arch == "stablelm":  # StableLM 2 1.6B's: a quarter of each head rotated, q/k/v biases, LayerNorms
        config = transformers.StableLmConfig(
            **common, intermediate_size=128, num_key_value_heads=2, use_qkv_bias=True, initializer_range=0.2,
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        cls = transformers.StableLmForCausalLM
    elif arch == "olmo":  # OLMo 1: LayerNorms without weights, q/k/v clamped at 0.5 (it bites)
        config = transformers.OlmoConfig(
            **common, intermediate_size=128, num_key_value_heads=2, clip_qkv=0.5, initializer_range=0.2,
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        cls = transformers.OlmoForCausalLM
    elif arch in (
        "nemotron",
        "arcee",
    ):  # squared-ReLU MLPs; Nemotron's LayerNorms of 1 + weight, half of each head turned
        cls = transformers.NemotronForCausalLM if arch == "nemotron" else transformers.ArceeForCausalLM
        config = (transformers.NemotronConfig if arch == "nemotron" else transformers.ArceeConfig)(
            **common, intermediate_size=128, num_key_value_heads=2, initializer_range=0.2, pad_token_id=0,
            bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
    elif arch == "gemma":  # Gemma 1: Llama's layers with Gemma's norms and MLP, the embeddings scaled
        config = transformers.GemmaConfig(
            **common, intermediate_size=128, num_key_value_heads=2, head_dim=16, initializer_range=0.2,
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        cls = transformers.GemmaForCausalLM
    elif arch == "starcoder2":  # every layer's window (8: shorter than most test contexts), GQA, biases
        config = transformers.Starcoder2Config(
            **common, intermediate_size=256, num_key_value_heads=2, sliding_window=8, initializer_range=0.2,
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        cls = transformers.Starcoder2ForCausalLM
    elif arch == "gpt2":  # learned positions, a GELU MLP four times as wide
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, initializer_range=0.2,
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )  # fmt: skip
        cls = transformers.GPT2LMHeadModel
    elif arch == "olmo2":
        config = transformers.Olmo2Config(**common, intermediate_size=128, num_key_value_heads=2, initializer_range=0.2)
        cls = transformers.Olmo2ForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common, intermediate_size=128, num_key_value_heads=2, initializer_range=0.2)
        cls = transformers.Qwen2ForCausalLM
    else:
        config = transformers.OPTConfig(**common, ffn_dim=128, word_embed_proj_dim=64, init_std=0.2)
        cls = transformers.OPTForCausalLM
    torch.manual_seed(SEEDS[arch])
    model = cls(config).eval()
    with torch.no_grad():  # biases and norm weights are 0 / 1 at init: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.2)
            elif name.endswith("sinks"):  # (gpt-oss's: some above the scores, some below)
                p.normal_(0.0, 2.0)
            elif name.endswith("A_log") and arch in DELTA_RULE_ARCHS:  # (decays of 0.7-1 a token: states that last)
                p.copy_(torch.empty_like(p).uniform_(0.02, 0.3).log())
            elif p.ndim == 1:  # Gemma's and Qwen3-Next's norms scale by 1 + weight, 0 at init
                zero_centered = arch.startswith(("gemma", "qwen3_next", "qwen3_5", "vaultgemma")) and name.endswith(
                    "norm.weight"
                )
                p.add_(0.1 * torch.randn_like(p)) if zero_centered else p.mul_(1 + 0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias")):  # (a router's bias, a buffer: 0 at init)
                b.normal_(0.0, 0.5)
    return model


def save_as_the_hub(model, path) -> None:
    """``model.save_pretrained(path)``, its tensors as the Hub's checkpoints hold them: OLMo Hybrid's convolution of
    q, k and v as three tensors of their sizes (transformers 5.24 saves it in three equal thirds, whatever they are,
    and joins them back as it loads)."""
    model.save_pretrained(path)
    if model.config.model_type != "olmo_hybrid":
        return
    import safetensors.torch

    file = f"{path}/model.safetensors"
    weights = safetensors.torch.load_file(file)
    key_dim = model.config.linear_num_key_heads * model.config.linear_key_head_dim
    for prefix in {key.removesuffix("q_conv1d.weight") for key in weights if key.endswith(".q_conv1d.weight")}:
        names = [f"{prefix}{part}_conv1d.weight" for part in "qkv"]
        joined = torch.cat([weights.pop(name) for name in names])
        sizes = (key_dim, key_dim, joined.shape[0] - 2 * key_dim)
        weights.update(zip(names, (part.contiguous() for part in joined.split(sizes)), strict=True))
    safetensors.torch.save_file(weights, file, metadata={"format": "pt"})


def greedy(model, ids: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy continuation of ``ids`` by ``model``: ``num_tokens`` tokens, EOS or not."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False)
    return out[0, len(ids) :].tolist()


def prompt_logprobs(model, ids: list[int]) -> list[float]:
    """transformers' log-probability of each token of ``ids`` after the first, given those before it."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


@functools.cache
def hf_cached(arch: str):
    """``hf_model(arch)``, made once (read-only)."""
    return hf_model(arch)


@functools.cache
def hf_greedy(arch: str, prompt: tuple[int, ...], num_tokens: int) -> list[int]:
    """``greedy_past_eos`` by ``hf_cached(arch)``, each prompt's once (``greedy_by_full_forwards`` for the models
    whose ``generate`` parts from their own forward passes: ``BY_FULL_FORWARDS``)."""
    if arch in BY_FULL_FORWARDS:
        return greedy_by_full_forwards(arch, list(prompt), num_tokens)
    return greedy_past_eos(hf_cached(arch), list(prompt), num_tokens)


# NOTE: transformers 5.24's generate for Jamba parts from its own forward passes on a 5-token prompt (its cached
# prefill and decode steps, called directly, agree with the whole-sequence passes and the engine)
BY_FULL_FORWARDS = ("jamba",)


def greedy_by_full_forwards(arch, ids: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy continuation of ``ids`` by the model ``arch`` names (or that model), each token from a
    forward pass over the whole sequence (no cache): greedy decoding by its definition. NOTE: transformers 5.24's
    ``generate`` for LFM2 parts from it on prompts of 33 tokens and more (the same model's cached steps agree given
    the positions)."""
    model, ids = hf_cached(arch) if isinstance(arch, str) else arch, list(ids)
    with torch.no_grad():
        for _ in range(num_tokens):
            ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(ids) - num_tokens :]


def greedy_past_eos(model, ids: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy continuation of ``ids`` by ``model`` with EOS a token like any other (it neither ends
    the run nor is held back: the engine's ``ignore_eos``), ``num_tokens`` tokens."""
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False,
        eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    return out[0, len(ids) :].tolist()


def reference(arch: str) -> list[list[int]]:
    """transformers' greedy tokens of each of ``PROMPTS``."""
    return [hf_greedy(arch, tuple(p), n) for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]


def greedy_tokens(path: str, scheduler: str, **kwargs):
    """(the engine's greedy tokens of each of ``PROMPTS``, EOS ignored, the ``LLM``) of the model at ``path``."""
    from sloserve import LLM, SamplingParams

    llm = LLM(path, scheduler, **kwargs)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [o.outputs[0].token_ids for o in outputs], llm
