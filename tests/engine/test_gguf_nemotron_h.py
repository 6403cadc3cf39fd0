"""A Nemotron-H GGUF file written here (``gguf.GGUFWriter``) from a tiny random transformers model and a trained BPE
tokenizer, as llama.cpp's converter lays it out: architecture ``nemotron_h``, each block's kind by
``attention.head_count_kv`` (attention) and ``feed_forward_length`` (an MLP), a count and a length a block (0
elsewhere: a Mamba-2 mixer), the mixers' ``ssm.*`` keys, a context of 2**20, the block norm ``attn_norm``, the
attention's Q and K rows permuted, the mixers' tensors as Mamba-2's. transformers does not read it: the engine gives
the greedy tokens and prompt log-probabilities of the model it was written from, its steps unclamped as llama.cpp
runs them (the file has no time_step_min)."""

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
from sloserve.checkpoint.config import MAMBA, MLP_LAYER  # noqa: E402
from sloserve.core.errors import ConfigError  # noqa: E402

BLOCKS = ["linear_attention", "mlp", "full_attention", "mlp", "linear_attention"]
# transformers' names of an attention or MLP block's mixer tensors -> llama.cpp's
NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output", "up_proj": "ffn_up",
         "down_proj": "ffn_down"}  # fmt: skip


def tiny_nemotron_h(vocab_size: int):
    """A random Nemotron-H: Mamba-2 blocks (8 heads of 16 in 2 groups), MLP blocks and one attention block; the
    mixers' steps unclamped (llama.cpp's)."""
    torch.manual_seed(41)
    config = transformers.NemotronHConfig(
        vocab_size=vocab_size, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, layers_block_type=BLOCKS, mamba_num_heads=8, mamba_head_dim=16, n_groups=2,
        ssm_state_size=16, chunk_size=8, initializer_range=0.2, max_position_embeddings=4096, pad_token_id=None,
        bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    model = varied_(transformers.NemotronHForCausalLM(config))
    for layer in model.model.layers:
        if hasattr(layer.mixer, "time_step_limit"):
            layer.mixer.time_step_limit = (0.0, float("inf"))
    return model


def write_nemotron_h_gguf(path, model, tokenizer, ffn_lengths=None) -> None:
    """``model`` as llama.cpp's Nemotron-H converter writes it (``ffn_lengths``: in place of its own list)."""
    c = model.config
    kinds = c.layers_block_type
    writer = gguf.GGUFWriter(str(path), "nemotron_h")
    writer.add_context_length(2**20)  # (the converter's, without a rotary embedding)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(len(kinds))
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv([c.num_key_value_heads if kind == "full_attention" else 0 for kind in kinds])
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_feed_forward_length(ffn_lengths or [c.intermediate_size if kind == "mlp" else 0 for kind in kinds])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(c.layer_norm_epsilon)
    writer.add_vocab_size(c.vocab_size)
    writer.add_ssm_conv_kernel(c.conv_kernel)
    writer.add_ssm_state_size(c.ssm_state_size)
    writer.add_ssm_group_count(c.n_groups)
    writer.add_ssm_inner_size(c.mamba_num_heads * c.mamba_head_dim)
    writer.add_ssm_time_step_rank(c.mamba_num_heads)
    writer.add_rope_scaling_finetuned(False)
    add_bpe_tokenizer(writer, tokenizer)
    state = {name: tensor.float() for name, tensor in model.state_dict().items()}
    tensors = {
        "token_embd.weight": state.pop("model.embeddings.weight"),
        "output_norm.weight": state.pop("model.norm_f.weight"),
        "output.weight": state.pop("lm_head.weight"),
    }
    for name, tensor in state.items():
        n, part = name.removeprefix("model.layers.").split(".", 1)
        if part == "norm.weight":
            tensors[f"blk.{n}.attn_norm.weight"] = tensor
        elif kinds[int(n)] == "linear_attention":
            gguf_name, tensor = mamba2_gguf_tensor(part.removeprefix("mixer."), tensor, c.n_groups)
            tensors[f"blk.{n}.{gguf_name}"] = tensor
        else:
            projection = part.removeprefix("mixer.").removesuffix(".weight")
            if projection in ("q_proj", "k_proj"):
                heads = c.num_attention_heads if projection == "q_proj" else c.num_key_value_heads
                tensor = torch.from_numpy(permute(tensor.numpy(), heads))
            tensors[f"blk.{n}.{NAMES[projection]}.weight"] = tensor
    write_gguf_tensors(writer, tensors)


def test_a_nemotron_h_gguf_file_gives_the_greedy_tokens_and_logprobs_of_its_model(bpe_tokenizer, tmp_path):
    model = tiny_nemotron_h(bpe_tokenizer.get_vocab_size())
    path = tmp_path / "tiny-nemotron-h.gguf"
    write_nemotron_h_gguf(path, model, bpe_tokenizer)
    llm = LLM(str(path), kv_capacity_tokens=1024)
    config = llm.loaded.config
    assert config.model_type == "nemotron_h" and config.layer_types == (
        MAMBA, MLP_LAYER, "full_attention", MLP_LAYER, MAMBA
    )  # fmt: skip
    assert config.mamba["time_step_limit"] == (0.0, float("inf")) and config.intermediate_size == 128
    assert assert_gives_the_outputs_of(llm, model, bpe_tokenizer, path).kv_layers == 1


def test_a_nemotron_h_gguf_file_whose_mlp_lengths_do_not_fit_its_blocks_is_refused(bpe_tokenizer, tmp_path):
    model = tiny_nemotron_h(bpe_tokenizer.get_vocab_size())
    write_nemotron_h_gguf(tmp_path / "bad.gguf", model, bpe_tokenizer, ffn_lengths=[0, 128, 0])
    with pytest.raises(ConfigError, match="nemotron_h.feed_forward_length must list each of the 5 blocks' MLP length"):
        LLM(str(tmp_path / "bad.gguf"), kv_capacity_tokens=1024)
