"""Qwen3-MoE's, Qwen2-MoE's, gpt-oss's and DeepSeek's sparse mixtures of experts (``engine/models/moe.py``,
``deepseek_v2.py``): the layer against transformers' ``Qwen3MoeSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock``
(its gated shared expert), ``GptOssMLP`` (its router's biases, its experts' clamped SwiGLU) and DeepSeek-V2's
and V3's MoE (their routings, shared experts) on random tokens (experts that get many
tokens, one, or none), which layers are sparse, the parameter count, GGUF files as llama.cpp lays them out,
gpt-oss's MXFP4 experts, and CUDA graphs refused for a routing that sets its own shapes. The whole model's
greedy tokens are checked in test_architectures.py."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


from hf_models import greedy, hf_model, prompt_logprobs  # noqa: E402
from sloserve import LLM, SamplingParams  # noqa: E402
from sloserve.checkpoint.config import from_hf_config  # noqa: E402
from sloserve.core.errors import ConfigError  # noqa: E402
from sloserve.engine.attention import TorchAttention  # noqa: E402
from sloserve.engine.loader import load_model  # noqa: E402
from sloserve.engine.models import checkpoint_tensors, create_model  # noqa: E402
from sloserve.engine.models.moe import SparseMoE  # noqa: E402


def moe_config(**overrides) -> dict:
    config = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                  num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16)  # fmt: skip
    return {**config, **overrides}


def random_block(block_class, hf_config, seed: int, std: float = 0.3):
    """transformers' MoE block of ``hf_config`` with its weights (its router's bias too) drawn from N(0, std)."""
    torch.manual_seed(seed)
    block = block_class(hf_config).eval()
    with torch.no_grad():
        for p in [*block.parameters(), *(b for name, b in block.named_buffers() if name.endswith("correction_bias"))]:
            p.normal_(0.0, std)
    return block


def engine_layer_holding(config: dict, block):
    """The engine's first MLP of ``config``, holding ``block``'s weights: its stacked experts in the engine's own
    layout ((E, 2 I, H) gate rows then up rows, (E, H, I)), the rest under the Hub's names."""
    ours = create_model(from_hf_config(config), TorchAttention(), torch.float32, torch.device("cpu"))
    layer = ours.model.layers[0].mlp
    tensors = checkpoint_tensors(ours)
    stacked = {"experts.gate_up_proj": "gate_up", "experts.down_proj": "down"}
    with torch.no_grad():
        for name, tensor in block.state_dict().items():
            if name in stacked:
                getattr(layer.experts, stacked[name]).copy_(tensor)
            else:
                tensors[f"model.layers.0.mlp.{name}"].copy_(tensor)
    return layer


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("num_tokens", [1, 5, 64])
def test_the_layer_equals_transformers_block(norm_topk_prob, num_tokens):
    hf_config = transformers.Qwen3MoeConfig(**{**moe_config(norm_topk_prob=norm_topk_prob), "model_type": None})
    block = random_block(transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock, hf_config, num_tokens)
    ours = SparseMoE(from_hf_config(moe_config(norm_topk_prob=norm_topk_prob)))
    with torch.no_grad():
        ours.gate.weight.copy_(block.gate.weight)
        ours.experts.gate_up.copy_(block.experts.gate_up_proj)  # (E, 2 I, H): gate rows, then up rows
        ours.experts.down.copy_(block.experts.down_proj)
    x = torch.randn(num_tokens, 32)
    with torch.no_grad():
        expected = block(x[None])[0]
        got = ours(x)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    if num_tokens == 64:  # (every expert gets tokens here; with 1 token, 4 of 6 get none)
        routed = ours.gate(x).topk(2, dim=-1).indices
        assert routed.unique().numel() == 6


