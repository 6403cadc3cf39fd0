"""The engine's Triton attention kernels against the PyTorch reference, on random inputs.

On a machine without CUDA the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1),
which executes the same kernel code with numpy: the indexing, masks, grouped-query mapping and online
softmax are checked here in CI; on a GPU the same tests check the compiled kernels (and bf16/fp16).
Errors are ||out - ref|| / ||ref|| against the reference in float64 (the device METHOD's measure).
"""

from __future__ import annotations

import math
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from attention_steps import make_step  # noqa: E402
from sloserve.core.errors import ConfigError  # noqa: E402
from sloserve.engine import attention, triton_attention  # noqa: E402
from sloserve.engine.attention import AttentionMetadata, PrefillSeq, TorchAttention  # noqa: E402
from sloserve.engine.loader import load_model, resolve_attention_backend  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Relative error allowed per dtype: float32 with IEEE dots lands near 1e-7; bf16/fp16 operands
# between 1e-3 and 1e-2 (METHOD.md).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPES = [torch.float32] if DEVICE.type == "cpu" else [torch.float32, torch.float16, torch.bfloat16]
# (query heads, KV heads): grouped 2:1 (tiny Llama), plain (OPT), 7:1 (Qwen2.5-7B's 28:4), 4:1.
HEADS = [(4, 2), (4, 4), (7, 1), (8, 2)]


def _record_launches(monkeypatch, kernel: str) -> list[tuple[tuple, dict]]:
    """The (grid, keyword arguments) of each launch of ``triton_attention``'s ``kernel`` (``kernel[grid](...)``),
    run as before, from now on."""
    launches, real = [], getattr(triton_attention, kernel)

    class Recorded:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, kwargs)) or real[grid](*args, **kwargs)

    monkeypatch.setattr(triton_attention, kernel, Recorded())
    return launches


def _to(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping.to(device),
        prefills=[PrefillSeq(s.query_start, s.query_len, s.context_slots.to(device)) for s in meta.prefills],
        decode_token_index=meta.decode_token_index.to(device),
        decode_slots=meta.decode_slots.to(device),
        decode_context_lens=meta.decode_context_lens.to(device),
    )


