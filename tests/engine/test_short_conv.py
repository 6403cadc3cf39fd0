"""LFM2 (short convolutions beside attention, models/short_conv.py): the convolution layer against transformers'
(a prompt whole, in chunks that carry their states, then decodes; several requests in one step), the config as
the Hub and transformers write it, the shape the simulator sees. Its greedy tokens through five runs are
test_mamba.py's (``test_a_hybrid_model_gives_hf_greedy_tokens``): the same state slots."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_models import MAX_TOKENS, PROMPTS, greedy_by_full_forwards, greedy_tokens, hf_cached, reference  # noqa: E402
from sloserve import LLM, SamplingParams  # noqa: E402
from sloserve.checkpoint import model_spec  # noqa: E402
from sloserve.checkpoint.config import from_hf_config  # noqa: E402
from sloserve.checkpoint.model_config import SHORT_CONV  # noqa: E402
from sloserve.core.errors import ConfigError  # noqa: E402
from sloserve.engine.models.short_conv import ShortConv  # noqa: E402
from sloserve.engine.state_cache import StateCache  # noqa: E402
from state_steps import assert_steps_give_the_references_outputs  # noqa: E402

# LFM2-1.2B's config.json as the Hub has it (its names before transformers': block_ff_dim, full_attn_idxs,
# tie_embedding), the sizes cut down
HUB_CONFIG = {
    "architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "vocab_size": 300, "hidden_size": 64,
    "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "block_ff_dim": 96, "block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": 1.0, "block_multiple_of": 32,
    "full_attn_idxs": [2, 5], "conv_L_cache": 3, "conv_bias": False, "norm_eps": 1e-5, "rope_theta": 1000000.0,
    "tie_embedding": True, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 7,
}  # fmt: skip


def _layers():
    """transformers' short convolution of the tests' LFM2 (its third layer) and the engine's with its weights."""
    from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv

    hf_config = hf_cached("lfm2").config
    torch.manual_seed(5)
    theirs = Lfm2ShortConv(hf_config, 2).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(0.3 * torch.randn_like(p))
    config = from_hf_config(hf_config.to_dict())
    ours = ShortConv(config, 2).eval()
    ours.load_state_dict(theirs.state_dict())
    assert ours.state_index == 1  # (its states: the second of the model's convolutions')
    return theirs, ours, config


def test_the_short_convolution_gives_transformers_outputs_whole_in_chunks_and_decoding():
    """A 21-token prompt: whole; as chunks of 5 and 9 that carry their states, then 7 decodes; and beside other
    requests in one step (a prompt in another slot, a decode, a prompt in a slot with stale states):
    transformers' outputs for the whole prompt, position by position."""
    theirs, ours, config = _layers()
    x = torch.randn(21, config.hidden_size, generator=torch.Generator().manual_seed(1))
    cache = StateCache(config, 4, torch.float32, torch.device("cpu"))
    assert cache.ssm is None and cache.conv.shape == (2, 5, 64, 2)  # (2 layers, 4 slots and the pad, width 3)
    with torch.no_grad():
        out = assert_steps_give_the_references_outputs(ours, config, x, theirs(x[None])[0])
        torch.testing.assert_close(out[11], ours.out_proj.bias)  # (a padding row: the gate times zeros, projected)


