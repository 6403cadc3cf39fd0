"""GGML's quantized formats dequantized with torch, on the device the weights are loaded to.

gguf-py dequantizes with numpy on one core: on a 2-core VM a 4096 x 4096 Q4_K matrix took 0.12-0.21 s, a whole
Llama-3-8B Q4_K_M file about 100 s, most of a GGUF model's start. On a GPU the same arithmetic is a few
elementwise kernels over the tensor's bytes, copied there quantized (4.5 bits a weight for Q4_K, not 32).

Each format follows gguf-py's ``dequantize_blocks`` operation for operation: the same float32 products and
sums in the same order, each its own kernel (no fused multiply-add), so the weights are bit-equal to
gguf-py's on any device (tests/engine/test_gguf_dequant.py). Formats: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0, the K-quants Q2_K-Q6_K (llama.cpp's ``Q*_K_S``/``Q*_K_M`` files mix them) and MXFP4 (gpt-oss's experts).
The others (IQ*, TQ*, NVFP4) stay gguf-py's: ``DEQUANTIZED`` tells which.

On the CPU the engine keeps gguf-py: this port ran at 0.34-0.97x its speed there on 2 cores
(``python benchmarks/gguf_dequant.py``), which also times it on CUDA where there is one.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

QK_K = 256  # a K-quant's super-block: 256 weights
# Dequantized at most this many weights at a time: the intermediates (a few times the output's bytes) stay
# small beside a model already on the device (a Llama 3 embedding is 525M weights)
CHUNK_WEIGHTS = 1 << 24


def _u8(values: list[int], shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8, device=device).reshape(shape)


def _as(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A slice of each block's bytes read as ``dtype`` (little-endian, as ggml writes them): (n, k) -> (n, k / size).
    NOTE: copied first: a view's storage offset must be a multiple of ``dtype``'s size, a slice's is not."""
    return blocks.clone(memory_format=torch.contiguous_format).view(dtype)


def _f16(blocks: torch.Tensor) -> torch.Tensor:
    """A block's float16 scale as float32: (n, 2) bytes -> (n, 1)."""
    return _as(blocks, torch.float16).float()


def _nibbles(qs: torch.Tensor, width: int) -> torch.Tensor:
    """Low nibbles of each ``width`` bytes, then their high nibbles: (n, m) -> (n, m / width, 2, width)."""
    n = qs.shape[0]
    return (qs.reshape(n, -1, 1, width) >> _u8([0, 4], (1, 1, 2, 1), qs.device)) & 0x0F


def _bits(qh: torch.Tensor, count: int, step: int, mask: int) -> torch.Tensor:
    """Each byte's ``count`` fields of ``step`` bits, the lowest first: (n, m) -> (n, m / 32, count, 32)."""
    n = qh.shape[0]
    shifts = _u8(list(range(0, count * step, step)), (1, 1, count, 1), qh.device)
    return (qh.reshape(n, -1, 1, 32) >> shifts) & mask


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:  # (n, 18) -> (n, 32)
    n = blocks.shape[0]
    d = _f16(blocks[:, :2])
    qs = _nibbles(blocks[:, 2:], 16).reshape(n, -1).to(torch.int8) - 8
    return d * qs.float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:  # (n, 20) -> (n, 32)
    n = blocks.shape[0]
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    qs = _nibbles(blocks[:, 4:], 16).reshape(n, -1).float()
    return (d * qs) + m


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0's and Q5_1's fifth bits: 4 bytes, one bit a weight -> (n, 32) uint8 of 0 or 1."""
    # NOTE: as int32 (torch's shifts want a signed type): an arithmetic shift's sign bits are masked off
    words = _as(qh, torch.int32)  # (n, 1)
    return ((words >> torch.arange(32, dtype=torch.int32, device=qh.device)) & 1).to(torch.uint8)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:  # (n, 22) -> (n, 32)
    n = blocks.shape[0]
    d, qh = _f16(blocks[:, :2]), _high_bits(blocks[:, 2:6])
    ql = _nibbles(blocks[:, 6:], 16).reshape(n, -1)
    qs = (ql | (qh << 4)).to(torch.int8) - 16
    return d * qs.float()


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:  # (n, 24) -> (n, 32)
    n = blocks.shape[0]
    d, m, qh = _f16(blocks[:, :2]), _f16(blocks[:, 2:4]), _high_bits(blocks[:, 4:8])
    ql = _nibbles(blocks[:, 8:], 16).reshape(n, -1)
    qs = (ql | (qh << 4)).float()
    return (d * qs) + m


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:  # (n, 34) -> (n, 32)
    d = _f16(blocks[:, :2])
    return _as(blocks[:, 2:], torch.int8).float() * d


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:  # (n, 84) -> (n, 256)
    n = blocks.shape[0]
    scales, qs = blocks[:, :16], blocks[:, 16:80]
    d, dmin = _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
    dl = (d * (scales & 0xF).float()).reshape(n, 16, 1)  # 16 sub-blocks of 16
    ml = (dmin * (scales >> 4).float()).reshape(n, 16, 1)
    q = _bits(qs, 4, 2, 3).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:  # (n, 110) -> (n, 256)
    n = blocks.shape[0]
    hmask, qs, packed, d = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108], _f16(blocks[:, 108:110])
    # 16 scales of 6 bits: the low 4 in bytes 0-7 (low nibbles, then high), the top 2 in bytes 8-11
    low = (packed[:, :8].reshape(n, 1, 8) >> _u8([0, 4], (1, 2, 1), blocks.device)).reshape(n, 16)
    high = (packed[:, 8:].reshape(n, 1, 4) >> _u8([0, 2, 4, 6], (1, 4, 1), blocks.device)).reshape(n, 16)
    scales = ((low & 0x0F) | ((high & 0x03) << 4)).to(torch.int8) - 32
    dl = (d * scales.float()).reshape(n, 16, 1)
    ql = _bits(qs, 4, 2, 3).reshape(n, 16, 16)
    qh = _bits(hmask, 8, 1, 1).reshape(n, 16, 16) ^ 1  # (a set bit means no offset of -4)
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).float()
    return (dl * q).reshape(n, QK_K)


def _scale_min_k4(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's 8 scales and 8 mins of 6 bits from 12 bytes: (n, 12) -> ((n, 8), (n, 8))."""
    n = packed.shape[0]
    packed = packed.reshape(n, 3, 4)
    d, m, m_d = packed[:, 0:1], packed[:, 1:2], packed[:, 2:3]
    scales = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return scales.reshape(n, 8), mins.reshape(n, 8)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:  # (n, 144) -> (n, 256)
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    scales, mins = _scale_min_k4(blocks[:, 4:16])
    dl = (d * scales.float()).reshape(n, -1, 1)  # 8 sub-blocks of 32
    ml = (dmin * mins.float()).reshape(n, -1, 1)
    q = _nibbles(blocks[:, 16:], 32).reshape(n, -1, 32).float()
    return (dl * q - ml).reshape(n, QK_K)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:  # (n, 176) -> (n, 256)
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    scales, mins = _scale_min_k4(blocks[:, 4:16])
    dl = (d * scales.float()).reshape(n, -1, 1)
    ml = (dmin * mins.float()).reshape(n, -1, 1)
    ql = _nibbles(blocks[:, 48:], 32).reshape(n, -1, 32)
    qh = _bits(blocks[:, 16:48], 8, 1, 1).reshape(n, -1, 32)
    q = (ql | (qh << 4)).float()
    return (dl * q - ml).reshape(n, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:  # (n, 210) -> (n, 256)
    n = blocks.shape[0]
    ql, qh, scales, d = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208], _f16(blocks[:, 208:210])
    dl = (d * _as(scales, torch.int8).float()).reshape(n, 16, 1)
    low = _nibbles(ql, 64).reshape(n, -1, 32)
    high = _bits(qh, 4, 2, 3).reshape(n, -1, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, -1).float()
    return (dl * q).reshape(n, QK_K)