def _clone(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.clone()


def _to_device(x: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if x is None else x.to(DEVICE, dtype)


def check_against_reference(
    monkeypatch,
    step,
    dtype: torch.dtype,
    block: int = 64,
    scale: float | None = None,
    window: int | None = None,
    splits: int | None = None,
    dense_from: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    value_dim: int | None = None,
    chunk: int | None = None,
    alibi: torch.Tensor | None = None,
    combine_in_kernel: bool = False,
) -> float:
    """Run the Triton backend on ``step`` cast to ``dtype``; assert its cache writes are the
    reference's and return its relative error against the float64 reference. ``value_dim``: keys only
    (the step's values and V cache left out)."""
    q, k, v, k_cache, v_cache, meta = step
    if value_dim is not None:
        v = v_cache = None
    ref_k_cache, ref_v_cache = k_cache.clone(), _clone(v_cache)
    options = dict(scale=scale, window=window, softcap=softcap, value_dim=value_dim, chunk=chunk)
    ref = TorchAttention().forward(q, k, v, ref_k_cache, ref_v_cache, meta, **options, sinks=sinks, alibi=alibi)
    k_dev, v_dev = k_cache.to(DEVICE, dtype), _to_device(v_cache, dtype)
    # Poison the output: a row no kernel writes stays NaN and fails the comparison.
    real_empty_like = torch.empty_like
    monkeypatch.setattr(triton_attention.torch, "empty_like", lambda x: real_empty_like(x).fill_(math.nan))
    backend = triton_attention.TritonAttention(
        block_m=block,
        block_n=block,
        num_decode_splits=splits,
        dense_prefill_min_tokens=dense_from,
        combine_splits_in_kernel=combine_in_kernel,
    )
    out = backend.forward(
        q.to(DEVICE, dtype),
        k.to(DEVICE, dtype),
        _to_device(v, dtype),
        k_dev,
        v_dev,
        _to(meta, DEVICE),
        **options,
        sinks=None if sinks is None else sinks.to(DEVICE, dtype),
        alibi=None if alibi is None else alibi.to(DEVICE, torch.float32),
    )
    monkeypatch.undo()
    assert torch.equal(k_dev.cpu(), ref_k_cache.to(dtype))
    assert v_cache is None or torch.equal(v_dev.cpu(), ref_v_cache.to(dtype))
    out = out.cpu().double()
    assert not out.isnan().any()
    return float((out - ref).norm() / ref.norm())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=str)
def test_prefills_with_context_and_decodes_in_one_step(monkeypatch, heads, dtype):
    """A fresh prompt, a chunk after 50 cached tokens, a 2-token chunk and decodes of context 1 to
    131, with 32-token tiles so most sequences span several tiles and the causal diagonal cuts
    through them."""
    gen = torch.Generator().manual_seed(sum(heads))
    step = make_step(gen, *heads, 32, [(0, 37), (50, 70), (5, 2)], [0, 3, 130, 64], num_slots=600)
    assert check_against_reference(monkeypatch, step, dtype, block=32) < TOLERANCE[dtype]


@pytest.mark.parametrize("window", [1, 3, 16, 40, 500])
def test_sliding_windows_and_a_score_scale(monkeypatch, window):
    """Gemma 3's local layers: each query sees its last ``window`` positions. Windows shorter than a
    tile, as long as one, across several and past every context; rows of a 32-query tile whose
    windows start in different tiles."""
    gen = torch.Generator().manual_seed(window)
    step = make_step(gen, 4, 2, 32, [(0, 37), (50, 70), (5, 2)], [0, 3, 130, 64], num_slots=600)
    error = check_against_reference(monkeypatch, step, torch.float32, block=16, scale=0.3, window=window)
    assert error < TOLERANCE[torch.float32]


@pytest.mark.parametrize(("window", "splits"), [(None, 1), (None, 4), (16, 1), (40, 3)])
def test_capped_scores(monkeypatch, window, splits):
    """Gemma 2's scores capped at 2 (softcap * tanh(score / softcap)), on every kernel (prefills with
    context, decodes split or not, in a window or not); a fresh prompt past the dense threshold keeps
    the prefill kernel (SDPA cannot cap). The reference's capped attention is checked against the
    formula written out in float64."""
    gen = torch.Generator().manual_seed(17 + (window or 0) + splits)
    step = make_step(gen, 4, 2, 32, [(0, 37), (50, 70), (5, 2)], [0, 3, 130, 64], num_slots=600)
    error = check_against_reference(
        monkeypatch, step, torch.float32, block=16, scale=0.3, window=window, splits=splits, dense_from=16, softcap=2.0
    )
    assert error < TOLERANCE[torch.float32]
    q, k, v, k_cache, v_cache, meta = step
    capped = TorchAttention().forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, scale=0.3, softcap=2.0)
    plain = TorchAttention().forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, scale=0.3)
    assert (capped - plain).abs().max() > 0.1  # NOTE: the cap bites on these scores
    # the reference's scores a few rows at a time (a long prompt's whole matrix would not fit): the same
    monkeypatch.setattr(attention, "WRITTEN_SCORES_PER_CALL", 300)
    chunked = TorchAttention().forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, scale=0.3, softcap=2.0)
    monkeypatch.undo()
    assert torch.allclose(chunked, capped, atol=1e-12)
    # the fresh prompt (tokens 0..36, nothing cached) by the formula
    query, keys, values = (x[:37].double().transpose(0, 1) for x in (q, k, v))  # (nh | nkv, 37, hd)
    keys, values = keys.repeat_interleave(2, 0), values.repeat_interleave(2, 0)
    scores = torch.tanh(query @ keys.transpose(1, 2) * 0.3 / 2.0) * 2.0
    scores = scores.masked_fill(~torch.ones(37, 37, dtype=torch.bool).tril(), float("-inf"))
    expected = (torch.softmax(scores, -1) @ values).transpose(0, 1)
    assert torch.allclose(capped[:37].double(), expected, atol=1e-5)


@pytest.mark.parametrize(("window", "splits"), [(None, 1), (None, 4), (16, 1), (40, 3)])
def test_attention_sinks(monkeypatch, window, splits):
    """gpt-oss's sinks (a logit per head in each query's softmax, no value) on every kernel: prefills with
    context, decodes split or not (only the first split starts from the sink), in a window or not; a fresh
    prompt past the dense threshold keeps the prefill kernel (SDPA has no sinks). The reference's
    attention with sinks is checked against transformers' eager formula written out in float64."""
    gen = torch.Generator().manual_seed(23 + (window or 0) + splits)
    step = make_step(gen, 4, 2, 32, [(0, 37), (50, 70), (5, 2)], [0, 3, 130, 64], num_slots=600)
    sinks = torch.randn(4, generator=gen, dtype=torch.float64) * 2 + 1  # (nh,) some above the scores
    error = check_against_reference(
        monkeypatch, step, torch.float32, block=16, scale=0.3, window=window, splits=splits, dense_from=16, sinks=sinks
    )
    assert error < TOLERANCE[torch.float32]
    q, k, v, k_cache, v_cache, meta = step
    sunk = TorchAttention().forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, scale=0.3, sinks=sinks)
    plain = TorchAttention().forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, scale=0.3)
    assert (sunk - plain).abs().max() > 0.1  # NOTE: the sinks take a share here
    # the fresh prompt (tokens 0..36, nothing cached) and the decode of context 130 by the formula
    query, keys, values = (x[:37].double().transpose(0, 1) for x in (q, k, v))  # (nh | nkv, 37, hd)
    keys, values = keys.repeat_interleave(2, 0), values.repeat_interleave(2, 0)
    scores = (query @ keys.transpose(1, 2) * 0.3).masked_fill(~torch.ones(37, 37, dtype=torch.bool).tril(), -math.inf)
    combined = torch.cat((scores, sinks[:, None, None].expand(4, 37, 1)), -1)  # (nh, 37, 38)
    expected = (torch.softmax(combined, -1)[..., :-1] @ values).transpose(0, 1)
    assert torch.allclose(sunk[:37].double(), expected, atol=1e-5)


