"""Block-wise FP8 checkpoints (DeepSeek-V3's, Qwen3's and GLM-4.5's FP8 releases: ``quant_method`` fp8 with a
``weight_block_size``): their weights dequantized as they load give the greedy tokens of transformers' model
holding the same dequantized weights; other quantizations and broken files are one clear error each."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from hf_models import PROMPTS, greedy_past_eos, hf_model  # noqa: E402
from sloserve import LLM, SamplingParams  # noqa: E402
from sloserve.core.errors import ConfigError  # noqa: E402

BLOCK = (24, 16)  # (neither divides every projection: partial blocks at the ends)
FP8_MAX = 448.0  # float8_e4m3fn's largest
QUANTIZATION = {"quant_method": "fp8", "weight_block_size": list(BLOCK), "fmt": "e4m3", "activation_scheme": "dynamic"}


def quantized(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(FP8 weight, its scale_inv, the weight they stand for), one scale a block, block by block as the FP8
    converters write them: each block's largest magnitude at 448."""
    rows, columns = BLOCK
    *lead, n, k = weight.shape
    scale_inv = torch.empty(*lead, math.ceil(n / rows), math.ceil(k / columns))
    codes = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    restored = torch.empty(weight.shape)
    for i in range(scale_inv.shape[-2]):
        for j in range(scale_inv.shape[-1]):
            cut = (..., slice(i * rows, (i + 1) * rows), slice(j * columns, (j + 1) * columns))
            block = weight[cut].float()
            scale = block.abs().amax(dim=(-2, -1)).clamp(min=1e-12) / FP8_MAX  # (*lead,)
            scale_inv[..., i, j] = scale
            codes[cut] = (block / scale[..., None, None]).to(torch.float8_e4m3fn)
            restored[cut] = codes[cut].float() * scale[..., None, None]
    return codes, scale_inv, restored


def fp8_checkpoint(arch: str, path: Path):
    """transformers' ``arch`` model saved at ``path`` with its projections (each expert's too) block-wise FP8,
    and transformers' model of the weights the FP8 ones stand for (saved beside, read back by transformers)."""
    hf_model(arch).save_pretrained(path)
    tensors = safetensors_torch.load_file(str(path / "model.safetensors"))
    restored = dict(tensors)
    for name, tensor in list(tensors.items()):
        if name.endswith("proj.weight"):  # (q/k/v/o, gate/up/down, each expert's: the Hub's names)
            tensors[name], tensors[f"{name}_scale_inv"], restored[name] = quantized(tensor)
    safetensors_torch.save_file(tensors, str(path / "model.safetensors"))
    shutil.copytree(path, path.with_name(path.name + "-restored"))
    safetensors_torch.save_file(restored, str(path.with_name(path.name + "-restored") / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": QUANTIZATION}))
    return transformers.AutoModelForCausalLM.from_pretrained(path.with_name(path.name + "-restored")).eval()


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "qwen3_next"])
def test_a_block_wise_fp8_checkpoint_gives_the_greedy_tokens_of_its_weights(arch, tmp_path):
    """Llama's projections, Qwen3-MoE's experts (each its own weight and scales) and Qwen3-Next's (its DeltaNets'
    grouped projections dequantized, then reordered) in FP8: transformers' greedy tokens on the weights the FP8 ones
    stand for."""
    model = fp8_checkpoint(arch, tmp_path / "fp8")
    llm = LLM(str(tmp_path / "fp8"), kv_capacity_tokens=256)
    for ids in PROMPTS[:2]:
        [out] = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
        assert out.outputs[0].token_ids == greedy_past_eos(model, ids, 10)


def test_fp8_checkpoints_that_cannot_be_read_are_refused(hf_dirs, tmp_path):
    """Per-tensor FP8 (no weight_block_size), a bad block, static activation scales, a weight without its
    scale and scales of another block size: one ConfigError each."""
    fp8_checkpoint("llama", tmp_path / "good")

    def variant(name: str, **quantization) -> Path:
        path = tmp_path / name
        shutil.copytree(tmp_path / "good", path)
        config = json.loads((path / "config.json").read_text())
        config["quantization_config"] = {**QUANTIZATION, **quantization}
        (path / "config.json").write_text(json.dumps(config))
        return path

    with pytest.raises(ConfigError, match="quant_method 'fp8' without weight_block_size"):
        LLM(str(variant("per_tensor", weight_block_size=None)))
    with pytest.raises(ConfigError, match="weight_block_size must be two positive integers, got \\[128\\]"):
        LLM(str(variant("bad_block", weight_block_size=[128])))
    with pytest.raises(ConfigError, match="FP8 quantization_config activation_scheme 'static' is not supported"):
        LLM(str(variant("static", activation_scheme="static")))
    with pytest.raises(ConfigError, match="FP8 tensor model.layers.0.mlp.down_proj.weight \\(64, 128\\) and its scales "
                       "\\(3, 8\\) do not pair \\(one scale a 16 x 16 block"):  # fmt: skip
        LLM(str(variant("other_block", weight_block_size=[16, 16])))
    unscaled = variant("unscaled")
    tensors = safetensors_torch.load_file(str(unscaled / "model.safetensors"))
    del tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    safetensors_torch.save_file(tensors, str(unscaled / "model.safetensors"))
    with pytest.raises(ConfigError, match="FP8 tensor model.layers.0.self_attn.o_proj.weight has no scale"):
        LLM(str(unscaled))
