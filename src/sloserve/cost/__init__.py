"""Batch-time cost models: InferMax's linear form, a roofline form, fitting, bundled presets."""

from __future__ import annotations

from pathlib import Path

from sloserve.core.errors import ConfigError, UnknownNameError

from .base import BatchShape, CostBreakdown, CostModel
from .fit import FitReport, LinearFit, fit_linear, fit_linear_shapes, read_profile_csv, write_profile_csv
from .linear import DEFAULT_SWAP_BANDWIDTH, LinearCoefficients, LinearCostModel
from .presets import PRESETS, find_preset, get_preset, list_presets, load_preset, save_preset
from .roofline import SWAP_EFFICIENCY, RooflineCostModel
from .specs import (
    GPUS,
    MODELS,
    HardwareSpec,
    ModelSpec,
    get_gpu,
    get_model,
    gpu_of_device,
    kv_capacity_tokens,
)

ROOFLINE = "roofline"

__all__ = [
    "BatchShape",
    "CostBreakdown",
    "CostModel",
    "DEFAULT_SWAP_BANDWIDTH",
    "FitReport",
    "GPUS",
    "HardwareSpec",
    "LinearCoefficients",
    "LinearCostModel",
    "LinearFit",
    "MODELS",
    "ModelSpec",
    "PRESETS",
    "RooflineCostModel",
    "build_cost_model",
    "fit_linear",
    "fit_linear_shapes",
    "linear_coefficients",
    "write_profile_csv",
    "get_gpu",
    "get_model",
    "get_preset",
    "gpu_of_device",
    "kv_capacity_tokens",
    "list_presets",
    "load_preset",
    "read_profile_csv",
    "save_preset",
]


def _looks_like_path(name: str) -> bool:
    return name.endswith(".json") or "/" in name or "\\" in name or Path(name).is_file()


def linear_coefficients(name_or_path: str, *, also_valid: tuple[str, ...] = ()) -> LinearCoefficients:
    """A linear preset by name (``list_presets()``) or from a JSON preset file, to run with (its steps
    take time: ``check_steps_take_time``); an ``UnknownNameError`` listing the presets (and
    ``also_valid``, names the caller handles itself) for anything else."""
    if name_or_path in PRESETS:
        return get_preset(name_or_path)
    if _looks_like_path(name_or_path):
        coefficients = load_preset(name_or_path)
        coefficients.check_steps_take_time()
        return coefficients
    err = UnknownNameError("cost model", name_or_path, [*PRESETS, *also_valid])
    err.args = (f"{err.args[0]}; or a path to a JSON preset file (written by save_preset)",)
    raise err


def build_cost_model(
    model: ModelSpec, gpu: HardwareSpec, *, num_gpus: int = 1, cost_model: str | None = None
) -> CostModel:
    """The cost model to simulate ``model`` on ``num_gpus`` x ``gpu`` with.

    ``cost_model``: None picks the linear preset measured on this exact deployment if there is one
    (llama-2-7b on 1x a100-80gb, llama-3-70b on 4x a100-80gb), else the roofline model;
    ``"roofline"``; a preset name (``list_presets()``); or a path to a JSON preset file written by
    ``save_preset``. Linear models swap KV at ``SWAP_EFFICIENCY`` x the GPU's PCIe bandwidth x
    ``num_gpus`` (each GPU copies its shard of the KV over its own link).
    Raises ``UnknownNameError`` for an unknown name and ``ConfigError`` when the linear model's
    layer count differs from the model's.
    """
    swap_bandwidth = gpu.pcie_bandwidth * SWAP_EFFICIENCY * num_gpus
    if cost_model is None:
        preset = find_preset(model.name, gpu.name, num_gpus)
        if preset is None:
            return RooflineCostModel(model, gpu, num_gpus=num_gpus)
        coefficients = get_preset(preset)
    elif cost_model == ROOFLINE:
        return RooflineCostModel(model, gpu, num_gpus=num_gpus)
    else:
        coefficients = linear_coefficients(cost_model, also_valid=(ROOFLINE,))
    if coefficients.num_layers != model.num_layers:
        raise ConfigError(
            f"cost model {coefficients.name} was fitted for {coefficients.num_layers} layers but "
            f"model {model.name} has {model.num_layers}; pick a matching cost model or 'roofline'"
        )
    return LinearCostModel(coefficients, swap_bandwidth=swap_bandwidth)
