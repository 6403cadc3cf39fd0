"""Mamba, Falcon Mamba and Mamba-2 GGUF files written here (``gguf.GGUFWriter``) from tiny random transformers models
and a trained BPE tokenizer, as llama.cpp's converter lays them out: architecture ``mamba`` (Falcon Mamba's with
``ssm.dt_b_c_rms``) or ``mamba2``, the ``ssm.*`` keys, head count and MLP length 0, a context of 2**20; the tensors
under ``gguf``'s own name map, A stored as -exp(A_log), the convolutions (C, taps), Mamba-2's A and D as (heads, 1)
and its norm by group, a tied LM head left out. The engine gives the greedy tokens and prompt log-probabilities of
transformers' reading of the Mamba file (``from_pretrained(gguf_file=...)``), and of the models the others were
written from (transformers reads neither: Falcon Mamba's norms and Mamba-2 are not in its GGUF reader)."""

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
    varied_,
    write_gguf_tensors,
)

from sloserve import LLM  # noqa: E402
from sloserve.checkpoint.model_types import UNNAMED_CONTEXT_TOKENS  # noqa: E402
from sloserve.core.errors import ConfigError  # noqa: E402

ARCHS = ("mamba", "falcon_mamba", "mamba2")


def tiny_model(arch: str, vocab_size: int):
    """A random transformers model of ``arch``: 3 layers of 128 channels; Falcon Mamba's mixer norms at the file's
    one epsilon (llama.cpp's), its projections with biases; Mamba-2's 8 heads of 16 in 2 groups, an untied LM
    head."""
    torch.manual_seed(21)
    common = dict(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=3, initializer_range=0.2,
                  pad_token_id=None, bos_token_id=0, eos_token_id=1)  # fmt: skip
    if arch == "mamba2":
        config = transformers.Mamba2Config(**common, num_heads=8, head_dim=16, n_groups=2, state_size=16, chunk_size=8)
        model = transformers.Mamba2ForCausalLM(config)
    elif arch == "falcon_mamba":
        config = transformers.FalconMambaConfig(
            **common, state_size=8, time_step_rank=8, mixer_rms_eps=1e-5, use_bias=True
        )
        model = transformers.FalconMambaForCausalLM(config)
    else:  # (no biases of in_proj and out_proj: transformers' GGUF reader reads no use_bias, and would drop them)
        config = transformers.MambaConfig(**common, state_size=8, time_step_rank=8)
        model = transformers.MambaForCausalLM(config)
    return varied_(model)


def write_mamba_gguf(path, model, tokenizer, inner_size=None) -> None:
    """``model`` as llama.cpp's Mamba or Mamba-2 converter writes it (``inner_size``: in place of its own)."""
    c = model.config
    mamba2 = c.model_type == "mamba2"
    arch = gguf.MODEL_ARCH.MAMBA2 if mamba2 else gguf.MODEL_ARCH.MAMBA
    d_inner = c.expand * c.hidden_size
    writer = gguf.GGUFWriter(str(path), "mamba2" if mamba2 else "mamba")
    writer.add_context_length(2**20)  # (the converter's "arbitrary value")
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(0)
    writer.add_head_count(0)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_ssm_conv_kernel(c.conv_kernel)
    writer.add_ssm_inner_size(inner_size or d_inner)
    writer.add_ssm_state_size(c.state_size)
    writer.add_ssm_time_step_rank(c.num_heads if mamba2 else c.time_step_rank)
    if mamba2:
        writer.add_ssm_group_count(c.n_groups)
    writer.add_layer_norm_rms_eps(c.layer_norm_epsilon)
    if not mamba2:
        writer.add_ssm_dt_b_c_rms(c.model_type == "falcon_mamba")
    add_bpe_tokenizer(writer, tokenizer)
    names = gguf.get_tensor_name_map(arch, c.num_hidden_layers)
    tensors = {}
    state = model.state_dict()
    for name, tensor in state.items():
        if name == "lm_head.weight" and torch.equal(tensor, state["backbone.embeddings.weight"]):
            continue  # tied: the converter leaves it out
        name = name.replace(".dt_bias", ".dt_proj.bias")  # (Mamba-2's, the converter's renaming)
        base, _, kind = name.rpartition(".")
        if kind in ("A_log", "D"):
            base, kind = name, ""
        weight = tensor.float()
        if name.endswith("conv1d.weight"):
            weight = weight.squeeze(1)
        elif mamba2 and name.endswith(("A_log", ".D")):
            weight = weight.reshape(-1, 1)  # (the converter's (heads, 1))
        elif mamba2 and name.endswith("mixer.norm.weight"):
            weight = weight.reshape(c.n_groups, -1)  # (by group)
        if name.endswith("A_log"):
            weight = -torch.exp(weight)
        tensors[names.get_name(base) + (f".{kind}" if kind else "")] = weight
    write_gguf_tensors(writer, tensors)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_mamba_gguf_file_gives_the_greedy_tokens_and_logprobs_of_its_model(arch, bpe_tokenizer, tmp_path):
    model = tiny_model(arch, bpe_tokenizer.get_vocab_size())
    path = tmp_path / f"tiny-{arch}.gguf"
    write_mamba_gguf(path, model, bpe_tokenizer)
    llm = LLM(str(path))
    config = llm.loaded.config
    assert (config.model_type, config.max_position_embeddings, config.num_kv_layers) == (
        arch,
        UNNAMED_CONTEXT_TOKENS,
        0,
    )
    assert config.tie_word_embeddings == (arch != "mamba2")
    if arch == "falcon_mamba":
        assert config.mamba["dt_bc_norms"] and config.mamba["dt_bc_norm_eps"] == pytest.approx(1e-5)  # (float32)
    reference = model
    if arch == "mamba":  # transformers' own reading of the file: the model it was written from
        reference = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        ).eval()
        # (transformers makes the file's BOS, 0, its pad id too: generate would take a prompt's BOS for padding)
        reference.generation_config.pad_token_id = None
        with torch.no_grad():
            ids = torch.tensor([bpe_tokenizer.encode(TEXTS[0]).ids])
            torch.testing.assert_close(reference(ids).logits, model(ids).logits, rtol=0, atol=1e-5)
    assert assert_gives_the_outputs_of(llm, reference, bpe_tokenizer, path).kv_bytes_per_token == 0


def test_a_mamba_gguf_file_whose_sizes_do_not_fit_is_refused_by_name(bpe_tokenizer, tmp_path):
    model = tiny_model("mamba2", bpe_tokenizer.get_vocab_size())
    write_mamba_gguf(tmp_path / "bad.gguf", model, bpe_tokenizer, inner_size=100)
    with pytest.raises(ConfigError, match="GGUF mamba2.ssm.inner_size 100 must be a multiple of embedding_length 64"):
        LLM(str(tmp_path / "bad.gguf"))
