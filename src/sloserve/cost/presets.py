"""Bundled linear-cost-model presets and the JSON preset file format.

Source of the coefficients: the InferMax authors' Vidur fork (repository ValerioL29/infermax,
vidur/vidur/execution_time_predictor/sklearn_execution_time_predictor.py; credited in NOTICE), fitted
on A100 GPUs with vLLM v0.6-era kernels; per layer, in ms.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import NamedTuple

from sloserve.core.errors import ConfigError, UnknownNameError

from .linear import COEFFICIENT_NAMES, EXTRA_TERM_NAMES, LinearCoefficients

PRESET_FORMAT = "sloserve-linear-cost-model"
PRESET_VERSION = 1


class Preset(NamedTuple):
    """A bundled coefficient set and the deployment it was measured on."""

    coefficients: LinearCoefficients
    model: str  # ModelSpec name
    gpu: str  # HardwareSpec name (canonical, not an alias)
    num_gpus: int


PRESETS: dict[str, Preset] = {
    "llama-2-7b-a100": Preset(
        LinearCoefficients(
            a_p=1.6773e-07,
            b_p=0.0926,
            a_d=8.513e-06,
            b_d=0.01921,
            a_o=0.00191,
            b_o=0.06486,
            s_p=0.001534,
            s_d=0.00074,
            m_p=9.224e-06,
            num_layers=32,
            name="llama-2-7b-a100",
        ),
        model="llama-2-7b",
        gpu="a100-80gb",
        num_gpus=1,
    ),
    # InferMax §6: TP4, communication counted as zero there (so it is not in these numbers).
    "llama-3-70b-4xa100": Preset(
        LinearCoefficients(
            a_p=4.309e-08,
            b_p=0.2112,
            a_d=1.222e-06,
            b_d=0.081,
            a_o=0.002,
            b_o=0.159,
            s_p=9.03e-04,
            s_d=3.92e-04,
            m_p=3.805e-07,
            num_layers=80,
            name="llama-3-70b-4xa100",
        ),
        model="llama-3-70b",
        gpu="a100-80gb",
        num_gpus=4,
    ),
}


def list_presets() -> list[str]:
    """Names of the bundled linear presets, sorted."""
    return sorted(PRESETS)


def get_preset(name: str) -> LinearCoefficients:
    """The bundled coefficients called ``name``; ``UnknownNameError`` if none."""
    if name not in PRESETS:
        raise UnknownNameError("cost model preset", name, list(PRESETS))
    return PRESETS[name].coefficients


def find_preset(model: str, gpu: str, num_gpus: int) -> str | None:
    """Name of the preset measured on exactly this model, GPU and GPU count, or None."""
    for name, preset in PRESETS.items():
        if (preset.model, preset.gpu, preset.num_gpus) == (model, gpu, num_gpus):
            return name
    return None


def save_preset(coefficients: LinearCoefficients, path: str | Path, *, extra: dict | None = None) -> None:
    """Write ``coefficients`` as a JSON preset file (readable by ``load_preset``).

    ``extra`` (e.g. a fit report) is stored under ``"info"`` and ignored when loading.
    """
    doc: dict = {
        "format": PRESET_FORMAT,
        "version": PRESET_VERSION,
        "name": coefficients.name,
        "num_layers": coefficients.num_layers,
        "unit": "ms per layer",
        "coefficients": {key: getattr(coefficients, key) for key in COEFFICIENT_NAMES},
        "knee_tokens": coefficients.knee_tokens,
        **{key: getattr(coefficients, key) for key in EXTRA_TERM_NAMES},
        "host_overlapped": coefficients.host_overlapped,
    }
    if extra:
        doc["info"] = extra
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


def load_preset(path: str | Path) -> LinearCoefficients:
    """Read a JSON preset file written by ``save_preset``; ``ConfigError`` naming the bad field."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"cost model file {path}: not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cost model file {path}: cannot read ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"cost model file {path}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(doc, dict) or doc.get("format") != PRESET_FORMAT:
        raise ConfigError(
            f"cost model file {path}: field 'format' must be {PRESET_FORMAT!r} "
            f"(write the file with save_preset or `sloserve` fitting)"
        )
    coeffs = doc.get("coefficients")
    if not isinstance(coeffs, dict):
        raise ConfigError(f"cost model file {path}: field 'coefficients' must be an object")
    missing = [key for key in COEFFICIENT_NAMES if key not in coeffs]
    if missing:
        raise ConfigError(
            f"cost model file {path}: coefficients missing {', '.join(missing)}; present: {', '.join(coeffs) or 'none'}"
        )
    values: dict[str, float] = {}
    for key in COEFFICIENT_NAMES:
        value = coeffs[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ConfigError(
                f"cost model file {path}: coefficients.{key} must be a non-negative number, got {value!r}"
            )
        values[key] = float(value)
    num_layers = doc.get("num_layers")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ConfigError(f"cost model file {path}: field 'num_layers' must be a positive integer, got {num_layers!r}")
    knee = doc.get("knee_tokens", 0.0)  # absent from files written before the knee existed
    if isinstance(knee, bool) or not isinstance(knee, (int, float)) or not math.isfinite(knee) or knee < 0:
        raise ConfigError(f"cost model file {path}: field 'knee_tokens' must be a non-negative number, got {knee!r}")
    extra: dict[str, float] = {}
    for key in EXTRA_TERM_NAMES:  # absent from files written before these terms existed
        value = doc.get(key, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ConfigError(f"cost model file {path}: field {key!r} must be a non-negative number, got {value!r}")
        extra[key] = float(value)
    overlapped = doc.get("host_overlapped", False)  # absent from files written before async scheduling
    if not isinstance(overlapped, bool):
        raise ConfigError(f"cost model file {path}: field 'host_overlapped' must be true or false, got {overlapped!r}")
    name = doc.get("name")
    if not isinstance(name, str) or not name:
        name = path.stem
    return LinearCoefficients(
        **values, num_layers=num_layers, name=name, knee_tokens=float(knee), **extra, host_overlapped=overlapped
    )
