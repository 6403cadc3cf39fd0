"""Model classes by architecture, random initialisation and safetensors loading."""

from __future__ import annotations

import contextlib
import math
from itertools import pairwise
from pathlib import Path

import torch
from torch import nn

from sloserve.checkpoint.model_config import ModelConfig
from sloserve.core.errors import ConfigError
from sloserve.engine.attention import AttentionBackend
from sloserve.engine.models import (
    afmoe,
    apertus,
    deepseek_v2,
    falcon,
    falcon_h1,
    gpt2,
    gpt_neox,
    hunyuan,
    hyperclovax,
    kimi_linear,
    lfm2,
    llama4,
    mamba,
    mpt,
    nanochat,
    nemotron_h,
    olmo2,
    phi,
    phimoe,
    qwen3_next,
)
from sloserve.engine.models.apertus import ApertusForCausalLM
from sloserve.engine.models.arcee import ArceeForCausalLM, Jais2ForCausalLM
from sloserve.engine.models.cohere import CohereForCausalLM
from sloserve.engine.models.deepseek_v2 import DeepseekV2ForCausalLM
from sloserve.engine.models.gemma3 import Gemma3ForCausalLM, GemmaForCausalLM
from sloserve.engine.models.glm4 import Glm4ForCausalLM
from sloserve.engine.models.gpt2 import GPT2LMHeadModel
from sloserve.engine.models.gpt_neox import GPTNeoXForCausalLM
from sloserve.engine.models.llama import LlamaForCausalLM, MergedLinear, past_the_layers
from sloserve.engine.models.moe import hub_expert_name, per_expert_tensors
from sloserve.engine.models.nemotron import NemotronForCausalLM
from sloserve.engine.models.nemotron_h import NemotronHForCausalLM
from sloserve.engine.models.olmo import OlmoForCausalLM
from sloserve.engine.models.olmo2 import Olmo2ForCausalLM
from sloserve.engine.models.opt import OPTForCausalLM
from sloserve.engine.models.phi import PhiForCausalLM
from sloserve.engine.models.stablelm import StableLmForCausalLM
from sloserve.engine.models.starcoder2 import Starcoder2ForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "gemma": GemmaForCausalLM,
    "olmo2": Olmo2ForCausalLM,
    "glm4": Glm4ForCausalLM,
    "gpt_neox": GPTNeoXForCausalLM,
    "cohere": CohereForCausalLM,
    "opt": OPTForCausalLM,
    "gpt2": GPT2LMHeadModel,
    "phi": PhiForCausalLM,
    "starcoder2": Starcoder2ForCausalLM,
    "deepseek_v2": DeepseekV2ForCausalLM,
    "stablelm": StableLmForCausalLM,
    "olmo": OlmoForCausalLM,
    "nemotron": NemotronForCausalLM,
    "arcee": ArceeForCausalLM,
    "hunyuan": LlamaForCausalLM,
    "glm4_moe": LlamaForCausalLM,
    "ernie4_5_moe": LlamaForCausalLM,
    "apertus": ApertusForCausalLM,
    "granitemoehybrid": LlamaForCausalLM,
    "nemotron_h": NemotronHForCausalLM,
    "mamba": mamba.MambaForCausalLM,
    "bamba": LlamaForCausalLM,
    "falcon_h1": LlamaForCausalLM,
    "lfm2": lfm2.Lfm2ForCausalLM,
    "lfm3": lfm2.Lfm3ForCausalLM,
    "minimax_m2": LlamaForCausalLM,
    "qwen3_next": qwen3_next.Qwen3NextForCausalLM,
    "olmo_hybrid": olmo2.OlmoHybridForCausalLM,
    "kimi_linear": kimi_linear.KimiLinearForCausalLM,
    "exaone_moe": LlamaForCausalLM,
    "llama4": llama4.Llama4ForCausalLM,
    "exaone": LlamaForCausalLM,
    "phimoe": phimoe.PhimoeForCausalLM,
    "sarvam_moe": LlamaForCausalLM,
    "hy_v3": LlamaForCausalLM,
    "afmoe": afmoe.AfmoeForCausalLM,
    "jamba": LlamaForCausalLM,
    "falcon": falcon.FalconForCausalLM,
    "jais2": Jais2ForCausalLM,
    "hyperclovax": hyperclovax.HyperClovaXForCausalLM,
    "mpt": mpt.MptForCausalLM,
    "nanochat": nanochat.NanoChatForCausalLM,
}


