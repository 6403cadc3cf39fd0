"""Granite 4.0-H GGUF files written here (``gguf.GGUFWriter``) from tiny random transformers models and a trained BPE
tokenizer, as llama.cpp's converter lays them out: architecture ``granitehybrid``, ``attention.head_count_kv`` a
count a layer (0 where a Mamba-2 mixer mixes), the mixers' ``ssm.*`` keys (their heads ``ssm.time_step_rank``),
Granite's scales, a context of 2**20 (no position embedding), the attention's Q and K rows permuted (Llama's
converter), A stored as -exp(A_log), A and D as (heads, 1), the gated norm by group, the experts stacked beside the
shared MLP (``*_shexp``), or the shared MLP as the dense one. transformers does not read these files: the engine
gives the greedy tokens and prompt log-probabilities of the models they were written from."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from gguf_files import (  # noqa: E402
    add_bpe_tokenizer,
    assert_gives_the_outputs_of,
    mamba2_gguf_tensor,
    permute,
    varied_,
    write_gguf_tensors,
)

from sloserve import LLM  # noqa: E402
from sloserve.checkpoint.model_config import MAMBA  # noqa: E402
from sloserve.core.errors import ConfigError  # noqa: E402

LAYER_TYPES = ["mamba", "attention", "mamba", "mamba"]
# transformers' names of a layer's tensors -> llama.cpp's (the MLP's: by whether the model has experts)
NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "block_sparse_moe.router.weight": "ffn_gate_inp.weight", "block_sparse_moe.experts.down_proj": "ffn_down_exps.weight",
}  # fmt: skip


def tiny_granite(vocab_size: int, num_experts: int):
    """A random Granite 4.0-H: Mamba-2 layers (8 heads of 16 in 2 groups) around one attention layer, no position
    embedding, Granite's scales; 4 experts beside the shared MLP, or none (the shared MLP the dense one)."""
    torch.manual_seed(31 + num_experts)
    config = transformers.GraniteMoeHybridConfig(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=len(LAYER_TYPES), num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=32, shared_intermediate_size=48, num_local_experts=num_experts,
        num_experts_per_tok=2, layer_types=LAYER_TYPES, position_embedding_type=None, mamba_n_heads=8,
        mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=8, embedding_multiplier=12.0, residual_multiplier=0.22,
        attention_multiplier=0.0625, logits_scaling=4.0, initializer_range=0.2, max_position_embeddings=4096,
        pad_token_id=None, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return varied_(transformers.GraniteMoeHybridForCausalLM(config))


def write_granite_gguf(path, model, tokenizer, rope: bool = False) -> None:
    """``model`` as llama.cpp's Granite hybrid converter writes it (``rope``: its flag of a rotary embedding)."""
    c = model.config
    layers = c.num_hidden_layers
    writer = gguf.GGUFWriter(str(path), "granitehybrid")
    writer.add_context_length(2**20)  # (the converter's, without a rotary embedding)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv([c.num_key_value_heads if kind == "attention" else 0 for kind in LAYER_TYPES])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_expert_count(c.num_local_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    writer.add_vocab_size(c.vocab_size)
    writer.add_attention_scale(c.attention_multiplier)
    writer.add_embedding_scale(c.embedding_multiplier)
    writer.add_residual_scale(c.residual_multiplier)
    writer.add_logit_scale(c.logits_scaling)
    writer.add_expert_shared_feed_forward_length(c.shared_intermediate_size)
    writer.add_ssm_conv_kernel(c.mamba_d_conv)
    writer.add_ssm_state_size(c.mamba_d_state)
    writer.add_ssm_group_count(c.mamba_n_groups)
    writer.add_ssm_inner_size(c.mamba_expand * c.hidden_size)
    writer.add_ssm_time_step_rank(c.mamba_n_heads)
    writer.add_rope_scaling_finetuned(rope)
    add_bpe_tokenizer(writer, tokenizer)
    shexp = "_shexp" if c.num_local_experts else ""
    state = {name: tensor.float() for name, tensor in model.state_dict().items()}
    tensors = {
        "token_embd.weight": state.pop("model.embed_tokens.weight"),
        "output_norm.weight": state.pop("model.norm.weight"),
        "output.weight": state.pop("lm_head.weight"),
    }
    for name, tensor in state.items():
        n, part = name.removeprefix("model.layers.").split(".", 1)
        if part == "shared_mlp.input_linear.weight":  # (gate rows, then up rows)
            gate, up = tensor.chunk(2)
            tensors.update({f"blk.{n}.ffn_gate{shexp}.weight": gate, f"blk.{n}.ffn_up{shexp}.weight": up})
        elif part == "shared_mlp.output_linear.weight":
            tensors[f"blk.{n}.ffn_down{shexp}.weight"] = tensor
        elif part == "block_sparse_moe.experts.gate_up_proj":  # (E, 2 I, H): gate rows, then up rows
            gate, up = tensor.chunk(2, dim=1)
            tensors.update({f"blk.{n}.ffn_gate_exps.weight": gate, f"blk.{n}.ffn_up_exps.weight": up})
        elif part.startswith("mamba."):
            gguf_name, tensor = mamba2_gguf_tensor(part.removeprefix("mamba."), tensor, c.mamba_n_groups)
            tensors[f"blk.{n}.{gguf_name}"] = tensor
        else:
            if part in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
                heads = c.num_attention_heads if "q_proj" in part else c.num_key_value_heads
                tensor = torch.from_numpy(permute(tensor.numpy(), heads))
            tensors[f"blk.{n}.{NAMES[part]}"] = tensor
    write_gguf_tensors(writer, tensors)


@pytest.mark.parametrize("num_experts", [4, 0])
def test_a_granite_4_h_gguf_file_gives_the_greedy_tokens_and_logprobs_of_its_model(
    num_experts, bpe_tokenizer, tmp_path
):
    model = tiny_granite(bpe_tokenizer.get_vocab_size(), num_experts)
    path = tmp_path / "tiny-granite-4-h.gguf"
    write_granite_gguf(path, model, bpe_tokenizer)
    llm = LLM(str(path), kv_capacity_tokens=1024)
    config = llm.loaded.config
    assert config.model_type == "granitemoehybrid" and config.layer_types == (MAMBA, "full_attention", MAMBA, MAMBA)
    assert not any(config.rotary_layers) and config.max_position_embeddings == 2**20
    assert (config.embedding_multiplier, config.logits_scaling) == (12.0, 4.0)
    assert config.is_moe == bool(num_experts) and config.mamba["n_heads"] == 8 and config.mamba["head_dim"] == 16
    assert assert_gives_the_outputs_of(llm, model, bpe_tokenizer, path).kv_layers == 1


def test_a_granite_hybrid_gguf_file_that_rotates_is_refused_by_name(bpe_tokenizer, tmp_path):
    model = tiny_granite(bpe_tokenizer.get_vocab_size(), 0)
    write_granite_gguf(tmp_path / "bamba.gguf", model, bpe_tokenizer, rope=True)
    with pytest.raises(ConfigError, match="granitehybrid.rope.scaling.finetuned \\(a rotary embedding: Bamba's\\)"):
        LLM(str(tmp_path / "bamba.gguf"), kv_capacity_tokens=1024)
