"""``deploy.yaml``: the deployment ``sloserve plan`` recommends, in the form ``sloserve serve --config``
reads, so that what was planned is what is served.

    # written by sloserve plan: ...
    model: llama-2-7b            # the model the plan simulated (serve --model names the weights)
    gpu: h100                    # what the plan priced: one replica per GPU of this type
    tensor_parallel: 1
    replicas: 3
    disaggregate: null           # "P:D": P prefill and D decode replicas (simulated only)
    scheduler: sarathi
    scheduler_options: {chunk_size: 512}
    router: least-outstanding
    enable_prefix_caching: null  # null: the server's default (on where the scheduler supports it)
    slo: {ttft_s: 1.0, tpot_s: 0.1}   # the SLO it was planned for: the RT requests' default

Tensor parallelism and disaggregated prefill/decode exist in the simulator only: the plan says so when
its answer uses them, and ``serve --config`` refuses them in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sloserve.core.errors import ConfigError, yaml_error_message
from sloserve.core.yaml_loader import load_yaml


class PlannedSlo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ttft_s: float | None = Field(default=None, gt=0)
    tpot_s: float | None = Field(default=None, gt=0)


class Deployment(BaseModel):
    """One planned deployment (``deploy.yaml``)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    gpu: str | None = None
    tensor_parallel: int = Field(default=1, ge=1)
    replicas: int = Field(default=1, ge=1)
    disaggregate: str | None = None
    scheduler: str = "vllm"
    scheduler_options: dict[str, Any] = Field(default_factory=dict)
    router: str = "least-outstanding"
    enable_prefix_caching: bool | None = None
    slo: PlannedSlo = Field(default_factory=PlannedSlo)

    def simulated_only(self) -> str | None:
        """What of it ``sloserve serve`` cannot deploy (None: all of it can)."""
        if self.tensor_parallel > 1:
            return f"tensor_parallel {self.tensor_parallel} (sloserve serve runs one GPU per replica)"
        if self.disaggregate is not None:
            return f"disaggregate {self.disaggregate} (prefill and decode replicas are simulated only)"
        return None


def deployment_of(doc: dict) -> Deployment | None:
    """The deployment of a plan's answer (``plan.json``); None when it has none."""
    answer = doc.get("answer")
    if answer is None:
        return None
    query = doc["query"]
    units = answer["units"]
    if answer["layout"] == "colocated":
        replicas, disaggregate = units, None
    else:  # "PP:DD"
        prefill, decode = (int(x.rstrip("PD")) for x in answer["layout"].split(":"))
        replicas, disaggregate = 1, f"{units * prefill}:{units * decode}"
    slo = query.get("slo") or {}
    return Deployment(
        model=query.get("model"),
        gpu=answer["gpu"],
        tensor_parallel=answer["tensor_parallel"],
        replicas=replicas,
        disaggregate=disaggregate,
        scheduler=answer["scheduler"],
        scheduler_options=answer["options"],
        router=query.get("router") or "least-outstanding",
        enable_prefix_caching=query.get("enable_prefix_caching"),
        slo=PlannedSlo(ttft_s=slo.get("ttft_s"), tpot_s=slo.get("tpot_s")),
    )


def write_deployment(deployment: Deployment, path: Path, header: str) -> Path:
    """``deployment`` as YAML at ``path``, after a comment ``header``."""
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    path.write_text(comment + yaml.safe_dump(deployment.model_dump(), sort_keys=False))
    return path


def load_deployment(path: Path) -> Deployment:
    """``deploy.yaml`` read and checked: a ConfigError names the file, the field and the problem."""
    try:
        raw = load_yaml(path.read_text())
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not YAML: {yaml_error_message(e)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: expected a mapping of fields (deploy.yaml from sloserve plan)")
    try:
        return Deployment.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(x) for x in first["loc"]) or "(top level)"
        raise ConfigError(f"--config {path}: {field}: {first['msg']} (got {first.get('input')!r})") from None
