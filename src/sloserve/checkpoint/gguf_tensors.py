"""A GGUF file's tensors as the engine loads them (``gguf_tensors``): dequantized (gguf-py on the CPU, torch on
a GPU: ``gguf_dequant``), renamed to their HF names (``gguf_names``), and put back in the checkpoint's layout where
llama.cpp's converter changed it (Q and K unpermuted, parts joined, experts split, value heads regrouped)."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from sloserve.checkpoint.gguf import GGUFCheckpoint
from sloserve.checkpoint.gguf_file import GGUFTensor
from sloserve.checkpoint.gguf_names import (
    ARCH_TENSORS,
    EXPERT_TENSORS,
    FUSED_EXPERTS,
    GPT_OSS_EXPERT_PARTS,
    GPT_OSS_EXPERTS,
    JOINED_TENSORS,
    LLAMA_TENSORS,
    LONGROPE_FACTORS,
    MAMBA2_ARCHS,
    MAMBA2_RESHAPED,
    PERMUTED,
    QWEN35_ARCHS,
    QWEN35_VALUE_HEAD_TENSORS,
    ROPE_FREQS,
    SHIFTED_NORMS,
)
from sloserve.core.errors import ConfigError


def _qwen35_value_heads_grouped(name: str, weight, config: dict[str, Any]):
    """A Qwen3.5 DeltaNet tensor with its value heads back in transformers' order. NOTE: where a key head has several
    value heads, llama.cpp's converter reorders them from grouped by key head (K0's v0, v1, then K1's) to tiled (K0's
    v0, K1's v0, K0's v1, K1's v1): in the value rows of ``attn_qkv``, the rows of ``attn_gate``, ``ssm_alpha`` and
    ``ssm_beta``, ``ssm_a``, ``ssm_dt``, the value channels of ``ssm_conv1d`` and the columns of ``ssm_out``."""
    import torch

    key_heads, value_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    kind = name.split(".")[2] if name.startswith("blk.") else None
    if key_heads == value_heads or kind not in QWEN35_VALUE_HEAD_TENSORS:
        return weight
    per_key = value_heads // key_heads

    def grouped(x, axis: int, head_width: int):  # (tiled: per_key, key_heads, head_width)
        tiled = x.reshape(*x.shape[:axis], per_key, key_heads, head_width, *x.shape[axis + 1 :])
        return tiled.swapaxes(axis, axis + 1).reshape(x.shape)

    width = config["linear_value_head_dim"]
    if kind in ("attn_qkv", "ssm_conv1d"):  # (the queries' and keys' rows or channels first, as they were)
        keys = 2 * key_heads * config["linear_key_head_dim"]
        return torch.cat([weight[:keys], grouped(weight[keys:], 0, width)])
    if kind == "ssm_out":
        return grouped(weight, 1, width)
    return grouped(weight, 0, width if kind == "attn_gate" else 1)


def _qwen3next_grouped_qkvz(qkv, z, config: dict[str, Any]):
    """Qwen3-Next's ``in_proj_qkvz`` (rows grouped by key head: its q, its k, its value heads' v, then z) from the
    converter's ``attn_qkv`` (all heads' q, then k, v) and ``attn_gate`` (z), as the checkpoint holds it."""
    import torch

    key_heads, key_width = config["linear_num_key_heads"], config["linear_key_head_dim"]
    group_values = config["linear_num_value_heads"] // key_heads * config["linear_value_head_dim"]
    q, k, v = qkv.split([key_heads * key_width] * 2 + [key_heads * group_values])
    parts = [part.reshape(key_heads, -1, qkv.shape[-1]) for part in (q, k, v, z)]  # (k heads, rows, H)
    return torch.cat(parts, dim=1).reshape(-1, qkv.shape[-1])


# How a joined tensor's two parts make the checkpoint's (``JOINED_TENSORS``; else the first's rows, then the second's)
JOINS = {"qwen3next": _qwen3next_grouped_qkvz}


def _unpermute(weight, num_heads: int):
    """Undo llama.cpp's row permutation of a Q or K projection (out_features, in_features)."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_tensors(checkpoint: GGUFCheckpoint, device: Any = "cpu", *, torch_dequantizes: bool | None = None):
    """(HF name, float32 tensor on ``device``) for each tensor of the file, dequantized, Q and K unpermuted.
    ``torch_dequantizes``: dequantize with torch on ``device`` each tensor whose format it reads
    (``gguf_dequant.DEQUANTIZED``: the bytes go there quantized), gguf-py on the CPU the others; ``None`` (the
    default): off the CPU only, gguf-py being faster on it (``gguf_dequant``). Bit-equal either way."""
    import torch

    device = torch.device(device)
    if torch_dequantizes is None:
        torch_dequantizes = device.type != "cpu"
    config = checkpoint.hf_config
    arch = checkpoint.metadata["general.architecture"]
    patterns = {}
    for gguf_name, hf_name in {**LLAMA_TENSORS, **ARCH_TENSORS[arch]}.items():
        if "{n}" in gguf_name:
            for n in range(config["num_hidden_layers"]):
                patterns[gguf_name.format(n=n)] = hf_name.format(n=n)
        else:
            patterns[gguf_name] = hf_name
    joins = {
        gguf_name.format(n=n): (hf_name.format(n=n), place)
        for gguf_name, (hf_name, place) in JOINED_TENSORS.get(arch, {}).items()
        for n in range(config["num_hidden_layers"])
    }
    joined: dict[str, dict[int, torch.Tensor]] = {}  # HF name -> the parts of it read so far, by place
    layers = config["num_hidden_layers"]
    # (the experts' count under transformers' names: Qwen's, Granite's, Nemotron-H's)
    num_experts = config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts")
    gpt_oss_experts: dict[str, dict[str, torch.Tensor]] = {}  # layer -> its experts' parts ("gate.weight"...)
    for tensor in checkpoint.reader.tensors:
        if tensor.name == ROPE_FREQS or tensor.name in LONGROPE_FACTORS.values():
            continue  # NOTE: the config's rope scaling (read_gguf), not a weight
        if arch in QWEN35_ARCHS and int(tensor.name.split(".")[1] if tensor.name.startswith("blk.") else 0) >= layers:
            continue  # NOTE: Qwen3.5's multi-token-prediction blocks, after its layers (_qwen35_config)
        weight = _dequantized(tensor, device, torch_dequantizes)
        if arch == "gpt-oss" and tensor.name.split(".")[2:3] and tensor.name.split(".")[2] in GPT_OSS_EXPERTS:
            _, n, kind, suffix = tensor.name.split(".")
            parts = gpt_oss_experts.setdefault(n, {})
            parts[f"{GPT_OSS_EXPERTS[kind]}.{suffix}"] = weight
            if len(parts) == len(GPT_OSS_EXPERT_PARTS):  # NOTE: a layer's experts yielded whole, then let go
                yield from _gpt_oss_experts(n, gpt_oss_experts.pop(n))
            continue
        if tensor.name in joins:  # NOTE: yielded once its two parts are read (gate and up; Qwen3-Next's qkv, z)
            name, place = joins[tensor.name]
            parts = joined.setdefault(name, {})
            parts[place] = weight
            if len(parts) == 2:
                first, second = parts[0], parts[1]
                yield name, JOINS[arch](first, second, config) if arch in JOINS else torch.cat([first, second])
                del joined[name]
            continue
        block, _, kind = tensor.name.removesuffix(".weight").rpartition(".")
        if kind in (*EXPERT_TENSORS, FUSED_EXPERTS) and num_experts and block.startswith("blk."):
            prefix = f"model.layers.{block.removeprefix('blk.')}.mlp.experts"  # (weight: (E, rows, cols))
            if kind == FUSED_EXPERTS:
                stacked = dict(zip(("gate_proj", "up_proj"), weight.chunk(2, dim=1)))
            else:
                stacked = {EXPERT_TENSORS[kind]: weight}
            for e in range(weight.shape[0]):
                yield from ((f"{prefix}.{e}.{part}.weight", experts[e]) for part, experts in stacked.items())
            continue
        if tensor.name not in patterns:
            raise ConfigError(f"{checkpoint.path}: unexpected GGUF tensor {tensor.name!r} for a {arch} model")
        yield patterns[tensor.name], _as_checkpoint_holds_it(arch, tensor.name, weight, config)
    for name in joined:  # (a tensor of which the file has one part)
        raise ConfigError(f"{checkpoint.path}: GGUF {arch} has half of {name!r} (its gate rows or its up rows)")
    for n, parts in gpt_oss_experts.items():  # (a layer that lacks some)
        gguf_names = {part: name for name, part in GPT_OSS_EXPERTS.items()}
        missing = [
            f"blk.{n}.{gguf_names[p.split('.')[0]]}.{p.split('.')[1]}" for p in GPT_OSS_EXPERT_PARTS if p not in parts
        ]
        raise ConfigError(f"{checkpoint.path}: GGUF gpt-oss layer {n}'s experts have no {', '.join(missing)}")