@pytest.mark.parametrize(("heads", "splits"), [((4, 2), 1), ((4, 2), 4), ((6, 6), 3)])
def test_alibi_slopes(monkeypatch, heads, splits):
    """ALiBi (BLOOM, MPT: score + m_h (j - p) for key j at query position p) on every kernel: prefills with context,
    decodes split or not, heads in groups (each its own slope) or not; a fresh prompt past the dense threshold keeps
    the prefill kernel (SDPA takes no bias in float32 here). The reference is checked against the formula written
    out in float64 for the fresh prompt and for the decode of context 131."""
    gen = torch.Generator().manual_seed(29 + splits + heads[0])
    nh, nkv = heads
    step = make_step(gen, nh, nkv, 32, [(0, 37), (50, 70), (5, 2)], [0, 3, 130, 64], num_slots=600)
    slopes = 2.0 ** -torch.arange(1, nh + 1, dtype=torch.float64) * 4  # (nh,) 2 .. 2^(2 - nh): the bias bites
    error = check_against_reference(
        monkeypatch, step, torch.float32, block=16, scale=0.3, splits=splits, dense_from=16, alibi=slopes
    )
    assert error < TOLERANCE[torch.float32]
    q, k, v, k_cache, v_cache, meta = step
    biased = TorchAttention().forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, scale=0.3, alibi=slopes)
    plain = TorchAttention().forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, scale=0.3)
    assert (biased - plain).abs().max() > 0.1
    group = nh // nkv

    def by_formula(query, keys, values, positions):  # (nh, c, hd), (nkv, n, hd) x 2, (c,) -> (c, nh, hd)
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
        distance = torch.arange(keys.shape[1], dtype=torch.float64) - positions[:, None]  # (c, n)
        scores = query @ keys.transpose(1, 2) * 0.3 + slopes[:, None, None] * distance
        scores = scores.masked_fill(distance > 0, -math.inf)
        return (torch.softmax(scores, -1) @ values).transpose(0, 1)

    query, keys, values = (x[:37].double().transpose(0, 1) for x in (q, k, v))  # the fresh prompt: tokens 0..36
    expected = by_formula(query, keys, values, torch.arange(37, dtype=torch.float64))
    assert torch.allclose(biased[:37].double(), expected, atol=1e-5)
    row = 2  # the decode of 130 cached tokens: its context's slots in the table, its own K/V written there
    token, context = int(meta.decode_token_index[row]), meta.decode_slots[row, :131]
    cache_k, cache_v = k_cache.clone(), v_cache.clone()
    cache_k[meta.slot_mapping], cache_v[meta.slot_mapping] = k, v
    keys, values = cache_k[context].transpose(0, 1), cache_v[context].transpose(0, 1)  # (nkv, 131, hd)
    expected = by_formula(
        q[token : token + 1].transpose(0, 1), keys, values, torch.tensor([130.0], dtype=torch.float64)
    )
    assert torch.allclose(biased[token : token + 1].double(), expected, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=str)
@pytest.mark.parametrize("splits", [2, 3, 8])
def test_decodes_split_over_their_context(monkeypatch, splits, heads, dtype):
    """Flash decoding: each context cut into ``splits`` runs of whole 32-token tiles, merged by the
    combine kernel. Contexts of 1 token (every split but the first reads nothing), one tile, a tile
    and one, and long ones; a prefill in the same step keeps its own kernel."""
    gen = torch.Generator().manual_seed(splits + sum(heads))
    step = make_step(gen, *heads, 32, [(20, 30)], [0, 31, 32, 200, 700], num_slots=1200)
    assert check_against_reference(monkeypatch, step, dtype, block=32, splits=splits) < TOLERANCE[dtype]


@pytest.mark.parametrize("local", [("window", 1), ("window", 40), ("window", 300), ("chunk", 1), ("chunk", 64),
                                   ("chunk", 100), ("chunk", 1000)], ids=str)  # fmt: skip
def test_split_decodes_in_a_sliding_window_or_a_chunk(monkeypatch, local):
    """Splits start at the first tile of the window, or of the decode's chunk (Llama 4's local layers): none
    reads a key outside it. Decodes first in their chunk, last in it, inside one; a chunk longer than all."""
    gen = torch.Generator().manual_seed(local[1])
    step = make_step(gen, 4, 2, 32, [], [3, 130, 700, 63, 64, 199], num_slots=1400)
    error = check_against_reference(monkeypatch, step, torch.float32, block=16, splits=4, **dict([local]))
    assert error < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=str)
