"""Build a model from a local HF directory, a GGUF file or a named random shape (``random:NAME``).
Nothing is ever downloaded: a missing directory or file is a ConfigError naming it."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from sloserve.checkpoint.config import RANDOM_PREFIX, from_hf_config, load_hf_config, random_config
from sloserve.checkpoint.gguf import is_gguf, read_gguf
from sloserve.checkpoint.gguf_tensors import gguf_tensors
from sloserve.checkpoint.model_config import ModelConfig
from sloserve.core.errors import ConfigError
from sloserve.engine.attention_selector import BACKENDS, triton_available
from sloserve.engine.c_heap import keep_freed_memory
from sloserve.engine.models import (
    check_config_fits_checkpoint,
    checkpoint_shapes,
    copy_weights,
    create_model,
    init_random_,
    load_weights,
    stores_lm_head,
)
from sloserve.engine.models.moe import use_fused_experts
from sloserve.engine.switches import switch
from sloserve.engine.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    tokenizer: ByteTokenizer | HFTokenizer | None  # None: prompts must be token ids
    dtype: torch.dtype
    device: torch.device
    attention_backend: str = "torch"  # the backend's name (resolve_attention_backend)
    cuda_graphs: bool = False  # decode-only steps replay CUDA graphs (cuda_graphs.DecodeGraphs)


def resolve_device(device: str) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N``; CUDA without a GPU is a ConfigError."""
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"unknown device {device!r}; use cpu or cuda") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but CUDA is not available on this machine")
    if resolved.type not in ("cpu", "cuda"):
        raise ConfigError(f"unsupported device {device!r}; use cpu or cuda")
    return resolved