def test_lfm2s_config_as_the_hub_and_transformers_write_it():
    """The Hub's names (block_ff_dim, full_attn_idxs, tie_embedding) read as transformers reads them: the MLP 2/3
    of block_ff_dim, times the multiplier, rounded up to block_multiple_of; transformers 5's layer_types alike;
    bad layer types and sizes refused by name."""
    hub = from_hf_config(HUB_CONFIG)
    kinds = tuple("full_attention" if i in (2, 5) else SHORT_CONV for i in range(6))
    assert (hub.layer_types, hub.intermediate_size, hub.tie_word_embeddings, hub.eos_token_ids) == (
        kinds,
        64,
        True,
        (7,),
    )
    assert (hub.short_conv, hub.qk_norm, hub.rope_theta, hub.norm_eps) == ({"width": 3, "bias": False}, True, 1e6, 1e-5)
    assert (hub.num_kv_layers, hub.num_state_layers, hub.kv_layer_index(5), hub.state_layer_index(4)) == (2, 4, 1, 3)
    listed = {k: v for k, v in HUB_CONFIG.items() if k not in ("full_attn_idxs", "block_ff_dim", "tie_embedding")}
    listed.update(layer_types=list(kinds), intermediate_size=96, tie_word_embeddings=True)
    assert from_hf_config(listed) == hub
    # 2/3 of 160 is 106; times 1.5, 159; rounded up to a multiple of 32, 160. Unadjusted: as given
    assert from_hf_config({**HUB_CONFIG, "block_ff_dim": 160, "block_ffn_dim_multiplier": 1.5}).intermediate_size == 160
    assert from_hf_config({**HUB_CONFIG, "block_auto_adjust_ff_dim": False}).intermediate_size == 96
    assert from_hf_config({**HUB_CONFIG, "tie_embedding": False}).tie_word_embeddings is False
    # LFM2-1.2B's own sizes: its model card's 1,170,340,608 parameters; 10 convolutions' states, 80 KB a request
    full = {**HUB_CONFIG, "vocab_size": 65536, "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "block_ff_dim": 12288, "block_multiple_of": 256,
            "full_attn_idxs": [2, 5, 8, 10, 12, 14]}  # fmt: skip
    spec = from_hf_config(full).spec()
    assert (spec.num_params, spec.intermediate_size, spec.kv_layers) == (1_170_340_608, 8192, 6)
    assert spec.state_bytes_per_sequence == 10 * 2048 * 2 * 2
    with pytest.raises(ConfigError, match="lfm2 layer_types must be 6 entries of conv, full_attention, got"):
        from_hf_config({**listed, "layer_types": [*kinds[:5], "mamba"]})
    with pytest.raises(ConfigError, match="conv_L_cache must be a positive integer, got 0"):
        from_hf_config({**HUB_CONFIG, "conv_L_cache": 0})
    with pytest.raises(ConfigError, match="block_ff_dim \\(intermediate_size\\) must be a positive integer"):
        from_hf_config({**HUB_CONFIG, "block_ff_dim": None})


@pytest.mark.parametrize("bias", [True, False])
def test_lfm2s_shape_counts_its_convolutions_and_only_its_attention_layers_kv(hf_dirs, tmp_path, bias):
    """transformers' parameter count (with the convolutions' biases and without); KV bytes a token of the one
    attention layer of three; a request's states, the two convolutions' last two inputs (float32): the engine's
    and the simulator's alike."""
    if bias:
        path, hf = hf_dirs["lfm2"], hf_cached("lfm2")
    else:
        hf = transformers.Lfm2ForCausalLM(
            transformers.Lfm2Config(**{**hf_cached("lfm2").config.to_dict(), "conv_bias": False})
        )
        hf.save_pretrained(tmp_path)
        path = str(tmp_path)
    spec = model_spec(path)
    assert spec.num_params == sum(p.numel() for p in hf.parameters())
    assert (spec.num_layers, spec.kv_layers) == (3, 1)
    assert spec.kv_bytes_per_token == 2 * 1 * 2 * 16 * 4  # K and V, 1 layer, 2 KV heads of 16, float32
    assert spec.state_bytes_per_sequence == 2 * 64 * 2 * 4
    llm = LLM(path, "vllm")
    assert llm.engine.cache.gpu.shape[1] == 1  # (one layer's KV)
    states = llm.engine.executor.states.cache
    assert StateCache.bytes_per_slot(llm.loaded.config, llm.loaded.dtype) == spec.state_bytes_per_sequence
    assert states.conv.shape[0] == 2 and states.ssm is None


