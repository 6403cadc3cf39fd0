"""Steps with a prefill on piecewise CUDA graphs (``engine.piecewise_graphs``): the padded pieces around
eager attention give the eager path's tokens and touch no request's KV.

On the CPU the pieces are not captured (``capture=False`` runs them on the same padded buffers
eagerly): these tests check the cut of the forward pass, the padding, the buffer copies and the
executor's dispatch, everything but the capture. The test marked ``cuda`` captures real graphs.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from greedy_runs import generate_greedy  # noqa: E402

from sloserve import LLM, SamplingParams  # noqa: E402
from sloserve.core.errors import ConfigError  # noqa: E402
from sloserve.engine import piecewise_graphs  # noqa: E402
from sloserve.engine.llm_engine import default_async_scheduling  # noqa: E402
from sloserve.engine.piecewise_graphs import PiecewiseGraphs, piecewise_graphs_for, token_sizes  # noqa: E402

CUDA = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not CUDA, reason="captures CUDA graphs: needs a GPU")


def test_token_sizes():
    assert token_sizes(512) == [8, 16, *range(32, 513, 32)]
    assert token_sizes(100) == [8, 16, 32, 64, 96, 100]
    assert token_sizes(8) == [8]


def _on_pieces(llm: LLM, sizes: list[int], compile: bool = False) -> list[int]:
    """Give ``llm``'s executor uncaptured piecewise graphs of ``sizes``; returns the list of each step's
    token count that runs on them, filled as it runs."""
    graphs = PiecewiseGraphs(llm.loaded.model, llm.engine.cache, capture=False, sizes=sizes, compile=compile)
    counts: list[int] = []
    real_forward = graphs.forward
    graphs.forward = lambda tokens, *rest: counts.append(len(tokens)) or real_forward(tokens, *rest)
    llm.engine.executor.piecewise = graphs
    return counts


@pytest.mark.parametrize(
    "model,backend,scheduler,options",
    [
        ("tiny-llama", "torch", "vllm", {}),
        ("tiny-llama", "torch", "sarathi", dict(prefill_token_budget=16, block_size=4)),  # mixed chunks
        ("tiny-qwen3", "torch", "vllm", dict(kv_capacity_tokens=96, block_size=4, preemption_mode="recompute")),
        ("tiny-qwen2", "torch", "sarathi", dict(kv_capacity_tokens=96, block_size=4, preemption_mode="swap")),
        ("tiny-llama", "torch", "bros", {}),  # bidirectional KV blocks
        ("tiny-mistral", "torch", "sarathi", dict(prefill_token_budget=16, block_size=4)),  # a sliding window
        ("tiny-granite", "torch", "sarathi", dict(prefill_token_budget=16, block_size=4)),  # scales
        ("tiny-phi4-mini", "torch", "sarathi", dict(prefill_token_budget=16, block_size=4)),  # partial rotary
        ("tiny-ministral3", "torch", "sarathi", dict(prefill_token_budget=16, block_size=4)),  # queries' own tables
        ("tiny-starcoder2", "torch", "sarathi", dict(prefill_token_budget=16, block_size=4)),  # LayerNorms
        ("tiny-gemma", "torch", "sarathi", dict(prefill_token_budget=16, block_size=4)),  # scaled embeddings
        # MLA's keys-only cache (no V buffer, outputs 32 wide of 40), DeepSeek's MoE
        ("hf:deepseek_v2", "torch", "sarathi", dict(prefill_token_budget=16, block_size=4)),
        # Llama 4's chunked layers, its unrotated layers' query scales in float32 tables (a model in bf16)
        ("hf:llama4", "torch", "sarathi", dict(prefill_token_budget=16, block_size=4, dtype="bfloat16")),
        ("tiny-llama", "triton", "sarathi", dict(prefill_token_budget=16, block_size=4)),
        ("tiny-llama", "torch", "sarathi", dict(prefill_token_budget=16, block_size=4, async_scheduling=True)),
    ],
)
def test_engine_on_padded_pieces_gives_the_eager_tokens(hf_dirs, model, backend, scheduler, options):
    """Every step of at most 40 tokens that the decode graphs do not take (the CPU has none: all of
    them) runs on the pieces of the smallest size that holds it, padded: every request's tokens equal
    the eager engine's. (``hf:ARCH``: the tests' transformers model of that architecture.)"""
    if backend == "triton":
        pytest.importorskip("triton")
        # compiled on a GPU; its decode graphs off, as the CPU has none: they would take every step but the
        # 16-token chunks, which the pieces would then run unpadded (as the H200 did, 2026-12-04)
        options = {**options, "device": "cuda" if CUDA else "cpu", "dtype": "float32", "cuda_graphs": False}
    source = hf_dirs[model.removeprefix("hf:")] if model.startswith("hf:") else f"random:{model}"
    eager = LLM(source, scheduler, attention_backend=backend, **{**options, "async_scheduling": False})
    expected = generate_greedy(eager)
    llm = LLM(source, scheduler, attention_backend=backend, **options)
    counts = _on_pieces(llm, [8, 16, 40])
    assert generate_greedy(llm) == expected
    early = options.get("async_scheduling", default_async_scheduling(llm.loaded))
    assert (llm.engine.executor.num_early_launches > 0) == early
    padded = {llm.engine.executor.piecewise.size_for(n) for n in counts}
    assert len(padded) > 1 and any(n not in padded for n in counts)  # several sizes, padding rows
    if "preemption_mode" in options:
        assert llm.engine.scheduler.num_preemptions > 0


def test_a_padded_step_writes_only_its_slots_and_the_pad_slot():
    """One step of 3 prompts (24 tokens, padded to 32): the KV cache afterwards equals the eager
    engine's at every request's slot, and the padding rows changed only the pad slot's block."""
    prompts = [list(range(1, 9)), list(range(20, 31)), list(range(40, 45))]
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    caches = []
    for pieces in (False, True):
        llm = LLM("random:tiny-llama", "vllm", block_size=4)
        if pieces:
            counts = _on_pieces(llm, [32])
        before = llm.engine.cache.gpu.clone()
        for ids in prompts:
            llm.engine.add_request(ids, params)
        llm.engine.step()
        caches.append((before, llm.engine.cache.gpu.clone(), llm.engine.cache.pad_slot))
    assert counts == [24]
    (_, eager, pad), (before, padded, _) = caches
    torch.testing.assert_close(padded[:, :, :pad], eager[:, :, :pad], rtol=1e-5, atol=1e-5)
    changed = (padded != before).flatten(0, 1).any(0).flatten(1).any(1)  # (slots,)
    assert changed[pad] and not changed[pad + 1 :].any(), "padding rows write the pad slot only"


