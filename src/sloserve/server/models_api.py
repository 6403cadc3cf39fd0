"""``GET /v1/models`` (and ``/v1/models/{id}``): the one model this server serves; ``GET /version``:
sloserve's (vLLM's route)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

import sloserve
from sloserve.server.protocol import now_unix
from sloserve.server.serving import OpenAIServing


def models_router(serving: OpenAIServing) -> APIRouter:
    router = APIRouter()

    def model() -> dict[str, Any]:
        return {
            "id": serving.config.model_name,
            "object": "model",
            "created": now_unix(),
            "owned_by": "sloserve",
            "max_model_len": serving.engine.max_model_len,
        }

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model()]}

    @router.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str) -> dict[str, Any]:
        serving.check_model(model_id)  # NOTE: another name: a 404 (model_not_found)
        return model()

    @router.get("/version")
    async def version() -> dict[str, str]:
        return {"version": sloserve.__version__}

    return router