@pytest.mark.parametrize(
    "arch", ["lfm2", "lfm3", "granite_4_h", "qwen3_next", "kimi_linear", "jamba", "mamba", "mamba2"]
)
@pytest.mark.parametrize(
    "scheduler,options",
    [
        ("vllm", dict(block_size=4)),  # the saved point inside a prompt's one chunk
        ("sarathi", dict(prefill_token_budget=8, block_size=4)),  # inside a chunk (37 tokens), at a chunk's end (33)
    ],
)
@pytest.mark.parametrize("first_turn", [37, 33])
def test_a_conversations_next_turn_starts_from_the_states_saved_at_its_history(
    hf_dirs, arch, scheduler, options, first_turn
):
    """Prefix caching on a model with state layers (kv/cached_states.py): a conversation's second turn (the first's
    prompt, its answer, a new message) and the first prompt resent find the first prompt's blocks up to the states
    saved at its last full block before its last token, start from them, and give transformers' greedy tokens
    (LFM2's short convolutions; Granite 4.0-H's Mamba-2 scans and Qwen3-Next's delta rules, split at the saved
    point; Mamba's and Mamba-2's models, of no attention: their states alone). The reference: forward
    passes over whole sequences (``greedy_by_full_forwards``)."""
    llm = LLM(hf_dirs[arch], scheduler, **options)
    first = [(i * 11 + 3) % 300 for i in range(first_turn)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    (turn,) = llm.generate([{"prompt_token_ids": first}], [params])
    assert turn.outputs[0].token_ids == greedy_by_full_forwards(arch, first, 10) and turn.num_cached_tokens == 0
    second = [*first, *turn.outputs[0].token_ids, 7, 8, 9]
    outputs = llm.generate([{"prompt_token_ids": p} for p in (second, first)], [params, params])
    saved = (first_turn - 1) // 4 * 4
    assert [o.num_cached_tokens for o in outputs] == [saved, saved]
    assert [o.outputs[0].token_ids for o in outputs] == [greedy_by_full_forwards(arch, p, 10) for p in (second, first)]
    states = llm.engine.scheduler.kv.cached_states
    assert states.num_loaded == 2 and states.num_saved == 2  # (the first turn's point; the second's own)
    states.check()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_saved_states_are_found_from_the_step_after_the_one_that_writes_them(hf_dirs, async_scheduling):
    """Two requests of one prompt admitted in one step: the second finds the first's KV blocks registered but not
    its states (written by that step's forward pass), so it computes its prompt. A third, admitted while the first
    still generates, starts from the first's saved states; all give transformers' greedy tokens."""
    engine = LLM(hf_dirs["lfm2"], "vllm", block_size=4, async_scheduling=async_scheduling).engine
    prompt = [(i * 11 + 3) % 300 for i in range(37)]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (12, 4, 4)]
    requests = [engine.add_request(prompt, params[0]), engine.add_request(prompt, params[1])]
    engine.step()
    requests.append(engine.add_request(prompt, params[2]))
    outputs = {}
    while engine.has_unfinished():
        for request in engine.step():
            outputs[request] = engine.release(request).output_token_ids
    assert [r.num_cached_tokens for r in requests] == [0, 0, 36]
    assert [outputs[r] for r in requests] == [greedy_by_full_forwards("lfm2", prompt, p.max_tokens) for p in params]


