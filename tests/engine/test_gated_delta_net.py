"""Qwen3-Next, Qwen3.5 (gated DeltaNets beside gated attention, models/gated_delta_net.py, models/qwen3_next.py),
OLMo Hybrid (beside OLMo 3's attention, models/olmo2.py) and Kimi Linear (a decay a key channel, beside MLA without
rope, models/kimi_linear.py):
the chunked delta rule against the token-by-token recurrence (float64, random inputs), the layer against
transformers' (a prompt whole, in chunks that carry their states, then decodes; several requests in one step; Qwen3-
Next's grouped projections reordered as they load), the configs as the Hub and transformers write them and the
shape the simulator sees. Their greedy tokens through five runs are test_mamba.py's
(``test_a_hybrid_model_gives_hf_greedy_tokens``), their prefix caching test_short_conv.py's."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from hf_models import (  # noqa: E402
    MAX_TOKENS,
    PROMPTS,
    greedy_by_full_forwards,
    greedy_tokens,
    hf_cached,
    save_as_the_hub,
)
from sloserve import LLM  # noqa: E402
from sloserve.checkpoint import model_spec  # noqa: E402
from sloserve.checkpoint.config import from_hf_config  # noqa: E402
from sloserve.checkpoint.model_config import LINEAR_ATTENTION  # noqa: E402
from sloserve.core.errors import ConfigError  # noqa: E402
from sloserve.engine.models import gated_delta_net, qwen3_next  # noqa: E402
from sloserve.engine.models.gated_delta_net import GatedDeltaNet, chunked_delta_rule, delta_rule_step  # noqa: E402
from sloserve.engine.state_cache import StateCache  # noqa: E402
from state_steps import assert_steps_give_the_references_outputs  # noqa: E402


def recurrence(q, k, v, decay, beta, state):
    """S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T, o_t = S_t^T q_t (a_t = exp(decay_t); a decay a key
    channel: diag(a_t) S_{t-1}), a token at a time, each head by itself."""
    state, outputs = state.clone(), []
    for t in range(q.shape[0]):
        out = []
        for h in range(q.shape[1]):
            a = torch.exp(decay[t, h])
            s = state[h] * (a if decay.dim() == 2 else a[:, None])
            s = s + beta[t, h] * torch.outer(k[t, h], v[t, h] - s.T @ k[t, h])
            state[h] = s
            out.append(s.T @ q[t, h])
        outputs.append(torch.stack(out))
    return torch.stack(outputs), state


@settings(max_examples=40, deadline=None)
@given(
    length=st.integers(1, 150),
    chunk_size=st.sampled_from([1, 3, 16, 64]),
    chunks_at_once=st.sampled_from([None, 1, 2]),
    from_zeros=st.booleans(),
    strong_decay=st.booleans(),
    by_channel=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_chunked_delta_rule_is_the_recurrence(
    length, chunk_size, chunks_at_once, from_zeros, strong_decay, by_channel, seed
):
    """Float64, random q, k (unit length), v, decays (down to exp(-40) a token: nothing overflows; one a head, or
    one a key channel: Kimi's KDA) and writing strengths, from zeros or a state: the chunked rule's outputs and last
    state are the recurrence's, whatever the chunks and however many are solved at once; the decode step is one
    token of it."""
    gen = torch.Generator().manual_seed(seed)
    heads, dk, dv = 2, 5, 3

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, v = rand(length, heads, dk), rand(length, heads, dv)
    k = torch.nn.functional.normalize(rand(length, heads, dk), dim=-1)
    shape = (length, heads, dk) if by_channel else (length, heads)
    decay = -torch.rand(*shape, generator=gen, dtype=torch.float64) * (40 if strong_decay else 1)
    beta = 2 * torch.rand(length, heads, generator=gen, dtype=torch.float64)  # (OLMo Hybrid's reach 2)
    initial = torch.zeros(heads, dk, dv, dtype=torch.float64) if from_zeros else rand(heads, dk, dv)
    want_y, want_state = recurrence(q, k, v, decay, beta, initial)
    patch = pytest.MonkeyPatch()
    if chunks_at_once is not None:
        channels = dk if by_channel else 1
        patch.setattr(gated_delta_net, "SCAN_NUMBERS", chunks_at_once * heads * chunk_size * chunk_size * channels)
    try:
        y, state = chunked_delta_rule(q, k, v, decay, beta, None if from_zeros else initial, chunk_size)
    finally:
        patch.undo()
    torch.testing.assert_close(y, want_y, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, want_state, rtol=1e-10, atol=1e-10)
    y, state = delta_rule_step(q[:1], k[:1], v[:1], decay[:1], beta[:1], initial[None])
    want_y, want_state = recurrence(q[:1], k[:1], v[:1], decay[:1], beta[:1], initial)
    torch.testing.assert_close(y, want_y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state[0], want_state, rtol=1e-12, atol=1e-12)


def _layers(arch: str):
    """transformers' gated DeltaNet of the tests' Qwen3-Next or Qwen3.5 (its third layer) and the engine's with its
    weights (Qwen3-Next's projections as the loader reorders them: ``qwen3_next.checkpoint_tensor``)."""
    hf = hf_cached(arch)
    hf_config = hf.config
    torch.manual_seed(5)
    theirs = type(hf.model.layers[0].linear_attn)(hf_config, 2).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(0.1 * torch.randn_like(p))
        theirs.A_log.copy_(torch.empty_like(theirs.A_log).uniform_(0.02, 0.3).log())  # (decays that let S last)
    config = from_hf_config(hf_config.to_dict())
    ours = GatedDeltaNet(config, 2).eval()
    weights = dict(
        qwen3_next.checkpoint_tensor(f"model.layers.2.linear_attn.{name}", tensor, config)
        for name, tensor in theirs.state_dict().items()
    )
    views = {f"model.layers.2.linear_attn.{name}": view for name, view in ours.in_proj.checkpoint_views().items()}
    with torch.no_grad():
        for name, view in views.items():
            view.copy_(weights.pop(name))
    ours.load_state_dict(
        {key.removeprefix("model.layers.2.linear_attn."): t for key, t in weights.items()}, strict=False
    )
    assert ours.state_index == 1  # (its states: the second of the model's DeltaNets')
    return theirs, ours, config


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_the_gated_delta_net_gives_transformers_outputs_whole_in_chunks_and_decoding(arch):
    """A 21-token prompt: whole; as chunks of 5 and 9 that carry their states, then 7 decodes; and beside other
    requests in one step (a prompt in another slot, a decode, a prompt in a slot with stale states): transformers'
    outputs for the whole prompt, position by position (Qwen3-Next's grouped projections, Qwen3.5's apart)."""
    theirs, ours, config = _layers(arch)
    x = torch.randn(21, config.hidden_size, generator=torch.Generator().manual_seed(1))
    cache = StateCache(config, 4, torch.float32, torch.device("cpu"))
    # (2 layers, 4 slots and the pad; q, k of 2 heads of 8 and v of 4 heads of 12 through 3 taps; 4 heads' S of 8 x 12)
    assert cache.conv.shape == (2, 5, 2 * 16 + 48, 3) and cache.ssm.shape == (2, 5, 4, 8, 12)
    with torch.no_grad():
        out = assert_steps_give_the_references_outputs(ours, config, x, theirs(x[None])[0])
        assert torch.equal(out[11], torch.zeros(config.hidden_size))  # (a padding row: zeros through the norm)


def test_kimi_delta_attention_gives_transformers_outputs_whole_in_chunks_and_decoding():
    """Kimi Linear's KDA layer (a decay a key channel, low-rank gates, q, k and v each through its convolution)
    against transformers': a 21-token prompt whole, in chunks then decodes, and beside other requests in one step."""
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

    from sloserve.engine.models.kimi_linear import KimiDeltaAttention

    hf_config = hf_cached("kimi_linear").config
    torch.manual_seed(6)
    theirs = KimiLinearDeltaAttention(hf_config, 2).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(0.1 * torch.randn_like(p))
        theirs.forget_gate.A_log.copy_(torch.empty_like(theirs.forget_gate.A_log).uniform_(0.02, 0.3).log())
        # (transformers leaves dt_bias as torch.empty made it, outside a model's init: NaN where memory held some)
        theirs.forget_gate.dt_bias.copy_(0.5 * torch.randn_like(theirs.forget_gate.dt_bias))
    config = from_hf_config(hf_config.to_dict())
    ours = KimiDeltaAttention(config, 2).eval()
    weights = {name.removeprefix("forget_gate."): tensor for name, tensor in theirs.state_dict().items()}
    weights["A_log"] = weights["A_log"].reshape(-1)  # (transformers' (1, 1, heads, 1))
    convolutions = weights.pop("conv1d.weight").chunk(3)  # (transformers joins q's, k's and v's in one)
    merged = {f"{x}_proj.weight": weights.pop(f"{x}_proj.weight") for x in "qkv"}
    merged.update({f"{x}_conv1d.weight": w for x, w in zip("qkv", convolutions, strict=True)})
    with torch.no_grad():
        for name, view in {**ours.in_proj.checkpoint_views(), **ours.conv1d.checkpoint_views()}.items():
            view.copy_(merged.pop(name))
    assert not merged and not ours.load_state_dict(weights, strict=False).unexpected_keys
    assert ours.state_index == 1
    x = torch.randn(21, config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_steps_give_the_references_outputs(ours, config, x, theirs(x[None])[0])


# Qwen3-Next-80B-A3B-Instruct's config.json as the Hub has it
QWEN3_NEXT_80B = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
    "head_dim": 256, "max_position_embeddings": 262144, "rope_theta": 10000000, "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06, "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "num_experts": 512,
    "num_experts_per_tok": 10, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645,
}  # fmt: skip


def _transformers_count(config) -> int:
    """transformers' parameter count of a model of ``config`` (built without memory: the meta device)."""
    classes = {
        "qwen3_next": transformers.Qwen3NextForCausalLM,
        "qwen3_5_text": transformers.Qwen3_5ForCausalLM,
        "qwen3_5_moe_text": transformers.Qwen3_5MoeForCausalLM,
        "olmo_hybrid": transformers.OlmoHybridForCausalLM,
        "kimi_linear": transformers.KimiLinearForCausalLM,
    }
    with torch.device("meta"):
        return sum(p.numel() for p in classes[config.model_type](config).parameters())


def test_the_configs_read_as_transformers_reads_them():
    """Qwen3-Next-80B-A3B's config as the Hub has it: every fourth layer attending, a quarter of each head rotated,
    512 experts beside a gated shared one, transformers' parameter count (79.7B); Qwen3.5's dense and MoE text models
    at transformers' defaults (their 9B's and 35B-A3B's shapes) likewise; a request's states every DeltaNet's (the
    convolution's last 3 inputs in bf16, each value head's S in float32); bad layer types and head counts refused
    by name."""
    config = from_hf_config(QWEN3_NEXT_80B)
    assert config.layer_types == tuple("full_attention" if i % 4 == 3 else LINEAR_ATTENTION for i in range(48))
    assert (config.rotary_dim, config.rope_theta, config.num_kv_layers, config.num_state_layers) == (64, 1e7, 12, 36)
    assert config.moe["shared_expert_intermediate_size"] == 512 and config.moe["norm_topk_prob"]
    unsaid = {k: v for k, v in QWEN3_NEXT_80B.items() if k not in ("norm_topk_prob", "shared_expert_intermediate_size")}
    assert from_hf_config(unsaid).moe == config.moe  # (transformers' defaults: renormalized, a shared expert of 512)
    spec = config.spec()
    assert spec.num_params == _transformers_count(transformers.Qwen3NextConfig(**QWEN3_NEXT_80B)) == 79_674_391_296
    assert spec.state_bytes_per_sequence == 36 * ((2 * 2048 + 4096) * 3 * 2 + 32 * 128 * 128 * 4)
    for hf_config in (transformers.Qwen3_5TextConfig(), transformers.Qwen3_5MoeTextConfig()):
        assert from_hf_config(hf_config.to_dict()).num_params == _transformers_count(hf_config)
    with pytest.raises(ConfigError, match="layer_types must be 48 entries of full_attention, linear_attention, got"):
        from_hf_config({**QWEN3_NEXT_80B, "layer_types": ["mamba"] * 48})
    with pytest.raises(ConfigError, match="linear_num_key_heads 12 must divide linear_num_value_heads 32"):
        from_hf_config({**QWEN3_NEXT_80B, "linear_num_key_heads": 12})
    with pytest.raises(ConfigError, match="full_attention_interval must be a positive integer, got 0"):
        from_hf_config({**QWEN3_NEXT_80B, "full_attention_interval": 0})


def test_olmo_hybrids_config_reads_as_transformers_reads_it(tmp_path):
    """OLMo Hybrid at transformers' defaults (7B's shape: its DeltaNets' heads as many as attention's, keys 3/4 of the
    hidden size over them, values twice as wide, beta in (0, 2), every fourth layer attending): transformers'
    parameter count; without a rope base (the released checkpoint's ``rope_theta`` null) no layer rotates, with one
    the attention layers do, and a model of it gives transformers' greedy tokens (chunked prefill); beta in (0, 1)
    where ``linear_allow_neg_eigval`` is false."""
    hf_config = transformers.OlmoHybridConfig()
    config = from_hf_config(hf_config.to_dict())
    assert config.num_params == _transformers_count(hf_config)
    net = config.gated_delta_net
    assert (net["num_k_heads"], net["num_v_heads"], net["head_k_dim"], net["head_v_dim"]) == (30, 30, 96, 192)
    assert (net["beta_scale"], net["norm_eps"], config.qk_norm_whole_projection, config.rotary_layers) == (
        2.0,
        1e-5,
        True,
        (),
    )
    assert config.layer_types[:4] == (LINEAR_ATTENTION, LINEAR_ATTENTION, LINEAR_ATTENTION, "full_attention")
    raw = hf_cached("olmo_hybrid").config.to_dict()
    assert from_hf_config(raw).rotary_layers == (False, False, False)  # (rope_theta null: NoPE)
    assert from_hf_config({**raw, "linear_allow_neg_eigval": False}).gated_delta_net["beta_scale"] == 1.0
    rotated = transformers.OlmoHybridConfig(**{**raw, "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}})
    assert from_hf_config(rotated.to_dict()).rotary_layers == () and from_hf_config(rotated.to_dict()).rope_theta == 500
    torch.manual_seed(2)
    model = transformers.OlmoHybridForCausalLM(rotated).eval()
    save_as_the_hub(model, tmp_path)
    tokens, _ = greedy_tokens(str(tmp_path), "sarathi", prefill_token_budget=8, block_size=4)
    assert tokens == [greedy_by_full_forwards(model, p, n) for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]


def test_kimi_linears_config_reads_as_transformers_reads_it():
    """Kimi Linear at transformers' defaults (48B-A3B's shape): transformers' parameter count (and the routers' biases,
    buffers to it); its attention layers without rope; its KDA layers' states (45.6 MB a request). The Hub's config
    (its names of the routing's settings, the KDA's sizes and 1-indexed layers in ``linear_attn_config``) reads as
    transformers' saved one; bad layer types are refused by name."""
    hf_config = transformers.KimiLinearConfig()
    config = from_hf_config(hf_config.to_dict())
    assert config.num_params == _transformers_count(hf_config) + 26 * 256  # (26 MoE layers' router biases)
    assert config.rotary_layers == (False,) * 27 and config.num_kv_layers == 6 and config.mla["q_lora_rank"] is None
    assert config.gated_delta_net["channel_decay"] and config.request_state_bytes(2) == 21 * (
        3 * 4096 * 3 * 2 + 32 * 128 * 128 * 4
    )
    saved = hf_cached("kimi_linear").config.to_dict()
    moved = ("layer_types", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim")  # (to linear_attn_config)
    hub = {key: value for key, value in saved.items() if key not in moved}
    hub["linear_attn_config"] = {"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4,
                                 "full_attn_layers": [2], "kda_layers": [1, 3]}  # fmt: skip
    assert from_hf_config(hub) == from_hf_config(saved)
    moe = from_hf_config(saved).moe  # (a shared expert of moe_intermediate_size beside 8, the first MLP dense)
    assert (moe["shared_expert_intermediate_size"], moe["num_experts"], moe["moe_layers"]) == (
        16,
        8,
        (False, True, True),
    )
    with pytest.raises(ConfigError, match="layer_types must be 3 entries of full_attention, linear_attention, got"):
        from_hf_config({**saved, "layer_types": ["linear_attention", None, "linear_attention"]})
    with pytest.raises(ConfigError, match="linear_attn_config kda_layers holds 4, not a layer in 1..3"):
        from_hf_config({**hub, "linear_attn_config": {**hub["linear_attn_config"], "kda_layers": [1, 4]}})


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid"])
def test_the_tests_models_shapes_count_as_transformers(hf_dirs, arch):
    """The tests' models: transformers' parameter count; KV bytes a token of the one attention layer of three; a
    request's states the two DeltaNets' (float32): the engine's and the simulator's alike."""
    spec = model_spec(hf_dirs[arch])
    assert spec.num_params == sum(p.numel() for p in hf_cached(arch).parameters())
    assert (spec.num_layers, spec.kv_layers) == (3, 1)
    assert spec.kv_bytes_per_token == 2 * 1 * 2 * 16 * 4  # K and V, 1 layer, 2 KV heads of 16, float32
    assert spec.state_bytes_per_sequence == 2 * (80 * 3 * 4 + 4 * 8 * 12 * 4)
    llm = LLM(hf_dirs[arch], "vllm")
    assert llm.engine.cache.gpu.shape[1] == 1  # (one layer's KV)
    assert StateCache.bytes_per_slot(llm.loaded.config, llm.loaded.dtype) == spec.state_bytes_per_sequence