def test_only_models_with_pieces_get_them(monkeypatch):
    """With CUDA graphs and the setting on (unset: its default): the Llama family; Gemma 3 (its own forward) and
    OPT run their prefills eagerly, as does every model with the setting off or without CUDA graphs."""
    monkeypatch.delenv("SLOSERVE_PIECEWISE_GRAPHS", raising=False)
    monkeypatch.setattr(piecewise_graphs, "PiecewiseGraphs", lambda model, cache, compile: ("graphs", compile))
    for model, has_pieces in (
        ("tiny-llama", True),
        ("tiny-qwen3", True),
        ("tiny-starcoder2", True),
        ("tiny-gemma3", False),
        ("tiny-opt", False),
    ):
        llm = LLM(f"random:{model}")
        cache = llm.engine.cache
        pieces = piecewise_graphs_for(llm.loaded.model, cache, cuda_graphs=True)
        assert pieces == (("graphs", False) if has_pieces else None)
        assert piecewise_graphs_for(llm.loaded.model, cache, cuda_graphs=False) is None
    monkeypatch.setenv("SLOSERVE_COMPILE_PIECES", "1")  # compiled pieces
    assert piecewise_graphs_for(llm.loaded.model, cache, cuda_graphs=True) is None  # (OPT: none to compile)
    assert piecewise_graphs_for(LLM("random:tiny-llama").loaded.model, cache, cuda_graphs=True) == ("graphs", True)
    monkeypatch.setenv("SLOSERVE_PIECEWISE_GRAPHS", "0")
    assert piecewise_graphs_for(llm.loaded.model, cache, cuda_graphs=True) is None
    for name in ("SLOSERVE_PIECEWISE_GRAPHS", "SLOSERVE_COMPILE_PIECES"):  # a bad value: one clear error, GPU or not
        monkeypatch.setenv(name, "yes")
        with pytest.raises(ConfigError, match=f"{name} must be 0 or 1, got 'yes'"):
            piecewise_graphs_for(llm.loaded.model, cache, cuda_graphs=False)
        monkeypatch.setenv(name, "0")


