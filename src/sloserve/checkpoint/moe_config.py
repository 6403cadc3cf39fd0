"""A mixture of experts' settings (``ModelConfig.moe``) from its config: the experts, their routing
(softmax or sigmoid, grouped, biased), the shared experts and which layers are dense, under each model
type's names and transformers' defaults."""

from __future__ import annotations

from typing import Any

from sloserve.checkpoint.config_values import (
    check_layer_period,
    check_positive_ints,
    json_float,
    layer_index,
    one_for_all_layers,
)
from sloserve.checkpoint.model_config import MOE_LAYER
from sloserve.checkpoint.model_types import (
    DEEPSEEK_ROUTED,
    DEEPSEEK_ROUTING_DEFAULTS,
    GATED_SHARED_EXPERTS,
    MOE_DEFAULTS,
    MOE_SETTING_NAMES,
    ROUTING_METHODS,
    UNGATED_SHARED_EXPERTS,
)
from sloserve.core.errors import ConfigError


def nemotron_h_moe(raw: dict[str, Any], kinds: list[str], name: str) -> dict[str, Any] | None:
    """Nemotron-H's experts' blocks (Nemotron 3 Nano's): DeepSeek-V3's routing (sigmoid scores chosen with the
    router's bias from the best groups, renormalized, scaled), two-matrix squared-ReLU experts beside a shared one;
    transformers' defaults. None without them."""
    if MOE_LAYER not in kinds:
        return None
    if raw.get("moe_latent_size") is not None:
        raise ConfigError(f"{name}: moe_latent_size (experts on a latent projection) is not supported")
    moe = {
        "num_experts": raw.get("n_routed_experts", raw.get("num_local_experts", 8)),
        "num_experts_per_tok": raw.get("num_experts_per_tok", 2),
        "moe_intermediate_size": raw.get("moe_intermediate_size", 7688),
        "norm_topk_prob": bool(raw.get("norm_topk_prob", True)),
        "moe_layers": tuple(kind == MOE_LAYER for kind in kinds),
        # (transformers' NemotronHMoE runs its shared expert whatever n_shared_experts says)
        "shared_expert_intermediate_size": raw.get("moe_shared_expert_intermediate_size", 7688),
        "routed_scaling_factor": json_float(raw.get("routed_scaling_factor", 1.0), "routed_scaling_factor", name),
        "topk_method": "noaux_tc",
        "n_group": raw.get("n_group", 1),
        "topk_group": raw.get("topk_group", 1),
    }
    check_positive_ints(moe, ("shared_expert_intermediate_size",), name)  # (transformers builds it always)
    _check_moe_sizes(moe, name)
    _check_group_routing(moe, ("noaux_tc",), name)
    return moe