def _as_checkpoint_holds_it(arch: str, name: str, weight, config: dict[str, Any]):
    """The file's tensor ``name`` as the HF checkpoint holds it: Q and K rows unpermuted, Gemma's and Qwen3.5's norms
    less their 1, vectors and convolutions in HF's shapes, Mamba's A back to A_log, Qwen3.5's value heads regrouped."""
    import torch

    if arch in ("qwen35", "qwen35moe"):
        weight = _qwen35_value_heads_grouped(name, weight, config)
    if arch in PERMUTED and name.endswith("attn_q.weight"):
        weight = _unpermute(weight, config["num_attention_heads"])
    elif arch in PERMUTED and name.endswith("attn_k.weight"):
        weight = _unpermute(weight, config["num_key_value_heads"])
    elif arch in SHIFTED_NORMS and name.endswith("norm.weight") and not name.endswith("ssm_norm.weight"):
        weight -= 1.0
    elif name.endswith("ffn_gate_inp_shexp.weight"):
        weight = weight.reshape(1, -1)  # NOTE: llama.cpp's is a vector (n_embd), HF's a (1, H) projection
    elif name.endswith(("shortconv.conv.weight", "ssm_conv1d.weight")):
        weight = weight[:, None, :]  # NOTE: llama.cpp's (C, taps), a depthwise Conv1d's (C, 1, taps)
    if arch in MAMBA2_ARCHS and name.endswith(MAMBA2_RESHAPED):
        weight = weight.reshape(-1)
    if name.endswith(".ssm_a"):
        weight = torch.log(-weight)  # NOTE: the converter's A = -exp(A_log), back to A_log
    return weight


