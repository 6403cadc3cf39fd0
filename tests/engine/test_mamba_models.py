"""Models of no attention (Mamba, Falcon Mamba, Mamba-2: models/mamba.py): transformers' shapes and parameter counts,
a KV cache of 0 bytes a token whose capacity is the state slots' contexts, a context past the default one (no
position embedding ends it) against transformers' greedy tokens, the simulator's run of such a model, and bad configs
refused by name. Their greedy tokens on five schedules: test_mamba.py's hybrid tests."""

from __future__ import annotations

import dataclasses
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_models import hf_cached, hf_greedy  # noqa: E402
from sloserve import LLM, SamplingParams  # noqa: E402
from sloserve.checkpoint import model_spec  # noqa: E402
from sloserve.checkpoint.config import from_hf_config  # noqa: E402
from sloserve.checkpoint.model_config import MAMBA  # noqa: E402
from sloserve.checkpoint.model_types import UNNAMED_CONTEXT_TOKENS  # noqa: E402
from sloserve.core.errors import ConfigError  # noqa: E402
from sloserve.engine import llm_engine  # noqa: E402
from sloserve.engine.state_cache import StateCache  # noqa: E402

ARCHS = ("mamba", "falcon_mamba", "mamba2")
# A request's states, float32: each of 3 layers' convolution's last 3 inputs and its recurrent state (Mamba's: 8 a
# channel of 128; Mamba-2's convolution over x, B and C, 128 + 2 groups x 16 wide, and 8 heads' 16 x 16)
STATE_BYTES = {
    "mamba": 3 * (128 * 3 * 4 + 128 * 8 * 4),
    "falcon_mamba": 3 * (128 * 3 * 4 + 128 * 8 * 4),
    "mamba2": 3 * (192 * 3 * 4 + 8 * 16 * 16 * 4),
}


@pytest.mark.parametrize("arch", ARCHS)
def test_a_mamba_models_shape_is_transformers_and_its_tokens_take_no_kv(hf_dirs, arch):
    """transformers' parameter count (Falcon Mamba's norms of the step, B and C have no weights; Mamba-2's LM head
    untied); no KV layer and 0 bytes a token, in the simulator's spec and the engine alike; the engine's KV cache
    holds nothing, its capacity the contexts of its state slots, no swap space."""
    hf = hf_cached(arch)
    spec = model_spec(hf_dirs[arch])
    assert spec.num_params == sum(p.numel() for p in hf.parameters())
    assert (spec.num_layers, spec.kv_layers, spec.kv_bytes_per_token) == (3, 0, 0)
    assert (spec.max_context_len, spec.tied_embeddings) == (UNNAMED_CONTEXT_TOKENS, arch != "mamba2")
    config = from_hf_config(hf.config.to_dict())
    assert spec.state_bytes_per_sequence == StateCache.bytes_per_slot(config, torch.float32) == STATE_BYTES[arch]
    assert config.layer_types == (MAMBA,) * 3 and config.num_kv_layers == 0
    llm = LLM(hf_dirs[arch], "vllm")
    engine = llm.engine
    slots = engine.executor.states.cache.num_slots
    assert llm_engine.kv_bytes_per_token(llm.loaded) == 0 and engine.cache.gpu.numel() == 0
    assert engine.scheduler.kv.gpu.num_blocks * engine.scheduler.kv.block_size == slots * UNNAMED_CONTEXT_TOKENS
    assert engine.cache.cpu.numel() == 0 and engine.scheduler.kv.cpu.num_blocks == 0
    mixer = llm.loaded.model.model.layers[0].mamba
    normed = [name for name, _ in mixer.named_modules() if name.endswith("_layernorm")]
    assert normed == (["dt_layernorm", "b_layernorm", "c_layernorm"] if arch == "falcon_mamba" else [])
    assert all(p.numel() == 0 for name, p in mixer.named_parameters() if "layernorm" in name)


def test_falcon_mamba_7bs_shape_as_its_config_gives_it():
    """Falcon Mamba 7B's config.json: 7.27B parameters (its model card's; transformers' count of the config), no
    KV, a request's states 37 MB (64 layers of 8,192 channels: 3 convolution inputs in bf16, 16 float32 states);
    a spec of no attention layer must keep states."""
    raw = {"model_type": "falcon_mamba", "vocab_size": 65024, "hidden_size": 4096, "num_hidden_layers": 64,
           "state_size": 16, "expand": 2, "conv_kernel": 4, "time_step_rank": 256, "tie_word_embeddings": False,
           "torch_dtype": "bfloat16"}  # fmt: skip
    spec = from_hf_config(raw, "falcon-mamba-7b").spec()
    assert (spec.num_params, spec.kv_bytes_per_token) == (7_272_665_088, 0)
    assert spec.state_bytes_per_sequence == 64 * (8192 * 3 * 2 + 8192 * 16 * 4) == 36_700_160
    with pytest.raises(ConfigError, match="kv_layers 0 \\(no attention layer\\) needs state_bytes_per_sequence > 0"):
        dataclasses.replace(spec, state_bytes_per_sequence=0)
    with pytest.raises(ConfigError, match="kv_layers 65 exceeds num_layers 64"):
        dataclasses.replace(spec, kv_layers=65)