def test_fresh_prompts_attend_densely_beside_the_kernels(monkeypatch, heads, dtype):
    """Prompts of at least ``dense_from`` tokens with nothing cached run as one causal SDPA call each;
    a shorter fresh prompt, a chunk after cached tokens (as long as the fresh ones) and decodes keep the
    kernels, in the same step."""
    gen = torch.Generator().manual_seed(1 + sum(heads))
    step = make_step(gen, *heads, 32, [(0, 40), (0, 90), (0, 7), (30, 40)], [0, 3, 130], num_slots=800)
    dense_calls = []
    real_dense = triton_attention._dense_causal

    def counted(q, *args):
        dense_calls.append(q.shape[0])
        return real_dense(q, *args)

    monkeypatch.setattr(triton_attention, "_dense_causal", counted)
    error = check_against_reference(monkeypatch, step, dtype, block=32, dense_from=40)
    assert sorted(dense_calls) == [40, 90] and error < TOLERANCE[dtype]


@pytest.mark.parametrize("local", [("window", 20), ("chunk", 20), ("chunk", 32)], ids=str)
def test_a_sliding_window_or_chunked_layer_keeps_the_kernel_for_fresh_prompts(monkeypatch, local):
    """SDPA's causal mask has no window and no chunks: a local layer's prompts go to the prefill kernel (chunks
    that start inside a tile and at its start; a chunk after cached tokens that starts inside a chunk)."""
    gen = torch.Generator().manual_seed(5)
    step = make_step(gen, 4, 2, 32, [(0, 60), (45, 30)], [], num_slots=200)
    monkeypatch.setattr(triton_attention, "_dense_causal", None)  # (a call would fail)
    error = check_against_reference(monkeypatch, step, torch.float32, block=16, dense_from=16, **dict([local]))
    assert error < TOLERANCE[torch.float32]


def test_the_dense_prefill_setting_comes_from_the_environment(monkeypatch):
    """On unless SLOSERVE_DENSE_PREFILL=0; a bad value is one clear error."""
    monkeypatch.delenv("SLOSERVE_DENSE_PREFILL", raising=False)
    assert triton_attention.TritonAttention().dense_prefill_min_tokens == triton_attention.DENSE_PREFILL_MIN_TOKENS
    for setting, threshold in (("0", None), ("1", triton_attention.DENSE_PREFILL_MIN_TOKENS)):
        monkeypatch.setenv("SLOSERVE_DENSE_PREFILL", setting)
        assert triton_attention.TritonAttention().dense_prefill_min_tokens == threshold
    monkeypatch.setenv("SLOSERVE_DENSE_PREFILL", "yes")
    with pytest.raises(ConfigError, match="SLOSERVE_DENSE_PREFILL must be 0 or 1, got 'yes'"):
        triton_attention.TritonAttention()


def test_dense_prefills_ask_sdpa_for_cudnn_first_on_hopper_only(monkeypatch):
    """SLOSERVE_DENSE_PREFILL_SDPA: "auto" (unset) asks for cuDNN's attention first on compute capability
    9.x and keeps torch's order on other GPUs; the CPU's kernel is never steered; a named backend is
    asked for first on every GPU; a bad value is one clear error when the backend is built."""
    prefer = triton_attention.sdpa_preference
    cudnn, flash = triton_attention.SDPBackend.CUDNN_ATTENTION, triton_attention.SDPBackend.FLASH_ATTENTION
    assert prefer("auto", (9, 0)) == (cudnn,)
    assert prefer("auto", (8, 0)) == prefer("auto", (10, 0)) == prefer("auto", None) == ()
    assert prefer("flash", (9, 0)) == prefer("flash", (8, 6)) == (flash,)
    assert prefer("cudnn", (10, 0)) == (cudnn,) and prefer("cudnn", None) == prefer("torch", (9, 0)) == ()
    monkeypatch.setattr(triton_attention, "_SDPA_SETTING", "flash")
    assert triton_attention.TritonAttention().dense_prefill_sdpa == "flash"
    monkeypatch.setattr(triton_attention, "_SDPA_SETTING", "fa3")
    with pytest.raises(
        ConfigError, match="SLOSERVE_DENSE_PREFILL_SDPA must be one of auto, cudnn, flash, torch, got 'fa3'"
    ):
        triton_attention.TritonAttention()


