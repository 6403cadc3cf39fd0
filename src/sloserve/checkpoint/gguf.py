"""GGUF checkpoints (llama.cpp's single-file format): ``--model PATH.gguf``.

``gguf_file`` reads the file: its metadata gives the config (here), the tokenizer (``gguf_tokenizer``) and the
chat template; its tensors (``gguf_tensors``, their names ``gguf_names``) are dequantized to float32 (by the ``gguf``
package, ``gguf.quants.dequantize``: Q4_0, Q4_1, Q8_0, K-quants... as llama.cpp defines them; on a GPU by the same
arithmetic in torch there, ``gguf_dequant``) and copied into the model under their HF names, so the engine runs the
same weights transformers does when it loads the file (``from_pretrained(gguf_file=...)``).

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
halves); ``gguf_tensors._unpermute`` undoes it, as transformers' GGUF loader does. The others are converted unpermuted (llama.cpp
runs them with NEOX-style RoPE, HF's).
"""

from __future__ import annotations

import functools
import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sloserve.checkpoint.config_values import (
    BOOLEAN,
    COUNT,
    INTEGERS,
    NUMBER,
    NUMBERS,
    POSITIVE_INT,
    STRINGS,
    TEXT,
    check_positive_ints,
)
from sloserve.checkpoint.gguf_file import ELEMENT_DTYPES, GGUFFile, read_gguf_file
from sloserve.checkpoint.gguf_names import ARCH_TENSORS, LONGROPE_FACTORS, QWEN35_ARCHS, ROPE_FREQS
from sloserve.core.errors import ConfigError

# The architectures whose norms are LayerNorms: the HF config's name of their epsilon
LAYER_NORM_EPS_NAMES = {"stablelm": "layer_norm_eps", "starcoder2": "norm_epsilon"}
# The architectures whose rotary embedding may turn part of a head (``rope.dimension_count``)
PARTIAL_ROTARY_ARCHS = ("phi3", "stablelm", *QWEN35_ARCHS)
# The mixtures of experts: GGUF architecture -> HF model_type
GGUF_MOE = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe"}
# SmolLM3's layers without a rotary embedding: every fourth, as llama.cpp's code has it (the file does not say)
SMOLLM3_NO_ROPE_STEP = 4
# What llama.cpp's code says of a Gemma model that its file does not: which layers slide (every
# pattern-th is global), the layer count of the 27B model (its scores are scaled by (hidden / heads)
# ** -0.5, the others' by head_dim ** -0.5), the caps when the file names none (Gemma 2's)
GEMMA_LAYOUT = {
    "gemma2": {"pattern": 2, "layers_27b": 46, "attn_softcap": 50.0, "final_softcap": 30.0},
    "gemma3": {"pattern": 6, "layers_27b": 62, "attn_softcap": None, "final_softcap": None},
}
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
# The special tokens a file may name by id (tokenizer.ggml.{name}_token_id)
SPECIAL_TOKENS = ("bos", "eos", "unknown", "padding")
# The kind of each "{arch}." metadata value the reading takes as it is, checked where the file has it: a value of
# another type would otherwise fail deep in the reading (a TypeError, a division by zero) or be read as another
# (a string's bool() is true). Those of two kinds (a count or one a layer: attention.head_count_kv,
# feed_forward_length, attention.sliding_window_pattern) are checked where they are read.
GGUF_SETTING_KINDS = {
    **{key: POSITIVE_INT for key in (
        "embedding_length", "block_count", "context_length", "vocab_size", "attention.key_length",
        "attention.value_length", "rope.dimension_count", "expert_feed_forward_length", "shortconv.l_cache",
        "ssm.conv_kernel", "ssm.state_size", "ssm.inner_size", "ssm.time_step_rank",
    )},
    **{key: COUNT for key in (
        "attention.head_count",  # (0 in a model of no attention: Mamba's)
        "attention.sliding_window", "expert_count", "expert_used_count", "expert_shared_feed_forward_length",
        "expert_group_count", "expert_group_used_count", "expert_gating_func", "leading_dense_block_count",
        "full_attention_interval", "nextn_predict_layers", "moe_latent_size", "ssm.group_count",
        "rope.scaling.original_context_length",
    )},
    **{key: NUMBER for key in (
        "attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon", "rope.freq_base", "rope.freq_base_swa",
        "attention.scale", "embedding_scale", "residual_scale", "logit_scale", "expert_weights_scale",
        "attn_logit_softcapping", "final_logit_softcapping", "rope.scaling.factor", "rope.scaling.attn_factor",
        "rope.scaling.yarn_attn_factor", "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
        "rope.scaling.yarn_ext_factor", "rope.scaling.yarn_log_multiplier",
    )},
    **{key: BOOLEAN for key in (
        "expert_weights_norm", "use_parallel_residual", "ssm.dt_b_c_rms", "rope.scaling.finetuned",
    )},
    "rope.scaling.type": TEXT,
}  # fmt: skip
# ... and of the tokenizer's, the special tokens' ids and the chat template
GGUF_TOKENIZER_KINDS = {
    "tokenizer.ggml.model": TEXT, "tokenizer.ggml.pre": TEXT, "tokenizer.ggml.tokens": STRINGS,
    "tokenizer.ggml.merges": STRINGS, "tokenizer.ggml.scores": NUMBERS, "tokenizer.ggml.token_type": INTEGERS,
    "tokenizer.ggml.add_bos_token": BOOLEAN, "tokenizer.ggml.add_space_prefix": BOOLEAN,
    **{key: COUNT for key in (*END_OF_GENERATION_KEYS, *(f"tokenizer.ggml.{name}_token_id" for name in SPECIAL_TOKENS))},
    "tokenizer.chat_template": TEXT,
}  # fmt: skip


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
        for name in SPECIAL_TOKENS:
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
    if not isinstance(arch, str) or arch not in ARCH_TENSORS:
        raise ConfigError(f"{path}: GGUF architecture {arch!r} is not supported ({', '.join(ARCH_TENSORS)})")
    _check_metadata_kinds(meta, arch, path)
    names = {t.name for t in reader.tensors}
    _check_block_count(meta, arch, names, path)

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in meta:
            raise ConfigError(f"{path}: GGUF metadata has no '{arch}.{key}'")
        return meta[f"{arch}.{key}"]

    vocabulary = _vocabulary(meta, arch, names)
    if arch in ("mamba", "mamba2"):
        return GGUFCheckpoint(path, {**_mamba_config(meta, arch, need, names, path), **vocabulary}, meta, reader)
    config = {**_transformer_config(meta, arch, need, path), **vocabulary}
    config["rope_scaling"] = _rope_scaling(meta, arch, path)
    _add_architecture_fields(config, meta, arch, need, names, reader, path)
    factors = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if factors is not None:
        frequencies = config["head_dim"] // 2
        config["rope_scaling"] = {"rope_type": "frequency_factors",
                                  "factors": _frequency_factors(factors, frequencies, path)}  # fmt: skip
    return GGUFCheckpoint(path, config, meta, reader)


