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
from sloserve.checkpoint.model_config import MAMBA, MLP_LAYER  # noqa: E402
from sloserve.core.errors import ConfigError  # noqa: E402

BLOCKS = ["linear_attention", "mlp", "full_attention", "mlp", "linear_attention"]
MOE = "moe"
# transformers' names of an attention or MLP block's mixer tensors -> llama.cpp's
NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output", "up_proj": "ffn_up",
         "down_proj": "ffn_down", "gate": "ffn_gate_inp", "shared_experts.up_proj": "ffn_up_shexp",
         "shared_experts.down_proj": "ffn_down_shexp", "experts.up_proj": "ffn_up_exps",
         "experts.down_proj": "ffn_down_exps"}  # fmt: skip


def tiny_nemotron_h(vocab_size: int, experts: bool = False):
    """A random Nemotron-H: Mamba-2 blocks (8 heads of 16 in 2 groups), MLP blocks and one attention block; the
    mixers' steps unclamped (llama.cpp's). With ``experts``, Nemotron 3's: experts' blocks (8, 2 a token from the
    best of 2 groups, scaled by 2.5, their router's bias) in the MLPs' places."""
    torch.manual_seed(41 + experts)
    config = transformers.NemotronHConfig(
        vocab_size=vocab_size, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, layers_block_type=[MOE if kind == "mlp" and experts else kind for kind in BLOCKS],
        mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, chunk_size=8, initializer_range=0.2,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
        n_group=2, topk_group=1, routed_scaling_factor=2.5, max_position_embeddings=4096, pad_token_id=None,
        bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    model = varied_(transformers.NemotronHForCausalLM(config))
    for name, bias in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # (0 at init)
            bias.normal_(0.0, 0.5)
    for layer in model.model.layers:
        if hasattr(layer.mixer, "time_step_limit"):
            layer.mixer.time_step_limit = (0.0, float("inf"))
    return model


def write_nemotron_h_gguf(path, model, tokenizer, ffn_lengths=None) -> None:
    """``model`` as llama.cpp's Nemotron-H converter writes it (``ffn_lengths``: in place of its own list); Nemotron
    3's experts stacked, its ``expert_*`` keys."""
    c = model.config
    kinds = c.layers_block_type
    moe = MOE in kinds
    writer = gguf.GGUFWriter(str(path), "nemotron_h_moe" if moe else "nemotron_h")
    writer.add_context_length(2**20)  # (the converter's, without a rotary embedding)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(len(kinds))
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv([c.num_key_value_heads if kind == "full_attention" else 0 for kind in kinds])
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    lengths = {"mlp": c.intermediate_size, MOE: c.moe_intermediate_size}
    writer.add_feed_forward_length(ffn_lengths or [lengths.get(kind, 0) for kind in kinds])
    if moe:
        writer.add_expert_count(c.n_routed_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(c.moe_shared_expert_intermediate_size)
        writer.add_expert_weights_norm(c.norm_topk_prob)
        writer.add_expert_weights_scale(c.routed_scaling_factor)
        writer.add_expert_group_count(c.n_group)
        writer.add_expert_group_used_count(c.topk_group)
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
        elif part == "mixer.gate.e_score_correction_bias":
            tensors[f"blk.{n}.exp_probs_b.bias"] = tensor
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


def test_a_nemotron_3_gguf_file_gives_the_greedy_tokens_and_logprobs_of_its_model(bpe_tokenizer, tmp_path):
    """Nemotron 3 Nano's outline (llama.cpp's ``nemotron_h_moe``): experts' blocks by their routers, DeepSeek-V3's
    routing by the ``expert_*`` keys (2 groups, the best 1, scaled by 2.5) with the router's bias."""
    model = tiny_nemotron_h(bpe_tokenizer.get_vocab_size(), experts=True)
    path = tmp_path / "tiny-nemotron-3.gguf"
    write_nemotron_h_gguf(path, model, bpe_tokenizer)
    llm = LLM(str(path), kv_capacity_tokens=1024)
    config = llm.loaded.config
    assert config.layer_types == (MAMBA, "moe", "full_attention", "moe", MAMBA)
    assert (config.moe["n_group"], config.moe["topk_group"], config.moe["routed_scaling_factor"]) == (2, 1, 2.5)
    spec = assert_gives_the_outputs_of(llm, model, bpe_tokenizer, path)
    assert (spec.num_experts, spec.experts_per_token, spec.kv_layers) == (8, 2, 1)
