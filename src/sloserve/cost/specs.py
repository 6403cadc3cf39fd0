"""Model and GPU specifications, bundled registries, and KV-cache capacity (InferMax's M)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sloserve.core.errors import ConfigError, UnknownNameError

MLP_KINDS = ("gated", "relu")


def _check_positive_int(owner: str, field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{owner}: {field} must be a positive integer, got {value!r}")


def _check_positive_number(owner: str, field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{owner}: {field} must be a positive finite number, got {value!r}")


@dataclass(frozen=True)
class ModelSpec:
    """Architecture numbers of a decoder-only transformer (values of its HF ``config.json``).

    ``num_params`` counts every parameter (embeddings and LM head included). ``tied_embeddings``
    says whether the LM head shares the input embedding matrix (OPT: yes; Llama, Qwen2.5-7B: no).
    ``keys_only_kv``: the KV cache holds one tensor a token and layer, read as keys and as values
    (multi-head latent attention: DeepSeek's latent, one 576-wide "head"), not keys and values apart.
    A mixture of experts: ``num_experts`` routed experts a MoE layer, ``experts_per_token`` of them a token,
    ``expert_params`` the parameters of every routed expert of every layer (within ``num_params``; the
    router's and shared experts' are not: every token runs them); 0, 0, 0 for a dense model.
    ``prefill_head_dim``, ``prefill_kv_flops_per_token``: a second form of prefill attention, at that many
    numbers a head after that many FLOPs (all layers) expand each context token's cache entry into keys and
    values by head (MLA's prefills by head: 192, 2 L d_c nh (d_h + d_v)); 0, 0: none. ``kv_layers``: the layers
    with a KV cache and attention, where fewer than ``num_layers`` (a hybrid's: Granite 4.0-H's Mamba layers,
    LFM2's short convolutions keep a state a request instead; 0: a model of no attention, Mamba's, its tokens
    taking no memory); None: all of them. ``state_bytes_per_sequence``:
    those states, every layer's, a request's (0: none): a decode step reads and writes them, and the scheduler's
    slots' (at most ``STATE_SLOTS``) take memory from the KV cache. ``window_layers``, ``window_tokens``: of those
    attention layers, the ones whose query sees only the last ``window_tokens`` positions (a sliding window: Mistral
    7B v0.1's every layer, Gemma 3's five of six, gpt-oss's every other) or only those of its own chunk of that many
    (Llama 4's chunked layers: at most as many); 0, 0: none. Their cache holds every token, as the engine's does, but
    their attention reads only the keys a query sees.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_params: int
    max_context_len: int
    dtype_bytes: float = 2
    mlp_kind: str = "gated"  # "gated": SwiGLU (Llama, Qwen); "relu": two-matrix MLP (OPT)
    tied_embeddings: bool = False
    keys_only_kv: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    expert_params: int = 0
    prefill_head_dim: int = 0
    prefill_kv_flops_per_token: int = 0
    kv_layers: int | None = None
    state_bytes_per_sequence: int = 0
    window_layers: int = 0
    window_tokens: int = 0

    def __post_init__(self) -> None:
        owner = f"model spec {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"model spec: name must be a non-empty string, got {self.name!r}")
        for field in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "num_params",
            "max_context_len",
        ):
            _check_positive_int(owner, field, getattr(self, field))
        _check_positive_number(owner, "dtype_bytes", self.dtype_bytes)
        if self.mlp_kind not in MLP_KINDS:
            raise ConfigError(f"{owner}: mlp_kind must be one of {', '.join(MLP_KINDS)}, got {self.mlp_kind!r}")
        for field in (
            "num_experts",
            "experts_per_token",
            "expert_params",
            "prefill_head_dim",
            "prefill_kv_flops_per_token",
            "state_bytes_per_sequence",
            "window_layers",
            "window_tokens",
        ):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{owner}: {field} must be an integer >= 0, got {value!r}")
        if (self.num_experts > 0) != (self.experts_per_token > 0) or (self.num_experts > 0) != (self.expert_params > 0):
            raise ConfigError(f"{owner}: num_experts, experts_per_token and expert_params are all 0 or all positive")
        if self.experts_per_token > self.num_experts or self.expert_params > self.layer_params:
            raise ConfigError(
                f"{owner}: experts_per_token {self.experts_per_token} must be at most num_experts {self.num_experts}, "
                f"and expert_params {self.expert_params:,} at most the layers' {self.layer_params:,} parameters"
            )
        if (self.prefill_head_dim > 0) != (self.prefill_kv_flops_per_token > 0):
            raise ConfigError(f"{owner}: prefill_head_dim and prefill_kv_flops_per_token are both 0 or both positive")
        kv_layers = self.kv_layers
        if kv_layers is not None and (isinstance(kv_layers, bool) or not isinstance(kv_layers, int) or kv_layers < 0):
            raise ConfigError(f"{owner}: kv_layers must be an integer >= 0 or None (all), got {kv_layers!r}")
        if self.attention_layers > self.num_layers:
            raise ConfigError(f"{owner}: kv_layers {kv_layers} exceeds num_layers {self.num_layers}")
        if self.attention_layers == 0 and not self.state_bytes_per_sequence:
            raise ConfigError(
                f"{owner}: kv_layers 0 (no attention layer) needs state_bytes_per_sequence > 0: such a model's "
                "requests hold their context in states"
            )
        if (self.window_layers > 0) != (self.window_tokens > 0):
            raise ConfigError(f"{owner}: window_layers and window_tokens are both 0 or both positive")
        if self.window_layers > self.attention_layers:
            raise ConfigError(
                f"{owner}: window_layers {self.window_layers} exceeds the {self.attention_layers} attention layers"
            )
        if self.window_layers and self.prefill_head_dim:
            raise ConfigError(f"{owner}: windowed layers beside a second form of prefill attention are not modelled")
        if self.num_attention_heads % self.num_kv_heads:
            raise ConfigError(
                f"{owner}: num_kv_heads {self.num_kv_heads} must divide num_attention_heads {self.num_attention_heads}"
            )

    @property
    def kv_bytes_per_token(self) -> int | float:
        """Bytes of K and V for one token over all layers: 2 * layers * kv_heads * head_dim * dtype (half of
        that with ``keys_only_kv``)."""
        tensors = 1 if self.keys_only_kv else 2
        return tensors * self.attention_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def attention_layers(self) -> int:
        """The layers with attention and a KV cache (``kv_layers``, else every one)."""
        return self.num_layers if self.kv_layers is None else self.kv_layers

    @property
    def weight_bytes(self) -> int | float:
        """Bytes of all weights at ``dtype_bytes`` per parameter."""
        return self.num_params * self.dtype_bytes

    @property
    def embedding_params(self) -> int:
        """Parameters of the input embedding and LM head (counted once when tied)."""
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)

    @property
    def layer_params(self) -> int:
        """Parameters of the layers (decoder layers, norms): all minus embedding/LM head. A mixture of
        experts' token runs only ``active_layer_params`` of them."""
        return self.num_params - self.embedding_params

    @property
    def active_layer_params(self) -> float:
        """The layers' parameters one token runs: the dense ones and its ``experts_per_token`` experts a layer."""
        if not self.num_experts:
            return self.layer_params
        return self.layer_params - self.expert_params * (1 - self.experts_per_token / self.num_experts)

    def experts_reached(self, tokens):
        """The expected routed experts a MoE layer runs for ``tokens`` tokens (an int or an array), each token
        its ``experts_per_token`` experts drawn uniformly: E (1 - (1 - k / E) ** tokens).

        NOTE: uniform, independent routing (the balance MoE training aims for; a real router is skewed, so
        this is an upper bound on the weights a step reads). The power is numpy's for an int as for an array:
        the same bits either way (BROS prices a batch's prefixes as one array, ``step_seconds_with_decodes``)."""
        e, k = self.num_experts, self.experts_per_token
        return e * (1 - np.power(1 - k / e, np.asarray(tokens, dtype=np.float64)))

    def layer_params_read(self, tokens):
        """The layers' parameters a step of ``tokens`` tokens (> 0) reads: all of a dense model's; a mixture of
        experts' dense ones and the experts its tokens reach (``experts_reached``)."""
        if not self.num_experts:
            return self.layer_params
        return self.layer_params - self.expert_params * (1 - self.experts_reached(tokens) / self.num_experts)


@dataclass(frozen=True)
class HardwareSpec:
    """One GPU's published peak numbers. Bandwidths are per direction, in bytes per second."""

    name: str
    peak_flops: float  # dense BF16/FP16 tensor-core FLOP/s (no sparsity)
    hbm_bandwidth: float  # B/s
    memory_bytes: float  # decimal bytes as in the datasheet ("80GB" -> 80e9)
    pcie_bandwidth: float  # B/s one direction, host <-> GPU (KV swap)
    interconnect_bandwidth: float  # B/s one direction per GPU, GPU <-> GPU (NVLink; TP all-reduce)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"gpu spec: name must be a non-empty string, got {self.name!r}")
        owner = f"gpu spec {self.name!r}"
        for field in (
            "peak_flops",
            "hbm_bandwidth",
            "memory_bytes",
            "pcie_bandwidth",
            "interconnect_bandwidth",
        ):
            _check_positive_number(owner, field, getattr(self, field))


# Models: values from each model's Hugging Face config.json; num_params is the exact count of the
# released checkpoint (equal to the count derived from the config, checked in tests/cost/test_cost.py).
MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        # facebook/opt-13b config.json: 40 layers, hidden 5120, 40 heads, ffn_dim 20480,
        # vocab 50272, max_position_embeddings 2048, tied LM head, ReLU MLP.
        ModelSpec(
            "opt-13b", 40, 5120, 40, 40, 128, 20480, 50272, 12_853_473_280, 2048, mlp_kind="relu", tied_embeddings=True
        ),
        # facebook/opt-30b config.json: 48 layers, hidden 7168, 56 heads, ffn_dim 28672,
        # vocab 50272, max_position_embeddings 2048, tied LM head, ReLU MLP (BROS §7.4).
        ModelSpec(
            "opt-30b", 48, 7168, 56, 56, 128, 28672, 50272, 29_974_540_288, 2048, mlp_kind="relu", tied_embeddings=True
        ),
        # meta-llama/Llama-2-7b-hf config.json: 32 layers, hidden 4096, 32 heads (MHA),
        # intermediate 11008, vocab 32000, max_position_embeddings 4096.
        ModelSpec("llama-2-7b", 32, 4096, 32, 32, 128, 11008, 32000, 6_738_415_616, 4096),
        # meta-llama/Llama-2-13b-hf config.json: 40 layers, hidden 5120, 40 heads (MHA),
        # intermediate 13824, vocab 32000, max_position_embeddings 4096.
        ModelSpec("llama-2-13b", 40, 5120, 40, 40, 128, 13824, 32000, 13_015_864_320, 4096),
        # meta-llama/Llama-2-70b-hf config.json: 80 layers, hidden 8192, 64 heads, 8 KV heads,
        # intermediate 28672, vocab 32000, max_position_embeddings 4096.
        ModelSpec("llama-2-70b", 80, 8192, 64, 8, 128, 28672, 32000, 68_976_648_192, 4096),
        # meta-llama/Meta-Llama-3-8B config.json: 32 layers, hidden 4096, 32 heads, 8 KV heads,
        # intermediate 14336, vocab 128256, max_position_embeddings 8192.
        ModelSpec("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256, 8_030_261_248, 8192),
        # meta-llama/Meta-Llama-3-70B config.json: 80 layers, hidden 8192, 64 heads, 8 KV heads,
        # intermediate 28672, vocab 128256, max_position_embeddings 8192.
        ModelSpec("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256, 70_553_706_496, 8192),
        # Qwen/Qwen2.5-7B-Instruct config.json: 28 layers, hidden 3584, 28 heads, 4 KV heads,
        # intermediate 18944, vocab 152064, max_position_embeddings 32768 (the base model's config
        # says 131072; 32768 is the native context, longer needs YaRN). QKV projections have biases.
        ModelSpec("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064, 7_615_616_512, 32768),
    )
}

_GB = 1e9
# GPUs: NVIDIA datasheets (SXM form factor unless named). Datasheets quote bidirectional totals for
# PCIe and NVLink; we store one direction (half). Dense BF16 is half the "with sparsity" figure.
GPUS: dict[str, HardwareSpec] = {
    g.name: g
    for g in (
        # A100 datasheet: BF16 312 TFLOPS dense; 80GB HBM2e at 2,039 GB/s (SXM);
        # PCIe Gen4 64 GB/s (32 per direction); NVLink 600 GB/s (300 per direction).
        HardwareSpec("a100-80gb", 312e12, 2039 * _GB, 80 * _GB, 32 * _GB, 300 * _GB),
        # A100 datasheet: 40GB HBM2 at 1,555 GB/s (SXM); other numbers as A100 80GB.
        HardwareSpec("a100-40gb", 312e12, 1555 * _GB, 40 * _GB, 32 * _GB, 300 * _GB),
        # H100 SXM datasheet: BF16 1,979 TFLOPS with sparsity (989 dense); 80GB HBM3 at 3.35 TB/s;
        # PCIe Gen5 128 GB/s (64 per direction); NVLink 900 GB/s (450 per direction).
        HardwareSpec("h100", 989e12, 3350 * _GB, 80 * _GB, 64 * _GB, 450 * _GB),
        # H200 SXM datasheet: BF16 1,979 TFLOPS with sparsity (989 dense); 141GB HBM3e at
        # 4.8 TB/s; PCIe Gen5 128 GB/s; NVLink 900 GB/s.
        HardwareSpec("h200", 989e12, 4800 * _GB, 141 * _GB, 64 * _GB, 450 * _GB),
        # A30 datasheet: BF16 165 TFLOPS dense (330 with sparsity); 24GB HBM2 at 933 GB/s;
        # PCIe Gen4 64 GB/s; third-generation NVLink bridge 200 GB/s (100 per direction).
        HardwareSpec("a30", 165e12, 933 * _GB, 24 * _GB, 32 * _GB, 100 * _GB),
        # H100 PCIe datasheet: BF16 1,513 TFLOPS with sparsity (756 dense); 80GB HBM2e at 2.0 TB/s; PCIe Gen5
        # 128 GB/s; NVLink bridge 600 GB/s (300 per direction).
        HardwareSpec("h100-pcie", 756e12, 2000 * _GB, 80 * _GB, 64 * _GB, 300 * _GB),
        # HGX B200 datasheet, a GPU's share at 1,000 W: FP16/BF16 4.5 PFLOPS with sparsity (2.25 dense); 180GB
        # HBM3e (1.44 TB for 8) at 8 TB/s; NVLink 5 1.8 TB/s (900 per direction); PCIe Gen5 to the host.
        HardwareSpec("b200", 2250e12, 8000 * _GB, 180 * _GB, 64 * _GB, 900 * _GB),
        # L40S datasheet: BF16 362.05 TFLOPS dense (733 with sparsity); 48GB GDDR6 at 864 GB/s; PCIe Gen4
        # 64 GB/s; no NVLink: GPU to GPU over PCIe as well (32 per direction).
        HardwareSpec("l40s", 362.05e12, 864 * _GB, 48 * _GB, 32 * _GB, 32 * _GB),
        # L4 datasheet: BF16 242 TFLOPS with sparsity (121 dense); 24GB GDDR6 at 300 GB/s; PCIe Gen4 64 GB/s;
        # no NVLink (as L40S).
        HardwareSpec("l4", 121e12, 300 * _GB, 24 * _GB, 32 * _GB, 32 * _GB),
        # AMD Instinct MI300X datasheet: BF16 1,307.4 TFLOPS dense (2,614.9 with sparsity); 192GB HBM3 at
        # 5.3 TB/s; PCIe Gen5 128 GB/s; 7 Infinity Fabric links of 128 GB/s, 896 GB/s in all (448 per direction).
        HardwareSpec("mi300x", 1307.4e12, 5300 * _GB, 192 * _GB, 64 * _GB, 448 * _GB),
    )
}

GPU_ALIASES: dict[str, str] = {"a100": "a100-80gb", "h100-sxm": "h100", "h200-sxm": "h200", "hgx-b200": "b200"}
# The name a device reports (``torch.cuda.get_device_name``, nvidia-smi's "name"), lower-cased, of each bundled GPU.
# NOTE: variants with other peaks are left out rather than matched to a sibling: H100 NVL and H200 NVL (other
# clocks and power), A100 80GB PCIe (1,935 GB/s), the A100 PCIe 40GB (250 W).
DEVICE_NAMES: dict[str, str] = {
    "nvidia h100 80gb hbm3": "h100",
    "nvidia h100 pcie": "h100-pcie",
    "nvidia h200": "h200",
    "nvidia a100-sxm4-80gb": "a100-80gb",
    "nvidia a100-sxm4-40gb": "a100-40gb",
    "nvidia a30": "a30",
    "nvidia l40s": "l40s",
    "nvidia l4": "l4",
    "nvidia b200": "b200",
    "amd instinct mi300x": "mi300x",
}


def get_model(name: str) -> ModelSpec:
    """The bundled ``ModelSpec`` called ``name`` (case-insensitive); ``UnknownNameError`` if none."""
    key = name.strip().lower()
    if key not in MODELS:
        raise UnknownNameError("model", name, list(MODELS))
    return MODELS[key]


def get_gpu(name: str) -> HardwareSpec:
    """The bundled ``HardwareSpec`` called ``name`` or an alias (``a100`` = ``a100-80gb``)."""
    key = name.strip().lower()
    key = GPU_ALIASES.get(key, key)
    if key not in GPUS:
        raise UnknownNameError("gpu", name, [*GPUS, *GPU_ALIASES])
    return GPUS[key]


def gpu_of_device(device_name: str) -> HardwareSpec | None:
    """The bundled ``HardwareSpec`` of the device that reports ``device_name`` (``torch.cuda.get_device_name``:
    "NVIDIA H100 80GB HBM3" is ``h100``); None for a device whose peaks are not bundled."""
    key = DEVICE_NAMES.get(" ".join(device_name.split()).lower())
    return None if key is None else GPUS[key]


def check_tensor_parallel(model: ModelSpec, num_gpus: int) -> None:
    """``ConfigError`` unless ``num_gpus`` is a positive integer dividing the attention heads."""
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
        raise ConfigError(f"num_gpus must be a positive integer, got {num_gpus!r}")
    if model.num_attention_heads % num_gpus:
        raise ConfigError(
            f"tensor parallel degree {num_gpus} must divide num_attention_heads "
            f"{model.num_attention_heads} of model {model.name}"
        )


# Fixed per-GPU memory outside weights, KV and activations: CUDA context, cuBLAS/NCCL workspaces,
# CUDA graphs. ~1 GiB is what vLLM-style engines typically leave for these.
FIXED_RESERVE_BYTES_PER_GPU = 1 << 30
# The requests a model with per-request states (Mamba-2 layers, short convolutions) keeps them for at most (vLLM's
# max_num_seqs); their
# memory comes off the KV cache's (``kv_capacity_tokens``, the engine's ``StateCache`` on CUDA)
STATE_SLOTS = 256


def default_activation_reserve(model: ModelSpec, num_gpus: int = 1) -> float:
    """Default memory held back per deployment (all GPUs) besides weights and KV, in bytes.

    Per GPU: ``FIXED_RESERVE_BYTES_PER_GPU`` plus the peak activations of one forward pass of
    ``max_context_len`` tokens: ~4 hidden-sized buffers (residual, normed input, attention output,
    MLP output) plus the MLP's intermediate buffers (2 for gated, 1 for ReLU), the latter split by TP.
    """
    mlp_buffers = 2 if model.mlp_kind == "gated" else 1
    per_token = 4 * model.hidden_size + mlp_buffers * model.intermediate_size / num_gpus
    activations = model.max_context_len * per_token * model.dtype_bytes
    return num_gpus * (FIXED_RESERVE_BYTES_PER_GPU + activations)


def kv_capacity_tokens(
    model: ModelSpec,
    gpu: HardwareSpec,
    *,
    num_gpus: int = 1,
    memory_utilization: float = 0.9,
    activation_reserve_bytes: float | None = None,
    state_slots: int = STATE_SLOTS,
) -> int:
    """How many tokens of KV cache fit (InferMax's M): (num_gpus * memory * utilization - weights -
    activation reserve - ``state_slots`` requests' states) / kv_bytes_per_token; a model of no attention (0 bytes a
    token) as many as its slots' requests hold, ``state_slots`` x max_context_len, where their states fit. With
    tensor parallelism both the weights and each token's KV are split across GPUs, so the totals are unchanged and
    memory sums.

    ``activation_reserve_bytes`` is the total over all GPUs (default: ``default_activation_reserve``).
    ``state_slots``: the requests a model with state layers keeps states for (``registry.state_slots``: the
    scheduler's max_num_seqs, at most ``STATE_SLOTS``, as the engine reserves them).
    Raises ``ConfigError`` if the weights (or weights plus reserve) do not fit.
    """
    check_tensor_parallel(model, num_gpus)
    if (
        isinstance(memory_utilization, bool)
        or not isinstance(memory_utilization, (int, float))
        or not 0 < memory_utilization <= 1
    ):
        raise ConfigError(f"memory_utilization must be in (0, 1], got {memory_utilization!r}")
    if activation_reserve_bytes is None:
        activation_reserve_bytes = default_activation_reserve(model, num_gpus)
    elif not math.isfinite(activation_reserve_bytes) or activation_reserve_bytes < 0:
        raise ConfigError(f"activation_reserve_bytes must be a non-negative number, got {activation_reserve_bytes!r}")
    usable = num_gpus * gpu.memory_bytes * memory_utilization
    where = f"{num_gpus}x {gpu.name} at memory utilization {memory_utilization:g} ({usable / 1e9:.0f} GB)"
    if model.weight_bytes >= usable:
        raise ConfigError(
            f"model {model.name} ({model.weight_bytes / 1e9:.0f} GB of weights) does not fit on "
            f"{where}; use more GPUs or a bigger GPU"
        )
    states = state_slots * model.state_bytes_per_sequence
    free = usable - model.weight_bytes - activation_reserve_bytes - states
    if free <= 0:
        tokens = 0
    elif not model.kv_bytes_per_token:  # (no attention: its tokens take no memory; its slots' requests hold them all)
        tokens = state_slots * model.max_context_len
    else:
        tokens = int(free // model.kv_bytes_per_token)
    if tokens < 1:
        of_states = f" and {states / 1e9:.1f} GB of {state_slots} requests' states" if states else ""
        raise ConfigError(
            f"model {model.name} ({model.weight_bytes / 1e9:.0f} GB of weights) plus "
            f"{activation_reserve_bytes / 1e9:.1f} GB of activation reserve{of_states} leaves no room for KV "
            f"cache on {where}; use more GPUs, a bigger GPU or a higher memory utilization"
        )
    return tokens