def _causal_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """(T, nh, hd) causal attention of (T, nh, hd) queries over (T, nkv, hd) keys and values, in float64."""
    group = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("thd,shd->hts", q, k) * scale  # (nh, T, T)
    scores.masked_fill_(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="SDPA's GPU backends (FlashAttention, cuDNN) need CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("setting", ["flash", "cudnn", "torch"])
def test_on_cuda_a_dense_prefill_asking_each_sdpa_backend_first_matches_the_reference(setting, dtype):
    """A prompt of Llama-3-8B's heads (32 query, 8 KV, 128), 300 tokens (not a tile multiple), asking
    SDPA for FlashAttention, cuDNN or nothing first: the reference's attention, to the dtype's rounding."""
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(300, heads, 128, generator=gen) for heads in (32, 8, 8))
    scale = 1 / math.sqrt(128)
    prefer = triton_attention.SDPA_PREFERENCES[setting]
    out = triton_attention._dense_causal(*(x.to(DEVICE, dtype) for x in (q, k, v)), scale, prefer)
    ref = _causal_reference(q, k, v, scale)
    error = float((out.double().cpu() - ref).norm() / ref.norm())
    assert out.shape == (300, 32, 128) and error < TOLERANCE[dtype]


@pytest.mark.parametrize(
    ("variable", "attribute"),
    [
        ("SLOSERVE_OVERLAP_ATTENTION", "overlap_prefill_decode"),  # a mixed step's prefill attention on a second stream
        ("SLOSERVE_COMBINE_SPLITS_IN_KERNEL", "combine_splits_in_kernel"),  # split decodes merged by the decode kernel
    ],
)
def test_the_switches_not_yet_timed_come_from_the_environment(monkeypatch, variable, attribute):
    """Each feature not yet timed on a GPU is off unless its variable is 1; a bad value is one clear error."""
    monkeypatch.delenv(variable, raising=False)
    assert getattr(triton_attention.TritonAttention(), attribute) is False
    for setting, on in (("0", False), ("1", True)):
        monkeypatch.setenv(variable, setting)
        assert getattr(triton_attention.TritonAttention(), attribute) is on
    monkeypatch.setenv(variable, "on")
    with pytest.raises(ConfigError, match=f"{variable} must be 0 or 1, got 'on'"):
        triton_attention.TritonAttention()


@pytest.mark.parametrize("dense_from", [None, 40])
def test_prefills_beside_the_decodes_give_the_same_output_bit_for_bit(monkeypatch, dense_from):
    """With the overlap on, a step of prefills (a chunk after cached tokens, fresh prompts: dense ones with
    ``dense_from``) and decodes: on CUDA its prefill attention runs on the second stream, and the output and
    the cache writes are the one-stream run's exactly (tiles of 32 keys both ways: the overlap's launch changes
    only the pipeline's stages, not the sums); elsewhere nothing changes. A step of prefills only and one of
    decodes only keep one stream."""
    gen = torch.Generator().manual_seed(11)
    dtype = torch.float32 if DEVICE.type == "cpu" else torch.bfloat16
    step = make_step(gen, 8, 2, 32, [(0, 40), (50, 70), (0, 90)], [0, 3, 130, 64, 700], num_slots=1500)
    only_prefills = make_step(gen, 8, 2, 32, [(0, 40), (50, 70)], [], num_slots=300)
    only_decodes = make_step(gen, 8, 2, 32, [], [3, 130], num_slots=300)
    forks = []
    real_beside = triton_attention.SideStream.beside

    def beside(self, device):
        forks.append(device)
        return real_beside(self, device)

    monkeypatch.setattr(triton_attention.SideStream, "beside", beside)

    def run(step, overlap: bool):
        q, k, v, k_cache, v_cache, meta = (x.to(DEVICE, dtype) if torch.is_tensor(x) else x for x in step)
        backend = triton_attention.TritonAttention(
            block_m=32, block_n=32, dense_prefill_min_tokens=dense_from, overlap_prefill_decode=overlap
        )
        out = backend.forward(q, k, v, k_cache, v_cache, _to(meta, DEVICE))
        return out.cpu(), k_cache.cpu(), v_cache.cpu()

    one_stream = run(step, overlap=False)
    assert not forks
    two_streams = run(step, overlap=True)
    assert [device.type for device in forks] == (["cuda"] if DEVICE.type == "cuda" else [])
    assert all(torch.equal(a, b) for a, b in zip(one_stream, two_streams, strict=True))
    forks.clear()
    run(only_prefills, overlap=True)
    run(only_decodes, overlap=True)
    assert not forks


def test_a_prefill_beside_the_decodes_launches_with_room_left_for_them():
    """Beside the decodes the prefill kernel reads at most ``OVERLAP_PREFILL_LAUNCH``'s 32 keys a tile at its 2
    stages in at most 192 registers a thread (two default programs hold every register of a Hopper
    multiprocessor); alone, the backend's tile, warps and stages, uncapped; the other settings pass through."""
    settings = {"BLOCK_N": 64, "GROUP": 4}
    default = triton_attention.TritonAttention()
    beside = {"num_stages": 2, "maxnreg": 192}
    assert default.prefill_launch(settings, beside=False) == {"BLOCK_N": 64, "GROUP": 4, "num_warps": 4}
    assert default.prefill_launch(settings, beside=True) == {"BLOCK_N": 32, "GROUP": 4, "num_warps": 4, **beside}
    tuned = triton_attention.TritonAttention(prefill_num_warps=8, prefill_num_stages=3)
    assert tuned.prefill_launch({"BLOCK_N": 16}, beside=True) == {"BLOCK_N": 16, "num_warps": 8, **beside}
    assert tuned.prefill_launch({"BLOCK_N": 16}, beside=False) == {"BLOCK_N": 16, "num_warps": 8, "num_stages": 3}


