"""The fused MoE kernels (``engine/fused_moe.py``) against the reference (``models.moe.by_expert``): the pairs'
alignment by expert on random routings, the experts' outputs of Qwen's and gpt-oss's layouts, and whole models'
greedy tokens. Without CUDA the kernel runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from hf_models import greedy_tokens, reference  # noqa: E402
from sloserve.checkpoint.config import from_hf_config  # noqa: E402
from sloserve.engine import fused_moe  # noqa: E402
from sloserve.engine.models.moe import Experts, GptOssExperts, use_fused_experts  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@settings(max_examples=60, deadline=None)
@given(
    num_tokens=st.integers(1, 40),
    top_k=st.integers(1, 4),
    num_experts=st.integers(1, 10),
    block_m=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**16),
)
def test_every_pair_lands_once_in_a_block_of_its_expert(num_tokens, top_k, num_experts, block_m, seed):
    """Each (token, choice) pair once, in a block whose expert is the pair's, in order within its expert; each
    expert's run padded to whole blocks with the id past the last pair; the runs' total as ``num_padded``; the
    pairs past it all padding."""
    experts = torch.randint(0, num_experts, (num_tokens, top_k), generator=torch.Generator().manual_seed(seed))
    pairs, block_experts, num_padded = fused_moe.align_by_expert(experts, num_experts, block_m)
    flat, num_pairs = experts.flatten(), num_tokens * top_k
    counts = torch.bincount(flat, minlength=num_experts)
    assert int(num_padded) == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert pairs.numel() == block_experts.numel() * block_m >= int(num_padded)
    used = pairs[: int(num_padded)]
    assert sorted(used[used < num_pairs].tolist()) == list(range(num_pairs))
    assert (pairs[int(num_padded) :] == num_pairs).all()
    runs = used.view(-1, block_m)
    for block, expert in zip(runs, block_experts.tolist()):
        real = block[block < num_pairs]
        assert (flat[real] == expert).all() and (block[: real.numel()] == real).all()  # (padding last)
    for expert in range(num_experts):  # in order within its run (a stable sort)
        mine = used[(used < num_pairs)][flat[used[used < num_pairs]] == expert]
        assert mine.tolist() == sorted(mine.tolist())


def _random_(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.3)
    return module


def _routing(num_tokens: int, num_experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts (T, k) distinct a token, weights (T, k)): every expert gets tokens but the last (none)."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    scores[:, -1] = -1.0  # (an expert no token picks)
    weights, experts = scores.topk(top_k, dim=-1)
    return experts, weights.softmax(dim=-1)


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k"), [(1, 6, 2), (5, 8, 4), (70, 6, 2), (3, 4, 1)])
@pytest.mark.parametrize("layout", ["qwen", "gpt_oss"])
def test_fused_experts_are_the_reference(num_tokens, num_experts, top_k, layout):
    """A decode's token, a few, enough for the large blocks (70 x 2 pairs on 6 experts), one expert a token;
    Qwen's stacked SwiGLU experts ((E, 2 I, H), (E, H, I)) and gpt-oss's (transposed, with biases and its clamped
    SwiGLU on interleaved columns): the fused kernels' outputs are ``by_expert``'s to float32's rounding."""
    hidden, inner = 40, 24  # (neither a multiple of the tiles)
    if layout == "qwen":
        experts_module = Experts(num_experts, hidden, inner)
    else:
        moe = dict(model_type="gpt_oss", vocab_size=64, hidden_size=hidden, intermediate_size=inner,
                   num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                   max_position_embeddings=64, num_local_experts=num_experts, num_experts_per_tok=top_k)  # fmt: skip
        experts_module = GptOssExperts(from_hf_config(moe))
    experts_module = _random_(experts_module, num_tokens + num_experts).to(DEVICE)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    experts, weights = (t.to(DEVICE) for t in _routing(num_tokens, num_experts, top_k, seed=num_tokens))
    with torch.inference_mode():
        want = experts_module(x, experts, weights)
        assert use_fused_experts(experts_module) == 1
        got = experts_module(x, experts, weights)
    assert got.shape == want.shape == (num_tokens, hidden)
    assert float((got - want).norm() / want.norm()) < 1e-5


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "gpt_oss", "deepseek_v3"])
def test_models_on_fused_experts_give_hf_greedy_tokens(hf_dirs, arch, monkeypatch):
    """``SLOSERVE_FUSED_MOE=1`` with the Triton backend (here in its interpreter): every MoE layer of Qwen3-MoE,
    Qwen2-MoE (its shared expert beside), gpt-oss and DeepSeek-V3 (its routing, its shared experts) on the
    fused kernels, and transformers' greedy tokens."""
    monkeypatch.setenv("SLOSERVE_FUSED_MOE", "1")
    calls = []
    real = fused_moe.fused_experts
    monkeypatch.setattr(fused_moe, "fused_experts", lambda *args, **kw: calls.append(1) or real(*args, **kw))
    # (on a GPU: on CUDA, where the decode steps replay CUDA graphs, the routing no longer setting shapes)
    tokens, llm = greedy_tokens(hf_dirs[arch], "vllm", attention_backend="triton", device=DEVICE.type)
    assert llm.loaded.cuda_graphs == (DEVICE.type == "cuda")
    layers = [m for m in llm.loaded.model.modules() if isinstance(m, (Experts, GptOssExperts))]
    assert layers and all(layer.fused for layer in layers) and calls
    assert tokens == reference(arch)


def test_the_fused_moe_switch(hf_dirs, monkeypatch):
    """On the CPU (Triton's interpreter) off unless SLOSERVE_FUSED_MOE=1 (on CUDA on unless 0), and only beside
    the Triton backend (the torch backend keeps the reference); a bad value is one clear error."""
    from sloserve.core.errors import ConfigError
    from sloserve.engine.loader import load_model

    def fused(backend: str) -> bool:
        loaded = load_model(hf_dirs["qwen3_moe"], attention_backend=backend)
        return all(m.fused for m in loaded.model.modules() if isinstance(m, Experts))

    monkeypatch.delenv("SLOSERVE_FUSED_MOE", raising=False)
    assert not fused("triton")
    monkeypatch.setenv("SLOSERVE_FUSED_MOE", "1")
    assert fused("triton") and not fused("torch")
    monkeypatch.setenv("SLOSERVE_FUSED_MOE", "yes")
    with pytest.raises(ConfigError, match="SLOSERVE_FUSED_MOE must be 0 or 1, got 'yes'"):
        load_model(hf_dirs["qwen3_moe"])
