"""Falcon-H1 GGUF files written here (``gguf.GGUFWriter``) from tiny random transformers models and a trained BPE
tokenizer, as llama.cpp's converter lays them out: architecture ``falcon-h1``, its mixers' ``ssm.*`` keys, every muP
multiplier folded into the weights (attention's input, keys and output, the mixer's input, its in_proj's five parts
and output, the MLP's gate and down, the embeddings and the LM head), the mixers' tensors as Mamba-2's, Q and K
unpermuted (llama.cpp rotates it by halves). transformers does not read them: the engine gives the greedy tokens and
prompt log-probabilities of the models they were written from, their mixers' output only gated (Falcon-H1's
default) or gated then normalized by group (llama.cpp's order; the file does not say)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from gguf_files import (  # noqa: E402
    add_bpe_tokenizer,
    add_model_shape,
    assert_gives_the_outputs_of,
    mamba2_gguf_tensor,
    varied_,
    write_gguf_tensors,
)

from sloserve import LLM  # noqa: E402

# transformers' names of a layer's attention and MLP tensors -> llama.cpp's
NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "pre_ff_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "feed_forward.gate_proj.weight": "ffn_gate.weight", "feed_forward.up_proj.weight": "ffn_up.weight",
    "feed_forward.down_proj.weight": "ffn_down.weight",
}  # fmt: skip


def tiny_falcon_h1(vocab_size: int, rms_norm: bool):
    """A random Falcon-H1: a Mamba-2 mixer (8 heads of 16 in 2 groups) beside each of 2 layers' attention, every muP
    multiplier away from 1; the mixers' output only gated, or gated then RMS-normalized by group."""
    torch.manual_seed(51 + rms_norm)
    config = transformers.FalconH1Config(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, max_position_embeddings=256, mamba_d_ssm=128, mamba_n_heads=8,
        mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=8, mamba_rms_norm=rms_norm,
        mamba_norm_before_gate=False, attention_in_multiplier=0.8, key_multiplier=1.3, attention_out_multiplier=0.7,
        ssm_in_multiplier=1.2, ssm_out_multiplier=0.9, ssm_multipliers=[0.5, 1.5, 0.8, 1.1, 0.7],
        mlp_multipliers=[1.2, 0.8], embedding_multiplier=2.0, lm_head_multiplier=0.5, initializer_range=0.2,
        pad_token_id=None, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return varied_(transformers.FalconH1ForCausalLM(config))


def folded(name: str, tensor: torch.Tensor, c) -> torch.Tensor:
    """``tensor`` with the muP multipliers the converter folds into it."""
    if name.endswith("in_proj.weight"):
        d, bc = c.mamba_d_ssm, c.mamba_n_groups * c.mamba_d_state
        sizes = (d, d, bc, bc, c.mamba_n_heads)
        rows = torch.cat([torch.full((n,), m) for n, m in zip(sizes, c.ssm_multipliers, strict=True)])
        return tensor * c.ssm_in_multiplier * rows[:, None]
    factors = {
        "down_proj": c.mlp_multipliers[1], "gate_proj": c.mlp_multipliers[0],
        "k_proj": c.key_multiplier * c.attention_in_multiplier, "q_proj": c.attention_in_multiplier,
        "v_proj": c.attention_in_multiplier, "o_proj": c.attention_out_multiplier, "out_proj": c.ssm_out_multiplier,
        "lm_head": c.lm_head_multiplier, "embed_tokens": c.embedding_multiplier,
    }  # fmt: skip
    return tensor * next((factor for part, factor in factors.items() if part in name), 1.0)


def write_falcon_h1_gguf(path, model, tokenizer) -> None:
    """``model`` as llama.cpp's Falcon-H1 converter writes it."""
    c = model.config
    writer = gguf.GGUFWriter(str(path), "falcon-h1")
    add_model_shape(writer, c)
    writer.add_vocab_size(c.vocab_size)
    writer.add_ssm_conv_kernel(c.mamba_d_conv)
    writer.add_ssm_inner_size(c.mamba_d_ssm)
    writer.add_ssm_state_size(c.mamba_d_state)
    writer.add_ssm_time_step_rank(c.mamba_d_ssm // c.mamba_d_head)
    writer.add_ssm_group_count(c.mamba_n_groups)
    add_bpe_tokenizer(writer, tokenizer)
    tensors = {}
    for name, tensor in model.state_dict().items():
        tensor = folded(name, tensor.float(), c)
        if name == "model.embed_tokens.weight":
            tensors["token_embd.weight"] = tensor
        elif name == "model.final_layernorm.weight":
            tensors["output_norm.weight"] = tensor
        elif name == "lm_head.weight":
            tensors["output.weight"] = tensor
        else:
            n, part = name.removeprefix("model.layers.").split(".", 1)
            if part.startswith("mamba."):
                part, tensor = mamba2_gguf_tensor(part.removeprefix("mamba."), tensor, c.mamba_n_groups)
                tensors[f"blk.{n}.{part}"] = tensor
            else:
                tensors[f"blk.{n}.{NAMES[part]}"] = tensor
    write_gguf_tensors(writer, tensors)


@pytest.mark.parametrize("rms_norm", [False, True])
def test_a_falcon_h1_gguf_file_gives_the_greedy_tokens_and_logprobs_of_its_model(rms_norm, bpe_tokenizer, tmp_path):
    model = tiny_falcon_h1(bpe_tokenizer.get_vocab_size(), rms_norm)
    path = tmp_path / "tiny-falcon-h1.gguf"
    write_falcon_h1_gguf(path, model, bpe_tokenizer)
    llm = LLM(str(path), kv_capacity_tokens=1024)
    config = llm.loaded.config
    assert config.model_type == "falcon_h1" and config.mamba["rms_norm"] == rms_norm
    assert config.embedding_multiplier == 1.0 and config.logits_scaling == 1.0  # (folded by the converter)
    assert assert_gives_the_outputs_of(llm, model, bpe_tokenizer, path).kv_layers == 2