def read_moe(raw: dict[str, Any], layers: int, name: str) -> dict[str, Any] | None:
    """Qwen3-MoE's and Qwen2-MoE's experts, as transformers' decoder layers place them: every
    ``decoder_sparse_step``-th layer not in ``mlp_only_layers`` (Qwen2-MoE's beside a shared expert);
    Mixtral's, gpt-oss's, OLMoE's and Granite MoE's: every layer, each expert of ``intermediate_size``
    (Mixtral's and Granite's top weights always renormalized); DeepSeek's: every layer after the first
    ``first_k_dense_replace``, beside shared experts, with their routing's settings (GLM-4.5's as V3's, Hunyuan's
    greedy); ERNIE 4.5's: every ``moe_layer_interval``-th layer between its start and end indices. ERNIE's and
    Hunyuan's settings have names of their own (``MOE_SETTING_NAMES``; Hunyuan's a value a layer, read as one).
    The defaults where a config has none are transformers'."""
    kind = raw["model_type"]
    experts_of_intermediate_size = kind in (
        "mixtral",
        "minimax_m2",
        "gpt_oss",
        "olmoe",
        "flex_olmo",
        "granitemoe",
        *UNGATED_SHARED_EXPERTS,
        "hunyuan_v1_moe",
        "llama4_text",
        "phimoe",
        "jamba",
        "cohere2_moe",
    )
    # NOTE: transformers 5 saves Qwen3-MoE's count as num_local_experts (Mixtral's name), the Hub as num_experts
    experts = raw.get("num_experts", raw.get("num_local_experts", MOE_DEFAULTS[kind]["num_experts"]))
    if kind in MOE_SETTING_NAMES:
        raw = {MOE_SETTING_NAMES[kind].get(key, key): value for key, value in raw.items()}
    if kind == "hunyuan_v1_moe":  # (its configs give a value a layer; transformers' reads one for all)
        raw = {
            **raw,
            **{key: one_for_all_layers(raw, key, name) for key in ("n_routed_experts", "num_experts_per_tok")},
        }
    if kind in DEEPSEEK_ROUTED:
        raw = {**DEEPSEEK_ROUTING_DEFAULTS[kind], **raw}
        experts = raw.get("n_routed_experts", MOE_DEFAULTS[kind]["num_experts"])
    if not experts:
        return None
    dense, step = _dense_layers_and_step(raw, kind, layers, name)
    if kind == "jamba" and experts == 1:  # (one expert: transformers' dense MLP)
        return None
    setting = {"ernie4_5_moe": "moe_layer_interval", "llama4_text": "interleave_moe_layer_step"}.get(
        kind, "decoder_sparse_step"
    )
    check_positive_ints({setting: step}, (setting,), name)
    moe = {
        "num_experts": experts,
        "num_experts_per_tok": raw.get("num_experts_per_tok", MOE_DEFAULTS[kind]["num_experts_per_tok"]),
        "moe_intermediate_size": raw.get("intermediate_size")
        if experts_of_intermediate_size
        else raw.get("moe_intermediate_size", MOE_DEFAULTS[kind]["moe_intermediate_size"]),
        # (Granite's: the softmax of the top k logits, the same weights; Qwen3-Next's by default)
        "norm_topk_prob": kind
        in ("mixtral", "granitemoe", *UNGATED_SHARED_EXPERTS, "hunyuan_v1_moe", "qwen3_5_moe_text")
        or bool(raw.get("norm_topk_prob", kind == "qwen3_next")),
        "moe_layers": tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)),
        "shared_expert_intermediate_size": raw.get("shared_expert_intermediate_size", GATED_SHARED_EXPERTS[kind])
        if kind in GATED_SHARED_EXPERTS
        else 0,
    }
    # NOTE: before the settings of each kind multiply or compare them (``_check_moe_sizes`` checks them again)
    check_positive_ints(moe, ("num_experts", "num_experts_per_tok", "moe_intermediate_size"), name)
    _add_kind_settings(moe, raw, kind, name)
    _check_moe_sizes(moe, name)
    return moe


def _dense_layers_and_step(raw: dict[str, Any], kind: str, layers: int, name: str) -> tuple[set[int], int]:
    """The layers whose MLP is dense, and the step of the others' experts (every ``step``-th layer of the rest, not
    yet checked), as each kind's config places them."""
    step, dense = raw.get("decoder_sparse_step", 1), set(raw.get("mlp_only_layers") or ())
    if kind == "ernie4_5_moe":  # (every moe_layer_interval-th layer from the start index to the end one's)
        start = layer_index(raw, "moe_layer_start_index", 1, name)
        end = layer_index(raw, "moe_layer_end_index", -1, name)
        step, end = raw.get("moe_layer_interval", 1), layers - 1 if end == -1 else end
        dense = {i for i in range(layers) if not start <= i <= end}
    elif kind in ("glm4_moe_lite", "kimi_linear", "exaone_moe", "hy_v3", "cohere2_moe") and raw.get(
        "mlp_layer_types"
    ):  # ("dense", "sparse")
        dense = dense_layers(raw["mlp_layer_types"], layers, name)
    elif kind in (*DEEPSEEK_ROUTED, "cohere2_moe"):  # (its first first_k_dense_replace layers' MLPs dense)
        dense = set(range(min(layer_index(raw, "first_k_dense_replace", 0, name), layers)))
    elif kind == "jamba":  # (its experts where i % expert_layer_period is expert_layer_offset)
        period, offset = raw.get("expert_layer_period", 2), raw.get("expert_layer_offset", 1)
        check_layer_period(period, offset, "expert_layer", name)
        dense = {i for i in range(layers) if i % period != offset}
    elif kind == "llama4_text":  # (its experts at moe_layers, else every interleave_moe_layer_step-th layer)
        step = 1 if raw.get("moe_layers") is not None else raw.get("interleave_moe_layer_step", 1)
        dense = _llama4_dense_layers(raw, layers, name)
    return dense, step