def test_the_split_setting_comes_from_the_environment(monkeypatch):
    """Flash decoding picks its splits (None) unless SLOSERVE_DECODE_SPLITS says a count (1: off) or
    auto; a bad value is one clear error."""
    if "SLOSERVE_DECODE_SPLITS" not in os.environ:  # (gpu_session.sh sets it)
        assert triton_attention.TritonAttention().num_decode_splits is None
    for setting, splits in (("1", 1), ("auto", None), ("4", 4)):
        monkeypatch.setattr(triton_attention, "_SPLITS_SETTING", setting)
        assert triton_attention.TritonAttention().num_decode_splits == splits
    monkeypatch.setattr(triton_attention, "_SPLITS_SETTING", "0")
    with pytest.raises(ConfigError, match="SLOSERVE_DECODE_SPLITS must be auto or a positive integer, got '0'"):
        triton_attention.TritonAttention()


# (heads, head dim, decodes' cached tokens, splits, the layer's options): GQA, a group cut in blocks of 16
# heads (MLA's latent, keys only), a window, sinks, ALiBi, contexts shorter than some splits
COMBINE_CASES = [
    ((8, 2), 32, [0, 3, 130, 64, 700], 4, {}),
    ((4, 4), 16, [5, 200], 8, {"window": 40}),
    ((7, 1), 32, [90, 1, 300], 3, {"sinks": True}),
    ((4, 2), 16, [33, 260], 5, {"alibi": True}),
    ((32, 1), 48, [2, 150, 70], 3, {"value_dim": 32}),
]


