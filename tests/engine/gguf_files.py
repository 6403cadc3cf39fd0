"""GGUF files of tiny models written as llama.cpp's converter writes them (``gguf.GGUFWriter``): a
Llama's Q and K rows permuted (a Qwen's or a Gemma's not), a Gemma's norms stored as 1 + weight, a tied
embedding left out (no ``output.weight``, as Llama 3.2 1B's), the tokenizer's metadata as given."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

TENSOR_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}  # fmt: skip
PHI3_TENSOR_NAMES = {**TENSOR_NAMES, "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}  # fused
STARCODER2_TENSOR_NAMES = {**TENSOR_NAMES, "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}  # (two matrices)
GPT_OSS_TENSOR_NAMES = {**TENSOR_NAMES, "post_attention_layernorm": "post_attention_norm"}  # (its experts apart)
GEMMA3_TENSOR_NAMES = {
    **TENSOR_NAMES, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}  # fmt: skip


# Llama 3's split, as its tokenizer.json has it (LFM2's too), and the text a BPE vocabulary of it is trained on
# and read back in: digits in runs of at most three
SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
CORPUS = ["In 2024, 12345 people paid 678 dollars for 90 items.", "The year 1999 had 365 days and 8760 hours."] * 30
TEXTS = ["In 20241999, 12345 people!", "The year 365 had 8760 hours\n\nand 90 items.", "<think>12 days</think>9"]
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
USER_DEFINED = ["<think>", "</think>"]  # added tokens that are not special (Qwen3's)


def llama3_tokenizer(split: str | None = SPLIT, corpus: list[str] = CORPUS):
    """A byte-level BPE tokenizer trained on ``corpus`` after ``split`` (Llama 3's; None: GPT-2's, the ByteLevel
    pre-tokenizer's own), its specials and user-defined tokens added, BOS added to each text."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = (
        pre_tokenizers.ByteLevel(add_prefix_space=False)
        if split is None
        else pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in USER_DEFINED])
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[(SPECIAL[0], 0)])
    return tok


def sentencepiece_vocabulary(
    corpus: list[str], added: tuple[str, ...] = ()
) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) as llama.cpp's converter writes a SentencePiece BPE vocabulary:
    <unk> (type 2), <s> and </s> (control, 3), the 256 byte tokens (6), the pieces learned from ``corpus``
    (1), each scored by its rank (the earlier merged, the higher), then ``added`` (control, as Phi-3's
    <|end|>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    trained.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300))
    vocab = trained.get_vocab()
    pieces = sorted(vocab, key=vocab.get)
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces, *added]
    scores = [0.0] * (3 + 256) + [-float(rank) for rank in range(len(pieces))] + [-1000.0] * len(added)
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [3] * len(added)
    return tokens, scores, types


def tiny_llama(vocab_size: int, rope: dict[str, Any]):
    """A random transformers Llama (tied embedding) with ``rope`` as its ``rope_parameters``."""
    torch.manual_seed(6)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=512, initializer_range=0.2, tie_word_embeddings=True,
        rope_parameters=rope,
    )  # fmt: skip
    return uneven_norms_(transformers.LlamaForCausalLM(config).eval())


@torch.no_grad()
def uneven_norms_(model):
    """``model`` with its norm weights (1 at init) spread around 1, so that they count."""
    for p in model.parameters():
        if p.ndim == 1:
            p.mul_(1 + 0.1 * torch.randn_like(p))
    return model


def varied_(model):
    """``model`` (in eval mode) with its biases (0 at init) drawn from N(0, 0.2) and its norm weights spread around 1
    (``uneven_norms_``), so that they count."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.2)
    return uneven_norms_(model.eval())


def permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter's row order of a Q or K projection (its rope rotates adjacent pairs)."""
    shape = weight.shape
    return weight.reshape(num_heads, 2, shape[0] // num_heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def add_model_shape(writer, c, block_count: int | None = None) -> None:
    """The keys of a transformers config ``c`` every converter writes: the context, the widths, the layers
    (``block_count``: more, where the converter appends blocks), the heads, the norms' epsilon, the rope base."""
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)  # (Gemma 3's: one a layer type)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(block_count or c.num_hidden_layers)
    if getattr(c, "intermediate_size", None) is not None:  # (a model of experts only may have none: Qwen3.5-MoE)
        writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads  # (Phi-3's config has none)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if hasattr(c, "rms_norm_eps"):
        writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    else:  # (LayerNorms: StableLM's, StarCoder2's)
        writer.add_layer_norm_eps(getattr(c, "layer_norm_eps", None) or c.norm_epsilon)
    writer.add_rope_freq_base(rope["rope_theta"])