@pytest.mark.parametrize("num_tokens", [1, 5, 64])
def test_qwen2_moes_layer_with_its_shared_expert_equals_transformers_block(num_tokens):
    """Qwen2-MoE: the routed experts' sum (top weights not renormalized) plus the shared expert's output
    times sigmoid(shared_expert_gate(x))."""
    config = moe_config(model_type="qwen2_moe", shared_expert_intermediate_size=24)
    hf_config = transformers.Qwen2MoeConfig(**{**config, "model_type": None})
    block = random_block(
        transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock, hf_config, 100 + num_tokens
    )
    layer = engine_layer_holding(config, block)
    assert isinstance(layer, SparseMoE)
    x = torch.randn(num_tokens, 32)
    with torch.no_grad():
        expected = block(x[None])[0]
        got = layer(x)
        weights, chosen = layer.gate(x).softmax(-1).topk(2, dim=-1)
        without_shared = layer.experts(x, chosen, weights)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(without_shared, expected, atol=1e-2)  # NOTE: the shared expert counts


def test_which_layers_are_sparse_and_the_parameter_count(tmp_path):
    """Every second layer sparse but layer 3 (``decoder_sparse_step``, ``mlp_only_layers``): the engine's
    tensors are the Hub's names (each expert's projections, Qwen3-30B-A3B's layout), as many parameters as
    transformers' model has, and a checkpoint with the experts stacked (as transformers 5 holds them,
    ``mlp.experts.gate_up_proj``) loads too."""
    config = from_hf_config(moe_config(decoder_sparse_step=2, mlp_only_layers=[3]))
    assert config.moe["moe_layers"] == (False, True, False, False)
    hf = transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(
            **{**moe_config(decoder_sparse_step=2, mlp_only_layers=[3], initializer_range=0.2), "model_type": None}
        )
    ).eval()
    assert config.num_params == sum(p.numel() for p in hf.parameters())
    model = create_model(config, TorchAttention(), torch.float32, torch.device("cpu"))
    names = set(checkpoint_tensors(model))
    hub_experts = {f"model.layers.1.mlp.experts.{e}.{p}_proj.weight" for e in range(6) for p in ("gate", "up", "down")}
    assert {n for n in names if ".mlp.experts." in n} == hub_experts
    assert "model.layers.1.mlp.gate.weight" in names and "model.layers.0.mlp.gate_proj.weight" in names
    hf.save_pretrained(tmp_path)
    stacked = {name: t.contiguous() for name, t in hf.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in stacked  # (E, 2 I, H)
    safetensors_torch.save_file(stacked, str(tmp_path / "model.safetensors"))
    llm = LLM(str(tmp_path))  # the stacked tensors split into the per-expert views
    ids = [3, 9, 27, 17, 51, 25]
    [out] = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert out.outputs[0].token_ids == greedy(hf, ids, 8)


def test_bad_experts_and_cuda_graphs_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="num_experts_per_tok 7 exceeds num_experts 6"):
        from_hf_config(moe_config(num_experts_per_tok=7))
    with pytest.raises(ConfigError, match="moe_intermediate_size must be a positive integer, got 0"):
        from_hf_config(moe_config(moe_intermediate_size=0))
    with pytest.raises(ConfigError, match="decoder_sparse_step must be a positive integer, got 0"):
        from_hf_config(moe_config(decoder_sparse_step=0))
    ernie = {**moe_config(), "model_type": "ernie4_5_moe", "moe_num_experts": 6, "moe_k": 2, "moe_layer_interval": 0}
    with pytest.raises(ConfigError, match="moe_layer_interval must be a positive integer, got 0"):
        from_hf_config(ernie)
    with pytest.raises(ConfigError, match="moe_layer_end_index must be an integer >= 0 or -1, got 'last'"):
        from_hf_config({**ernie, "moe_layer_interval": 1, "moe_layer_end_index": "last"})
    glm = {**moe_config(), "model_type": "glm4_moe", "n_routed_experts": 6}
    with pytest.raises(ConfigError, match="first_k_dense_replace must be an integer >= 0, got 1.5"):
        from_hf_config({**glm, "first_k_dense_replace": 1.5})
    # (more dense layers than layers: every layer dense, read without a set of 10**12 indices)
    assert from_hf_config({**glm, "first_k_dense_replace": 10**12}).moe["moe_layers"] == (False,) * 4
    with pytest.raises(ConfigError, match="routed_scaling_factor must be a positive number, got 'x'"):
        from_hf_config({**glm, "routed_scaling_factor": "x"})
    command = {**moe_config(), "model_type": "cohere2_moe", "num_experts": 6}
    with pytest.raises(ConfigError, match="expert_selection_fn must be softmax or sigmoid, got 'relu'"):
        from_hf_config({**command, "expert_selection_fn": "relu"})
    with pytest.raises(ConfigError, match="shared_expert_combination_strategy must be sum or average, got 'max'"):
        from_hf_config({**command, "shared_expert_combination_strategy": "max"})
    with pytest.raises(ConfigError, match="sliding_window_pattern must be a positive integer, got 0"):
        from_hf_config({**command, "sliding_window_pattern": 0})
    hf_model("qwen3_moe").save_pretrained(tmp_path)
    assert not load_model(str(tmp_path)).cuda_graphs
    with pytest.raises(ConfigError, match="CUDA graphs"):
        load_model(str(tmp_path), cuda_graphs=True)