def test_the_engine_finds_the_cached_prefixes_the_simulator_finds_with_state_layers(tmp_path):
    """Conversations of three turns, each resending the turn before's prompt (its full 16-token blocks: a trace's
    ``hash_ids`` at ``hash_block_tokens`` 16), replayed on an LFM2: request for request, the engine (by tokens) and
    the simulator (by ids) find the same cached tokens: each later turn the turn before's prompt up to its last
    full block before its last token, where that turn's states were saved."""
    import csv
    import json

    from click.testing import CliRunner

    from sloserve.cli import main

    config = transformers.Lfm2Config(**{**hf_cached("lfm2").config.to_dict(), "max_position_embeddings": 512})
    torch.manual_seed(0)
    transformers.Lfm2ForCausalLM(config).save_pretrained(tmp_path / "lfm2")
    rows, want, next_id = [], [], 0
    for conversation, first in enumerate((37, 42, 48, 52)):  # (48: its KV found to 48, its states at 32)
        ids, length = [], 0
        for turn, new in enumerate((first, 40, 29)):
            full = ids[: length // 16]  # (the turn before's full blocks, resent)
            want.append(0 if turn == 0 else (length - 1) // 16 * 16)
            length += new + (20 if turn else 0)  # (the answer before, then the new message)
            ids = full + list(range(next_id, next_id + -(-length // 16) - len(full)))
            next_id += -(-length // 16) - len(full)
            rows.append({"timestamp": 1000 * (10 * turn + conversation), "input_length": length, "output_length": 20,
                         "hash_ids": ids})  # fmt: skip
    trace = tmp_path / "conversations.jsonl"
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = ("--trace", str(trace), "--columns", "hash_block_tokens=16", "--trace-arrivals",
              "--kv-capacity-tokens", "65536")  # fmt: skip
    cached = {}
    for name, args in {
        "engine": ("run", "--model", str(tmp_path / "lfm2"), *common, "--virtual-clock"),
        "sim": ("simulate", "--model", str(tmp_path / "lfm2"), *common),
    }.items():
        result = CliRunner().invoke(main, [*args, "--out", str(tmp_path / name)])  # in process: torch imported once
        assert result.exit_code == 0, result.output
        with open(tmp_path / name / "requests.csv") as f:
            cached[name] = {int(row["request_id"]): int(row["cached_tokens"]) for row in csv.DictReader(f)}
    order = sorted(range(len(rows)), key=lambda k: rows[k]["timestamp"])  # (the trace's rows by arrival)
    assert cached["engine"] == cached["sim"] == {i: want[k] for i, k in enumerate(order)}


def test_lfm2_moes_experts_route_and_load_as_transformers(hf_dirs, tmp_path):
    """LFM2-MoE: a dense MLP before ``num_dense_layers``, then experts: transformers' parameter count (its
    routers' biases, buffers to it, tensors of the checkpoint); the router's weights of each token as
    transformers' (sigmoid scores, the choice by scores plus the bias, renormalized with 1e-6 added, times
    routed_scaling_factor); transformers 5's stacked experts load as the Hub's per-expert tensors;
    use_expert_bias false refused by name."""
    import shutil

    from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeSparseMoeBlock

    from sloserve.engine.models.moe import DeepseekMoE

    safetensors_torch = pytest.importorskip("safetensors.torch")
    hf = hf_cached("lfm2_moe")
    spec = model_spec(hf_dirs["lfm2_moe"])
    assert spec.num_params == sum(p.numel() for p in hf.parameters()) + 2 * 8
    assert (spec.num_experts, spec.experts_per_token, spec.expert_params) == (8, 2, 2 * 8 * 3 * 64 * 32)
    config = from_hf_config(hf.config.to_dict())
    assert config.moe["moe_layers"] == (False, True, True) and config.intermediate_size == 96  # (not adjusted)
    assert (config.moe["norm_topk_eps"], config.moe["routed_scaling_factor"], config.moe["n_group"]) == (1e-6, 2.0, 1)
    theirs: Lfm2MoeSparseMoeBlock = hf.model.layers[2].feed_forward
    ours = DeepseekMoE(config, None)
    ours.gate.weight.data.copy_(theirs.gate.weight)
    ours.gate.e_score_correction_bias.data.copy_(theirs.expert_bias)
    x = torch.randn(50, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, want_weights, want_experts = theirs.gate(x, theirs.expert_bias)
        weights, experts = ours.route(x)
    assert torch.equal(experts, want_experts)
    torch.testing.assert_close(weights, want_weights, rtol=2e-7, atol=0)
    shutil.copytree(hf_dirs["lfm2_moe"], tmp_path / "stacked")
    path = tmp_path / "stacked" / "model.safetensors"
    weights = safetensors_torch.load_file(str(path))
    for layer in (1, 2):
        prefix = f"model.layers.{layer}.feed_forward.experts"
        gate_up = [
            torch.cat((weights.pop(f"{prefix}.{e}.w1.weight"), weights.pop(f"{prefix}.{e}.w3.weight")))
            for e in range(8)
        ]
        weights[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        weights[f"{prefix}.down_proj"] = torch.stack([weights.pop(f"{prefix}.{e}.w2.weight") for e in range(8)])
    safetensors_torch.save_file(weights, str(path))
    tokens, _ = greedy_tokens(str(tmp_path / "stacked"), "vllm")
    assert tokens == reference("lfm2_moe")
    with pytest.raises(
        ConfigError, match="use_expert_bias false \\(sigmoid routing without its bias\\) is not supported"
    ):
        from_hf_config({**hf.config.to_dict(), "use_expert_bias": False})


def test_lfm3s_config_shape_and_rope_as_transformers(hf_dirs, tmp_path):
    """LFM3: convolutions of 7 taps, a sliding layer with a plain rope of base 10,000 and a full one whose rope turns
    half of each head's pairs at the whole head's frequencies (transformers' proportional rope, its frequencies
    equal); transformers' parameter count with and without the output norms and the heads' gate, and its greedy
    tokens without them; transformers' layer pattern where the config has none; an unknown layer type refused."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from sloserve.checkpoint.model_config import SLIDING
    from sloserve.engine.models.llama import rope_inv_freq

    hf = hf_cached("lfm3")
    raw = hf.config.to_dict()
    config = from_hf_config(raw)
    assert config.layer_types == (SHORT_CONV, SLIDING, "full_attention", SHORT_CONV)
    assert (config.sliding_window, config.short_conv["width"], config.rope_local_theta) == (8, 7, 10_000.0)
    assert (config.rotary_dim, config.rope_theta, config.rope_scaling["rope_type"]) == (16, 1e6, "proportional")
    want, _ = ROPE_INIT_FUNCTIONS["proportional"](hf.config, layer_type="full_attention")
    assert torch.equal(rope_inv_freq(config), want) and torch.count_nonzero(want) == 4  # (4 pairs of 8 turn)
    assert model_spec(hf_dirs["lfm3"]).num_params == sum(p.numel() for p in hf.parameters())
    plain = transformers.Lfm3Config(**{**raw, "use_sandwich_norm": False, "use_attention_gate": False})
    torch.manual_seed(1)
    bare = transformers.Lfm3ForCausalLM(plain).eval()
    bare.save_pretrained(tmp_path)
    assert model_spec(str(tmp_path)).num_params == sum(p.numel() for p in bare.parameters())
    tokens, _ = greedy_tokens(str(tmp_path), "sarathi", prefill_token_budget=8, block_size=4)
    assert tokens == [greedy_by_full_forwards(bare, p, n) for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]
    unlisted = from_hf_config({k: v for k, v in {**raw, "num_hidden_layers": 8}.items() if k != "layer_types"})
    c, s, f = SHORT_CONV, SLIDING, "full_attention"
    assert unlisted.layer_types == (
        c,
        c,
        f,
        c,
        s,
        c,
        f,
        c,
    )  # (transformers': full at 2 of 4, sliding at 0 but the first)
    with pytest.raises(
        ConfigError, match="lfm3 layer_types must be 4 entries of conv, full_attention, sliding_attention"
    ):
        from_hf_config({**raw, "layer_types": ["conv", "mamba", "full_attention", "conv"]})