def _without_later_layers(key: str, tensor: torch.Tensor, config: ModelConfig) -> tuple[str, torch.Tensor] | None:
    """GLM-4.5's tensors as they are, but its multi-token-prediction layer's (not read)."""
    return None if past_the_layers(key, config) else (key, tensor)


# ERNIE 4.5's router bias, (1, E), as its checkpoints name it (its "MoE statistics")
ERNIE_ROUTER_BIAS = "mlp.moe_statics.e_score_correction_bias"


def _without_mtp(key: str, tensor: torch.Tensor, config: ModelConfig) -> tuple[str, torch.Tensor] | None:
    """K-EXAONE's tensors as they are, but its multi-token-prediction module's (``mtp.``: not read, as transformers
    and vLLM serve it without)."""
    return None if key.startswith("mtp.") else (key, tensor)


def _ernie4_5_moe_tensor(key: str, tensor: torch.Tensor, config: ModelConfig) -> tuple[str, torch.Tensor] | None:
    """ERNIE 4.5 MoE's tensors as they are, but the router's bias under the router's name as a vector, and its
    multi-token-prediction tensors (``mtp_*``) not read (transformers' and vLLM's rule)."""
    if "mtp" in key:
        return None
    if key.endswith(ERNIE_ROUTER_BIAS):
        return key.removesuffix(ERNIE_ROUTER_BIAS) + "mlp.gate.e_score_correction_bias", tensor.reshape(-1)
    return key, tensor


def _granite_4_tensor(key: str, tensor: torch.Tensor, config: ModelConfig) -> tuple[str, torch.Tensor]:
    """Granite 4.0's shared MLP (``shared_mlp.input_linear``: its gate rows then its up rows, ``output_linear``)
    under Llama's MLP names: the layer's MLP where it has no experts, else the shared expert beside them."""
    mlp = ".mlp.shared_expert." if config.is_moe else ".mlp."
    for theirs, ours in ((".shared_mlp.input_linear.", "gate_up_proj."), (".shared_mlp.output_linear.", "down_proj.")):
        key = key.replace(theirs, mlp + ours)
    return key, tensor