def write_gguf(
    path: Path,
    model,
    fields: dict[str, Any],
    arch: str = "llama",
    rope_freqs: list[float] | None = None,
    tensors: dict[str, np.ndarray] | None = None,
) -> None:
    """``model`` as a GGUF file of ``arch``; ``fields``: ``GGUFWriter`` method -> its value (the tokenizer's,
    ``add_token_list``..., and others: ``add_sliding_window``...); ``rope_freqs``: Llama 3.1's frequency
    factors, as the converter stores them; ``tensors``: more, by their GGUF names."""
    import gguf

    c = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    add_model_shape(writer, c)
    for method, value in fields.items():
        getattr(writer, method)(value)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "model.norm.bias": "output_norm.bias"}  # fmt: skip
    if not c.tie_word_embeddings:
        names["lm_head.weight"] = "output.weight"
    for n in range(c.num_hidden_layers):
        names_of = {"gemma2": GEMMA3_TENSOR_NAMES, "gemma3": GEMMA3_TENSOR_NAMES, "phi3": PHI3_TENSOR_NAMES,
                    "olmo2": GEMMA3_TENSOR_NAMES, "starcoder2": STARCODER2_TENSOR_NAMES,
                    "gpt-oss": GPT_OSS_TENSOR_NAMES}  # fmt: skip
        for hf, ours in names_of.get(arch, TENSOR_NAMES).items():
            for kind in ("weight", "bias"):  # (a bias where the model has one: a LayerNorm's, a projection's)
                names[f"model.layers.{n}.{hf}.{kind}"] = f"blk.{n}.{ours}.{kind}"
    for name, tensor in model.state_dict().items():
        if name not in names:
            continue  # the LM head tied to the embedding
        weight = tensor.float().numpy()
        if arch in ("llama", "smollm3", "granite") and name.endswith("q_proj.weight"):
            weight = permute(weight, c.num_attention_heads)
        elif arch in ("llama", "smollm3", "granite") and name.endswith("k_proj.weight"):
            weight = permute(weight, c.num_key_value_heads)
        elif arch in ("gemma", "gemma2", "gemma3") and name.endswith("norm.weight"):
            weight = weight + 1  # Gemma's RMSNorm scales by 1 + weight, llama.cpp's by the weight
        writer.add_tensor(names[name], weight)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.array(rope_freqs, dtype=np.float32))
    for name, tensor in (tensors or {}).items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_bpe_tokenizer(writer, tokenizer, pre: str = "llama-bpe") -> None:
    """``tokenizer`` (``llama3_tokenizer``'s) as llama.cpp's converter writes a byte-level BPE: its tokens (control
    and user-defined ones marked), the pre-tokenizer ``pre`` (Llama 3's split), its merges, BOS (added to each text)
    and EOS."""
    import json

    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIAL else 4 if t in USER_DEFINED else 1 for t in tokens])
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(vocab[SPECIAL[0]])
    writer.add_eos_token_id(vocab[SPECIAL[1]])
    writer.add_add_bos_token(True)


# transformers' names of a Mamba-2 mixer's tensors -> llama.cpp's
MAMBA2_TENSOR_NAMES = {
    "in_proj.weight": "ssm_in.weight", "conv1d.weight": "ssm_conv1d.weight", "conv1d.bias": "ssm_conv1d.bias",
    "dt_bias": "ssm_dt.bias", "A_log": "ssm_a", "D": "ssm_d", "norm.weight": "ssm_norm.weight",
    "out_proj.weight": "ssm_out.weight",
}  # fmt: skip


def mamba2_gguf_tensor(name: str, tensor: torch.Tensor, n_groups: int) -> tuple[str, torch.Tensor]:
    """A Mamba-2 mixer's tensor (transformers' ``name`` within the mixer) as llama.cpp's converter writes it: its
    GGUF name within the block, the convolution (C, taps), A as -exp(A_log), A and D as (heads, 1), the gated norm's
    weight by group."""
    if name == "conv1d.weight":
        tensor = tensor.squeeze(1)
    elif name in ("A_log", "D"):
        tensor = (-torch.exp(tensor) if name == "A_log" else tensor).reshape(-1, 1)
    elif name == "norm.weight":
        tensor = tensor.reshape(n_groups, -1)
    return MAMBA2_TENSOR_NAMES[name], tensor