def resolve_dtype(dtype: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    """``auto``: float32 on the CPU (exact tests), the checkpoint's dtype on CUDA."""
    if dtype == "auto":
        dtype = "float32" if device.type == "cpu" else config.torch_dtype
        dtype = dtype if dtype in DTYPES else "bfloat16"
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; valid: auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """``auto``: ``triton`` on CUDA when triton is installed, else ``torch`` (the reference).
    ``triton`` on the CPU runs only under Triton's interpreter (``TRITON_INTERPRET=1``, for tests)."""
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if name not in BACKENDS:
        raise ConfigError(f"unknown attention backend {name!r}; valid: auto, {', '.join(BACKENDS)}")
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError(
            f"attention backend 'triton' runs on CUDA, not on {device.type} (on the CPU only under "
            "Triton's interpreter, TRITON_INTERPRET=1); use 'torch' there"
        )
    return name


def cuda_graphs_supported(device: torch.device, backend_name: str) -> bool:
    """CUDA graphs need a CUDA device and the Triton backend: the PyTorch reference groups decodes by
    length on the host (``AttentionMetadata.decode_groups``), which a graph cannot replay."""
    return device.type == "cuda" and backend_name == "triton"


def check_cuda_graphs(device: torch.device, backend_name: str) -> None:
    """A ConfigError naming the device and backend unless ``cuda_graphs_supported``."""
    if not cuda_graphs_supported(device, backend_name):
        raise ConfigError(
            f"CUDA graphs need device cuda and the triton attention backend, got device {device.type} "
            f"and the {backend_name} backend"
        )


def load_model(
    model: str,
    *,
    device: str = "cpu",
    dtype: str = "auto",
    seed: int = 0,
    attention_backend: str = "auto",
    cuda_graphs: bool | None = None,
) -> LoadedModel:
    """``model`` is a local HF directory (config.json, *.safetensors, tokenizer.json), a GGUF file
    (``checkpoint/gguf.py``: dequantized to float32) or ``random:NAME`` (``RANDOM_SHAPES``: random weights from ``seed``, byte tokenizer).
    ``attention_backend``: ``auto``, ``torch`` or ``triton`` (``resolve_attention_backend``).
    ``cuda_graphs``: engines on this model replay decode-only steps as CUDA graphs (``check_cuda_graphs``);
    ``None`` (the default): wherever they are supported, that is on CUDA with the Triton backend."""
    if not -(2**63) <= seed < 2**64:  # torch.manual_seed's range (random weights are drawn from it)
        raise ConfigError(f"seed must be in -2**63..2**64-1, torch's range, got {seed}")
    dev = resolve_device(device)
    if dev.type == "cpu" and switch("SLOSERVE_KEEP_FREED_MEMORY", default=True):
        keep_freed_memory()  # (a step's large tensors in the memory the step before freed: c_heap.py)
    # NOTE: fused_ops reads this switch at import (every kernel call checks ENABLED): a bad value is
    # refused here, when a model is loaded, as the other switches are when their part is built
    switch("SLOSERVE_FUSED_KERNELS", default=True)
    path = Path(model).expanduser()
    checkpoint = None
    if model.startswith(RANDOM_PREFIX):
        config = random_config(model[len(RANDOM_PREFIX) :])
    elif is_gguf(model):
        checkpoint = read_gguf(path)
        config = from_hf_config(checkpoint.hf_config, name=path.stem)
        shapes = {tensor.name: tensor.shape for tensor in checkpoint.reader.tensors}
        check_config_fits_checkpoint(config, shapes, f"GGUF file {path}")
    else:
        config = load_hf_config(path)
        multimodal = config.extra.get("multimodal_checkpoint", False)
        shapes = checkpoint_shapes(path, multimodal)
        if multimodal:
            config = dataclasses.replace(config, tie_word_embeddings=not stores_lm_head(shapes))
        check_config_fits_checkpoint(config, shapes, f"model directory {path}")
    backend_name = resolve_attention_backend(attention_backend, dev)
    # A mixture of experts' tokens through fused_moe's kernels where the Triton backend runs: on CUDA unless
    # SLOSERVE_FUSED_MOE=0 (an H200, 2026-12-04: four MoE models' greedy tokens, a layer 7.7-54x as fast as by
    # expert; benchmarks/RESULTS.md), in Triton's interpreter with SLOSERVE_FUSED_MOE=1
    fused_moe = (
        switch("SLOSERVE_FUSED_MOE", default=dev.type == "cuda")
        and config.is_moe
        and backend_name == "triton"
        and config.moe_experts_gated
    )
    if cuda_graphs is None:
        # NOTE: on by default since the H200 session of 2026-11-26: capture and replay gave the eager
        # engine's tokens there, and decode steps ran 1.07-1.66x faster (benchmarks/RESULTS.md). Not for
        # a mixture of experts by the reference: its routing decides its shapes (models/moe.py).
        cuda_graphs = cuda_graphs_supported(dev, backend_name) and (not config.is_moe or fused_moe)
    elif cuda_graphs:
        check_cuda_graphs(dev, backend_name)
        if config.is_moe and not fused_moe:
            raise ConfigError(
                f"CUDA graphs cannot replay {config.name}'s mixture of experts (its routing sets its shapes; "
                "SLOSERVE_FUSED_MOE=1, the default on CUDA, runs it on kernels they can)"
            )
    torch_dtype = resolve_dtype(dtype, config, dev)
    net = create_model(config, BACKENDS[backend_name](), torch_dtype, dev)
    if fused_moe:
        use_fused_experts(net)
    if model.startswith(RANDOM_PREFIX):
        init_random_(net, seed)
        tokenizer = ByteTokenizer()
    elif checkpoint is not None:
        weights = gguf_tensors(checkpoint, dev)  # (dequantized on the GPU where the model is on one)
        copy_weights(net, ((path, name, weight) for name, weight in weights), f"GGUF file {path}")
        tokenizer = load_tokenizer(path)
    else:
        load_weights(net, path)
        tokenizer = load_tokenizer(path)
    return LoadedModel(net, config, tokenizer, torch_dtype, dev, backend_name, cuda_graphs)