def test_a_qwen3_moe_gguf_file_gives_transformers_greedy_tokens(tmp_path):
    """llama.cpp's ``qwen3moe`` layout: the router (``ffn_gate_inp``) and each layer's experts stacked
    (``ffn_gate_exps``, ``ffn_up_exps`` (E, I, H), ``ffn_down_exps`` (E, H, I)); Qwen's unpermuted Q and K."""
    pytest.importorskip("gguf")
    from gguf_files import uneven_norms_, write_gguf

    hf_config = transformers.Qwen3MoeConfig(
        **{**moe_config(norm_topk_prob=True, vocab_size=300, initializer_range=0.2), "model_type": None}
    )
    torch.manual_seed(21)
    model = uneven_norms_(transformers.Qwen3MoeForCausalLM(hf_config).eval())
    state = {name: t.float().numpy() for name, t in model.state_dict().items()}
    experts = {}
    for n in range(hf_config.num_hidden_layers):
        gate_up, i = state[f"model.layers.{n}.mlp.experts.gate_up_proj"], hf_config.moe_intermediate_size
        experts[f"blk.{n}.ffn_gate_exps.weight"] = gate_up[:, :i].copy()
        experts[f"blk.{n}.ffn_up_exps.weight"] = gate_up[:, i:].copy()
        experts[f"blk.{n}.ffn_down_exps.weight"] = state[f"model.layers.{n}.mlp.experts.down_proj"]
        experts[f"blk.{n}.ffn_gate_inp.weight"] = state[f"model.layers.{n}.mlp.gate.weight"]
    fields = {
        "add_tokenizer_model": "gpt2", "add_token_list": [f"t{i}" for i in range(300)], "add_expert_count": 6,
        "add_expert_used_count": 2, "add_expert_feed_forward_length": 16,
    }  # fmt: skip
    path = tmp_path / "tiny-qwen3moe.gguf"
    write_gguf(path, model, fields, arch="qwen3moe", tensors=experts)
    llm = LLM(str(path), kv_capacity_tokens=256)
    assert llm.engine.executor.model.config.moe["moe_layers"] == (True,) * 4
    prompts = [[3, 9, 27, 17, 51, 25, 101, 7], list(range(40, 70))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)
    assert [o.outputs[0].token_ids for o in outputs] == [greedy(model, ids, 12) for ids in prompts]


