"""A Jamba GGUF file written here (``gguf.GGUFWriter``) from a tiny random transformers model and a trained BPE
tokenizer, as llama.cpp's converter lays it out: architecture ``jamba``, the attention layers by
``attention.head_count_kv`` (a count a layer), the experts' by their routers' tensors, Mamba's mixers' ``ssm.*`` keys,
A stored as -exp(A_log), the convolutions (C, taps), the norms of the step, B and C (``ssm_dt_norm``...), the experts
stacked. transformers does not read it: the engine gives the greedy tokens (by whole forward passes:
``hf_models.BY_FULL_FORWARDS``) and prompt log-probabilities of the model it was written from."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from gguf_files import add_bpe_tokenizer, assert_gives_the_outputs_of, varied_, write_gguf_tensors  # noqa: E402

from sloserve import LLM  # noqa: E402
from sloserve.checkpoint.model_config import MAMBA  # noqa: E402
from sloserve.core.errors import ConfigError  # noqa: E402

# transformers' names of a layer's tensors -> llama.cpp's (the experts': stacked, below)
NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "pre_ff_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mamba.in_proj.weight": "ssm_in.weight", "mamba.conv1d.weight": "ssm_conv1d.weight",
    "mamba.conv1d.bias": "ssm_conv1d.bias", "mamba.x_proj.weight": "ssm_x.weight", "mamba.dt_proj.weight": "ssm_dt.weight",
    "mamba.dt_proj.bias": "ssm_dt.bias", "mamba.A_log": "ssm_a", "mamba.D": "ssm_d", "mamba.out_proj.weight": "ssm_out.weight",
    "mamba.dt_layernorm.weight": "ssm_dt_norm.weight", "mamba.b_layernorm.weight": "ssm_b_norm.weight",
    "mamba.c_layernorm.weight": "ssm_c_norm.weight", "feed_forward.gate_proj.weight": "ffn_gate.weight",
    "feed_forward.up_proj.weight": "ffn_up.weight", "feed_forward.down_proj.weight": "ffn_down.weight",
    "feed_forward.router.weight": "ffn_gate_inp.weight", "feed_forward.experts.down_proj": "ffn_down_exps.weight",
}  # fmt: skip


def tiny_jamba(vocab_size: int):
    """A random Jamba: Mamba's mixers (128 channels, 8 states each, a step of rank 8) around an attention layer
    without rope (layer 1 of 4), every other MLP 4 experts (2 a token)."""
    torch.manual_seed(61)
    config = transformers.JambaConfig(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, num_experts=4, num_experts_per_tok=2, attn_layer_period=4, attn_layer_offset=1,
        expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8, mamba_dt_rank=8, initializer_range=0.2,
        max_position_embeddings=256, pad_token_id=None, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return varied_(transformers.JambaForCausalLM(config))


def write_jamba_gguf(path, model, tokenizer, head_count_kv=None) -> None:
    """``model`` as llama.cpp's Jamba converter writes it (``head_count_kv``: in place of its own list)."""
    c = model.config
    kv = [
        c.num_key_value_heads if i % c.attn_layer_period == c.attn_layer_offset else 0
        for i in range(c.num_hidden_layers)
    ]
    writer = gguf.GGUFWriter(str(path), "jamba")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(head_count_kv or kv)
    writer.add_ssm_conv_kernel(c.mamba_d_conv)
    writer.add_ssm_inner_size(c.mamba_expand * c.hidden_size)
    writer.add_ssm_state_size(c.mamba_d_state)
    writer.add_ssm_time_step_rank(c.mamba_dt_rank)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_expert_count(c.num_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    add_bpe_tokenizer(writer, tokenizer)
    state = {name: tensor.float() for name, tensor in model.state_dict().items()}
    tensors = {
        "token_embd.weight": state.pop("model.embed_tokens.weight"),
        "output_norm.weight": state.pop("model.final_layernorm.weight"),
        "output.weight": state.pop("lm_head.weight"),
    }
    for name, tensor in state.items():
        n, part = name.removeprefix("model.layers.").split(".", 1)
        if part == "feed_forward.experts.gate_up_proj":  # (E, 2 I, H): gate rows, then up rows
            gate, up = tensor.chunk(2, dim=1)
            tensors.update({f"blk.{n}.ffn_gate_exps.weight": gate, f"blk.{n}.ffn_up_exps.weight": up})
            continue
        if part == "mamba.conv1d.weight":
            tensor = tensor.squeeze(1)
        elif part == "mamba.A_log":
            tensor = -torch.exp(tensor)
        tensors[f"blk.{n}.{NAMES[part]}"] = tensor
    write_gguf_tensors(writer, tensors)


def test_a_jamba_gguf_file_gives_the_greedy_tokens_and_logprobs_of_its_model(bpe_tokenizer, tmp_path):
    model = tiny_jamba(bpe_tokenizer.get_vocab_size())
    path = tmp_path / "tiny-jamba.gguf"
    write_jamba_gguf(path, model, bpe_tokenizer)
    llm = LLM(str(path), kv_capacity_tokens=1024)
    config = llm.loaded.config
    assert config.layer_types == (MAMBA, "full_attention", MAMBA, MAMBA) and not any(config.rotary_layers)
    assert config.moe["moe_layers"] == (False, True, False, True) and config.mamba["dt_bc_norm_weights"]
    spec = assert_gives_the_outputs_of(llm, model, bpe_tokenizer, path, by_full_forwards=True)
    assert (spec.kv_layers, spec.num_experts) == (1, 4)


def test_a_jamba_gguf_file_of_another_layout_is_refused_by_name(bpe_tokenizer, tmp_path):
    model = tiny_jamba(bpe_tokenizer.get_vocab_size())
    write_jamba_gguf(tmp_path / "bad.gguf", model, bpe_tokenizer, head_count_kv=[2, 2, 0, 2])
    with pytest.raises(ConfigError, match="jamba's attention layers \\[0, 1, 3\\] are not every period-th layer"):
        LLM(str(tmp_path / "bad.gguf"), kv_capacity_tokens=1024)
