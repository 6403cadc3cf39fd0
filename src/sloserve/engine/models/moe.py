"""Sparse mixture-of-experts MLPs (Qwen3-MoE: Qwen3-30B-A3B, Qwen3-235B-A22B; Qwen2-MoE: Qwen1.5-MoE-A2.7B,
Qwen2-57B-A14B, with a shared expert; Mixtral 8x7B, 8x22B; gpt-oss-20b and 120b: ``GptOssMoE``; DeepSeek-V2's and
V3's routings, GLM-4.5's and ERNIE 4.5's too: ``DeepseekMoE``).

Each token's router scores pick its ``num_experts_per_tok`` best experts (softmax over all experts, in
float32, then the top k; with ``norm_topk_prob`` their weights renormalized to sum to 1, as transformers'
``Qwen3MoeTopKRouter``); the token's output is the weighted sum of those experts' SwiGLU MLPs.

The experts' weights are held stacked, one tensor for every expert's gate and up rows and one for their
down projections (as vLLM's fused-MoE layer holds them); a checkpoint's per-expert tensors
(``mlp.experts.{e}.gate_proj.weight``...; transformers 5 may save them stacked, ``per_expert_tensors``)
load into views of them (``checkpoint_views``).

NOTE: the reference computation here groups the step's tokens by expert (a sort) and runs one pair of
matmuls per expert that has tokens. Its shapes depend on the routing, so a CUDA graph cannot replay it:
engines on a MoE model run eagerly (``ModelConfig.is_moe``), unless its experts run ``fused_moe``'s
grouped matmuls (``use_fused_experts``: on CUDA unless ``SLOSERVE_FUSED_MOE=0``), whose shapes do not.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from sloserve.checkpoint.model_config import ModelConfig
from sloserve.checkpoint.model_types import BIASED_ROUTINGS
from sloserve.engine import fused_ops


class Experts(nn.Module):
    """Every expert's SwiGLU weights, stacked: ``gate_up`` (E, 2 I, H) (gate rows, then up rows) and
    ``down`` (E, H, I). ``fused``: the tokens go through ``fused_moe``'s kernels, not ``by_expert``."""

    fused = False

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def checkpoint_views(self) -> dict[str, torch.Tensor]:
        """``{"experts.0.gate_proj.weight": expert 0's gate rows, ...}`` (the checkpoint's names, under the
        MLP's): views that share the stacked storage."""
        i, views = self.intermediate_size, {}
        for e in range(self.num_experts):
            views[f"experts.{e}.gate_proj.weight"] = self.gate_up[e, :i]
            views[f"experts.{e}.up_proj.weight"] = self.gate_up[e, i:]
            views[f"experts.{e}.down_proj.weight"] = self.down[e]
        return views

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:  # (n, H) -> (n, H)
        return F.linear(fused_ops.silu_and_mul(F.linear(x, self.gate_up[e])), self.down[e])  # via (n, 2 I), (n, I)

    def forward(
        self,
        x: torch.Tensor,  # (T, H)
        experts: torch.Tensor,  # (T, k) the experts each token is routed to
        weights: torch.Tensor,  # (T, k) their weights, in x's dtype
    ) -> torch.Tensor:  # (T, H)
        if self.fused:
            from sloserve.engine.fused_moe import fused_experts  # (triton's)

            return fused_experts(x, experts, weights, self.gate_up, self.down, fused_ops.silu_and_mul)
        return by_expert(x, experts, weights, self.num_experts, self.expert)