@pytest.mark.parametrize(("heads", "head_dim", "decodes", "splits", "layer"), COMBINE_CASES)
def test_splits_merged_in_the_decode_kernel_give_the_combine_kernels_output(
    monkeypatch, heads, head_dim, decodes, splits, layer
):
    """The decode kernel's last split to finish merges a decode's splits (``COMBINE_IN_KERNEL``): the output
    the combine kernel gives (the same math on at least 16 rows, padded: their sums may round apart), the cache
    writes the same, and the counters zero again after each call, so the next call (another layer's) reuses
    them; no combine kernel launched."""
    gen = torch.Generator().manual_seed(sum(decodes) + splits)
    dtype = torch.float32 if DEVICE.type == "cpu" else torch.bfloat16
    q, k, v, k_cache, v_cache, meta = make_step(gen, *heads, head_dim, [], decodes, num_slots=1500)
    value_dim = layer.get("value_dim")
    if value_dim is not None:
        v = v_cache = None
    options = {
        "window": layer.get("window"),
        "value_dim": value_dim,
        "sinks": torch.randn(heads[0], generator=gen).to(DEVICE, dtype) if layer.get("sinks") else None,
        "alibi": torch.rand(heads[0], generator=gen).to(DEVICE) if layer.get("alibi") else None,
    }
    combines = _record_launches(monkeypatch, "_combine_splits_kernel")

    def run(backend):
        caches = [_to_device(x, dtype) for x in (k_cache, v_cache)]
        out = backend.forward(
            q.to(DEVICE, dtype), k.to(DEVICE, dtype), _to_device(v, dtype), *caches, _to(meta, DEVICE), **options
        )
        return [out.cpu()] + [x.cpu() for x in caches if x is not None]

    by_kernel = run(triton_attention.TritonAttention(block_n=16, num_decode_splits=splits))
    assert len(combines) == 1
    backend = triton_attention.TritonAttention(block_n=16, num_decode_splits=splits, combine_splits_in_kernel=True)
    in_kernel = run(backend)
    counters = backend.split_counters.zeros(1, DEVICE)
    assert len(combines) == 1 and not counters.any()
    again = run(backend)
    assert backend.split_counters.zeros(1, DEVICE) is counters and not counters.any()
    torch.testing.assert_close(in_kernel[0], by_kernel[0])  # (float32 here: within 1.3e-6 of each other)
    assert all(torch.equal(a, b) for a, b in zip(in_kernel[1:], by_kernel[1:], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(in_kernel, again, strict=True))


@pytest.mark.parametrize(("warps", "stages", "block_m"), [(4, None, 64), (8, 2, 128)])
def test_the_prefill_kernel_launches_with_the_backends_warps_and_stages(monkeypatch, warps, stages, block_m):
    """``prefill_num_warps`` and ``prefill_num_stages`` reach the prefill kernel's launch (None: Triton's stages);
    a program's query rows grow with its warps: 128 rows of 128-wide heads at 8 warps (two warpgroups), cut to 64
    at 4 (``TILE_NUMBERS``). The reference's output either way."""
    launches = _record_launches(monkeypatch, "_prefill_kernel")
    q, k, v, k_cache, v_cache, meta = make_step(torch.Generator().manual_seed(2), 4, 2, 128, [(10, 20)], [], 64)
    want = TorchAttention().forward(q, k, v, k_cache.clone(), v_cache.clone(), meta)
    backend = triton_attention.TritonAttention(
        block_m=128, dense_prefill_min_tokens=None, prefill_num_warps=warps, prefill_num_stages=stages
    )
    got = backend.forward(*(x.to(DEVICE, torch.float32) for x in (q, k, v, k_cache, v_cache)), _to(meta, DEVICE))
    assert [(kw["BLOCK_M"], kw["num_warps"], kw.get("num_stages")) for _, kw in launches] == [(block_m, warps, stages)]
    assert float((got.cpu().double() - want).norm() / want.norm()) < TOLERANCE[torch.float32]


def test_split_counters_grow_and_keep_every_tensor_made():
    """One zeroed tensor serves every launch that fits in it; a larger launch gets a new one, at least twice the
    size, and the old one stays alive (a CUDA graph may replay on it)."""
    counters = triton_attention.SplitCounters()
    cpu = torch.device("cpu")
    first = counters.zeros(24, cpu)
    assert first.dtype == torch.int32 and first.numel() == 24 and not first.any()
    assert counters.zeros(10, cpu) is first and counters.zeros(24, cpu) is first
    second = counters.zeros(25, cpu)
    assert second.numel() == 48 and not second.any() and counters.zeros(30, cpu) is second
    assert counters.zeros(100, cpu).numel() == 100
    assert [t.numel() for t in counters._made] == [24, 48, 100]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
def test_on_cuda_splits_merged_in_the_decode_kernel_replay_in_a_cuda_graph():
    """Captured in a CUDA graph (as the decode graphs run it) and replayed on new queries, the decode kernel
    that merges its own splits gives the eager call's output each time: the counters it left zero are the ones
    the graph replays on."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, k_cache, v_cache, meta = (
        x.to(DEVICE, torch.bfloat16) if torch.is_tensor(x) else x
        for x in make_step(gen, 32, 8, 128, [], [1000, 17, 4000, 300], num_slots=6000)
    )
    meta = _to(meta, DEVICE)
    backend = triton_attention.TritonAttention(num_decode_splits=None, combine_splits_in_kernel=True)
    backend.forward(q, k, v, k_cache, v_cache, meta)  # (warm-up: the kernels compiled, the counters made)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, k_cache, v_cache, meta)
    for seed in range(3):
        q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, q.dtype))
        graph.replay()
        assert torch.equal(out, backend.forward(q, k, v, k_cache, v_cache, meta))
    assert not backend.split_counters.zeros(1, DEVICE).any()


def test_how_many_splits_a_decode_batch_gets():
    """Enough (decode, KV head, split) programs to fill an H200's 132 multiprocessors twice, no split
    under MIN_SPLIT_TOKENS context tokens, none once the batch fills the GPU by itself."""
    splits = triton_attention.decode_splits
    assert splits(1, 8, 1025, 132) == 4  # 1K contexts: 4 splits of 256 tokens
    assert splits(1, 8, 8192, 132) == 32  # 33 would fill the GPU twice; at most 8192 / 256
    assert splits(8, 8, 32769, 132) == 5  # 64 programs -> 320
    assert splits(64, 8, 1025, 132) == 1  # 512 programs already
    assert splits(1, 8, 255, 132) == 1  # too short to split
    assert splits(1, 1, 1 << 20, 132) == triton_attention.MAX_SPLITS


@pytest.mark.parametrize("head_dim", [16, 24, 64, 128])
def test_head_dims_padded_to_a_power_of_two(monkeypatch, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    step = make_step(gen, 4, 2, head_dim, [(9, 21)], [17, 0], num_slots=200)
    assert check_against_reference(monkeypatch, step, torch.float32) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float16], ids=str)  # (DeepSeek's: bf16)
@pytest.mark.parametrize(
    ("heads", "value_dim", "head_dim"),
    [((4, 1), 32, 40), ((20, 1), 512, 576), ((8, 2), 24, 36)],
    ids=str,
)
@pytest.mark.parametrize("splits", [1, 3])
def test_keys_only_attention_takes_its_values_from_the_keys(monkeypatch, heads, value_dim, head_dim, splits, dtype):
    """MLA's cache (keys only: a key's first ``value_dim`` numbers are its value, as DeepSeek's latent c_KV
    with its rotated key k_R after it): a tail past the values' numbers (8, as the tiny DeepSeek's; 12, not a
    power of two; DeepSeek's 512 + 64 with 20 query heads on the one key: two programs of 16 heads a decode),
    decodes split or not. The reference's keys-only attention is the two-tensor attention of values sliced off the keys."""
    gen = torch.Generator().manual_seed(value_dim + heads[0] + splits)
    step = make_step(gen, *heads, head_dim, [(0, 37), (50, 20)], [0, 3, 130, 64], num_slots=600)
    error = check_against_reference(monkeypatch, step, dtype, block=32, splits=splits, value_dim=value_dim)
    assert error < TOLERANCE[dtype]
    q, k, _, k_cache, _, meta = step
    keys_only = TorchAttention().forward(q, k, None, k_cache.clone(), None, meta, value_dim=value_dim)
    v_cache = k_cache[..., :value_dim].clone()
    v_cache[meta.slot_mapping] = k[..., :value_dim]  # (the step's values, stored as write_kv would)
    sliced = TorchAttention().forward(q, k, k[..., :value_dim], k_cache.clone(), v_cache, meta)
    assert keys_only.shape == (q.shape[0], heads[0], value_dim)
    assert torch.allclose(keys_only, sliced, atol=1e-12)