def _dequantized(tensor: GGUFTensor, device, torch_dequantizes: bool):
    """A tensor's weights as a float32 torch tensor of its own (writable) on ``device``."""
    import torch

    from sloserve.checkpoint.gguf_dequant import DEQUANTIZED, dequantize

    if torch_dequantizes and tensor.type_id in DEQUANTIZED:
        with warnings.catch_warnings():  # NOTE: a read-only view of the file, read only (dequantize's output is new)
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(tensor.data.reshape(-1).view(np.uint8))
        return dequantize(raw.to(device), tensor.type_id, tensor.shape)
    import gguf

    weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    if weights.dtype != np.float32 or not weights.flags.writeable:  # (an F32 tensor is a view of the file)
        weights = weights.astype(np.float32)
    return torch.from_numpy(weights).to(device)


def _gpt_oss_experts(n: str, parts: dict):
    """transformers' gpt-oss expert tensors of layer ``n`` from llama.cpp's ``parts`` ("gate.weight"...): gate
    and up (E, I, H) each interleaved into ``gate_up_proj`` (E, H, 2 I), gate in the even columns, their biases
    (E, I) into ``gate_up_proj_bias`` (E, 2 I); down (E, H, I) transposed to ``down_proj`` (E, I, H), its bias
    kept."""
    import torch

    gate, up = parts["gate.weight"], parts["up.weight"]
    experts, rows, hidden = gate.shape
    gate_up = torch.empty((experts, hidden, 2 * rows), dtype=torch.float32, device=gate.device)
    gate_up[:, :, ::2], gate_up[:, :, 1::2] = gate.transpose(1, 2), up.transpose(1, 2)
    bias = torch.empty((experts, 2 * rows), dtype=torch.float32, device=gate.device)
    bias[:, ::2], bias[:, 1::2] = parts["gate.bias"], parts["up.bias"]
    prefix = f"model.layers.{n}.mlp.experts"
    yield f"{prefix}.gate_up_proj", gate_up
    yield f"{prefix}.gate_up_proj_bias", bias
    yield f"{prefix}.down_proj", parts["down.weight"].transpose(1, 2).contiguous()
    yield f"{prefix}.down_proj_bias", parts["down.bias"]