def test_qwen2_moes_parameter_count_and_gguf_file(tmp_path):
    """A Qwen2-MoE model has transformers' parameter count; llama.cpp's ``qwen2moe`` layout (the experts
    stacked as Qwen3-MoE's, the shared expert's ``ffn_*_shexp`` and its gate ``ffn_gate_inp_shexp``, a vector;
    q/k/v biases) gives transformers' greedy tokens, the top weights not renormalized."""
    pytest.importorskip("gguf")
    from gguf_files import uneven_norms_, write_gguf

    config = moe_config(model_type="qwen2_moe", shared_expert_intermediate_size=24, vocab_size=300)
    hf_config = transformers.Qwen2MoeConfig(**{**config, "model_type": None, "initializer_range": 0.2})
    torch.manual_seed(22)
    model = uneven_norms_(transformers.Qwen2MoeForCausalLM(hf_config).eval())
    assert from_hf_config(config).num_params == sum(p.numel() for p in model.parameters())
    state = {name: t.float().numpy() for name, t in model.state_dict().items()}
    more = {}
    for n in range(hf_config.num_hidden_layers):
        mlp, i = f"model.layers.{n}.mlp", hf_config.moe_intermediate_size
        more[f"blk.{n}.ffn_gate_exps.weight"] = state[f"{mlp}.experts.gate_up_proj"][:, :i].copy()
        more[f"blk.{n}.ffn_up_exps.weight"] = state[f"{mlp}.experts.gate_up_proj"][:, i:].copy()
        more[f"blk.{n}.ffn_down_exps.weight"] = state[f"{mlp}.experts.down_proj"]
        more[f"blk.{n}.ffn_gate_inp.weight"] = state[f"{mlp}.gate.weight"]
        for part in ("gate", "up", "down"):
            more[f"blk.{n}.ffn_{part}_shexp.weight"] = state[f"{mlp}.shared_expert.{part}_proj.weight"]
        more[f"blk.{n}.ffn_gate_inp_shexp.weight"] = state[f"{mlp}.shared_expert_gate.weight"].reshape(-1)
    fields = {
        "add_tokenizer_model": "gpt2", "add_token_list": [f"t{i}" for i in range(300)], "add_expert_count": 6,
        "add_expert_used_count": 2, "add_expert_feed_forward_length": 16, "add_expert_shared_feed_forward_length": 24,
    }  # fmt: skip
    path = tmp_path / "tiny-qwen2moe.gguf"
    write_gguf(path, model, fields, arch="qwen2moe", tensors=more)
    llm = LLM(str(path), kv_capacity_tokens=256)
    moe = llm.engine.executor.model.config.moe
    assert moe["moe_layers"] == (True,) * 4 and not moe["norm_topk_prob"]
    prompts = [[3, 9, 27, 17, 51, 25, 101, 7], list(range(40, 70))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)
    assert [o.outputs[0].token_ids for o in outputs] == [greedy(model, ids, 12) for ids in prompts]


@pytest.mark.parametrize("num_tokens", [1, 5, 64])
def test_gpt_oss_layer_equals_transformers_mlp(num_tokens):
    """The router's top k logits (with its bias) softmaxed into the weights; each expert's gate and up columns
    interleaved, clamped at 7 (the gate above, the up both sides), (up + 1) gate sigmoid(1.702 gate)."""
    config = {**hf_model("gpt_oss").config.to_dict(), "num_local_experts": 6}
    hf_config = transformers.GptOssConfig(**{k: v for k, v in config.items() if k != "model_type"})
    # (weights large enough that some gates and ups pass the clamp)
    block = random_block(transformers.models.gpt_oss.modeling_gpt_oss.GptOssMLP, hf_config, 200 + num_tokens, std=1.0)
    ours = create_model(from_hf_config(config), TorchAttention(), torch.float32, torch.device("cpu"))
    layer = ours.model.layers[0].mlp
    with torch.no_grad():
        for name, tensor in layer.named_parameters():
            tensor.copy_(block.state_dict()[name])
    x = torch.randn(num_tokens, 64)
    with torch.no_grad():
        expected = block(x[None])[0][0]
        got = layer(x)
        clamped = (x @ block.experts.gate_up_proj).abs().max()
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-5)
    assert clamped > 7  # NOTE: the clamp bites here