def test_compiled_pieces_give_the_eager_tokens():
    """The pieces compiled by ``torch.compile`` (inductor; C++ kernels on the CPU): every request's tokens
    equal the eager engine's, through Sarathi's mixed chunks, and the middle pieces of every layer and
    token count share one graph (3 graphs in all: the first piece, the middle ones, the last)."""
    from torch._dynamo.utils import counters

    options = dict(scheduler="sarathi", prefill_token_budget=16, block_size=4)
    expected = generate_greedy(LLM("random:small-llama", **options))
    llm = LLM("random:small-llama", **options)
    assert len(llm.loaded.model.model.layers) >= 3  # (several middle pieces)
    graphs_before = counters["stats"]["unique_graphs"]
    counts = _on_pieces(llm, [8, 16, 40], compile=True)
    assert generate_greedy(llm) == expected
    assert len({llm.engine.executor.piecewise.size_for(n) for n in counts}) > 1
    assert counters["stats"]["unique_graphs"] - graphs_before == 3


@cuda_only
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_compiled_pieces_give_the_uncompiled_tokens(dtype, monkeypatch):
    """On a GPU: the engine with the compiled pieces captured (inductor's Triton kernels in the graphs)
    gives the tokens of uncaptured, uncompiled pieces."""
    monkeypatch.setenv("SLOSERVE_PIECEWISE_GRAPHS", "1")
    monkeypatch.setenv("SLOSERVE_COMPILE_PIECES", "1")
    options = dict(device="cuda", dtype=dtype, scheduler="sarathi", prefill_token_budget=16, block_size=4)
    uncaptured = LLM("random:small-llama", **options)
    _on_pieces(uncaptured, piecewise_graphs.token_sizes(piecewise_graphs.DEFAULT_MAX_NUM_TOKENS))
    llm = LLM("random:small-llama", **options)
    assert llm.engine.executor.piecewise.compile and llm.engine.executor.piecewise.graphs
    assert generate_greedy(llm) == generate_greedy(uncaptured)


@cuda_only
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_pieces_replay_the_uncaptured_ones(dtype, monkeypatch):
    """On a GPU: the engine with captured pieces gives the uncaptured pieces' tokens."""
    monkeypatch.setenv("SLOSERVE_PIECEWISE_GRAPHS", "1")
    options = dict(device="cuda", dtype=dtype, scheduler="sarathi", prefill_token_budget=16, block_size=4)
    uncaptured = LLM("random:tiny-llama", **options)
    _on_pieces(uncaptured, piecewise_graphs.token_sizes(piecewise_graphs.DEFAULT_MAX_NUM_TOKENS))
    llm = LLM("random:tiny-llama", **options)
    assert llm.engine.executor.piecewise is not None and llm.engine.executor.piecewise.graphs
    assert generate_greedy(llm) == generate_greedy(uncaptured)
