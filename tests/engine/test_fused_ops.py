"""The fused rotary, SiLU-and-multiply and add-and-RMSNorm kernels against their PyTorch forms, on
random inputs.

On a machine without CUDA they run in Triton's interpreter (conftest sets TRITON_INTERPRET=1); on a
GPU the same tests check the compiled kernels. They round where PyTorch rounds, so the rotary output
and the residual sum are bit-equal in every dtype; SiLU's exponential may differ in its last place,
and so may the norm (its sum of squares is added in another order).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from sloserve.checkpoint.config import random_config  # noqa: E402
from sloserve.engine import fused_ops  # noqa: E402
from sloserve.engine.models.llama import Rotary  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


@settings(max_examples=15, deadline=None)
@given(
    tokens=st.integers(1, 9),
    heads=st.tuples(st.integers(1, 20), st.integers(1, 4)),
    head_dim=st.sampled_from([16, 24, 64, 128]),
    partial=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_rotary_equals_the_pytorch_form(tokens, heads, head_dim, partial, dtype, seed):
    """Q and K heads rotated together from the fused QKV projection's output (a strided view), at
    random positions of a real rotary table; ``partial``: the leading 3/4 of each head (Phi-4 mini's)."""
    gen = torch.Generator().manual_seed(seed)
    nh, nkv = heads
    qkv = torch.randn(tokens, nh + 2 * nkv, head_dim, generator=gen).to(DEVICE, dtype)
    rotary_dim = head_dim * 3 // 4 if partial else head_dim
    qk = qkv[:, : nh + nkv, :rotary_dim]  # (T, nh + nkv, rotary_dim), not contiguous
    config = random_config("tiny-llama")
    rotary = Rotary(config)
    rotary.config = type(config)(**{**config.__dict__, "head_dim": head_dim, "partial_rotary_dim": rotary_dim})
    positions = torch.randint(0, config.max_position_embeddings, (tokens,), generator=gen).to(DEVICE)
    cos, sin = rotary.for_positions(positions, dtype)
    out = fused_ops.rotary_triton(qk, cos, sin)
    assert out.shape == qk.shape and out.is_contiguous()
    assert torch.equal(out, fused_ops.rotary_torch(qk, cos, sin))


@settings(max_examples=15, deadline=None)
@given(
    tokens=st.integers(1, 9),
    size=st.sampled_from([1, 7, 64, 1000, 1408]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_silu_and_mul_matches_the_pytorch_form(tokens, size, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    gate_up = (3 * torch.randn(tokens, 2 * size, generator=gen)).to(DEVICE, dtype)
    out = fused_ops.silu_and_mul_triton(gate_up)
    ref = fused_ops.silu_and_mul_torch(gate_up)
    assert out.shape == ref.shape
    # The exponential may differ in its last places: a few roundings of the dtype at most.
    torch.testing.assert_close(out, ref, rtol=4 * torch.finfo(dtype).eps, atol=torch.finfo(dtype).eps)


@settings(max_examples=15, deadline=None)
@given(
    tokens=st.integers(1, 9),
    size=st.sampled_from([1, 7, 64, 576, 1000]),
    dtype=st.sampled_from(DTYPES),
    strided=st.booleans(),
    num_warps=st.sampled_from([None, 8, 32]),
    seed=st.integers(0, 2**16),
)
def test_add_rms_norm_matches_the_pytorch_form(tokens, size, dtype, strided, num_warps, seed):
    """The residual stream's sum bit for bit; its norm within a few roundings. ``strided``: the layer's
    output is a view into a wider tensor (its rows further apart than its width). ``num_warps``: of a row's
    program (benchmarks/fused_ops.py times them; the interpreter runs any alike, a GPU does not)."""
    gen = torch.Generator().manual_seed(seed)
    wide = (3 * torch.randn(tokens, 2 * size, generator=gen)).to(DEVICE, dtype)
    x = wide[:, :size] if strided else wide[:, :size].contiguous()
    residual = (3 * torch.randn(tokens, size, generator=gen)).to(DEVICE, dtype)
    weight = torch.randn(size, generator=gen).to(DEVICE, dtype)
    out, summed = fused_ops.add_rms_norm_triton(x, residual, weight, 1e-6, num_warps=num_warps)
    ref_out, ref_summed = fused_ops.add_rms_norm_torch(x, residual, weight, 1e-6)
    assert out.shape == summed.shape == (tokens, size)
    assert torch.equal(summed, ref_summed)
    torch.testing.assert_close(out, ref_out, rtol=4 * torch.finfo(dtype).eps, atol=4 * torch.finfo(dtype).eps)


def test_the_model_uses_pytorch_off_cuda():
    """A CPU tensor never goes to the Triton kernels (the CPU engine has no Triton)."""
    x = torch.randn(3, 4, 16)
    cos, sin = torch.randn(3, 1, 16), torch.randn(3, 1, 16)
    assert torch.equal(fused_ops.rotary(x, cos, sin), fused_ops.rotary_torch(x, cos, sin))
    residual, weight = torch.randn(3, 16), torch.randn(16)
    fused = fused_ops.add_rms_norm(x[:, 0], residual, weight, 1e-6)
    for got, want in zip(fused, fused_ops.add_rms_norm_torch(x[:, 0], residual, weight, 1e-6), strict=True):
        assert torch.equal(got, want)


def test_the_fused_kernels_are_on_unless_switched_off_and_a_bad_value_is_refused_when_a_model_loads(monkeypatch):
    """On by default since the GPU session of 2026-11-29 (read at import; gpu_session.sh sets 1)."""
    from sloserve.core.errors import ConfigError
    from sloserve.engine.loader import load_model

    if "SLOSERVE_FUSED_KERNELS" not in os.environ:
        assert fused_ops.ENABLED
    monkeypatch.setenv("SLOSERVE_FUSED_KERNELS", "yes")
    with pytest.raises(ConfigError, match="SLOSERVE_FUSED_KERNELS must be 0 or 1, got 'yes'"):
        load_model("random:tiny-llama")


@settings(max_examples=15, deadline=None)
@given(
    tokens=st.integers(1, 9),
    heads=st.tuples(st.integers(1, 20), st.integers(1, 8)),
    head_dim=st.sampled_from([16, 24, 64, 128, 256]),  # (rows of up to 2,048: two programs a token)
    num_slots=st.integers(9, 40),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_write_kv_stores_what_the_index_copies_store(tokens, heads, head_dim, num_slots, dtype, seed):
    """K and V as the model hands them over (slices of the fused QKV projection's output: each token's
    heads one row, the tokens further apart) stored at distinct random slots of caches that hold
    other values: the caches equal the two index copies' bit for bit, and no other slot changed."""
    gen = torch.Generator().manual_seed(seed)
    nh, nkv = heads
    qkv = torch.randn(tokens, nh + 2 * nkv, head_dim, generator=gen).to(DEVICE, dtype)
    k, v = qkv[:, nh : nh + nkv], qkv[:, nh + nkv :]  # (T, nkv, hd) each, not contiguous
    slots = torch.randperm(num_slots, generator=gen)[:tokens].to(DEVICE)  # (T,)
    before = torch.randn(2, num_slots, nkv, head_dim, generator=gen).to(DEVICE, dtype)
    fused, reference = before.clone(), before.clone()
    fused_ops.write_kv_triton(k, v, fused[0], fused[1], slots)
    fused_ops.write_kv_torch(k, v, reference[0], reference[1], slots)
    assert torch.equal(fused, reference)
    untouched = torch.ones(num_slots, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(fused[:, untouched], before[:, untouched]) and torch.equal(fused[0, slots], k)
