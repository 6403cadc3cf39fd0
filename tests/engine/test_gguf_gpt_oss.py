"""gpt-oss GGUF files (``gpt-oss``), as llama.cpp's converter writes them: the attention's biases and sinks
(``attn_sinks``), the router with its bias (``ffn_gate_inp``), the experts stacked with gate and up apart
(``ffn_gate_exps``, ``ffn_up_exps``: transformers' interleaved columns split, ``ffn_down_exps``), in MXFP4 as
the published files hold them or in float32, every other layer sliding (llama.cpp's pattern) and YaRN. The
engine gives the greedy tokens and log-probabilities of the transformers model the file was written from
(its experts as MXFP4 stores them); its tensors are the same dequantized by torch (on a GPU) or by gguf-py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import numpy as np  # noqa: E402
from gguf_files import (  # noqa: E402
    assert_greedy_tokens_and_logprobs,
    assert_the_same_tensors_either_way,
    write_gguf,
)

from hf_models import VOCAB, hf_cached  # noqa: E402
from sloserve import LLM  # noqa: E402
from sloserve.checkpoint.gguf import read_gguf  # noqa: E402
from sloserve.core.errors import ConfigError  # noqa: E402

PROMPTS = [list(range(3, 90)), [7, 1, 9] * 12]
MXFP4 = gguf.GGMLQuantizationType.MXFP4


def as_llama_cpp_writes_it(model, mxfp4: bool) -> dict[str, np.ndarray]:
    """The tensors of ``model`` that llama.cpp's converter writes apart from a Llama's (sinks, router, experts);
    with ``mxfp4`` the experts quantized, and ``model``'s experts set to what the file holds."""
    tensors: dict[str, np.ndarray] = {}
    state = {name: t.detach().float().numpy() for name, t in model.state_dict().items()}
    for n in range(model.config.num_hidden_layers):
        layer, experts = f"model.layers.{n}", f"model.layers.{n}.mlp.experts"
        tensors[f"blk.{n}.attn_sinks.weight"] = state[f"{layer}.self_attn.sinks"]
        tensors[f"blk.{n}.ffn_gate_inp.weight"] = state[f"{layer}.mlp.router.weight"]
        tensors[f"blk.{n}.ffn_gate_inp.bias"] = state[f"{layer}.mlp.router.bias"]
        gate_up, bias = state[f"{experts}.gate_up_proj"], state[f"{experts}.gate_up_proj_bias"]  # (E, H, 2 I), (E, 2 I)
        parts = {
            "ffn_gate_exps": gate_up[:, :, ::2].transpose(0, 2, 1),  # (E, I, H)
            "ffn_up_exps": gate_up[:, :, 1::2].transpose(0, 2, 1),
            "ffn_down_exps": state[f"{experts}.down_proj"].transpose(0, 2, 1),  # (E, H, I)
        }
        for name, weight in parts.items():
            weight = np.ascontiguousarray(weight)
            if mxfp4:
                weight = gguf.quants.quantize(weight, MXFP4)
            tensors[f"blk.{n}.{name}.weight"] = weight
        tensors[f"blk.{n}.ffn_gate_exps.bias"] = bias[:, ::2].copy()
        tensors[f"blk.{n}.ffn_up_exps.bias"] = bias[:, 1::2].copy()
        tensors[f"blk.{n}.ffn_down_exps.bias"] = state[f"{experts}.down_proj_bias"]
        if mxfp4:  # the model's experts as the file holds them
            held = {k: gguf.quants.dequantize(tensors[f"blk.{n}.{k}.weight"], MXFP4) for k in parts}
            with torch.no_grad():
                mlp = model.model.layers[n].mlp.experts
                mlp.gate_up_proj[:, :, ::2] = torch.from_numpy(held["ffn_gate_exps"].transpose(0, 2, 1).copy())
                mlp.gate_up_proj[:, :, 1::2] = torch.from_numpy(held["ffn_up_exps"].transpose(0, 2, 1).copy())
                mlp.down_proj.copy_(torch.from_numpy(held["ffn_down_exps"].transpose(0, 2, 1).copy()))
    return tensors