class UpDownExperts(nn.Module):
    """Every expert's two-matrix MLP, stacked: ``up`` (E, I, H) and ``down`` (E, H, I), an expert's output
    down(act(up x)) (Nemotron-H's: its squared ReLU, no gate). Always by expert: ``fused_moe``'s kernels are
    for gated experts."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act: Callable) -> None:
        super().__init__()
        self.num_experts, self.act = num_experts, act
        self.up = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def checkpoint_views(self) -> dict[str, torch.Tensor]:
        """``{"experts.0.up_proj.weight": expert 0's up rows, ...}``, as ``Experts.checkpoint_views``."""
        views = {}
        for e in range(self.num_experts):
            views[f"experts.{e}.up_proj.weight"] = self.up[e]
            views[f"experts.{e}.down_proj.weight"] = self.down[e]
        return views

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:  # (n, H) -> (n, H)
        return F.linear(self.act(F.linear(x, self.up[e])), self.down[e])

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:  # (T, H)
        return by_expert(x, experts, weights, self.num_experts, self.expert)


def by_expert(
    x: torch.Tensor,  # (T, H)
    experts: torch.Tensor,  # (T, k) the experts each token is routed to
    weights: torch.Tensor,  # (T, k) their weights, in x's dtype
    num_experts: int,
    expert: Callable[[int, torch.Tensor], torch.Tensor],  # (e, its tokens (n, H)) -> (n, H)
) -> torch.Tensor:  # (T, H)
    """Each token's weighted sum of its experts' outputs: the tokens grouped by expert (a sort), ``expert``
    run once for each expert that has tokens."""
    out = torch.zeros_like(x)
    flat = experts.flatten()  # (T k,)
    order = flat.argsort(stable=True)  # the (token, choice) pairs grouped by expert
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # NOTE: a device sync
    tokens = order // experts.shape[1]  # (T k,) the token of each pair, in that order
    pair_weights = weights.flatten()[order]
    start = 0
    for e, count in enumerate(counts):
        if count:
            rows = tokens[start : start + count]
            out.index_add_(0, rows, expert(e, x[rows]) * pair_weights[start : start + count, None])
            start += count
    return out


# Mixtral's checkpoint names of an expert's projections (under ``block_sparse_moe.``, not ``mlp.``)
MIXTRAL_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# Granite 3 MoE's names of its stacked experts ((E, 2 I, H) gate then up rows, (E, H, I)) and its router (Granite
# Swash's: transformers 5's names of them, under ``block_sparse_moe``)
GRANITE_MOE_NAMES = {
    "mlp.input_linear.weight": "mlp.experts.gate_up_proj",
    "mlp.output_linear.weight": "mlp.experts.down_proj",
    "mlp.router.layer.weight": "mlp.gate.weight",
    "mlp.router.weight": "mlp.gate.weight",
}


def hub_expert_name(key: str) -> str:
    """A Mixtral checkpoint's MoE tensor (``block_sparse_moe.experts.0.w1.weight``, ``block_sparse_moe.gate``), or
    a Granite MoE's (``block_sparse_moe.input_linear.weight``...), under the names the engine's MoE layers take
    (``mlp.experts.0.gate_proj.weight``, ``mlp.gate``; Granite's stacked ones as transformers 5's,
    ``per_expert_tensors``)."""
    if ".block_sparse_moe." not in key:
        return key
    key = key.replace(".block_sparse_moe.", ".mlp.")
    for granite, ours in GRANITE_MOE_NAMES.items():
        if key.endswith(granite):
            return key.removesuffix(granite) + ours
    prefix, _, rest = key.partition(".mlp.experts.")
    if not rest or "." not in rest:  # (not an expert's, or all experts' stacked: transformers 5's)
        return key
    expert, projection, suffix = (rest.split(".", 2) + ["", ""])[:3]
    return f"{prefix}.mlp.experts.{expert}.{MIXTRAL_EXPERT_NAMES.get(projection, projection)}.{suffix}"


def per_expert_tensors(key: str, tensor) -> list[tuple[str, object]] | None:
    """A stacked experts tensor of a checkpoint saved by transformers 5 (``mlp.experts.gate_up_proj``
    (E, 2 I, H), ``mlp.experts.down_proj`` (E, H, I); an ungated expert's ``up_proj`` (E, I, H)) as the Hub's
    per-expert tensors, under any module's name (Nemotron-H's ``mixer.experts``, renamed after); None for any
    other."""
    prefix, _, kind = key.rpartition(".")
    if (
        not prefix.endswith(".experts")
        or kind not in ("gate_up_proj", "up_proj", "down_proj")
        or len(tensor.shape) != 3
    ):
        return None
    if kind in ("up_proj", "down_proj"):  # (an ungated expert's up, Nemotron-H's, and anyone's down)
        return [(f"{prefix}.{e}.{kind}.weight", tensor[e]) for e in range(tensor.shape[0])]
    i = tensor.shape[1] // 2
    return [
        (f"{prefix}.{e}.{part}_proj.weight", rows)
        for e in range(tensor.shape[0])
        for part, rows in (("gate", tensor[e, :i]), ("up", tensor[e, i:]))
    ]


class SparseMoE(nn.Module):
    """A MoE layer's MLP: the router (``gate``, HF's name) and the experts; Qwen2-MoE's ``shared_expert``
    (a dense MLP every token runs, given by the caller) scaled by sigmoid(``shared_expert_gate``(x)), Granite
    4.0's unscaled (``shared_expert_gated`` False)."""

    def __init__(
        self, config: ModelConfig, shared_expert: nn.Module | None = None, shared_expert_gated: bool = True
    ) -> None:
        super().__init__()
        moe = config.moe
        self.top_k, self.norm_topk_prob = moe["num_experts_per_tok"], moe["norm_topk_prob"]
        self.gate = nn.Linear(config.hidden_size, moe["num_experts"], bias=False)
        self.experts = Experts(moe["num_experts"], config.hidden_size, moe["moe_intermediate_size"])
        self.shared_expert = shared_expert
        self.shared_expert_gate = None
        if shared_expert is not None and shared_expert_gated:
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H) -> (T, H)
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # (T, E)
        weights, experts = probs.topk(self.top_k, dim=-1)  # (T, k) each
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        routed = self.experts(x, experts, weights.to(x.dtype))
        if self.shared_expert is None:
            return routed
        if self.shared_expert_gate is None:
            return routed + self.shared_expert(x)
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)  # (T, 1) * (T, H)