def _add_kind_settings(moe: dict[str, Any], raw: dict[str, Any], kind: str, name: str) -> None:
    """What each kind's experts need besides their count, width and layers: PhiMoE's SparseMixer, Command A+'s and
    DeepSeek's routing, the shared experts of the kinds that size them from other settings, gpt-oss's SwiGLU."""
    if kind == "phimoe":  # (SparseMixer's: two experts a token, their logits' margin)
        if moe["num_experts_per_tok"] != 2:
            raise ConfigError(f"{name}: phimoe routes each token to 2 experts (SparseMixer), got num_experts_per_tok "
                              f"{moe['num_experts_per_tok']!r}")  # fmt: skip
        moe["router_jitter_noise"] = json_float(raw.get("router_jitter_noise", 0.01), "router_jitter_noise", name)
    if kind == "cohere2_moe":  # (the softmax of the top k logits or their sigmoids; its shared MLPs as one)
        check_positive_ints(raw, ("intermediate_size",), name)
        moe.update(_cohere2_moe_routing(raw, name), shared_expert_intermediate_size=raw.get("intermediate_size")
                   * layer_index(raw, "num_shared_experts", 0, name))  # fmt: skip
    if kind == "llama4_text":  # (its shared expert, ungated, as wide as each routed one)
        moe["shared_expert_intermediate_size"] = raw.get("intermediate_size")
    if kind in UNGATED_SHARED_EXPERTS:  # (its shared MLP, ungated, beside the experts; Granite 4.0's 1,024 wide)
        default = 1024 if kind == "granitemoehybrid" else 0
        moe["shared_expert_intermediate_size"] = raw.get("shared_intermediate_size", default)
    if kind in DEEPSEEK_ROUTED:  # its shared experts, one MLP (ungated); its routing (moe.DeepseekMoE)
        scaling = raw["routed_scaling_factor"]
        if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not 0 < scaling < float("inf"):
            raise ConfigError(f"{name}: routed_scaling_factor must be a positive number, got {scaling!r}")
        moe.update(
            shared_expert_intermediate_size=moe["moe_intermediate_size"] * (raw["n_shared_experts"] or 0),
            routed_scaling_factor=float(raw["routed_scaling_factor"]),
            # (a model type of one method takes it whatever its config says: transformers' rule)
            topk_method=ROUTING_METHODS[kind][0] if len(ROUTING_METHODS[kind]) == 1 else raw["topk_method"],
            n_group=raw["n_group"],
            topk_group=raw["topk_group"],
            norm_topk_eps=raw.get("norm_topk_eps", 1e-20),  # (transformers' guard: LFM2-MoE's 1e-6)
        )
        if kind == "lfm2_moe" and not raw.get("use_expert_bias", True):
            raise ConfigError(f"{name}: use_expert_bias false (sigmoid routing without its bias) is not supported")
        _check_group_routing(moe, ROUTING_METHODS[kind], name)
        if moe["norm_topk_prob"] and kind == "deepseek_v2":
            # NOTE: DeepSeek's code renormalizes V2's top weights, transformers' does not: neither is chosen
            raise ConfigError(f"{name}: norm_topk_prob (renormalized top weights) is not supported for deepseek_v2")
    if kind == "gpt_oss":  # softmax over the top k router logits (with biases); the experts' clamped SwiGLU
        moe.update(
            norm_topk_prob=True,
            swiglu_alpha=json_float(raw.get("swiglu_alpha", 1.702), "swiglu_alpha", name),
            swiglu_limit=json_float(raw.get("swiglu_limit", 7.0), "swiglu_limit", name),
        )