def test_wide_heads_get_smaller_tiles():
    """A program's accumulator and tiles stay those of a 128-wide head's 64 x 64 tiles: DeepSeek's 512-wide
    latent (its keys read once, as values too) gets 16 heads or query rows and 32 keys a tile, a 256-wide head
    32 and 32; heads of 128 or less keep the defaults; never fewer than 16 (tl.dot's least)."""
    fit, total = triton_attention._fit_tile, triton_attention.TILE_NUMBERS
    assert [fit(64, width) for width in (64, 128, 256, 512, 1024)] == [64, 64, 32, 16, 16]
    assert fit(16, 512) == 16 and fit(32, 128) == 32  # (a group of 32 heads of 128 keeps one program)
    assert fit(64, 512, 2 * total) == 32 and fit(64, 2 * 256, 2 * total) == 32 and fit(64, 2 * 128, 2 * total) == 64


def test_mla_decodes_split_by_the_programs_their_heads_take(monkeypatch):
    """Flash decoding counts a decode's programs: DeepSeek-V2's 128 query heads on its one latent key take 8
    programs of 16 (the reference's output still), not one KV head's."""
    seen = []
    real = triton_attention.decode_splits
    monkeypatch.setattr(triton_attention, "decode_splits", lambda *args: seen.append(args) or real(*args))
    step = make_step(torch.Generator().manual_seed(3), 128, 1, 576, [], [2], num_slots=16)
    q, k, _, k_cache, _, meta = step
    want = TorchAttention().forward(q, k, None, k_cache.clone(), None, meta, value_dim=512)
    backend = triton_attention.TritonAttention(num_decode_splits=None)
    q, k, k_cache = (x.to(DEVICE, torch.float32) for x in (q, k, k_cache))
    got = backend.forward(q, k, None, k_cache, None, _to(meta, DEVICE), value_dim=512)
    assert seen[0][:2] == (1, 8) and torch.allclose(got.cpu().double(), want, atol=1e-4)


@settings(max_examples=10, deadline=None)
@given(
    heads=st.sampled_from(HEADS),
    head_dim=st.sampled_from([16, 32]),
    prefills=st.lists(st.tuples(st.integers(0, 64), st.integers(1, 48)), max_size=3),
    decodes=st.lists(st.integers(0, 100), max_size=4),
    block=st.sampled_from([16, 32]),
    local=st.one_of(st.none(), st.tuples(st.sampled_from(["window", "chunk"]), st.integers(1, 80))),
    splits=st.sampled_from([None, 1, 2, 5]),
    combine_in_kernel=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_any_step_matches_the_reference(
    heads, head_dim, prefills, decodes, block, local, splits, combine_in_kernel, seed
):
    """Any step, in a sliding window or chunks (Llama 4's local layers) of any length, or neither; split
    decodes merged by either kernel."""
    if not prefills and not decodes:
        return
    option = {} if local is None else {local[0]: local[1]}
    with pytest.MonkeyPatch.context() as monkeypatch:
        step = make_step(torch.Generator().manual_seed(seed), *heads, head_dim, prefills, decodes, num_slots=800)
        error = check_against_reference(
            monkeypatch, step, torch.float32, block, splits=splits, combine_in_kernel=combine_in_kernel, **option
        )
        assert error < TOLERANCE[torch.float32]


def test_backend_choice_and_bad_choices(monkeypatch):
    assert resolve_attention_backend("auto", torch.device("cpu")) == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_attention_backend("triton", torch.device("cpu")) == "triton"  # in the interpreter
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ConfigError, match="attention backend 'triton' runs on CUDA, not on cpu"):
        load_model("random:tiny-llama", attention_backend="triton")
    with pytest.raises(ConfigError, match="unknown attention backend 'flash'; valid: auto, torch, triton"):
        load_model("random:tiny-llama", attention_backend="flash")