class DeepseekRouter(nn.Module):
    """The router's weight (E, H) and, for V3's and ERNIE 4.5's routings (``BIASED_ROUTINGS``), the bias its
    choice adds to the scores (``e_score_correction_bias``, DeepSeek-V3's auxiliary-loss-free balancing b_i).

    NOTE: the weight and the bias stay float32 in a bf16 model (``float32_parameters``, as transformers keeps
    them: its ``_keep_in_fp32_modules_strict``; vLLM the bias): rounded to bf16, experts whose scores nearly
    tie would swap."""

    float32_parameters = ("weight", "e_score_correction_bias")

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        experts = config.moe["num_experts"]
        self.weight = nn.Parameter(torch.empty(experts, config.hidden_size))
        biased = config.moe["topk_method"] in BIASED_ROUTINGS
        self.e_score_correction_bias = nn.Parameter(torch.empty(experts)) if biased else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H) -> (T, E) float32 logits
        return F.linear(x.float(), self.weight.float())


class DeepseekMoE(nn.Module):
    """DeepSeek's MoE (GLM-4.5's and ERNIE 4.5's too): router scores in float32, each token's top k experts, their weights
    times ``routed_scaling_factor``; the shared experts (one MLP, ungated, given by the caller) run for every
    token.

    - ``greedy`` (V2, §2.2): softmax scores, the top k.
    - ``group_limited_greedy`` (V2, §2.2.2): softmax scores, the top k of the ``topk_group`` groups (of
      ``n_group``) whose best expert scores highest.
    - ``noaux_tc`` (V3, §2.1.2): sigmoid scores s; the experts chosen by s + b (the router's bias), from the
      ``topk_group`` groups whose two best s + b sum highest; their weights s, renormalized where
      ``norm_topk_prob``.
    - ``softmax_with_bias`` (ERNIE 4.5's): softmax scores s; the experts chosen by s + b; their weights s,
      renormalized.
    - ``softmax_top2_groups`` (Mistral Small 4's): softmax scores s; the experts chosen by s from the
      ``topk_group`` groups whose two best s sum highest; their weights s, renormalized where ``norm_topk_prob``."""

    def __init__(self, config: ModelConfig, shared_experts: nn.Module | None, experts: nn.Module | None = None) -> None:
        """``experts``: other than SwiGLU ones (Nemotron-H's ``UpDownExperts``)."""
        super().__init__()
        moe = config.moe
        self.top_k, self.norm_topk_prob = moe["num_experts_per_tok"], moe["norm_topk_prob"]
        self.scaling, self.method = moe["routed_scaling_factor"], moe["topk_method"]
        self.num_groups, self.top_groups = moe["n_group"], moe["topk_group"]
        self.norm_eps = moe.get("norm_topk_eps", 1e-20)  # (added to the top weights' sum: LFM2-MoE's 1e-6)
        self.gate = DeepseekRouter(config)
        self.experts = experts or Experts(moe["num_experts"], config.hidden_size, moe["moe_intermediate_size"])
        self.shared_experts = shared_experts

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights (T, k) float32, experts (T, k)) of each token."""
        logits = self.gate(x)  # (T, E)
        if self.method == "noaux_tc":
            scores = logits.sigmoid()
            choice = scores + self.gate.e_score_correction_bias  # (T, E) float32
            by_group = choice.view(x.shape[0], self.num_groups, -1)  # (T, G, E / G)
            group_scores = by_group.topk(2, dim=-1).values.sum(dim=-1)  # (T, G)
            choice = self._in_best_groups(by_group, group_scores, float("-inf"))
            experts = choice.topk(self.top_k, dim=-1).indices  # (T, k)
            weights = scores.gather(1, experts)
        elif self.method == "softmax_top2_groups":  # (Mistral Small 4's: V3's groups over softmax scores, no bias)
            scores = torch.softmax(logits, dim=-1)
            by_group = scores.view(x.shape[0], self.num_groups, -1)  # (T, G, E / G)
            choice = self._in_best_groups(by_group, by_group.topk(2, dim=-1).values.sum(dim=-1), 0.0)
            experts = choice.topk(self.top_k, dim=-1).indices  # (T, k)
            weights = scores.gather(1, experts)
        elif self.method == "softmax_with_bias":  # (ERNIE 4.5's: the bias picks, the softmax weighs)
            scores = torch.softmax(logits, dim=-1)
            experts = (scores + self.gate.e_score_correction_bias).topk(self.top_k, dim=-1).indices  # (T, k)
            weights = scores.gather(1, experts)
        else:
            scores = torch.softmax(logits, dim=-1)
            if self.method == "group_limited_greedy":  # the experts outside the token's best groups score 0
                by_group = scores.view(x.shape[0], self.num_groups, -1)
                scores = self._in_best_groups(by_group, by_group.amax(dim=-1), 0.0)
            weights, experts = scores.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + self.norm_eps)  # (transformers' guard)
        return weights * self.scaling, experts

    def _in_best_groups(self, by_group: torch.Tensor, group_scores: torch.Tensor, fill: float) -> torch.Tensor:
        """``by_group`` (T, G, E / G) with the experts outside each token's ``topk_group`` best groups (by
        ``group_scores`` (T, G)) set to ``fill``, as (T, E)."""
        best = group_scores.topk(self.top_groups, dim=-1).indices  # (T, topk_group)
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # (T, G)
        return by_group.masked_fill(~kept[..., None], fill).flatten(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H) -> (T, H)
        weights, experts = self.route(x)
        routed = self.experts(x, experts, weights.to(x.dtype))
        return routed if self.shared_experts is None else routed + self.shared_experts(x)


class GptOssExperts(nn.Module):
    """gpt-oss's experts, held as its checkpoints hold them (transformers' layout: MXFP4 ones are dequantized
    into it as they load): ``gate_up_proj`` (E, H, 2 I), its gate and up columns interleaved, and
    ``down_proj`` (E, I, H), each with a bias. An expert computes (up + 1) * gate * sigmoid(alpha gate),
    its gate clamped above at ``limit`` and its up to [-limit, limit] (gpt-oss's clamped SwiGLU).
    ``fused``: as ``Experts``'."""

    fused = False

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe, h = config.moe, config.hidden_size
        e, i = moe["num_experts"], moe["moe_intermediate_size"]
        self.num_experts, self.alpha, self.limit = e, moe["swiglu_alpha"], moe["swiglu_limit"]
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
        self.down_proj = nn.Parameter(torch.empty(e, i, h))
        self.down_proj_bias = nn.Parameter(torch.empty(e, h))

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:  # (n, 2 I) interleaved -> (n, I)
        gate = gate_up[:, ::2].clamp(max=self.limit)  # (n, I)
        up = gate_up[:, 1::2].clamp(min=-self.limit, max=self.limit)  # (n, I)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:  # (n, H) -> (n, H)
        gate_up = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]  # (n, 2 I)
        return self.activation(gate_up) @ self.down_proj[e] + self.down_proj_bias[e]

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x (T, H); experts, weights (T, k): each token's experts and their weights -> (T, H)."""
        if self.fused:  # (its weights inputs x outputs: transposed views are F.linear's)
            from sloserve.engine.fused_moe import fused_experts

            gate_up, down = self.gate_up_proj.transpose(1, 2), self.down_proj.transpose(1, 2)
            biases = dict(gate_up_bias=self.gate_up_proj_bias, down_bias=self.down_proj_bias)
            return fused_experts(x, experts, weights, gate_up, down, self.activation, **biases)
        return by_expert(x, experts, weights, self.num_experts, self.expert)


def use_fused_experts(model: nn.Module) -> int:
    """Run the experts of every MoE layer of ``model`` through ``fused_moe``'s kernels (on CUDA, or in
    Triton's interpreter); how many layers that is."""
    layers = [m for m in model.modules() if isinstance(m, (Experts, GptOssExperts))]
    for layer in layers:
        layer.fused = True
    return len(layers)


class GptOssMoE(nn.Module):
    """gpt-oss's MLP: the router (a linear layer with a bias) picks each token's top k experts by logit, their
    weights the softmax of those k logits (transformers' ``GptOssTopKRouter``); then ``GptOssExperts``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.moe["num_experts_per_tok"]
        self.router = nn.Linear(config.hidden_size, config.moe["num_experts"], bias=True)
        self.experts = GptOssExperts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H) -> (T, H)
        logits, experts = self.router(x).topk(self.top_k, dim=-1)  # (T, k) each
        return self.experts(x, experts, torch.softmax(logits, dim=-1))