def _cohere2_moe_routing(raw: dict[str, Any], name: str) -> dict[str, Any]:
    """Command A+'s routing settings (``moe.Cohere2MoE``): ``expert_selection_fn`` (softmax of the top k logits, or
    their sigmoids, renormalized where ``norm_topk_prob``) and ``shared_expert_combination_strategy`` (the shared
    MLP's output added to the routed one's, or their mean)."""
    selection = raw.get("expert_selection_fn", "softmax")
    combination = raw.get("shared_expert_combination_strategy", "average")
    if selection not in ("softmax", "sigmoid"):
        raise ConfigError(f"{name}: expert_selection_fn must be softmax or sigmoid, got {selection!r}")
    if combination not in ("sum", "average"):
        raise ConfigError(f"{name}: shared_expert_combination_strategy must be sum or average, got {combination!r}")
    norm = selection == "softmax" or bool(raw.get("norm_topk_prob", True))
    return {"expert_selection": selection, "norm_topk_prob": norm, "shared_expert_combination": combination}


def _llama4_dense_layers(raw: dict[str, Any], layers: int, name: str) -> set[int]:
    """The layers whose MLP is dense by Llama 4's ``moe_layers`` (the indices of those of experts; none: all by
    ``interleave_moe_layer_step``)."""
    listed = raw.get("moe_layers")
    if listed is None:
        return set()
    if not isinstance(listed, list) or not all(isinstance(i, int) and 0 <= i < layers for i in listed):
        raise ConfigError(f"{name}: moe_layers must be layer indices below {layers}, got {listed!r}")
    return set(range(layers)) - set(listed)


def dense_layers(kinds: Any, layers: int, name: str) -> set[int]:
    """The layers whose MLP ``mlp_layer_types`` says is dense (GLM-4.7-Flash's: "dense" or "sparse" a layer)."""
    if not isinstance(kinds, list) or len(kinds) != layers or not set(kinds) <= {"dense", "sparse"}:
        raise ConfigError(f"{name}: mlp_layer_types must be {layers} entries of dense or sparse, got {kinds!r}")
    return {i for i, kind in enumerate(kinds) if kind == "dense"}


def _check_moe_sizes(moe: dict[str, Any], name: str) -> None:
    """A mixture of experts' sizes: positive counts and widths, a shared expert's width >= 0 (0: none), a
    token's experts among them."""
    check_positive_ints(moe, ("num_experts", "num_experts_per_tok", "moe_intermediate_size"), name)
    shared = moe["shared_expert_intermediate_size"]
    if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
        raise ConfigError(f"{name}: shared_expert_intermediate_size must be an integer >= 0, got {shared!r}")
    if moe["num_experts_per_tok"] > moe["num_experts"]:
        raise ConfigError(
            f"{name}: num_experts_per_tok {moe['num_experts_per_tok']} exceeds num_experts {moe['num_experts']}"
        )


def _check_group_routing(moe: dict[str, Any], methods: tuple[str, ...], name: str) -> None:
    """DeepSeek's routing: greedy, or group-limited (the experts in ``n_group`` groups, a token's picked from
    its ``topk_group`` best groups: V2's group_limited_greedy, V3's noaux_tc), with groups that divide the
    experts and hold the top k; ``methods``: the model's."""
    method = moe["topk_method"]
    if method not in methods:
        raise ConfigError(f"{name}: topk_method {method!r} is not supported ({', '.join(methods)})")
    if method in ("greedy", "softmax_with_bias"):  # (no groups)
        return
    groups, picked = moe["n_group"], moe["topk_group"]
    for key, value in (("n_group", groups), ("topk_group", picked)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name}: {method} needs {key}, a positive integer; got {value!r}")
    if moe["num_experts"] % groups or picked > groups:
        raise ConfigError(
            f"{name}: n_group {groups} must divide the {moe['num_experts']} experts, and topk_group {picked} "
            "be at most n_group"
        )
    if picked * (moe["num_experts"] // groups) < moe["num_experts_per_tok"]:
        raise ConfigError(f"{name}: topk_group {picked} groups hold fewer experts than num_experts_per_tok")