def _vocabulary(meta: dict[str, Any], arch: str, names: set[str]) -> dict[str, Any]:
    """Every architecture's: its vocabulary and special ids, float32 weights, an LM head of its own or the
    embeddings'."""
    tokens = meta.get("tokenizer.ggml.tokens") or []
    eos = {meta[key] for key in END_OF_GENERATION_KEYS if meta.get(key) is not None}
    eos |= {token_id for token_id, token in enumerate(tokens) if token in END_OF_GENERATION_TEXTS}
    return {
        "vocab_size": meta.get(f"{arch}.vocab_size") or len(tokens),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": sorted(eos),
        "torch_dtype": "float32",  # dequantized weights are float32
        "tie_word_embeddings": "output.weight" not in names,
    }


def _transformer_config(meta: dict[str, Any], arch: str, need: Callable[[str], Any], path: Path) -> dict[str, Any]:
    """The shape every architecture with attention has: its width, layers, heads and their width, MLP, context,
    norms' epsilon, rope base and the part of a head it turns."""
    hidden = need("embedding_length")
    heads = need("attention.head_count")
    check_positive_ints(
        {f"{arch}.attention.head_count": heads}, (f"{arch}.attention.head_count",), str(path), "GGUF metadata "
    )
    # (a Qwen3-MoE file may have no dense MLP's length: its every MLP is the experts)
    experts_only = arch in GGUF_MOE or arch in ("gpt-oss", "qwen35moe", "qwen3next")
    dense_mlp = meta.get(f"{arch}.feed_forward_length") if experts_only else need("feed_forward_length")
    config = {
        "model_type": "gemma3_text" if arch == "gemma3" else arch,
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
        if arch not in PARTIAL_ROTARY_ARCHS or int(config["head_dim"] * (rotated / config["head_dim"])) != rotated:
            raise ConfigError(
                f"{path}: GGUF {arch}.rope.dimension_count {rotated} rotates part of a head of {config['head_dim']}; "
                f"partial rotary embeddings are supported for {', '.join(PARTIAL_ROTARY_ARCHS)} only"
            )
        config["partial_rotary_factor"] = rotated / config["head_dim"]
    return config


def _add_architecture_fields(
    config: dict[str, Any],
    meta: dict[str, Any],
    arch: str,
    need: Callable[[str], Any],
    names: set[str],
    reader: GGUFFile,
    path: Path,
) -> None:
    """What ``config`` needs of each architecture besides the shape, as its HF config names it. NOTE: in this order:
    the hybrids read the fields set before them (the KV heads, the MLP's length, the epsilon)."""
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
            rotary_dim = meta.get("phi3.rope.dimension_count") or config["head_dim"]
            config["rope_scaling"] = _longrope_scaling(meta, reader, rotary_dim, path)


def _check_metadata_kinds(meta: dict[str, Any], arch: str, path: Path) -> None:
    """A ConfigError naming the first metadata value the reading takes of a kind (``GGUF_SETTING_KINDS``,
    ``GGUF_TOKENIZER_KINDS``) that is not of it; of a vocabulary's list, its first item of another kind."""
    kinds = {**{f"{arch}.{key}": kind for key, kind in GGUF_SETTING_KINDS.items()}, **GGUF_TOKENIZER_KINDS}
    for key, (words, holds) in kinds.items():
        if key not in meta or holds(meta[key]):
            continue
        value = meta[key]
        if isinstance(value, list) and value and kinds[key] in (STRINGS, NUMBERS, INTEGERS):
            index = next(i for i, item in enumerate(value) if not holds([item]))
            raise ConfigError(f"{path}: GGUF metadata {key} must be {words}; item {index} is {value[index]!r}")
        raise ConfigError(f"{path}: GGUF metadata {key} must be {words}, got {value!r}")


def _check_block_count(meta: dict[str, Any], arch: str, names: set[str], path: Path) -> None:
    """A ConfigError where ``block_count`` counts more blocks than the file's tensors hold (``blk.{i}.*``; less the
    multi-token-prediction blocks, which a file may leave out). NOTE: the reading builds lists a layer long: a count of
    10**9 from a corrupt header ran it out of memory. A file of no block's tensors (its metadata alone) is not checked."""
    blocks = [int(name.split(".")[1]) for name in names if re.match(r"blk\.\d+\.", name)]
    count = meta.get(f"{arch}.block_count")
    if blocks and count is not None and count - (meta.get(f"{arch}.nextn_predict_layers") or 0) > max(blocks) + 1:
        raise ConfigError(
            f"{path}: GGUF {arch}.block_count is {count}, but the file's tensors hold blocks 0-{max(blocks)} only"
        )


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
    if not (interval >= 1 and layers >= 1 and key_heads >= 1 and value_heads % key_heads == 0
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
    if inner % hidden:  # (both positive integers: GGUF_SETTING_KINDS)
        raise ConfigError(
            f"{path}: GGUF {arch}.ssm.inner_size {inner!r} must be a multiple of embedding_length {hidden}"
        )
    return inner // hidden


def _mamba2_heads(arch: str, need: Callable[[str], Any], path: Path) -> tuple[int, int]:
    """A Mamba-2 mixer's (heads, their width) from llama.cpp's ``ssm.time_step_rank`` (its heads: a step each) and
    ``ssm.inner_size``."""
    inner, heads = need("ssm.inner_size"), need("ssm.time_step_rank")
    if inner % heads:  # (both positive integers: GGUF_SETTING_KINDS)
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
    if missing or not original:  # (absent or 0; an integer where present: GGUF_SETTING_KINDS)
        raise ConfigError(
            f"{path}: GGUF longrope scaling needs tensors {' and '.join(LONGROPE_FACTORS.values())} and "
            f"phi3.rope.scaling.original_context_length (missing: {', '.join(missing) or 'the context length'})"
        )
    scaling = {key: _frequency_factors(tensors[name], rotary_dim // 2, path) for key, name in LONGROPE_FACTORS.items()}
    # NOTE: llama.cpp scales cos and sin by attn_factor, 1 where the file has none (the converter writes it)
    attention_factor = float(meta.get("phi3.rope.scaling.attn_factor", 1.0))
    return {"rope_type": "longrope", **scaling, "original_max_position_embeddings": original,
            "attention_factor": attention_factor}  # fmt: skip
