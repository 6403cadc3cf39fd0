"""Hybrid models (Granite 4.0-H, Nemotron-H, Bamba, Falcon-H1: Mamba-2 mixers beside attention, models/mamba2.py): the chunked scan against
the token-by-token recurrence, the mixer against transformers' layer (a prompt whole, in chunks that carry their
states, then decodes; several requests in one step), and the engine against transformers' greedy tokens: on three
schedulers, through chunked prefill, preemption by recompute, asynchronous scheduling and a cap of state slots;
what cannot carry the states refused by name; the simulator's shape, roofline and slot cap of the same model."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_models import MAX_TOKENS, PROMPTS, greedy_tokens, hf_cached, hf_greedy, reference  # noqa: E402
from sloserve import LLM, SamplingParams  # noqa: E402
from sloserve.checkpoint import model_spec  # noqa: E402
from sloserve.checkpoint.config import from_hf_config  # noqa: E402
from sloserve.core.errors import ConfigError  # noqa: E402
from sloserve.engine import llm_engine  # noqa: E402
from sloserve.engine.models import mamba2  # noqa: E402
from sloserve.engine.models.mamba2 import Mamba2Mixer, ssd_scan  # noqa: E402
from sloserve.engine.state_cache import StateCache  # noqa: E402
from state_steps import assert_steps_give_the_references_outputs  # noqa: E402


def recurrence(x, dt, a, b, c, initial):
    """h_t = exp(dt_t a) h_{t-1} + dt_t x_t b_t^T, y_t = h_t c_t, one token at a time."""
    state, ys = initial.clone(), []
    for t in range(x.shape[0]):
        decay = torch.exp(dt[t] * a)[:, None, None]  # (heads, 1, 1)
        state = state * decay + (dt[t][:, None] * x[t])[..., None] * b[t][:, None, :]
        ys.append(torch.einsum("hpn,hn->hp", state, c[t]))
    return torch.stack(ys), state


@pytest.mark.parametrize("length,chunk_size", [(1, 4), (7, 4), (8, 4), (23, 8), (40, 16)])
@pytest.mark.parametrize("at_once", [None, 2])
def test_the_chunked_scan_is_the_recurrence(length, chunk_size, at_once, monkeypatch):
    """Float64, from zeros and from a state; all chunks' weights at once, or two chunks at a time."""
    if at_once is not None:
        monkeypatch.setattr(mamba2, "SCAN_NUMBERS", at_once * 3 * chunk_size * chunk_size)
    gen = torch.Generator().manual_seed(length)
    heads, head_dim, d_state = 3, 4, 5

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x, b, c = rand(length, heads, head_dim), rand(length, heads, d_state), rand(length, heads, d_state)
    dt = torch.nn.functional.softplus(rand(length, heads))
    a = -torch.rand(heads, generator=gen, dtype=torch.float64) * 2
    for initial in (torch.zeros(heads, head_dim, d_state, dtype=torch.float64), rand(heads, head_dim, d_state)):
        y, state = ssd_scan(x, dt, a, b, c, chunk_size, initial)
        want_y, want_state = recurrence(x, dt, a, b, c, initial)
        torch.testing.assert_close(y, want_y, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(state, want_state, rtol=1e-10, atol=1e-10)


def _mixers():
    """transformers' Mamba layer of the tests' Granite 4.0-H (its third layer) and the engine's with its weights."""
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMambaLayer

    hf_config = hf_cached("granite_4_h").config
    torch.manual_seed(5)
    theirs = GraniteMoeHybridMambaLayer(hf_config, 2).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            if p.ndim == 1:  # (dt_bias, A_log, D, the norm: ones or a range at init)
                p.mul_(1 + 0.3 * torch.randn_like(p))
    config = from_hf_config(hf_config.to_dict())
    ours = Mamba2Mixer(config, 2).eval()
    ours.load_state_dict(theirs.state_dict())
    assert ours.state_index == 1  # (its states: the second of the model's Mamba layers')
    return theirs, ours, config


def test_the_mixer_gives_transformers_outputs_whole_in_chunks_and_decoding():
    """A 21-token prompt (3 scan chunks of 8): whole; as chunks of 5 and 9 that carry their states, then 7
    decodes; and beside other requests in one step (a prompt in another slot, a decode): transformers' outputs
    for the whole prompt, position by position."""
    theirs, ours, config = _mixers()
    x = torch.randn(21, config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = assert_steps_give_the_references_outputs(ours, config, x, theirs(x[None])[0])
    assert torch.equal(out[11], ours.out_proj(torch.zeros(ours.d_inner)))  # (a padding row: y zeros, projected)


def test_nemotron_hs_blocks_as_the_hub_and_transformers_5_name_them(hf_dirs, tmp_path):
    """The Hub's ``hybrid_override_pattern`` (M: Mamba, *: attention, -: MLP) and ``mamba_*`` names read as
    transformers 5's list and names; transformers' parameter count; one block of five with a KV cache; Nemotron 3's
    experts (E) and an unknown letter refused by name; a pattern without attention of no KV cache."""
    from sloserve.checkpoint.model_config import MAMBA, MLP_LAYER

    raw = hf_cached("nemotron_h").config.to_dict()
    listed = from_hf_config(raw)
    hub = {k: v for k, v in raw.items() if k not in ("layers_block_type", "layer_types", "n_groups", "conv_kernel")}
    hub.update(hybrid_override_pattern="M-*-M", mamba_n_groups=2, mamba_d_conv=4)
    assert from_hf_config(hub) == listed
    assert listed.layer_types == (MAMBA, MLP_LAYER, "full_attention", MLP_LAYER, MAMBA)
    assert (listed.num_kv_layers, listed.num_mamba_layers, listed.kv_layer_index(2)) == (1, 2, 0)
    assert listed.mamba["time_step_limit"] == (0.001, float("inf")) and listed.mamba["d_inner"] == 8 * 16
    spec = model_spec(hf_dirs["nemotron_h"])
    assert spec.num_params == sum(p.numel() for p in hf_cached("nemotron_h").parameters())
    assert spec.kv_layers == 1
    experts = from_hf_config({**hub, "hybrid_override_pattern": "ME*EM", "n_routed_experts": 8, "n_group": 2})
    assert experts.moe["moe_layers"] == (False, True, False, True, False) and experts.moe["topk_method"] == "noaux_tc"
    moe = model_spec(hf_dirs["nemotron_h_moe"])
    hf = hf_cached("nemotron_h_moe")  # (its router's bias: a buffer to transformers, a tensor of the checkpoint)
    assert moe.num_params == sum(p.numel() for p in hf.parameters()) + 2 * 8
    assert (moe.num_experts, moe.experts_per_token, moe.expert_params) == (8, 2, 2 * 8 * 2 * 64 * 32)
    assert moe.kv_layers == 1  # (the attention block's alone: the experts' blocks keep no KV)
    with pytest.raises(ConfigError, match="moe_latent_size \\(experts on a latent projection\\) is not supported"):
        from_hf_config({**hub, "hybrid_override_pattern": "ME*EM", "moe_latent_size": 16})
    with pytest.raises(ConfigError, match="nemotron_h block type 'X' is not one of M, \\*, -, E"):
        from_hf_config({**hub, "hybrid_override_pattern": "MX*-M"})
    # a pattern without attention: a model of no KV cache (test_mamba_models.py), its context in its states alone
    unattended = tmp_path / "unattended"
    unattended.mkdir()
    (unattended / "config.json").write_text(json.dumps({**hub, "hybrid_override_pattern": "M-M-"}))
    assert from_hf_config({**hub, "hybrid_override_pattern": "M-M-"}).num_kv_layers == 0
    assert (model_spec(str(unattended)).kv_bytes_per_token, model_spec(str(unattended)).kv_layers) == (0, 0)


def test_nemotron_hs_experts_stored_stacked_load_as_per_expert_ones(hf_dirs, tmp_path):
    """Nemotron 3's experts as one (E, I, H) up and one (E, H, I) down tensor a block (a stacked layout, as
    transformers 5 holds them), not the Hub's tensor an expert: the same greedy tokens."""
    import shutil

    safetensors_torch = pytest.importorskip("safetensors.torch")
    shutil.copytree(hf_dirs["nemotron_h_moe"], tmp_path / "stacked")
    path = tmp_path / "stacked" / "model.safetensors"
    weights = safetensors_torch.load_file(str(path))
    for layer in (1, 3):
        prefix = f"backbone.layers.{layer}.mixer.experts"
        for kind in ("up_proj", "down_proj"):
            parts = [weights.pop(f"{prefix}.{e}.{kind}.weight") for e in range(8)]
            weights[f"{prefix}.{kind}"] = torch.stack(parts)
    safetensors_torch.save_file(weights, str(path))
    tokens, _ = greedy_tokens(str(tmp_path / "stacked"), "vllm")
    assert tokens == reference("nemotron_h_moe")


@pytest.mark.parametrize("arch", ["falcon_h1", "falcon_h1_norm"])
def test_falcon_h1s_shape_counts_both_mixers_of_every_layer(hf_dirs, arch):
    """transformers' parameter count (the gated norm's weight only with ``mamba_rms_norm``); every layer's KV and
    states."""
    spec = model_spec(hf_dirs[arch])
    assert spec.num_params == sum(p.numel() for p in hf_cached(arch).parameters())
    assert spec.kv_layers == spec.num_layers == 2 and spec.state_bytes_per_sequence == 2 * (
        192 * 3 * 4 + 8 * 16 * 16 * 4
    )


def mamba1_recurrence(x, dt, a, b, c, initial):
    """Mamba's h_t = exp(dt_t a) h_(t-1) + dt_t x_t b_t (a state of N a channel), y_t = h_t . c_t, one token at a
    time."""
    state, ys = initial.clone(), []
    for t in range(x.shape[0]):
        state = state * torch.exp(dt[t][:, None] * a) + (dt[t] * x[t])[:, None] * b[t][None, :]
        ys.append(state @ c[t])
    return torch.stack(ys), state


@settings(max_examples=30, deadline=None)
@given(
    length=st.integers(1, 40), chunk=st.one_of(st.none(), st.integers(1, 16)), from_state=st.booleans(),
    seed=st.integers(0, 2**16),
)  # fmt: skip
def test_mambas_chunked_selective_scan_is_the_recurrence(length, chunk, from_state, seed):
    """Float64, any length and chunk (the default: as many tokens as SCAN_NUMBERS allows), from zeros or a state,
    decays down to exp(-20) a token."""
    from sloserve.engine.models.mamba1 import selective_scan

    gen = torch.Generator().manual_seed(seed)
    channels, d_state = 6, 5

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x, b, c = rand(length, channels), rand(length, d_state), rand(length, d_state)
    dt = torch.nn.functional.softplus(rand(length, channels))
    a = -torch.rand(channels, d_state, generator=gen, dtype=torch.float64) * 8
    initial = rand(channels, d_state) if from_state else torch.zeros(channels, d_state, dtype=torch.float64)
    y, state = selective_scan(x, dt, a, b, c, initial if from_state else None, chunk)
    want_y, want_state = mamba1_recurrence(x, dt, a, b, c, initial)
    torch.testing.assert_close(y, want_y, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, want_state, rtol=1e-10, atol=1e-10)


def test_jambas_shape_and_layers_as_its_config_says(hf_dirs):
    """Jamba: transformers' parameter count (the mixers' projections, the norms of the step, B and C, the experts of
    every other layer); a request's states (the convolution's last 3 inputs and 8 states a channel, of 128 channels,
    in 3 layers of 4) and the one attention layer's KV; periods and offsets as transformers reads them, bad ones
    refused by name."""
    spec = model_spec(hf_dirs["jamba"])
    hf = hf_cached("jamba")
    assert spec.num_params == sum(p.numel() for p in hf.parameters())
    assert (spec.num_layers, spec.kv_layers) == (4, 1)
    assert spec.state_bytes_per_sequence == 3 * (128 * 3 * 4 + 128 * 8 * 4)
    raw = hf.config.to_dict()
    config = from_hf_config(raw)
    assert config.layer_types == ("mamba", "full_attention", "mamba", "mamba")
    assert config.moe["moe_layers"] == (False, True, False, True) and not any(config.rotary_layers)
    assert from_hf_config({**raw, "num_experts": 1}).moe is None  # (one expert: a dense MLP, as transformers')
    with pytest.raises(ConfigError, match="attn_layer_offset must be an integer in 0..3, got 4"):
        from_hf_config({**raw, "attn_layer_offset": 4})


@pytest.mark.parametrize("arch", ["granite_4_h", "bamba"])
def test_a_hybrid_models_shape_counts_its_mixers_and_only_its_attention_layers_kv(hf_dirs, arch):
    """transformers' parameter count; KV bytes a token of the one attention layer of three (the engine's and
    the simulator's)."""
    spec = model_spec(hf_dirs[arch])
    hf = hf_cached(arch)
    assert spec.num_params == sum(p.numel() for p in hf.parameters())
    assert (spec.num_layers, spec.kv_layers) == (3, 1)
    assert spec.kv_bytes_per_token == 2 * 1 * 2 * 16 * 4  # K and V, 1 layer, 2 KV heads of 16, float32
    llm = LLM(hf_dirs[arch], "vllm")
    assert llm_engine.kv_bytes_per_token(llm.loaded) == spec.kv_bytes_per_token
    assert llm.engine.cache.gpu.shape[1] == 1  # (one layer's KV)
    if arch == "bamba":  # (attention at attn_layer_indices; half of each head rotated whatever the config says)
        raw = hf.config.to_dict()
        whole = {**(raw.get("rope_parameters") or {}), "partial_rotary_factor": 1.0}
        config = from_hf_config({**raw, "partial_rotary_factor": 1.0, "rope_parameters": whole})
        assert (config.layer_types[1], config.partial_rotary_dim) == ("full_attention", 8)
        with pytest.raises(ConfigError, match="attn_layer_indices must be layer indices below 3, got \\[3\\]"):
            from_hf_config({**raw, "attn_layer_indices": [3]})


def test_the_simulator_keeps_a_hybrids_states_as_the_engine_does(hf_dirs, monkeypatch):
    """The spec's states a request are the engine's slot (2 Mamba layers: a 192-wide convolution's last 3 inputs
    and 8 heads' 16 x 16 states, float32); the roofline reads and writes them each decode step; the KV capacity
    leaves room for 256 requests' states; a simulation runs no more requests at once than there are slots."""
    from sloserve.cost import BatchShape, RooflineCostModel, get_gpu, kv_capacity_tokens
    from sloserve.cost.specs import default_activation_reserve
    from sloserve.runs import SimOptions, run_simulation, setup_from_options
    from sloserve.sched import registry

    spec = model_spec(hf_dirs["granite_4_h"])
    config = from_hf_config(hf_cached("granite_4_h").config.to_dict())
    assert (
        spec.state_bytes_per_sequence
        == StateCache.bytes_per_slot(config, torch.float32)
        == 2 * (192 * 3 * 4 + 8 * 16 * 16 * 4)
    )
    gpu = get_gpu("h100")
    model = RooflineCostModel(spec, gpu)
    rate = gpu.hbm_bandwidth * model.bandwidth_efficiency
    decode = model.batch_time(BatchShape(4, 400)).decode_attention_s
    assert decode == pytest.approx((spec.kv_bytes_per_token * 404 + 2 * spec.state_bytes_per_sequence * 4) / rate)
    free = gpu.memory_bytes * 0.9 - spec.weight_bytes - default_activation_reserve(spec, 1)
    assert kv_capacity_tokens(spec, gpu) == int((free - 256 * spec.state_bytes_per_sequence) // spec.kv_bytes_per_token)
    setup = setup_from_options(
        SimOptions(trace="sharegpt", offline=True, num_requests=40, model=hf_dirs["granite_4_h"], gpu="h100",
                   max_model_len=4096, kv_capacity_tokens=200_000)
    )  # fmt: skip
    batches = {}
    for slots in (256, 3):
        monkeypatch.setattr(registry, "STATE_SLOTS", slots)
        result = run_simulation(setup, "vllm", {}, setup.make_workload(None))
        batches[slots] = max(result["_result"][1].column("num_requests"))
    assert batches == {256: 40, 3: 3}
    # a scheduler keeping fewer requests' states leaves the rest's memory to KV, as the engine's default cache does
    setup = setup_from_options(
        SimOptions(trace="sharegpt", offline=True, num_requests=4, model=hf_dirs["granite_4_h"], gpu="l4")
    )  # fmt: skip
    monkeypatch.setattr(registry, "STATE_SLOTS", 256)
    capacities = {}
    for seqs in (256, 64):
        result = run_simulation(setup, "vllm", {"max_num_seqs": seqs}, setup.make_workload(None))
        capacities[seqs] = result["kv_capacity_tokens"]
    assert setup.kv_capacity_tokens == kv_capacity_tokens(spec, get_gpu("l4"))
    more = int((setup.kv_capacity_tokens * spec.kv_bytes_per_token + 192 * spec.state_bytes_per_sequence)
               // spec.kv_bytes_per_token)  # fmt: skip
    assert capacities == {256: setup.kv_capacity_tokens // 16 * 16, 64: more // 16 * 16}  # whole blocks of 16
    # with prefix caching, as many saved states as slots (kv/cached_states.py): 64 slots' and 64 entries' states
    caching = dataclasses.replace(setup, options=dataclasses.replace(setup.options, enable_prefix_caching=True))
    result = run_simulation(caching, "vllm", {"max_num_seqs": 64}, caching.make_workload(None))
    less = int((setup.kv_capacity_tokens * spec.kv_bytes_per_token + 128 * spec.state_bytes_per_sequence)
               // spec.kv_bytes_per_token)  # fmt: skip
    assert result["kv_capacity_tokens"] == less // 16 * 16 and result["enable_prefix_caching"]


@pytest.mark.parametrize(
    "arch",
    [
        *("granite_4_h", "nemotron_h", "bamba", "nemotron_h_moe", "falcon_h1", "falcon_h1_norm"),
        *("lfm2", "lfm2_moe", "lfm3", "qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid", "kimi_linear"),
        *("jamba", "mamba", "falcon_mamba", "mamba2"),
    ],
)
@pytest.mark.parametrize(
    "scheduler,options",
    [
        ("vllm", {}),
        ("sarathi", dict(prefill_token_budget=8, block_size=4)),  # states carried chunk to chunk
        ("orca", {}),
        ("vllm", dict(kv_capacity_tokens=64, block_size=4, preemption_mode="recompute")),  # states dropped, refilled
        ("sarathi", dict(prefill_token_budget=8, block_size=4, async_scheduling=True)),  # steps launched early
    ],
)
def test_a_hybrid_model_gives_hf_greedy_tokens(hf_dirs, arch, scheduler, options):
    """Granite 4.0-H (Mamba layers, attention, experts beside a shared MLP), Nemotron-H (blocks of one mixer:
    Mamba, an MLP or attention without a position embedding; Nemotron 3's with experts, DeepSeek-V3's routing over
    two-matrix experts), Bamba (Llama's layers, half of each head rotated) and Falcon-H1 (a mixer beside each
    attention, every muP multiplier away from 1 and folded into the weights; its mixers' output gated, or
    normalized then gated); LFM2 (short convolutions instead of Mamba-2's, test_short_conv.py); Qwen3-Next, Qwen3.5
    and OLMo Hybrid (gated DeltaNets beside attention), Kimi Linear (KDA beside MLA: test_gated_delta_net.py); Jamba
    (Mamba's selective scan beside attention without rope, experts); Mamba, Falcon Mamba and Mamba-2, of no attention
    (test_mamba_models.py)."""
    tokens, llm = greedy_tokens(hf_dirs[arch], scheduler, **options)
    assert tokens == reference(arch)
    assert llm.engine.scheduler.kv.max_requests == llm.engine.executor.states.cache.num_slots
    if "preemption_mode" in options:
        assert llm.engine.scheduler.num_preemptions > 0
    if options.get("async_scheduling"):
        assert llm.engine.executor.num_early_launches > 0


@pytest.mark.parametrize(
    "arch", ["granite_4_h", "nemotron_h", "falcon_h1", "lfm2", "qwen3_next", "jamba", "mamba", "mamba2"]
)
def test_decode_steps_on_the_graphs_buffers_give_hf_greedy_tokens(hf_dirs, arch):
    """Decode-only steps through ``DecodeGraphs``' padded static buffers (not captured on the CPU, as in
    test_cuda_graphs.py): each row's state slot one more input, the padding rows on the state cache's pad slot."""
    from sloserve.engine.cuda_graphs import DecodeGraphs

    llm = LLM(hf_dirs[arch], "vllm")
    engine = llm.engine
    states = engine.executor.states.cache
    graphs = DecodeGraphs(
        llm.loaded.model, engine.cache, engine.max_model_len, engine.scheduler.kv.table_block_size,
        max_batch_size=8, capture=False, batch_sizes=[4, 8], states=states,
    )  # fmt: skip
    sizes = []
    real_forward = graphs.forward
    graphs.forward = lambda tokens, *rest: sizes.append(len(tokens)) or real_forward(tokens, *rest)
    engine.executor.graphs = graphs
    written = states.conv if states.ssm is None else states.ssm  # (LFM2's convolutions: no ssm)
    pad_before = written[:, states.pad_slot].clone()
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [o.outputs[0].token_ids for o in outputs] == reference(arch)
    assert set(sizes) - {4, 8}  # (steps padded to a graph's size)
    assert not torch.equal(written[:, states.pad_slot], pad_before)  # (the padding rows wrote there)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs: a GPU's (the runbook's tests stage)")
@pytest.mark.parametrize(
    "arch",
    [
        *("granite_4_h", "nemotron_h", "falcon_h1", "lfm2", "lfm3", "qwen3_next", "qwen3_5", "kimi_linear", "jamba"),
        *("mamba", "falcon_mamba", "mamba2"),
    ],
)
def test_on_cuda_a_hybrid_models_captured_decode_steps_give_hf_greedy_tokens(hf_dirs, arch):
    """The Triton backend, chunked prefills, and decode steps replayed from captured graphs, in float32."""
    options = dict(prefill_token_budget=8, block_size=4, cuda_graphs=True, dtype="float32")
    tokens, llm = greedy_tokens(hf_dirs[arch], "sarathi", device="cuda", attention_backend="triton", **options)
    assert llm.engine.executor.graphs is not None and llm.engine.executor.graphs.graphs
    assert tokens == reference(arch)


def test_requests_wait_for_a_state_slot(hf_dirs, monkeypatch):
    """Two slots for six prompts, the scheduler's own max_num_seqs far above: the KV manager admits a third request
    only once one of two ends, and the tokens are transformers'."""
    monkeypatch.setitem(llm_engine.MAX_STATE_SLOTS, "cpu", 2)
    held = []
    llm = LLM(hf_dirs["granite_4_h"], "vllm")
    kv = llm.engine.scheduler.kv
    real = kv.allocate_slots
    monkeypatch.setattr(kv, "allocate_slots", lambda *args: real(*args) and not held.append(len(kv.block_tables)))
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [o.outputs[0].token_ids for o in outputs] == reference("granite_4_h")
    assert kv.max_requests == 2 and max(held) == 2 and len(held) >= len(PROMPTS)  # (without the cap: 6 at once)


def test_a_kv_cache_asked_for_by_size_is_refused_where_the_states_beside_it_do_not_fit(hf_dirs, monkeypatch):
    """512 tokens of KV and as many of swap space take 256 KB; 64 requests' states 1.3 MB more, and with prefix
    caching (the default) 64 saved ones as much again: on a host of 1 MB the engine says so rather than be killed
    filling them."""
    monkeypatch.setattr(llm_engine, "host_memory_bytes", lambda: 1 << 20)
    for caching, states, need in ((False, "1.3", "1.5"), (None, "2.6", "2.8")):
        with pytest.raises(
            ConfigError,
            match=f"kv_capacity_tokens 512 and 512 tokens of swap space and {states} MiB of the requests' states need "
            f"{need} MiB of the host's memory \\(256 bytes a token\\); it has 1.0 MiB",
        ):
            LLM(hf_dirs["granite_4_h"], "vllm", kv_capacity_tokens=512, enable_prefix_caching=caching)
    monkeypatch.setattr(llm_engine, "host_memory_bytes", lambda: 3 << 20)
    LLM(hf_dirs["granite_4_h"], "vllm", kv_capacity_tokens=512)


def test_a_one_token_prompt_starts_from_zero_states(hf_dirs, monkeypatch):
    """One slot, two requests one after the other: the second, a prompt of one token (its first step a decode),
    does not read the states the first left in the slot."""
    monkeypatch.setitem(llm_engine.MAX_STATE_SLOTS, "cpu", 1)
    llm = LLM(hf_dirs["granite_4_h"], "vllm")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in (PROMPTS[2], [42])], [params, params])
    assert [o.outputs[0].token_ids for o in outputs] == [
        hf_greedy("granite_4_h", tuple(p), 6) for p in (PROMPTS[2], [42])
    ]


@pytest.mark.parametrize(
    "scheduler,options,message",
    [
        ("bros", {}, "scheduler bros's KV manager \\(bidirectional\\) does not run models with state layers"),
        ("econoserve", {}, "scheduler econoserve's KV manager \\(pipelined\\) does not run models with state layers"),
        ("vllm", dict(preemption_mode="swap"), "preemption_mode=swap does not move the requests' states"),
    ],
)
def test_what_cannot_carry_the_states_is_refused(hf_dirs, scheduler, options, message):
    with pytest.raises(ConfigError, match=message):
        LLM(hf_dirs["granite_4_h"], scheduler, **options)
    kv = LLM(hf_dirs["granite_4_h"], "vllm").engine.scheduler.kv  # (prefix caching on by default, with saved states)
    assert kv.prefix_cache is not None and kv.cached_states.num_entries == kv.max_requests == 64


def test_a_simulated_hybrid_is_not_disaggregated(hf_dirs):
    """Prefill and decode replicas hand each other KV over a link; a hybrid's states would go too, which the
    simulator does not model: refused by name rather than simulated without them."""
    from sloserve.runs import SimOptions, run_simulation, setup_from_options

    setup = setup_from_options(
        SimOptions(trace="sharegpt", offline=True, num_requests=4, model=hf_dirs["granite_4_h"], gpu="l4",
                   disaggregate="1:1")
    )  # fmt: skip
    with pytest.raises(ConfigError, match="--disaggregate 1:1: .* keeps states in its Mamba-2 or short-convolution"):
        run_simulation(setup, "vllm", {}, setup.make_workload(None))
