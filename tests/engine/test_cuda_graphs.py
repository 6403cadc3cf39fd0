"""Decode steps on CUDA graphs (``engine.cuda_graphs``): the padded static-buffer path gives the eager
path's outputs and touches no request's KV.

On the CPU the graphs are not captured (``capture=False`` runs the same padded buffers eagerly): these
tests check the padding, the buffer copies and the executor's dispatch, which is everything but the
capture itself. The tests marked ``cuda`` capture real graphs and run only on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from greedy_runs import generate_greedy  # noqa: E402

from sloserve import LLM  # noqa: E402
from sloserve.core.errors import ConfigError  # noqa: E402
from sloserve.core.request import Request  # noqa: E402
from sloserve.engine.attention import AttentionMetadata  # noqa: E402
from sloserve.engine.cuda_graphs import DecodeGraphs, capture_sizes  # noqa: E402
from sloserve.engine.kv_cache import KVCacheTensor  # noqa: E402
from sloserve.engine.llm_engine import default_async_scheduling  # noqa: E402
from sloserve.engine.loader import load_model  # noqa: E402
from sloserve.kv.manager import PagedKVManager  # noqa: E402

CUDA = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not CUDA, reason="captures CUDA graphs: needs a GPU")


def test_capture_sizes_are_vllms():
    assert capture_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]


def _decode_step(loaded, batch_size: int, seed: int, block_size: int = 4):
    """A KV cache with random contents and ``batch_size`` requests of random context lengths, each
    about to decode one token: (tokens, positions, context lengths, slot table, its block ids, cache)."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 40, size=batch_size)  # context tokens, the new one included
    kv = PagedKVManager(int(sum(-(-n // block_size) for n in lens)) + 3, block_size)
    cache = KVCacheTensor(loaded.config, kv.capacity_tokens, 0, block_size, loaded.dtype, loaded.device)
    cache.gpu.normal_(generator=torch.Generator(loaded.device).manual_seed(seed))
    requests = []
    for i, n in enumerate(lens.tolist()):
        request = Request(i, 0.0, n, 1, 1)
        assert kv.allocate_slots(request, n)
        request.add_computed(n - 1)
        requests.append(request)
    table = kv.slot_tables(requests, lens)  # (b, max len)
    block_ids = kv.block_id_tables(requests, lens)  # (b, max len / block_size)
    tokens = rng.integers(0, loaded.config.vocab_size, size=batch_size).tolist()
    return tokens, (lens - 1).tolist(), lens, table, block_ids, cache


@pytest.mark.parametrize("batch_size", [1, 3, 5, 6, 8])
def test_padded_decode_equals_eager_and_writes_only_its_slots(batch_size):
    """A batch of b decodes padded to its graph's size: the same hidden states as the unpadded eager
    forward pass, and the cache changes only at the b slots written and the pad slot."""
    loaded = load_model("random:tiny-llama")
    tokens, positions, lens, table, block_ids, cache = _decode_step(loaded, batch_size, seed=batch_size)
    written = table[np.arange(batch_size), lens - 1]
    before = cache.gpu.clone()
    eager_cache = cache.gpu.clone()
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(written.copy()),
        prefills=[],
        decode_token_index=torch.arange(batch_size),
        decode_slots=torch.from_numpy(table),
        decode_context_lens=torch.from_numpy(lens),
    )
    with torch.inference_mode():
        expected = loaded.model(torch.tensor(tokens), torch.tensor(positions), eager_cache, meta)
        graphs = DecodeGraphs(loaded.model, cache, max_context=64, table_block_size=4, max_batch_size=6, capture=False)
        if not graphs.fits(batch_size, table.shape[1]):
            assert batch_size > 6
            return
        hidden = graphs.forward(tokens, positions, lens, written, block_ids)
    assert hidden.shape == expected.shape
    torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)
    changed = set(torch.nonzero((cache.gpu != before).flatten(0, 1).any(0).flatten(1).any(1)).flatten().tolist())
    assert set(written.tolist()) <= changed <= set(written.tolist()) | {cache.pad_slot}
    real = list(range(cache.pad_slot))
    # The same K/V as the eager step wrote (to rounding: a matmul's blocking depends on its row count).
    torch.testing.assert_close(cache.gpu[:, :, real], eager_cache[:, :, real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "backend,scheduler,options",
    [
        ("torch", "vllm", {}),
        ("torch", "vllm", dict(kv_capacity_tokens=96, block_size=4, preemption_mode="recompute")),
        ("torch", "sarathi", dict(kv_capacity_tokens=96, block_size=4, preemption_mode="swap")),
        ("torch", "bros", {}),  # bidirectional KV blocks
        ("triton", "vllm", dict(block_size=4)),  # the kernel reads the wide static slot table
        ("torch", "vllm", dict(kv_capacity_tokens=96, block_size=4, async_scheduling=True)),  # tokens on the device
    ],
)
def test_engine_on_padded_graph_buffers_gives_the_eager_tokens(backend, scheduler, options):
    """The executor runs every decode-only step of at most 6 decodes on the graphs' padded buffers
    (larger ones and steps with a prefill run eagerly): every request's tokens equal the eager engine's
    (without async scheduling)."""
    if backend == "triton":
        pytest.importorskip("triton")
        options = {**options, "device": "cuda" if CUDA else "cpu", "dtype": "float32"}  # compiled on a GPU
    eager = LLM("random:tiny-llama", scheduler, attention_backend=backend, **{**options, "async_scheduling": False})
    expected = generate_greedy(eager)
    llm = LLM("random:tiny-llama", scheduler, attention_backend=backend, **options)
    engine = llm.engine
    graphs = DecodeGraphs(
        llm.loaded.model,
        engine.cache,
        engine.max_model_len,
        engine.scheduler.kv.table_block_size,
        max_batch_size=6,
        capture=False,
    )
    sizes: list[int] = []
    real_forward = graphs.forward
    graphs.forward = lambda tokens, *rest: sizes.append(len(tokens)) or real_forward(tokens, *rest)
    engine.executor.graphs = graphs
    assert generate_greedy(llm) == expected
    assert sizes and max(sizes) <= 6 and len(set(sizes)) > 1
    assert (engine.executor.num_early_launches > 0) == options.get(
        "async_scheduling", default_async_scheduling(llm.loaded)
    )
    if "preemption_mode" in options:
        assert engine.scheduler.num_preemptions > 0


def test_cuda_graphs_need_cuda_and_triton():
    with pytest.raises(
        ConfigError,
        match="CUDA graphs need device cuda and the triton attention backend, got device cpu and the torch backend",
    ):
        LLM("random:tiny-llama", cuda_graphs=True)


def test_cuda_graphs_are_on_by_default_where_supported():
    """Unless asked otherwise, decode steps replay graphs on CUDA with Triton, and run eagerly elsewhere."""
    assert load_model("random:tiny-llama").cuda_graphs is False  # the CPU
    assert load_model("random:tiny-llama", cuda_graphs=False).cuda_graphs is False
    if CUDA:
        assert load_model("random:tiny-llama", device="cuda", attention_backend="triton").cuda_graphs is True
        assert load_model("random:tiny-llama", device="cuda", attention_backend="torch").cuda_graphs is False
        assert load_model("random:tiny-llama", device="cuda", cuda_graphs=False).cuda_graphs is False


@cuda_only
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_graphs_replay_the_eager_step(dtype):
    """On a GPU: replaying the captured graph of each size gives the eager forward pass's hidden
    states, for batches that fill their graph and batches padded up to it."""
    loaded = load_model("random:tiny-llama", device="cuda", dtype=dtype, attention_backend="triton")
    for batch_size in [1, 3, 8, 13, 20]:
        tokens, positions, lens, table, block_ids, cache = _decode_step(loaded, batch_size, seed=batch_size)
        step = (tokens, positions, lens, table[np.arange(batch_size), lens - 1], block_ids)
        eager = DecodeGraphs(loaded.model, cache, max_context=64, table_block_size=4, max_batch_size=20, capture=False)
        with torch.inference_mode():
            expected = eager.forward(*step).clone()
            graphs = DecodeGraphs(loaded.model, cache, max_context=64, table_block_size=4, max_batch_size=20)
            hidden = graphs.forward(*step)
        torch.testing.assert_close(hidden, expected)


@cuda_only
def test_engine_with_cuda_graphs_gives_the_eager_tokens():
    expected = generate_greedy(LLM("random:tiny-llama", "vllm", device="cuda", dtype="float32", cuda_graphs=False))
    llm = LLM("random:tiny-llama", "vllm", device="cuda", dtype="float32", cuda_graphs=True)
    assert llm.engine.executor.graphs is not None and llm.engine.executor.graphs.graphs
    assert generate_greedy(llm) == expected
