"""A Qwen3.5 GGUF file written here (``gguf.GGUFWriter``) from a tiny random transformers model and a trained BPE
tokenizer, as llama.cpp's converter lays it out (``qwen35``): full attention every ``full_attention_interval``-th
layer, the DeltaNets' heads by the ``ssm.*`` keys, their value heads reordered from grouped by key head to tiled,
A as -exp(A_log), the convolution (C, taps), every norm but the DeltaNet's gated one stored as 1 + w, a
multi-token-prediction block appended (``nextn_predict_layers``); and a Qwen3.5-MoE one (``qwen35moe``: experts in
every layer, gate and up apart, beside a shared expert). transformers does not read them: the engine gives the greedy
tokens and prompt log-probabilities of the model each was written from."""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from gguf_files import (  # noqa: E402
    add_bpe_tokenizer,
    add_model_shape,
    assert_gives_the_outputs_of,
    varied_,
    write_gguf_tensors,
)

from sloserve import LLM  # noqa: E402
from sloserve.core.errors import ConfigError  # noqa: E402

LAYERS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


# The tiny models' shape: DeltaNets of 6 value heads of 12 (key heads of 8), gated attention (4 heads of 16, 2 KV heads,
# a quarter of each rotated); the MoE models' experts: 4 of 32 (2 a token) and a shared expert of 48 in each layer
SHAPE = dict(
    hidden_size=64, num_hidden_layers=len(LAYERS), num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=12, layer_types=LAYERS,
    initializer_range=0.2, max_position_embeddings=4096, bos_token_id=0, eos_token_id=1,
)  # fmt: skip
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


def tiny_qwen35(vocab_size: int, key_heads: int = 2):
    """A random Qwen3.5 text model of ``SHAPE`` whose DeltaNets have ``key_heads`` key heads (with 2, 3 value heads
    a key head: the converter reorders them, in an order that is not its own inverse)."""
    torch.manual_seed(35 + key_heads)
    config = transformers.Qwen3_5TextConfig(
        vocab_size=vocab_size, intermediate_size=96, linear_num_key_heads=key_heads, **SHAPE
    )
    return varied_(transformers.Qwen3_5ForCausalLM(config))


def tiny_qwen35_moe(vocab_size: int):
    """A random Qwen3.5-MoE text model of ``SHAPE`` (2 key heads) with ``EXPERTS``, no dense MLP."""
    torch.manual_seed(36)
    config = transformers.Qwen3_5MoeTextConfig(vocab_size=vocab_size, linear_num_key_heads=2, **SHAPE, **EXPERTS)
    return varied_(transformers.Qwen3_5MoeForCausalLM(config))


def tiny_qwen3_next(vocab_size: int):
    """``tiny_qwen35_moe``'s shape as Qwen3-Next's (its DeltaNets' projections grouped by key head), an MLP of 80
    where a layer is dense (none here: experts in every one, as llama.cpp builds it)."""
    torch.manual_seed(37)
    config = transformers.Qwen3NextConfig(
        vocab_size=vocab_size, intermediate_size=80, linear_num_key_heads=2, **SHAPE, **EXPERTS
    )
    return varied_(transformers.Qwen3NextForCausalLM(config))


def tiled(tensor: torch.Tensor, dim: int, key_heads: int, per_key: int, width: int) -> torch.Tensor:
    """llama.cpp's converter's value heads along ``dim``: grouped by key head -> tiled (its ``_reorder_v_heads``)."""
    shape = list(tensor.shape)
    tensor = tensor.reshape(*shape[:dim], key_heads, per_key, width, *shape[dim + 1 :])
    return tensor.transpose(dim, dim + 1).reshape(shape)