# MXFP4's e2m1 values, doubled (its scale is halved to match: ggml's ``ggml_e8m0_to_fp32_half``)
MXFP4_VALUES = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]


def _mxfp4(blocks: torch.Tensor) -> torch.Tensor:  # (n, 17) -> (n, 32): gpt-oss's experts
    n = blocks.shape[0]
    e = blocks[:, :1].to(torch.int32)  # the scale's exponent (e8m0), halved below
    d = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23).view(torch.float32)
    values = torch.tensor(MXFP4_VALUES, dtype=torch.int8, device=blocks.device)
    q = values[_nibbles(blocks[:, 1:], 16).reshape(n, 32).long()]
    return d * q.float()


def _bf16_weights(blocks: torch.Tensor) -> torch.Tensor:  # (n, 2) -> (n, 1)
    return _as(blocks, torch.bfloat16).float()


def _f32_weights(blocks: torch.Tensor) -> torch.Tensor:  # (n, 4) -> (n, 1)
    return _as(blocks, torch.float32)


# ggml's type id (gguf.GGMLQuantizationType) -> (weights a block, bytes a block, the block's dequantization)
DEQUANTIZED: dict[int, tuple[int, int, Callable[[torch.Tensor], torch.Tensor]]] = {
    0: (1, 4, _f32_weights),  # F32
    1: (1, 2, _f16),  # F16
    30: (1, 2, _bf16_weights),  # BF16
    2: (32, 18, _q4_0),
    3: (32, 20, _q4_1),
    6: (32, 22, _q5_0),
    7: (32, 24, _q5_1),
    8: (32, 34, _q8_0),
    10: (QK_K, 84, _q2_k),
    11: (QK_K, 110, _q3_k),
    12: (QK_K, 144, _q4_k),
    13: (QK_K, 176, _q5_k),
    14: (QK_K, 210, _q6_k),
    39: (32, 17, _mxfp4),
}


def dequantize(raw: torch.Tensor, type_id: int, shape: tuple[int, ...]) -> torch.Tensor:
    """float32 weights of ``shape`` (numpy's order, the last dimension ggml's rows) from a tensor's bytes ``raw``
    (uint8, any shape, on the device to dequantize on), of ggml type ``type_id`` (one of ``DEQUANTIZED``)."""
    block_weights, block_bytes, blocks_to_weights = DEQUANTIZED[type_id]
    count = math.prod(shape)
    if count % block_weights or raw.numel() != count // block_weights * block_bytes:
        raise ValueError(f"{raw.numel():,} bytes are not {shape} weights of ggml type {type_id}")
    blocks = raw.reshape(-1, block_bytes)  # (n, block_bytes)
    out = torch.empty(blocks.shape[0], block_weights, dtype=torch.float32, device=raw.device)
    step = max(1, CHUNK_WEIGHTS // block_weights)
    for start in range(0, blocks.shape[0], step):
        out[start : start + step] = blocks_to_weights(blocks[start : start + step])
    return out.reshape(shape)
