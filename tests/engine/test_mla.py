"""DeepSeek's multi-head latent attention (models/deepseek_v2.py): long prefills by head, the rest over the
latent. The rule at DeepSeek-V2's sizes, the two forms' outputs on one step, and transformers' greedy
tokens with every prefill by head, and with some of a step's by head beside others over the latent."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import greedy_tokens, reference  # noqa: E402
from sloserve import LLM  # noqa: E402
from sloserve.engine.attention import AttentionMetadata, PrefillSeq, TorchAttention  # noqa: E402
from sloserve.engine.models import deepseek_v2  # noqa: E402
from sloserve.engine.models.deepseek_v2 import PrefillsByHead  # noqa: E402


def _seq(query_len: int, cached: int) -> PrefillSeq:
    return PrefillSeq(0, query_len, torch.zeros(cached + query_len, dtype=torch.int64))


def _first_by_head(rule: PrefillsByHead, cached: int) -> int:
    """The fewest tokens after ``cached`` cached ones that ``rule`` takes by head."""
    return next(c for c in range(1, 2048) if rule(_seq(c, cached)))


def test_prefills_go_by_head_where_that_costs_fewer_flops_at_deepseek_v2s_sizes():
    """V2 and V2-Lite (d_c 512, d_h^R 64, d_h 128, values 128): a (query, key) pair and head costs 2,176 FLOPs
    over the latent and 768 by head, a context token 262,144 to up-project; so a prompt goes by head from
    372 tokens, a chunk after 4K cached ones from 191 (187 after 32K), and none whose keys and values by head
    pass 2^29 numbers (1 GiB in bf16)."""
    lite = PrefillsByHead.of(nh=16, latent_dim=512, nope_dim=128, rope_dim=64, v_dim=128)
    assert (lite.saved_flops_per_pair, lite.flops_per_key, lite.numbers_per_key) == (2176 - 768, 262_144, 16 * 384)
    assert [_first_by_head(lite, cached) for cached in (0, 4096, 32768)] == [372, 191, 187]
    longest = lite.max_numbers // lite.numbers_per_key  # 87,381 context tokens by head (1 GiB in bf16)
    assert longest == 87_381
    assert lite(_seq(4096, longest - 4096)) and not lite(_seq(4096, longest - 4095))
    v2 = PrefillsByHead.of(nh=128, latent_dim=512, nope_dim=128, rope_dim=64, v_dim=128)
    assert v2.max_numbers // v2.numbers_per_key == 10_922


def _mla_layer_and_step(hf_dirs):
    """The tests' DeepSeek-V2's first attention layer in float64, its KV cache with random entries, and a step:
    a prompt (10 tokens), a chunk of 6 after 14 cached tokens, a decode after 8."""
    llm = LLM(hf_dirs["deepseek_v2"], "vllm")
    attn = copy.deepcopy(llm.loaded.model.model.layers[0].self_attn).double()
    attn.backend = TorchAttention()
    gen = torch.Generator().manual_seed(0)
    width = attn.latent_dim + attn.rope_dim
    cache = torch.randn(200, 1, width, generator=gen, dtype=torch.float64)
    prompt = torch.arange(10)
    chunk_context = torch.randperm(100, generator=gen)[:20] + 100  # 14 cached, then the chunk's 6
    decode_context = torch.arange(30, 39)  # 8 cached, then the decode's token
    meta = AttentionMetadata(
        slot_mapping=torch.cat((prompt, chunk_context[14:], decode_context[8:])),
        prefills=[PrefillSeq(0, 10, prompt), PrefillSeq(10, 6, chunk_context)],
        decode_token_index=torch.tensor([16]),
        decode_slots=decode_context[None],
        decode_context_lens=torch.tensor([9]),
    )
    q = torch.randn(17, attn.num_heads, attn.nope_dim + attn.rope_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(17, 1, width, generator=gen, dtype=torch.float64)
    return attn, cache, meta, q, k


def test_a_step_attends_alike_by_head_and_over_the_latent(hf_dirs):
    """One step of a prompt, a chunk after a cached context and a decode, in float64: each head's values are the
    same (to rounding) with every prefill over the latent, every prefill by head, or one of each; the decode
    stays over the latent, and the backend sees only the prefills not taken by head."""
    attn, cache, meta, q, k = _mla_layer_and_step(hf_dirs)
    rule = attn.prefills_by_head
    outputs = {}
    for name, taken in [
        ("latent", replace(rule, saved_flops_per_pair=0)),
        ("by head", replace(rule, flops_per_key=0)),
        # the prompt's 55 pairs x 5 > its 10 keys x 27; the chunk's 105 x 5 < 20 x 27
        ("the prompt by head", replace(rule, saved_flops_per_pair=5, flops_per_key=27)),
    ]:
        attn.prefills_by_head = taken
        step = replace(meta, _local={}, _fresh={}, _apart={})
        by_head, rest = step.prefills_apart(taken)
        outputs[name] = attn.attend(q, k, None, cache.clone(), None, step)  # (17, nh, values)
        seen = [seq.query_start for seq in rest.prefills]
        assert [seq.query_start for seq in by_head] == {"latent": [], "by head": [0, 10]}.get(name, [0])
        assert seen == {"latent": [0, 10], "by head": []}.get(name, [10])
        assert torch.equal(rest.decode_token_index, meta.decode_token_index)
    assert outputs["latent"].shape == (17, attn.num_heads, attn.v_dim)
    for name in ("by head", "the prompt by head"):
        torch.testing.assert_close(outputs[name], outputs["latent"], rtol=1e-10, atol=1e-10)
    assert torch.equal(outputs["by head"][16], outputs["latent"][16])  # the decode: the same call


def _rule_of(saved_flops_per_pair: int, flops_per_key: int):
    return classmethod(lambda cls, *sizes: cls(saved_flops_per_pair, flops_per_key, 0))


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize("scheduler", ["vllm", "sarathi", "orca", "bros"])
def test_every_prefill_by_head_gives_hf_greedy_tokens(hf_dirs, monkeypatch, arch, scheduler):
    monkeypatch.setattr(PrefillsByHead, "of", _rule_of(1, 0))  # (any prefill)
    calls = []
    real = deepseek_v2.MultiHeadLatentAttention._attend_by_head
    monkeypatch.setattr(
        deepseek_v2.MultiHeadLatentAttention, "_attend_by_head", lambda *args: calls.append(1) or real(*args)
    )
    options = dict(prefill_token_budget=8, block_size=4) if scheduler == "sarathi" else {}
    tokens, _ = greedy_tokens(hf_dirs[arch], scheduler, **options)
    assert calls
    assert tokens == reference(arch)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_long_prompts_by_head_beside_short_ones_over_the_latent_give_hf_greedy_tokens(hf_dirs, monkeypatch, backend):
    """A prefill goes by head where its causal pairs outnumber 10 times its context (prompts of 20 tokens and
    more, not chunks of 8 after others): a step holds both forms (and, with Triton's kernels, the rest
    packed without the prompts by head)."""
    if backend == "triton":
        pytest.importorskip("triton")
    monkeypatch.setattr(PrefillsByHead, "of", _rule_of(1, 10))
    lengths = []
    real = deepseek_v2.MultiHeadLatentAttention._attend_by_head
    monkeypatch.setattr(
        deepseek_v2.MultiHeadLatentAttention,
        "_attend_by_head",
        lambda self, q, *args: lengths.append(q.shape[0]) or real(self, q, *args),
    )
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    tokens, _ = greedy_tokens(hf_dirs["deepseek_v2"], "vllm", attention_backend=backend, device=device)
    assert set(lengths) == {30}  # the 30-token prompt, in each layer (the others have 3-17 tokens)
    assert tokens == reference("deepseek_v2")
