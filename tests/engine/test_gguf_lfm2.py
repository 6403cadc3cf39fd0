"""An LFM2 GGUF file written here (``gguf.GGUFWriter``) from a tiny random LFM2 and a trained BPE tokenizer, as
llama.cpp's converter lays it out: architecture ``lfm2``, the tensors under ``gguf``'s own name map for it (the
short convolutions' ``shortconv.*``, their weights squeezed to (C, taps); the final norm ``token_embd_norm``),
``attention.head_count_kv`` a count a layer (0 where it convolves), the MLP's adjusted length, ``shortconv.l_cache``,
pre-tokenizer ``lfm2`` (llama.cpp splits its text as Llama 3's). The engine reads the tokens the tokenizer.json
trained with that split reads, and gives the greedy tokens and prompt log-probabilities of transformers' reading of
the file (``from_pretrained(gguf_file=...)``: a reading of its own)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers reads GGUF files only with it

from gguf_files import (  # noqa: E402
    TEXTS,
    add_bpe_tokenizer,
    assert_gives_the_outputs_of,
    assert_greedy_tokens_and_logprobs,
    llama3_tokenizer,
    uneven_norms_,
)

from sloserve import LLM  # noqa: E402
from sloserve.checkpoint import model_spec  # noqa: E402
from sloserve.core.errors import ConfigError  # noqa: E402

LAYER_TYPES = ["conv", "full_attention", "conv", "conv"]


def tiny_lfm2(vocab_size: int):
    """A random transformers LFM2: three convolutions of 3 taps around one attention layer, its MLP's length
    adjusted (2/3 of 96, rounded up to 16: 64, which the file holds; adjusted again it would be 48), tied
    embeddings."""
    torch.manual_seed(11)
    config = transformers.Lfm2Config(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, block_ffn_dim_multiplier=1.0, block_multiple_of=16, layer_types=LAYER_TYPES,
        max_position_embeddings=256, initializer_range=0.2, conv_L_cache=3, tie_word_embeddings=True,
        pad_token_id=None, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return uneven_norms_(transformers.Lfm2ForCausalLM(config).eval())


def tiny_lfm2_moe(vocab_size: int):
    """A random transformers LFM2-MoE: a dense first MLP, then 8 experts (2 a token, their scores sigmoids chosen
    with the router's bias, renormalized, scaled by 2)."""
    torch.manual_seed(12)
    config = transformers.Lfm2MoeConfig(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, num_dense_layers=1,
        routed_scaling_factor=2.0, layer_types=LAYER_TYPES, max_position_embeddings=256, initializer_range=0.2,
        conv_L_cache=3, pad_token_id=None, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    model = transformers.Lfm2MoeForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers[1:]:  # (the router's bias: 0 at init)
            layer.feed_forward.expert_bias.normal_(0.0, 0.5)
    return uneven_norms_(model.eval())


def write_lfm2_gguf(path, model, tokenizer, head_count_kv=None) -> None:
    """``model`` as llama.cpp's LFM2 (LFM2-MoE) converter writes it (``head_count_kv``: in place of its own list);
    LFM2-MoE's experts stacked, gate and up apart."""
    c = model.config
    moe = c.model_type == "lfm2_moe"
    writer = gguf.GGUFWriter(str(path), "lfm2moe" if moe else "lfm2")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_head_count(c.num_attention_heads)
    kv = [c.num_key_value_heads if kind == "full_attention" else 0 for kind in c.layer_types]
    writer.add_head_count_kv(kv if head_count_kv is None else head_count_kv)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_shortconv_l_cache(c.conv_L_cache)
    writer.add_feed_forward_length(model.model.layers[0].feed_forward.w1.out_features)  # (the adjusted length)
    if moe:
        writer.add_expert_count(c.num_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
        writer.add_leading_dense_block_count(c.num_dense_layers)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_expert_weights_scale(c.routed_scaling_factor)
    add_bpe_tokenizer(writer, tokenizer, pre="lfm2")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LFM2MOE if moe else gguf.MODEL_ARCH.LFM2, c.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied to the embedding: the converter leaves it out
        base, _, kind = name.rpartition(".")
        weight = tensor.float().numpy()
        if moe and ".feed_forward." in name and ".w" not in name:  # (the router, its bias, the stacked experts)
            block = f"blk.{name.split('.')[2]}"
            if kind == "gate_up_proj":  # (E, 2 I, H): gate rows, then up rows
                gate, up = weight[:, : c.moe_intermediate_size], weight[:, c.moe_intermediate_size :]
                writer.add_tensor(f"{block}.ffn_gate_exps.weight", gate.copy())
                writer.add_tensor(f"{block}.ffn_up_exps.weight", up.copy())
            else:
                gguf_name = {"down_proj": "ffn_down_exps.weight", "weight": "ffn_gate_inp.weight",
                             "expert_bias": "exp_probs_b.bias"}[kind]  # fmt: skip
                writer.add_tensor(f"{block}.{gguf_name}", weight)
            continue
        if "conv.conv" in name:
            weight = weight.squeeze(1)  # the converter's: llama.cpp's convolution takes a 2-D weight
        writer.add_tensor(f"{names.get_name(base)}.{kind}", weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def lfm2_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("lfm2-gguf")
    tokenizer = llama3_tokenizer()
    model = tiny_lfm2(tokenizer.get_vocab_size())
    write_lfm2_gguf(root / "tiny-lfm2.gguf", model, tokenizer)
    return root / "tiny-lfm2.gguf", model, tokenizer


def test_an_lfm2_gguf_file_gives_transformers_tokens_and_logprobs(lfm2_gguf):
    path, model, tokenizer = lfm2_gguf
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    llm = LLM(str(path), kv_capacity_tokens=1024)
    config = llm.loaded.config
    assert config.model_type == "lfm2" and config.layer_types == tuple(LAYER_TYPES)
    assert config.intermediate_size == 64 and config.short_conv["width"] == 3
    prompts = []
    for text in TEXTS:
        ids = llm.tokenizer.encode(text)
        assert ids == tokenizer.encode(text).ids == hf_tokenizer.encode(text) and ids[0] == hf_tokenizer.bos_token_id
        prompts.append(ids)
    # transformers' reading of the file is the model it was written from (a check of the writer above)
    with torch.no_grad():
        ids = torch.tensor([prompts[0]])
        assert torch.equal(reference(ids).logits, model(ids).logits)
    assert_greedy_tokens_and_logprobs(llm, reference, prompts)
    # the simulator's shape of the file (simulate --model FILE) counts its parameters, states and KV layers
    spec = model_spec(str(path))
    assert spec.num_params == sum(p.numel() for p in model.parameters()) and (spec.num_layers, spec.kv_layers) == (4, 1)
    assert spec.state_bytes_per_sequence > 0


def test_an_lfm2_gguf_file_whose_kv_head_counts_do_not_fit_its_layers_is_refused(lfm2_gguf, tmp_path):
    _, model, tokenizer = lfm2_gguf
    write_lfm2_gguf(tmp_path / "bad.gguf", model, tokenizer, head_count_kv=[0, 2, 0])
    with pytest.raises(ConfigError, match=r"head_count_kv must list each of the 4 layers' KV heads"):
        LLM(str(tmp_path / "bad.gguf"), kv_capacity_tokens=1024)
    write_lfm2_gguf(tmp_path / "none.gguf", model, tokenizer, head_count_kv=[0, 0, 0, 0])
    with pytest.raises(ConfigError, match=r"some of them positive"):
        LLM(str(tmp_path / "none.gguf"), kv_capacity_tokens=1024)


def test_an_lfm2_moe_gguf_file_gives_the_greedy_tokens_and_logprobs_of_its_model(bpe_tokenizer, tmp_path):
    """LFM2-MoE (llama.cpp's ``lfm2moe``, which transformers does not read): its experts after the leading dense
    layer, stacked, with the router's bias (``exp_probs_b``) and ``expert_weights_scale``: the model's outputs."""
    model = tiny_lfm2_moe(bpe_tokenizer.get_vocab_size())
    path = tmp_path / "tiny-lfm2-moe.gguf"
    write_lfm2_gguf(path, model, bpe_tokenizer)
    llm = LLM(str(path), kv_capacity_tokens=1024)
    config = llm.loaded.config
    assert config.model_type == "lfm2_moe" and config.moe["moe_layers"] == (False, True, True, True)
    assert config.moe["routed_scaling_factor"] == 2.0 and config.intermediate_size == 96
    spec = assert_gives_the_outputs_of(llm, model, bpe_tokenizer, path)
    assert (spec.num_experts, spec.experts_per_token, spec.kv_layers) == (8, 2, 1)