def test_mxfp4_dequantizes_as_transformers_does():
    """OCP MXFP4 (gpt-oss's experts): every 4-bit code and a range of block scales, against transformers'
    ``convert_moe_packed_tensors``; blocks and scales that do not pair are refused."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from sloserve.engine.models import dequantize_mxfp4

    gen = torch.Generator().manual_seed(5)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=gen, dtype=torch.uint8)  # (E, rows, G, 16)
    scales = torch.randint(110, 140, (3, 10, 4), generator=gen, dtype=torch.uint8)  # 2 ** -17 .. 2 ** 12
    ours = dequantize_mxfp4(blocks, scales)
    assert ours.shape == (3, 128, 10)  # (E, 32 G, rows)
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    with pytest.raises(ConfigError, match="MXFP4 blocks .* and scales .* do not pair"):
        dequantize_mxfp4(blocks, scales[:, :, :3])


def test_a_gpt_oss_checkpoint_with_mxfp4_experts(tmp_path):
    """gpt-oss as OpenAI ships it: each layer's experts as MXFP4 blocks and scales
    (``mlp.experts.gate_up_proj_blocks``...; ``quantization_config.quant_method`` mxfp4), the rest in full:
    the engine's log-probabilities equal transformers' on the model of the dequantized weights."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = hf_model("gpt_oss")
    assert from_hf_config(model.config.to_dict()).num_params == sum(p.numel() for p in model.parameters())
    model.save_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(6)
    state = {name: t.contiguous() for name, t in model.state_dict().items()}
    with torch.no_grad():
        for n in range(model.config.num_hidden_layers):
            experts = model.model.layers[n].mlp.experts
            for name in ("gate_up_proj", "down_proj"):
                weight = getattr(experts, name)  # (E, in, out): quantized as (E, out, in / 32, 16)
                e, cols, rows = weight.shape
                blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=gen, dtype=torch.uint8)
                scales = torch.randint(122, 127, (e, rows, cols // 32), generator=gen, dtype=torch.uint8)
                weight.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                key = f"model.layers.{n}.mlp.experts.{name}"
                del state[key]
                state[f"{key}_blocks"], state[f"{key}_scales"] = blocks, scales
    safetensors_torch.save_file(state, str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ids = [(7 * i + 3) % 300 for i in range(30)]
    llm = LLM(str(tmp_path), kv_capacity_tokens=256)
    [out] = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=0))
    assert [e.logprob for e in out.prompt_logprobs[1:]] == pytest.approx(prompt_logprobs(model, ids), abs=1e-4)
    assert out.outputs[0].token_ids == greedy(model, ids, 6)
    del state["model.layers.1.mlp.experts.down_proj_scales"]
    safetensors_torch.save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="MXFP4 tensor model.layers.1.mlp.experts.down_proj_blocks has no scales"):
        LLM(str(tmp_path), kv_capacity_tokens=256)