def write_gguf_tensors(writer, tensors: dict[str, torch.Tensor]) -> None:
    """``tensors`` (by their GGUF names) into ``writer``'s file, after its metadata; the file closed."""
    for name, tensor in tensors.items():
        writer.add_tensor(name, tensor.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def assert_gives_the_outputs_of(llm, model, tokenizer, path: Path, by_full_forwards: bool = False):
    """The engine (``llm``) on the GGUF file at ``path``, written from ``model`` (or read by transformers) with
    ``tokenizer``: the tokenizer's tokens of ``TEXTS``, and ``model``'s greedy tokens and prompt log-probabilities of
    them; the simulator's shape of the file (returned: ``simulate --model FILE``) counts ``model``'s parameters (and
    its routers' biases, a checkpoint's weights that transformers holds as buffers)."""
    from sloserve.checkpoint import model_spec

    prompts = [llm.tokenizer.encode(text) for text in TEXTS]
    assert prompts == [tokenizer.encode(text).ids for text in TEXTS]
    assert_greedy_tokens_and_logprobs(llm, model, prompts, by_full_forwards)
    spec = model_spec(str(path))
    biases = ("expert_bias", "e_score_correction_bias")  # (LFM2-MoE's, DeepSeek-V3's routing's)
    routers_biases = sum(b.numel() for name, b in model.named_buffers() if name.endswith(biases))
    assert spec.num_params == sum(p.numel() for p in model.parameters()) + routers_biases  # (buffers to transformers)
    return spec


def assert_reads_as_transformers(llm, path: Path, texts: list[str]) -> None:
    """The engine's tokens of each text are those of transformers' GGUF reading of ``path``, and decode to
    its text."""
    reference = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in texts:
        ids = llm.tokenizer.encode(text)
        assert ids == reference(text)["input_ids"], text
        assert llm.tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True)


def assert_greedy_tokens_and_logprobs(llm, model, prompts: list[list[int]], by_full_forwards: bool = False) -> None:
    """The engine's greedy tokens and prompt log-probabilities on ``prompts`` are ``model``'s (transformers'; its
    tokens from forward passes over whole sequences where ``by_full_forwards``: ``hf_models.BY_FULL_FORWARDS``)."""
    from hf_models import greedy, greedy_by_full_forwards, prompt_logprobs
    from sloserve import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)
    for ids, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == (greedy_by_full_forwards if by_full_forwards else greedy)(model, ids, 12)
        ours = [entry.logprob for entry in out.prompt_logprobs[1:]]
        assert ours == pytest.approx(prompt_logprobs(model, ids), abs=1e-4)


def assert_bit_equal(ours: torch.Tensor, theirs: np.ndarray) -> None:
    """The same float32 bits, a NaN's payload aside (which operand a NaN came from is the hardware's choice)."""
    ours = ours.cpu().numpy()
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(theirs))
    finite = ~np.isnan(theirs)
    np.testing.assert_array_equal(ours[finite].view(np.uint32), theirs[finite].view(np.uint32))


def assert_the_same_tensors_either_way(path: Path, device: str, monkeypatch) -> int:
    """The loader's tensors of the file at ``path`` dequantized by torch on ``device`` (each of them: counted)
    and by gguf-py: the same names, the same bits. Returns how many."""
    from sloserve.checkpoint import gguf_dequant
    from sloserve.checkpoint.gguf import read_gguf
    from sloserve.checkpoint.gguf_tensors import gguf_tensors

    checkpoint = read_gguf(path)
    by_gguf_py = dict(gguf_tensors(checkpoint, "cpu", torch_dequantizes=False))
    calls, dequantize = [], gguf_dequant.dequantize
    monkeypatch.setattr(gguf_dequant, "dequantize", lambda *args: calls.append(args[1]) or dequantize(*args))
    by_torch = dict(gguf_tensors(checkpoint, device, torch_dequantizes=True))
    assert len(calls) == len(checkpoint.reader.tensors)
    assert by_torch.keys() == by_gguf_py.keys()
    for name, tensor in by_torch.items():
        assert tensor.device.type == device
        assert_bit_equal(tensor, by_gguf_py[name].numpy())
    return len(by_torch)