def write_gpt_oss_gguf(path, model, tensors: dict[str, np.ndarray]) -> None:
    c, rope = model.config, model.config.rope_parameters
    fields = {
        "add_tokenizer_model": "gpt2", "add_token_list": [f"t{i}" for i in range(VOCAB)],
        "add_expert_count": c.num_local_experts, "add_expert_used_count": c.num_experts_per_tok,
        "add_expert_feed_forward_length": c.intermediate_size, "add_sliding_window": c.sliding_window,
        "add_rope_scaling_type": gguf.RopeScalingType.YARN, "add_rope_scaling_factor": rope["factor"],
        "add_rope_scaling_orig_ctx_len": rope["original_max_position_embeddings"],
    }  # fmt: skip
    quantized = {name: t for name, t in tensors.items() if t.dtype == np.uint8}
    write_gguf(path, model, fields, arch="gpt-oss", tensors={k: t for k, t in tensors.items() if k not in quantized})
    if quantized:  # (rewritten with the quantized experts: write_gguf writes float32 arrays)
        reader = gguf.GGUFReader(str(path))
        writer = gguf.GGUFWriter(str(path) + ".tmp", "gpt-oss")
        for field in reader.fields.values():
            if not field.name.startswith("GGUF.") and field.name != "general.architecture":
                writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=field.types[-1])
        for t in reader.tensors:
            writer.add_tensor(t.name, np.array(t.data))
        for name, t in quantized.items():
            writer.add_tensor(name, t, raw_dtype=MXFP4)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        path.unlink()
        (path.parent / (path.name + ".tmp")).rename(path)


def reference_model():
    """``hf_models``' gpt-oss with YaRN's ramp truncated, as llama.cpp computes it (a GGUF file does not
    say ``truncate``; the HF config's is false)."""
    base = hf_cached("gpt_oss")
    config = transformers.GptOssConfig(**{**base.config.to_dict(), "model_type": None})
    config.rope_parameters = {**config.rope_parameters, "truncate": True}
    model = transformers.GptOssForCausalLM(config).eval()
    model.load_state_dict(base.state_dict())
    return model


@pytest.mark.parametrize("mxfp4", [False, True])
def test_gpt_oss_reads_as_its_model(tmp_path, mxfp4):
    model = reference_model()
    tensors = as_llama_cpp_writes_it(model, mxfp4)
    path = tmp_path / "tiny-gpt-oss.gguf"
    write_gpt_oss_gguf(path, model, tensors)
    read = read_gguf(path).hf_config
    assert (read["model_type"], read["num_local_experts"], read["sliding_window"]) == ("gpt_oss", 4, 8)
    assert any(t.tensor_type == MXFP4 for t in read_gguf(path).reader.tensors) == mxfp4
    llm = LLM(str(path), kv_capacity_tokens=512)
    assert [llm.loaded.config.layer_window(i) for i in range(2)] == [8, None]
    assert_greedy_tokens_and_logprobs(llm, model, PROMPTS)


def test_the_experts_are_the_same_dequantized_by_torch(tmp_path, monkeypatch):
    """The loader's gpt-oss tensors from MXFP4 experts dequantized by torch (on the CPU here, as on a GPU) and by
    gguf-py: bit-equal, the gate and up columns interleaved alike."""
    model = reference_model()
    path = tmp_path / "tiny-gpt-oss.gguf"
    write_gpt_oss_gguf(path, model, as_llama_cpp_writes_it(model, mxfp4=True))
    assert assert_the_same_tensors_either_way(path, "cpu", monkeypatch) > 0


def test_a_gpt_oss_file_without_an_experts_bias_is_refused(tmp_path):
    model = reference_model()
    tensors = as_llama_cpp_writes_it(model, False)
    del tensors["blk.1.ffn_up_exps.bias"]
    path = tmp_path / "no-bias.gguf"
    write_gpt_oss_gguf(path, model, tensors)
    with pytest.raises(ConfigError, match="gpt-oss layer 1's experts have no blk.1.ffn_up_exps.bias"):
        LLM(str(path), kv_capacity_tokens=256)
