"""Fused elementwise kernels for the Llama family's decode path on CUDA: the rotary embedding (five
kernels in PyTorch: two products, a negation, a concatenation and a sum), SiLU-and-multiply (two) and
the residual stream's add with the RMSNorm after it (two: vLLM's ``fused_add_rms_norm``) each become
one Triton kernel, which reads its inputs once and writes its outputs once; so does the store of a
step's keys and values into the KV cache (two index copies: vLLM's ``reshape_and_cache``).

Why: a decode step's elementwise work is tiny, but each kernel costs a launch slot and a few
microseconds of ramp even inside a CUDA graph, and a layer runs these 13 kernels, 5 once fused: 256
fewer a 32-layer step (benchmarks/engine_speed.py lists where a step's GPU time goes).

NOTE: each kernel rounds where PyTorch's kernels round (every product and sum to the tensor's dtype),
so the rotary output (its launch forbids fused multiply-adds) and, on bf16/fp16, the residual sum equal
the unfused ones bit for bit; SiLU's exponential may differ from PyTorch's in a last place, and the
norm's sum of squares is added in another order. In those on float32 the GPU may contract a product
and a sum into one fused multiply-add (one rounding less).

``rotary``, ``silu_and_mul``, ``add_rms_norm`` and ``write_kv`` dispatch: the Triton kernel for a CUDA tensor while
``ENABLED``, PyTorch elsewhere, and while ``torch.compile`` traces (inductor fuses the PyTorch forms).
Tests run the kernels on the CPU in Triton's interpreter (``rotary_triton``, ``silu_and_mul_triton``,
``add_rms_norm_triton``, ``write_kv_triton``) against the PyTorch forms.

On unless ``SLOSERVE_FUSED_KERNELS=0`` is in the environment (``load_model`` refuses a value other than
0 or 1): checked against the references on an H200 (2026-11-29; with the split decodes, a decode step
1.11-1.30x as fast: benchmarks/RESULTS.md).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU engine never needs them
    triton = None

ENABLED = os.environ.get("SLOSERVE_FUSED_KERNELS", "1") == "1"  # the CUDA path uses the fused kernels


def rotary_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, hd); cos, sin: (T, 1, hd) (rotate-half layout)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2 I) -> (T, I): silu(gate) * up."""
    i = gate_up.shape[-1] // 2
    return F.silu(gate_up[:, :i]) * gate_up[:, i:]