# An architecture's reading of a checkpoint tensor: (HF name, tensor) -> (the engine's name, tensor as it holds it),
# or None for one it does not hold
CHECKPOINT_TENSORS = {
    "gpt_neox": gpt_neox.checkpoint_tensor,
    "gpt2": gpt2.checkpoint_tensor,
    "falcon": falcon.checkpoint_tensor,
    "deepseek_v2": deepseek_v2.checkpoint_tensor,
    "glm4_moe": _without_later_layers,
    "ernie4_5_moe": _ernie4_5_moe_tensor,
    "granitemoehybrid": _granite_4_tensor,
    "nemotron_h": nemotron_h.checkpoint_tensor,
    "mamba": nemotron_h.checkpoint_tensor,  # (Nemotron-H's names: every block a MAMBA one)
    "falcon_h1": falcon_h1.checkpoint_tensor,
    "qwen3_next": qwen3_next.checkpoint_tensor,
    "kimi_linear": kimi_linear.checkpoint_tensor,
    "exaone_moe": _without_mtp,
    "hy_v3": _without_later_layers,
}
# An architecture's checkpoint names of modules the engine names otherwise (Llama's): each part of a name replaced
CHECKPOINT_NAMES = {
    "phi": phi.CHECKPOINT_NAMES,
    "hunyuan": hunyuan.CHECKPOINT_NAMES,
    "apertus": apertus.CHECKPOINT_NAMES,
    "bamba": falcon_h1.CHECKPOINT_NAMES,  # (Bamba's names of its MLP, its norm before it and its final norm)
    "falcon_h1": falcon_h1.CHECKPOINT_NAMES,
    "lfm2": lfm2.CHECKPOINT_NAMES,
    "lfm3": lfm2.LFM3_CHECKPOINT_NAMES,
    "olmo_hybrid": olmo2.HYBRID_CHECKPOINT_NAMES,
    # (MiniMax-M2's router bias beside its router, as the engine holds it; its experts by Mixtral's names)
    "minimax_m2": {".mlp.e_score_correction_bias": ".mlp.gate.e_score_correction_bias"},
    "exaone_moe": {".mlp.e_score_correction_bias": ".mlp.gate.e_score_correction_bias"},  # (K-EXAONE's, the Hub's)
    # (Hunyuan 3's, the Hub's, which transformers 5 saves: its router's weight, its bias beside it, its shared MLP)
    "hy_v3": {
        ".mlp.router.gate.weight": ".mlp.gate.weight",
        ".mlp.expert_bias": ".mlp.gate.e_score_correction_bias",
        ".mlp.shared_mlp.": ".mlp.shared_experts.",
    },
    "llama4": llama4.CHECKPOINT_NAMES,
    "nanochat": nanochat.CHECKPOINT_NAMES,
    "afmoe": afmoe.CHECKPOINT_NAMES,
    # (Jamba's MLP, its router and the norms before it and after the layers)
    "jamba": {
        ".feed_forward.router.": ".mlp.gate.",
        ".feed_forward.": ".mlp.",
        ".pre_ff_layernorm.": ".post_attention_layernorm.",
        "model.final_layernorm.": "model.norm.",
    },
    # (EXAONE 3's, the Hub's: GPT-2's module names; transformers 5 saves Llama's)
    "exaone": {
        "transformer.wte.": "model.embed_tokens.",
        "transformer.h.": "model.layers.",
        "transformer.ln_f.": "model.norm.",
        ".attn.attention.": ".self_attn.",
        ".self_attn.out_proj.": ".self_attn.o_proj.",
        ".ln_1.": ".input_layernorm.",
        ".ln_2.": ".post_attention_layernorm.",
        ".mlp.c_fc_0.": ".mlp.gate_proj.",
        ".mlp.c_fc_1.": ".mlp.up_proj.",
        ".mlp.c_proj.": ".mlp.down_proj.",
    },
    # (Sarvam's, the Hub's: its Q/K/V fused as the engine's, its norms' and its router bias' names)
    "sarvam_moe": {
        "model.word_embeddings.": "model.embed_tokens.",
        ".attention.query_key_value.": ".self_attn.qkv_proj.",
        ".attention.dense.": ".self_attn.o_proj.",
        ".attention.query_layernorm.": ".self_attn.q_norm.",
        ".attention.key_layernorm.": ".self_attn.k_norm.",
        ".mlp.gate.expert_bias": ".mlp.gate.e_score_correction_bias",
    },
}
# The merged projections a model type's checkpoints store whole, in the row order the engine's have:
# Phi-3's Q/K/V (``qkv_proj``) and gate/up (``gate_up_proj``), GLM's and Granite 4.0's gate/up
FUSED_CHECKPOINTS = {
    "phi3": ("qkv_proj", "gate_up_proj"),
    "glm": ("gate_up_proj",),
    "glm4": ("gate_up_proj",),
    "granitemoehybrid": ("gate_up_proj",),
    "granitemoeshared": ("gate_up_proj",),
    "granitemoe_swa": ("gate_up_proj",),
    "sarvam_moe": ("qkv_proj",),
}
# Checkpoint tensors that are buffers in other implementations, not weights.
# (old GPT-NeoX and GPT-2 checkpoints: the causal mask and its fill value)
_IGNORED_SUFFIXES = (
    "rotary_emb.inv_freq",
    ".attention.bias",
    ".attention.masked_bias",
    ".attn.bias",
    ".attn.masked_bias",
)
# Each architecture's (input embedding, LM head) modules, tied where the config says so
TIED_MODULES = {
    "opt": ("model.decoder.embed_tokens", "lm_head"),
    "gpt_neox": ("gpt_neox.embed_in", "embed_out"),
    "gpt2": ("transformer.wte", "lm_head"),
    "falcon": ("transformer.word_embeddings", "lm_head"),
    "mpt": ("transformer.wte", "lm_head"),
}
# A multimodal checkpoint served as text (``ModelConfig.extra["multimodal_checkpoint"]``: Gemma 3 4B-27B,
# Mistral Small 3.1): its language model's tensors under the text model's names (as transformers saved
# them before 4.52, and since), the vision tower's and the projector's not read
LANGUAGE_MODEL_PREFIXES = {
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
    "model.language_model.": "model.",
}
VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "model.visual.",  # (Qwen3-VL's, and Qwen2-VL's and Qwen2.5-VL's as transformers 5 saves them)
    "visual.",  # (Qwen2-VL's and Qwen2.5-VL's on the Hub)
    "vision_model.",  # (Llama 4's, on the Hub and as transformers 5 saves them)
)