def write_qwen35_gguf(
    path, model, tokenizer, interval: int = 2, pre: str = "llama-bpe", fused_experts: bool = False
) -> None:
    """``model`` as llama.cpp's Qwen3.5 converter writes it, with one multi-token-prediction block after its layers
    (random tensors under the converter's names, which the engine must leave out)."""
    c = model.config
    layers = c.num_hidden_layers
    qwen3_next = isinstance(c, transformers.Qwen3NextConfig)  # (its converter: no MRoPE, MTP, value heads tiled)
    moe = qwen3_next or isinstance(c, transformers.Qwen3_5MoeTextConfig)
    arch = gguf.MODEL_ARCH.QWEN3NEXT if qwen3_next else gguf.MODEL_ARCH.QWEN35MOE if moe else gguf.MODEL_ARCH.QWEN35
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    add_model_shape(writer, c, block_count=layers + (not qwen3_next))
    if moe:  # (the converter's Qwen2-MoE keys)
        writer.add_expert_count(c.num_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    writer.add_rope_dimension_count(int(c.head_dim * c.rope_parameters["partial_rotary_factor"]))
    if not qwen3_next:
        writer.add_rope_dimension_sections([2, 1, 1, 0])  # (interleaved MRoPE: equal positions for a text)
    writer.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    writer.add_ssm_state_size(c.linear_key_head_dim)
    writer.add_ssm_group_count(c.linear_num_key_heads)
    writer.add_ssm_time_step_rank(c.linear_num_value_heads)
    writer.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    writer.add_full_attention_interval(interval)
    if not qwen3_next:
        writer.add_nextn_predict_layers(1)
    add_bpe_tokenizer(writer, tokenizer, pre)
    names = gguf.get_tensor_name_map(arch, layers + 1)
    key_heads, value_heads, width = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_value_head_dim
    per_key, keys = value_heads // key_heads, 2 * key_heads * c.linear_key_head_dim
    if qwen3_next:
        per_key = 1  # (Qwen3-Next's converter reorders no value heads)
    tensors = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.float().clone()
        if name.endswith("mlp.experts.gate_up_proj") and fused_experts:  # (E, 2 I, H) as it is: ffn_gate_up_exps
            tensors[names.get_name(name) + ".weight"] = tensor
            continue
        if name.endswith("mlp.experts.gate_up_proj"):  # (E, 2 I, H): the converter's gate (E, I, H), then up
            stem = name.removesuffix(".gate_up_proj")
            gate, up = tensor.chunk(2, dim=1)
            tensors[names.get_name(f"{stem}.gate_proj") + ".weight"] = gate
            tensors[names.get_name(f"{stem}.up_proj") + ".weight"] = up
            continue
        if name.endswith("mlp.experts.down_proj"):  # (E, H, I), as it is
            tensors[names.get_name(name) + ".weight"] = tensor
            continue
        if name.endswith("in_proj_qkvz.weight"):  # (Qwen3-Next's: each key head's q, k, v, z -> all q, k, v; z)
            groups = tensor.reshape(key_heads, -1, c.hidden_size)
            k, v = c.linear_key_head_dim, value_heads // key_heads * width
            q_, k_, v_, z_ = (part.reshape(-1, c.hidden_size) for part in groups.split([k, k, v, v], dim=1))
            stem = name.removesuffix(".linear_attn.in_proj_qkvz.weight").replace("model.layers", "blk")
            tensors[f"{stem}.attn_qkv.weight"], tensors[f"{stem}.attn_gate.weight"] = torch.cat([q_, k_, v_]), z_
            continue
        if ".linear_attn." in name and per_key > 1:  # (the converter's _LinearAttentionVReorderBase)
            kind = name.split(".linear_attn.")[1]
            if kind.startswith(("in_proj_qkv", "conv1d")):
                tensor = tensor.squeeze(1) if kind.startswith("conv1d") else tensor
                tensor = torch.cat([tensor[:keys], tiled(tensor[keys:], 0, key_heads, per_key, width)])
            elif kind.startswith("in_proj_z"):
                tensor = tiled(tensor, 0, key_heads, per_key, width)
            elif kind.startswith(("in_proj_a", "in_proj_b", "A_log", "dt_bias")):
                tensor = tiled(tensor.reshape(value_heads, -1), 0, key_heads, per_key, 1).reshape(tensor.shape)
            elif kind.startswith("out_proj"):
                tensor = tiled(tensor, 1, key_heads, per_key, width)
        if name.endswith(".A_log"):  # (Qwen3-Next's converter's rules)
            tensor = -torch.exp(tensor)
        elif name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        elif "conv1d" in name:
            tensor = tensor.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            tensor = tensor + 1
        base, dot, suffix = name.rpartition(".")
        gguf_name = names.get_name(base) + dot + suffix if suffix in ("weight", "bias") else names.get_name(name)
        tensors[gguf_name] = tensor
    if qwen3_next:
        write_gguf_tensors(writer, tensors)
        return
    mtp = {"nextn.eh_proj.weight": (c.hidden_size, 2 * c.hidden_size), "nextn.enorm.weight": (c.hidden_size,),
           "attn_norm.weight": (c.hidden_size,), "attn_q.weight": (2 * c.num_attention_heads * c.head_dim, c.hidden_size)}  # fmt: skip
    tensors.update({f"blk.{layers}.{name}": torch.randn(shape) for name, shape in mtp.items()})
    write_gguf_tensors(writer, tensors)


# Each file of the test below: its tiny model and transformers' model type. Qwen3.5 with 2 key heads (its value heads
# reordered by the converter) and 6 (one a key head: none); Qwen3.5-MoE, its experts stacked (gate and up apart, or
# as one: ``ffn_gate_up_exps``) beside a shared expert and its gate in every layer; Qwen3-Next, its DeltaNets'
# grouped ``in_proj_qkvz`` written by the converter as all heads' q, k, v (``attn_qkv``) and z (``attn_gate``),
# ``in_proj_ba`` as it is (``ssm_ba``)
MODELS = {
    "qwen35": (tiny_qwen35, "qwen3_5_text"),
    "qwen35-a-value-head-a-key-head": (functools.partial(tiny_qwen35, key_heads=6), "qwen3_5_text"),
    "qwen35moe": (tiny_qwen35_moe, "qwen3_5_moe_text"),
    "qwen35moe-gate-up-fused": (tiny_qwen35_moe, "qwen3_5_moe_text"),
    "qwen3next": (tiny_qwen3_next, "qwen3_next"),
}


@pytest.mark.parametrize("case", MODELS)
def test_a_gguf_file_gives_the_greedy_tokens_and_logprobs_of_its_model(bpe_tokenizer, tmp_path, case):
    make, model_type = MODELS[case]
    model = make(bpe_tokenizer.get_vocab_size())
    path = tmp_path / f"tiny-{case}.gguf"
    write_qwen35_gguf(path, model, bpe_tokenizer, fused_experts=case.endswith("-fused"))
    llm = LLM(str(path), kv_capacity_tokens=1024)
    config = llm.loaded.config
    assert config.model_type == model_type and config.layer_types == tuple(LAYERS)
    if model_type != "qwen3_5_text":
        assert (config.moe["num_experts"], config.moe["num_experts_per_tok"]) == (4, 2)
    assert assert_gives_the_outputs_of(llm, model, bpe_tokenizer, path).kv_layers == 2


def test_a_qwen35_gguf_file_whose_layers_do_not_divide_is_refused(bpe_tokenizer, tmp_path):
    model = tiny_qwen35(bpe_tokenizer.get_vocab_size())
    write_qwen35_gguf(tmp_path / "bad.gguf", model, bpe_tokenizer, interval=0)
    with pytest.raises(ConfigError, match="qwen35's full_attention_interval 0, 4 layers .* do not make Qwen3.5's"):
        LLM(str(tmp_path / "bad.gguf"), kv_capacity_tokens=1024)


def test_qwen35s_pre_tokenizer_keeps_a_words_combining_marks_with_it(tmp_path):
    """``tokenizer.ggml.pre = qwen35`` (Qwen3.5's files): Qwen's split with a word's combining marks kept in it (an
    accent written apart, U+0301), as Qwen3.5's tokenizer.json splits; Qwen2's split would part them, and merges
    learned across them would not apply."""
    from gguf_files import CORPUS, llama3_tokenizer

    from sloserve.checkpoint.gguf_tokenizer import QWEN35_SPLIT, QWEN_SPLIT

    text = "the cafe\u0301 of re\u0301sume\u0301s"
    tokenizer = llama3_tokenizer(QWEN35_SPLIT, [*CORPUS, *[text] * 30])
    path = tmp_path / "qwen35-marks.gguf"
    model = tiny_qwen35(tokenizer.get_vocab_size())
    write_qwen35_gguf(path, model, tokenizer, pre="qwen35")
    ours = LLM(str(path), kv_capacity_tokens=1024).tokenizer.encode(text)
    assert ours == tokenizer.encode(text).ids
    assert ours != llama3_tokenizer(QWEN_SPLIT, [*CORPUS, *[text] * 30]).encode(text).ids  # (the split matters)