def test_a_context_past_the_default_one_gives_transformers_tokens(hf_dirs):
    """No position embedding ends a Mamba model's context: max_model_len 4096 is served (a model that attends is
    refused above its positions), and a prompt of 2,100 tokens, prefilled in chunks of 512, continues as
    transformers continues it (Mamba-2's: transformers' Mamba scans such a prompt token by token, 13 s)."""
    arch = "mamba2"
    prompt = [(i * 37 + 11) % 300 for i in range(2100)]
    llm = LLM(hf_dirs[arch], "sarathi", max_model_len=4096, prefill_token_budget=512)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(arch, tuple(prompt), 4)
    with pytest.raises(ConfigError, match="max_model_len 4096 is above the model's context of 256 tokens"):
        LLM(hf_dirs["llama"], "vllm", max_model_len=4096)


def test_the_simulator_runs_a_model_of_no_attention_on_its_state_slots(hf_dirs, monkeypatch, capsys):
    """The roofline reads no KV, only the states; the KV capacity is the slots' contexts (256 x 2,048 tokens); a
    simulation completes every request, no more at once than the slots, in a context past the default one without a
    note (the engine serves it too); what would move KV to the CPU is refused for the states it cannot move, by
    name."""
    from sloserve.cost import BatchShape, RooflineCostModel, get_gpu, kv_capacity_tokens
    from sloserve.runs import SimOptions, run_simulation, setup_from_options
    from sloserve.sched import registry

    spec = model_spec(hf_dirs["mamba2"])
    gpu = get_gpu("h100")
    roofline = RooflineCostModel(spec, gpu)
    decode = roofline.batch_time(BatchShape(4, 400)).decode_attention_s
    assert decode == pytest.approx(
        2 * spec.state_bytes_per_sequence * 4 / (gpu.hbm_bandwidth * roofline.bandwidth_efficiency)
    )
    assert kv_capacity_tokens(spec, gpu) == 256 * UNNAMED_CONTEXT_TOKENS
    monkeypatch.setattr(registry, "STATE_SLOTS", 3)
    setup = setup_from_options(
        SimOptions(trace="sharegpt", offline=True, num_requests=20, model=hf_dirs["mamba2"], gpu="h100",
                   swap_space_gib=4.0, max_model_len=8192)
    )  # fmt: skip
    assert (
        setup.swap_space_tokens == 0 and setup.model.max_context_len == 8192 and "note" not in capsys.readouterr().err
    )
    result = run_simulation(setup, "vllm", {}, setup.make_workload(None))
    assert result["completed"] == 20 and max(result["_result"][1].column("num_requests")) == 3
    for scheduler, options, message in (
        ("bros", {}, "scheduler bros's KV manager \\(bidirectional\\) does not run models with state layers"),
        ("vllm", {"preemption_mode": "swap"}, "preemption_mode=swap does not move the requests' states"),
    ):
        with pytest.raises(ConfigError, match=message):
            run_simulation(setup, scheduler, options, setup.make_workload(None))


@pytest.mark.parametrize(
    "arch,change,message",
    [
        ("mamba", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported for mamba \\(silu\\)"),
        ("mamba", {"time_step_rank": 0}, "time_step_rank must be a positive integer, got 0"),
        ("falcon_mamba", {"state_size": "16"}, "state_size must be a positive integer, got '16'"),
        ("mamba2", {"num_heads": 7}, "num_heads 7 x head_dim 16 must be expand x hidden_size 128"),
        ("mamba2", {"n_groups": 3}, "n_groups 3 must divide the heads"),
        ("mamba2", {"time_step_limit": [0.0]}, "time_step_limit must be two numbers"),
    ],
)
def test_a_bad_mamba_config_is_refused_by_name(arch, change, message, tmp_path):
    raw = {**hf_cached(arch).config.to_dict(), **change}
    with pytest.raises(ConfigError, match=message):
        from_hf_config(raw)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=message):
        model_spec(str(tmp_path))