def language_model_name(key: str) -> str | None:
    """The text model's name of a multimodal checkpoint's tensor ``key``; None: a vision tensor."""
    if key.startswith(VISION_PREFIXES):
        return None
    prefix = next((p for p in LANGUAGE_MODEL_PREFIXES if key.startswith(p)), None)
    return key if prefix is None else LANGUAGE_MODEL_PREFIXES[prefix] + key[len(prefix) :]


@contextlib.contextmanager
def _weights_left_unset():
    """``torch.nn.init``'s fills do nothing inside, in the whole process (as in transformers' ``no_init_weights``).
    NOTE: on the meta device they would compute nothing, but ``normal_``'s meta function imports ``torch._dynamo``
    (2-3.6 s of every engine's start on the CPU, where nothing else imports it)."""
    fills = {name: getattr(nn.init, name) for name in dir(nn.init) if name.endswith("_") and not name.startswith("_")}
    try:
        for name in fills:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fill in fills.items():
            setattr(nn.init, name, fill)


def create_model(config: ModelConfig, backend: AttentionBackend, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """An uninitialised model on ``device`` (parameters allocated, not filled)."""
    with torch.device("meta"), _weights_left_unset():
        model = MODEL_CLASSES[config.architecture](config, backend)
    model = model.to_empty(device=device).to(dtype)
    for module in model.modules():  # (parameters a module keeps in float32 whatever the model's dtype)
        for name in getattr(module, "float32_parameters", ()):
            if getattr(module, name) is not None:
                setattr(module, name, nn.Parameter(getattr(module, name).float()))
    if config.tie_word_embeddings:  # to_empty re-creates parameters: tie again
        embed, head = TIED_MODULES.get(config.architecture, ("model.embed_tokens", "lm_head"))
        model.get_submodule(head).weight = model.get_submodule(embed).weight
    return model.eval()


def checkpoint_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters under their checkpoint (HF) names, in registration order: a merged
    projection (``MergedLinear``) appears as views of its parts (``q_proj.weight``...), or whole where
    the checkpoint stores it so (``FUSED_CHECKPOINTS``: Phi-3's ``qkv_proj.weight``); stacked experts
    (``moe.Experts``) as each expert's (``experts.0.gate_proj.weight``...). A tied weight appears under
    each of its names, as one tensor."""
    fused = FUSED_CHECKPOINTS.get(model.config.model_type, ())
    stacked = {
        name: m
        for name, m in model.named_modules()
        if hasattr(m, "checkpoint_views") and not (isinstance(m, MergedLinear) and name.rpartition(".")[2] in fused)
    }
    tensors: dict[str, torch.Tensor] = {}
    viewed: set[str] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        module_name = name.rpartition(".")[0]
        module = stacked.get(module_name)
        if module is None:
            tensors[name] = p
        elif module_name not in viewed:  # the parts' weights and biases, once per such module
            viewed.add(module_name)
            prefix = module_name.rpartition(".")[0]
            tensors.update({f"{prefix}.{part}": view for part, view in module.checkpoint_views().items()})
    return tensors


@torch.no_grad()
def init_random_(model: nn.Module, seed: int) -> None:
    """Fill weights from a seeded generator: linear weights N(0, 1/fan_in), embeddings N(0, 1),
    norm weights 1, biases 0 (a scale at which random models give varied tokens)."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    seen: set[int] = set()
    for name, p in checkpoint_tensors(model).items():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if name.endswith("bias"):
            p.zero_()
        elif p.ndim == 1:
            p.fill_(1.0)
        elif "embed" in name:
            p.normal_(0.0, 1.0, generator=generator)
        else:
            p.normal_(0.0, p.shape[1] ** -0.5, generator=generator)


def _safetensors_keys(path: Path, multimodal: bool, device: str = "cpu"):
    """(file, the opened file, key, the engine's name) of each tensor in the ``*.safetensors`` files of ``path``;
    a multimodal checkpoint's language model's only, as the engine names them (``language_model_name``). A
    ConfigError at once where there are no files, and at a file that is unreadable."""
    from safetensors import SafetensorError, safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model directory {path} has no *.safetensors weights")

    def keys():
        for file in files:
            try:
                opened = safe_open(str(file), framework="pt", device=device)
            except SafetensorError as e:  # a cut-off download fails here ("file not fully covered")
                raise ConfigError(f"{file}: not a readable safetensors file ({e})") from None
            with opened as f:
                for key in f.keys():
                    name = language_model_name(key) if multimodal else key
                    if name is not None:  # NOTE: a vision tensor is never read from the file
                        yield file, f, key, name

    return keys()


def checkpoint_shapes(path: Path, multimodal: bool) -> dict[str, tuple[int, ...]]:
    """The shapes of the tensors in the ``*.safetensors`` files of ``path`` by the engine's names, read from
    their headers (``_safetensors_keys``: a multimodal checkpoint's language model's)."""
    return {name: tuple(f.get_slice(key).get_shape()) for _, f, key, name in _safetensors_keys(path, multimodal)}


def stores_lm_head(shapes: dict[str, tuple[int, ...]]) -> bool:
    """Whether a multimodal checkpoint's language model (``shapes``: ``checkpoint_shapes``) has an LM head of
    its own (Mistral Small 3.1's) rather than one tied to its embedding (Gemma 3's). NOTE: its config cannot
    be trusted to say: transformers' multimodal configs default to tied, and read the flag at the top level
    or in the text_config depending on the version."""
    return "lm_head.weight" in shapes


# The modules that hold a model's decoder layers, as checkpoints name them: model.layers.N (most),
# transformer.h.N (GPT-2, Falcon, BLOOM), transformer.blocks.N (MPT), backbone.layers.N (Mamba), blk.N (GGUF)
LAYER_CONTAINERS = frozenset(("layers", "h", "blocks", "blk"))
# Values a checkpoint's number may hold: 2 where 4-bit weights are packed two a byte (gpt-oss's MXFP4)
MOST_VALUES_PER_NUMBER = 2


def check_config_fits_checkpoint(config: ModelConfig, shapes: dict[str, tuple[int, ...]], source: str) -> None:
    """A ConfigError naming ``source`` (the model directory or GGUF file) where ``config`` describes a larger
    model than the checkpoint's tensors (``shapes``, in values) hold, before the model is built: more decoder
    layers than the tensors hold, or more parameters than their numbers can hold. NOTE: a wrong
    num_hidden_layers of 10**5 took minutes to build a tiny model's layers, a vocab_size of 10**9 a raw
    allocation error; a tenfold 8B model does not fit in memory."""
    held_layers = 1 + max(
        (int(index) for name in shapes for container, index in pairwise(name.split("."))
         if container in LAYER_CONTAINERS and index.isdigit()),
        default=-1,
    )  # fmt: skip
    if config.num_hidden_layers > held_layers:
        raise ConfigError(
            f"{source}: the config has {config.num_hidden_layers} layers (num_hidden_layers), but the weights "
            f"are those of {held_layers}"
        )
    held_numbers = sum(math.prod(shape) for shape in shapes.values())
    if config.num_params > MOST_VALUES_PER_NUMBER * held_numbers:
        raise ConfigError(
            f"{source}: the config describes a model of {config.num_params:,} parameters, but the weights hold "
            f"{held_numbers:,} numbers: the config is not the weights' config"
        )


@torch.no_grad()
def load_weights(model: nn.Module, path: Path) -> None:
    """Copy every tensor of the ``*.safetensors`` files in ``path`` into ``model`` by name.

    A parameter missing from the files (other than a tied LM head) is a ConfigError naming it.
    """
    device = next(model.parameters()).device
    multimodal = model.config.extra.get("multimodal_checkpoint", False)
    keys = _safetensors_keys(path, multimodal, str(device))
    tensors = ((file, name, f.get_tensor(key)) for file, f, key, name in keys)
    copy_weights(model, tensors, f"model directory {path}")


# The model types whose stacked experts are (E, inputs, outputs) whatever their shape (Llama 4's: transformers'
# Llama4TextExperts multiplies the tokens by them as they are)
STACKED_INPUTS_FIRST = ("llama4_text",)


def _per_expert(tensors, config: ModelConfig):
    """``tensors`` with stacked experts tensors split into the per-expert ones (``per_expert_tensors``),
    Mixtral's named as the others' (``hub_expert_name``). A stacked tensor laid out (E, inputs, outputs), as the
    Hub's Qwen3-VL-MoE stores them, is transposed to transformers' (E, outputs, inputs) first: where its shape is
    not that one (transformers' rule, ``Transpose(check_dims=True)``), and always for a model type whose experts
    are held so (``STACKED_INPUTS_FIRST``)."""
    h, i = config.hidden_size, config.moe["moe_intermediate_size"]
    as_held = {"gate_up_proj": (2 * i, h), "up_proj": (i, h), "down_proj": (h, i)}  # (outputs, inputs) of each expert's
    inputs_first = config.model_type in STACKED_INPUTS_FIRST
    for origin, key, tensor in tensors:
        key = hub_expert_name(key)
        kind = key.rpartition(".")[2]
        stacked = key.endswith(".experts." + kind) and kind in as_held
        if stacked and (inputs_first or tuple(tensor.shape[1:]) != as_held[kind]):
            tensor = torch.as_tensor(tensor).transpose(1, 2)
        parts = per_expert_tensors(key, tensor)
        yield from ((origin, key, tensor),) if parts is None else ((origin, k, t) for k, t in parts)


# The projections whose rows the rotary embedding turns (``deinterleave_rotary_rows``)
_ROTATED_ROWS = tuple(f"self_attn.{p}_proj.{kind}" for p in ("q", "k") for kind in ("weight", "bias"))


def deinterleave_rotary_rows(tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """A Q or K projection's weight (heads x hd, H) or bias (heads x hd,) with each head's rotated rows
    reordered from adjacent pairs (GLM's rotary layout: rows 2i and 2i + 1 turn together) to halves (the
    engine's: rows i and i + rotary_dim / 2), the other rows in place. Queries and keys permuted alike
    give the same scores."""
    hd, rd = config.head_dim, config.rotary_dim
    order = torch.cat((torch.arange(0, rd, 2), torch.arange(1, rd, 2), torch.arange(rd, hd)))  # (hd,)
    heads = tensor.shape[0] // hd
    rows = (torch.arange(heads)[:, None] * hd + order[None, :]).flatten()  # (heads x hd,)
    return tensor[rows.to(tensor.device)]


# The values of OCP MXFP4's 4-bit codes (E2M1: a sign, two exponent bits, one mantissa bit)
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """OCP MXFP4, as gpt-oss's checkpoints store its experts: ``blocks`` (E, rows, G, 16) uint8, two 4-bit
    codes a byte (the low nibble first), ``scales`` (E, rows, G) uint8, each block of 32 values' power of
    two (E8M0: 2 ** (s - 127)) -> float32 (E, 32 G, rows): transposed, as the model multiplies by them
    (transformers' ``convert_moe_packed_tensors``). One expert at a time (the codes of a whole layer at
    once would take GBs)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ConfigError(
            f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} {scales.dtype} "
            "do not pair (uint8 (E, rows, G, 16) and (E, rows, G))"
        )
    table = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    experts = []
    for expert_blocks, expert_scales in zip(blocks, scales, strict=True):
        codes = torch.stack((expert_blocks & 0x0F, expert_blocks >> 4), dim=-1).flatten(-2)  # (rows, G, 32)
        values = torch.ldexp(table[codes.long()], expert_scales.to(torch.int32)[..., None] - 127)
        experts.append(values.flatten(-2).T)  # (32 G, rows)
    return torch.stack(experts)


def _joined(tensors, part_of, join, kind: str, part_names: tuple[str, str]):
    """``tensors`` with each tensor a checkpoint stores in two parts (its values and their scales) as the one
    ``join(values, scales, description)`` makes. ``part_of(key, tensor)``: (the tensor's name, 0 for its values
    or 1 for their scales), None for a tensor stored whole. In a file the two parts are neighbours: at most one
    waits for the other. A part without its pair is a ConfigError naming it (``part_names``: the two's, for it)."""
    pending: dict[tuple[str, int], tuple[object, str, object]] = {}  # (name, part) -> (its file, key, tensor)
    for origin, key, tensor in tensors:
        found = part_of(key, tensor)
        if found is None:
            yield origin, key, tensor
            continue
        name, part = found
        other = pending.pop((name, 1 - part), None)
        if other is None:
            pending[(name, part)] = origin, key, tensor
            continue
        values, scales = (tensor, other[2]) if part == 0 else (other[2], tensor)
        yield origin, name, join(values, scales, f"{origin}: {kind} tensor {name}")
    if pending:
        (_, part), (origin, key, _) = next(iter(pending.items()))
        raise ConfigError(f"{origin}: {kind} tensor {key} has no {part_names[1 - part]}")


def _mxfp4_part(key: str, tensor) -> tuple[str, int] | None:
    """An MXFP4 tensor's part: ``{name}_blocks`` (0) or ``{name}_scales`` (1)."""
    name, _, part = key.rpartition("_")
    return (name, ("blocks", "scales").index(part)) if part in ("blocks", "scales") else None


def _dequantized(tensors):
    """``tensors`` with each MXFP4 pair (``{name}_blocks``, ``{name}_scales``) as the tensor ``{name}``."""

    def join(blocks, scales, _):
        return dequantize_mxfp4(blocks, scales)

    return _joined(tensors, _mxfp4_part, join, "MXFP4", ("blocks", "scales"))


def dequantize_fp8_blocks(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], name: str = "FP8 weight"
) -> torch.Tensor:
    """A block-wise FP8 weight (..., N, K) float8_e4m3fn as float32: each (rows, columns) ``block`` of it times
    its scale (``scale_inv`` (..., ceil(N / rows), ceil(K / columns)), DeepSeek-V3's and transformers' name for
    the factor that undoes the quantization); the last blocks of a row or column may be partial. ``name``:
    the weight's, for the error when the two do not pair."""
    (n, k), (rows, columns) = weight.shape[-2:], block
    if tuple(scale_inv.shape) != (*weight.shape[:-2], -(-n // rows), -(-k // columns)):
        raise ConfigError(
            f"{name} {tuple(weight.shape)} and its scales {tuple(scale_inv.shape)} do not pair "
            f"(one scale a {rows} x {columns} block, quantization_config weight_block_size)"
        )
    scales = scale_inv.float().repeat_interleave(rows, dim=-2)[..., :n, :]
    return weight.float() * scales.repeat_interleave(columns, dim=-1)[..., :k]


def _fp8_part(key: str, tensor) -> tuple[str, int] | None:
    """A block-wise FP8 tensor's part: the float8 weight ``{name}`` (0) or its ``{name}_scale_inv`` (1)."""
    if key.endswith("_scale_inv"):
        return key.removesuffix("_scale_inv"), 1
    return (key, 0) if getattr(tensor, "dtype", None) == torch.float8_e4m3fn else None


def _fp8_dequantized(tensors, block: tuple[int, int]):
    """``tensors`` with each FP8 weight and its ``{name}_scale_inv`` as the float32 weight."""

    def join(weight, scale_inv, name):
        return dequantize_fp8_blocks(weight, scale_inv, block, name)

    return _joined(tensors, _fp8_part, join, "FP8", ("FP8 weight", "scale (_scale_inv)"))


@torch.no_grad()
def copy_weights(model: nn.Module, tensors, source: str) -> None:
    """Copy ``(origin, HF name, tensor or array)`` triples into ``model``; an unknown name, a wrong
    shape or a parameter left without weights (other than a tied LM head) is a ConfigError."""
    params = checkpoint_tensors(model)
    loaded: set[str] = set()
    if "fp8_weight_block" in model.config.extra:  # (block-wise FP8 weights, dequantized as they load)
        tensors = _fp8_dequantized(tensors, model.config.extra["fp8_weight_block"])
    if model.config.model_type == "gpt_oss":  # (its experts stacked as the model holds them)
        tensors = _dequantized(tensors)
    elif model.config.is_moe:
        tensors = _per_expert(tensors, model.config)
    as_held = CHECKPOINT_TENSORS.get(model.config.architecture)
    renames = CHECKPOINT_NAMES.get(model.config.architecture, {})
    for origin, key, tensor in tensors:
        if key.endswith(_IGNORED_SUFFIXES):
            continue
        for theirs, ours in renames.items():
            key = key.replace(theirs, ours)
        if model.config.rotary_interleaved and key.endswith(_ROTATED_ROWS):
            tensor = deinterleave_rotary_rows(torch.as_tensor(tensor), model.config)
        if as_held is not None:
            held = as_held(key, torch.as_tensor(tensor), model.config)
            if held is None:  # (one the engine does not run: DeepSeek-V3's multi-token prediction)
                continue
            key, tensor = held
        if key not in params:
            raise ConfigError(f"{origin}: unexpected tensor {key!r} for a {model.config.model_type} model")
        if tuple(tensor.shape) != tuple(params[key].shape):
            raise ConfigError(
                f"{origin}: tensor {key!r} has shape {tuple(tensor.shape)}, the config gives {tuple(params[key].shape)}"
            )
        params[key].copy_(torch.as_tensor(tensor))
        loaded.add(key)
    head = TIED_MODULES.get(model.config.architecture, ("", "lm_head"))[1]
    missing = [
        k for k in params if k not in loaded and not (k == f"{head}.weight" and model.config.tie_word_embeddings)
    ]
    if missing:
        raise ConfigError(
            f"{source}: weights missing for {', '.join(missing[:5])}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        )