def add_rms_norm_torch(
    x: torch.Tensor,  # (T, H) a layer's output, to join the residual stream
    residual: torch.Tensor,  # (T, H) the stream before it
    weight: torch.Tensor,  # (H,)
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (T, H) each
    """(RMSNorm of the sum, the sum): the residual stream after ``x`` joins it and its normalized form."""
    summed = x + residual
    return F.rms_norm(summed, weight.shape, weight, eps), summed


def write_kv_torch(
    k: torch.Tensor,  # (T, nkv, hd) this step's keys
    v: torch.Tensor | None,  # (T, nkv, hd) and values (None: a keys-only cache's, MLA's)
    k_cache: torch.Tensor,  # (num_slots, nkv, hd)
    v_cache: torch.Tensor | None,  # (num_slots, nkv, hd)
    slot_mapping: torch.Tensor,  # (T,) int64, the slot of each token
) -> None:
    """Store each token's K and V at its slot of the caches."""
    # NOTE: index_copy_ on dim 0 copies whole rows; advanced indexing (cache[slots] = ...) is several
    # times slower on the CPU
    k_cache.index_copy_(0, slot_mapping, k)
    if v is not None:
        v_cache.index_copy_(0, slot_mapping, v)


def _use_triton(x: torch.Tensor) -> bool:
    # NOTE: not while torch.compile traces (``piecewise_graphs.compiled_pieces``): inductor fuses the
    # PyTorch forms itself, with the ops around them
    return ENABLED and x.is_cuda and triton is not None and not torch.compiler.is_compiling()


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return rotary_triton(x, cos, sin) if _use_triton(x) else rotary_torch(x, cos, sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return silu_and_mul_triton(gate_up) if _use_triton(gate_up) else silu_and_mul_torch(gate_up)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if _use_triton(x):
        return add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_torch(x, residual, weight, eps)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor,
) -> None:
    # (keys only, MLA's: one index_copy_, already one kernel)
    fused = v is not None and _use_triton(k) and _rows_contiguous(k) and _rows_contiguous(v)
    if fused and k_cache.is_contiguous():
        write_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        write_kv_torch(k, v, k_cache, v_cache, slot_mapping)


def _rows_contiguous(x: torch.Tensor) -> bool:
    """Whether each token's heads of ``x`` (T, heads, hd) lie in one contiguous row."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


if triton is not None:

    @triton.jit
    def _rotary_kernel(
        x_ptr,  # (T, heads, hd), last dim contiguous
        cos_ptr,  # (T, 1, hd)
        sin_ptr,  # (T, 1, hd)
        out_ptr,  # (T, heads, hd) contiguous
        num_heads,
        stride_x_token,
        stride_x_head,
        stride_cos_token,
        stride_sin_token,
        HALF: tl.constexpr,
        HALF_PAD: tl.constexpr,  # power of two
        BLOCK_H: tl.constexpr,  # heads per program
    ):
        token = tl.program_id(0)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # (BLOCK_H,)
        d = tl.arange(0, HALF_PAD)  # (HALF_PAD,)
        ok = (h < num_heads)[:, None] & (d < HALF)[None, :]
        x_row = x_ptr + token * stride_x_token + h[:, None] * stride_x_head + d[None, :]
        x1 = tl.load(x_row, mask=ok, other=0.0)  # (BLOCK_H, HALF_PAD) first half
        x2 = tl.load(x_row + HALF, mask=ok, other=0.0)  # second half
        d_ok = d < HALF
        cos1 = tl.load(cos_ptr + token * stride_cos_token + d, mask=d_ok, other=0.0)[None, :]
        cos2 = tl.load(cos_ptr + token * stride_cos_token + HALF + d, mask=d_ok, other=0.0)[None, :]
        sin1 = tl.load(sin_ptr + token * stride_sin_token + d, mask=d_ok, other=0.0)[None, :]
        sin2 = tl.load(sin_ptr + token * stride_sin_token + HALF + d, mask=d_ok, other=0.0)[None, :]
        dtype = out_ptr.dtype.element_ty
        # out = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1); rounded as PyTorch rounds.
        # The products are rounded to the dtype before the sum (as PyTorch's three kernels), so the result
        # is bit-equal to theirs; NOTE: only with the launch's enable_fp_fusion=False (rotary_triton): else
        # CUDA fuses a product and the sum into one multiply-add, in float32 and across a 16-bit product's
        # widening alike (seen on an H200, 2026-11-29: one rounding off PyTorch in float32 and float16).
        out1 = (x1 * cos1).to(dtype).to(tl.float32) + ((-x2) * sin1).to(dtype).to(tl.float32)
        out2 = (x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)
        out_row = out_ptr + (token * num_heads + h[:, None]) * (2 * HALF) + d[None, :]
        tl.store(out_row, out1.to(dtype), mask=ok)
        tl.store(out_row + HALF, out2.to(dtype), mask=ok)

    @triton.jit
    def _silu_and_mul_kernel(
        gate_up_ptr,  # (T, 2 I), last dim contiguous
        out_ptr,  # (T, I) contiguous
        size,  # I
        stride_token,
        BLOCK: tl.constexpr,
    ):
        token = tl.program_id(0)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = i < size
        gate = tl.load(gate_up_ptr + token * stride_token + i, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + token * stride_token + size + i, mask=ok, other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        # silu rounded to the dtype first, as F.silu's output is, then the product.
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        tl.store(out_ptr + token * size + i, (act * up).to(dtype), mask=ok)

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr,  # (T, H), last dim contiguous
        residual_ptr,  # (T, H), last dim contiguous
        weight_ptr,  # (H,)
        out_ptr,  # (T, H) contiguous: the normalized sum
        sum_ptr,  # (T, H) contiguous: the sum
        size,  # H
        stride_x,
        stride_residual,
        eps,
        BLOCK: tl.constexpr,  # power of two >= H: one program holds its token's row
    ):
        token = tl.program_id(0)
        i = tl.arange(0, BLOCK)
        ok = i < size
        x = tl.load(x_ptr + token * stride_x + i, mask=ok, other=0.0).to(tl.float32)
        residual = tl.load(residual_ptr + token * stride_residual + i, mask=ok, other=0.0).to(tl.float32)
        # NOTE: loaded with the row, not after the sum's reduction: a load issued after that barrier is one
        # more trip to memory in a kernel whose time, at a decode's few rows, is such trips
        weight = tl.load(weight_ptr + i, mask=ok, other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        # The sum rounded to the dtype, as PyTorch's add stores it, and normalized from there.
        summed = (x + residual).to(dtype)
        tl.store(sum_ptr + token * size + i, summed, mask=ok)
        summed = summed.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(summed * summed, axis=0) / size + eps)
        # One rounding, after the weight, as F.rms_norm's fused kernel rounds.
        tl.store(out_ptr + token * size + i, (summed * rstd * weight).to(dtype), mask=ok)

    @triton.jit
    def _write_kv_kernel(
        k_ptr,  # (T, nkv, hd), each token's heads one contiguous row
        v_ptr,  # (T, nkv, hd), likewise
        k_cache_ptr,  # (num_slots, nkv, hd) contiguous
        v_cache_ptr,  # (num_slots, nkv, hd) contiguous
        slot_mapping_ptr,  # (T,) int64
        row_size,  # nkv * hd
        stride_k_token,
        stride_v_token,
        BLOCK: tl.constexpr,
    ):
        token = tl.program_id(0)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = i < row_size
        slot = tl.load(slot_mapping_ptr + token)
        k = tl.load(k_ptr + token * stride_k_token + i, mask=ok)
        v = tl.load(v_ptr + token * stride_v_token + i, mask=ok)
        tl.store(k_cache_ptr + slot * row_size + i, k, mask=ok)
        tl.store(v_cache_ptr + slot * row_size + i, v, mask=ok)


def rotary_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``rotary_torch`` as one kernel: x (T, heads, hd) with a contiguous last dim -> a new contiguous
    (T, heads, hd)."""
    t, heads, hd = x.shape
    assert hd % 2 == 0 and x.stride(2) == 1 and cos.stride(2) == 1 and sin.stride(2) == 1
    out = torch.empty((t, heads, hd), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    block_h = min(16, triton.next_power_of_2(heads))
    _rotary_kernel[(t, triton.cdiv(heads, block_h))](
        x,
        cos,
        sin,
        out,
        heads,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        sin.stride(0),
        HALF=hd // 2,
        HALF_PAD=triton.next_power_of_2(hd // 2),
        BLOCK_H=block_h,
        enable_fp_fusion=False,  # PyTorch's roundings (the kernel's NOTE)
    )
    return out


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu_and_mul_torch`` as one kernel: (T, 2 I) with a contiguous last dim -> a new (T, I)."""
    t, two_i = gate_up.shape
    assert two_i % 2 == 0 and gate_up.stride(1) == 1
    size = two_i // 2
    out = torch.empty((t, size), dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    block = min(1024, triton.next_power_of_2(size))
    _silu_and_mul_kernel[(t, triton.cdiv(size, block))](gate_up, out, size, gate_up.stride(0), BLOCK=block)
    return out


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, num_warps: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm_torch`` as one kernel: x and residual (T, H), each with a contiguous last dim ->
    (normalized sum, sum), each a new contiguous (T, H). ``num_warps``: of each row's program (None: Triton's
    default, 4; benchmarks/fused_ops.py times others)."""
    t, size = x.shape
    assert residual.shape == x.shape and x.stride(1) == 1 and residual.stride(1) == 1 and weight.is_contiguous()
    out = torch.empty((t, size), dtype=x.dtype, device=x.device)
    summed = torch.empty((t, size), dtype=x.dtype, device=x.device)
    if t == 0:
        return out, summed
    _add_rms_norm_kernel[(t,)](
        x, residual, weight, out, summed, size, x.stride(0), residual.stride(0), eps,
        BLOCK=triton.next_power_of_2(size), **({} if num_warps is None else {"num_warps": num_warps}),
    )  # fmt: skip
    return out, summed


def write_kv_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """``write_kv_torch`` as one kernel (two index copies in PyTorch): k and v (T, nkv, hd), each token's
    heads one contiguous row (the fused QKV projection's slices are), into contiguous caches."""
    t, nkv, hd = k.shape
    assert v.shape == k.shape and k_cache.shape[1:] == (nkv, hd) and v_cache.shape == k_cache.shape
    assert _rows_contiguous(k) and _rows_contiguous(v) and k_cache.is_contiguous() and v_cache.is_contiguous()
    if t == 0:
        return
    block = min(1024, triton.next_power_of_2(nkv * hd))
    _write_kv_kernel[(t, triton.cdiv(nkv * hd, block))](
        k, v, k_cache, v_cache, slot_mapping, nkv * hd, k.stride(0), v.stride(0), BLOCK=block
    )