@pytest.mark.parametrize("routing", ["greedy", "group_limited_greedy"])
@pytest.mark.parametrize("num_tokens", [1, 5, 64])
def test_deepseek_v2s_layer_equals_transformers_block(routing, num_tokens):
    """DeepSeek-V2's MoE: the routed experts' sum (weights times routed_scaling_factor; group-limited: both
    from the group of 4 of the token's best expert) plus the shared experts' output."""
    from sloserve.engine.models.moe import DeepseekMoE

    groups = {"n_group": 2, "topk_group": 1} if routing == "group_limited_greedy" else {}
    config = moe_config(
        model_type="deepseek_v2", n_routed_experts=8, n_shared_experts=2, routed_scaling_factor=2.0,
        first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=8, topk_method=routing, **groups,
    )  # fmt: skip
    del config["num_experts"]  # (its name: n_routed_experts)
    hf_config = transformers.DeepseekV2Config(**{**config, "model_type": None})
    block = random_block(
        transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2Moe, hf_config, 200 + num_tokens
    )
    layer = engine_layer_holding(config, block)
    assert isinstance(layer, DeepseekMoE)
    x = torch.randn(num_tokens, 32)
    with torch.no_grad():
        expected = block(x[None])[0]
        got = layer(x)
        greedy_weights, greedy_experts = layer.gate(x).softmax(-1).topk(2, dim=-1)
        ungrouped = layer.experts(x, greedy_experts, 2.0 * greedy_weights) + layer.shared_experts(x)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    if routing == "group_limited_greedy" and num_tokens == 64:  # NOTE: some token's best experts lie outside its groups
        assert not torch.allclose(ungrouped, expected, atol=1e-3)


@pytest.mark.parametrize("num_tokens", [1, 5, 64])
def test_deepseek_v3s_layer_equals_transformers_block(num_tokens):
    """DeepSeek-V3's MoE: experts chosen by sigmoid score plus the router's bias, from the best group (of 2, by
    the sum of its two best), weighted by their scores renormalized, times routed_scaling_factor; the shared
    expert's output added."""
    config = moe_config(
        model_type="deepseek_v3", n_routed_experts=8, n_shared_experts=1, routed_scaling_factor=2.5, n_group=2,
        topk_group=1, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8,
    )  # fmt: skip
    del config["num_experts"]  # (its name: n_routed_experts)
    hf_config = transformers.DeepseekV3Config(**{**config, "model_type": None})
    block = random_block(
        transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE, hf_config, 300 + num_tokens
    )
    layer = engine_layer_holding(config, block)
    x = torch.randn(num_tokens, 32)
    with torch.no_grad():
        expected = block(x[None])[0]
        got = layer(x)
        layer.gate.e_score_correction_bias.zero_()
        unbiased = layer(x)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    if num_tokens == 64:  # NOTE: the bias changes some token's choice
        assert not torch.allclose(unbiased, expected, atol=1e-3)


def test_deepseek_v3s_router_stays_float32_in_a_bf16_model():
    """As transformers keeps them (``_keep_in_fp32_modules_strict``: the router's weight and bias): rounded to
    bf16, experts whose scores plus bias nearly tie would swap, and a router stored in float32 (Hunyuan's)
    would lose its precision."""
    config = moe_config(model_type="deepseek_v3", n_routed_experts=8, n_group=2, topk_group=1, first_k_dense_replace=0)
    model = create_model(from_hf_config(config), TorchAttention(), torch.bfloat16, torch.device("cpu"))
    gate = model.model.layers[0].mlp.gate
    assert (gate.e_score_correction_bias.dtype, gate.weight.dtype) == (torch.float32, torch.float32)
    assert model.model.layers[0].mlp.experts.gate_up.dtype == torch.bfloat16
    assert checkpoint_tensors(model)["model.layers.0.mlp.gate.e_score_correction_bias"] is gate.e_score_correction_bias


def test_deepseek_v2s_routing_is_checked():
    config = moe_config(model_type="deepseek_v2", n_routed_experts=8, topk_method="group_limited_greedy")
    for bad, message in (
        ({}, "group_limited_greedy needs n_group"),
        ({"n_group": 3, "topk_group": 2}, "n_group 3 must divide the 8 experts"),
        ({"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}, "topk_group 1 groups hold fewer experts"),
        ({"topk_method": "noaux_tc"}, "topk_method 'noaux_tc' is not supported"),
        ({"topk_method": "greedy", "norm_topk_prob": True}, "norm_topk_prob .* is not supported for deepseek_v2"),
    ):
        with pytest.raises(ConfigError, match=message):
            from_hf_config({**config, **bad})
