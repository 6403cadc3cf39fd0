"""``GET /v1/models``: the one model this server serves."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from sloserve.server.protocol import now_unix
from sloserve.server.serving import OpenAIServing


def models_router(serving: OpenAIServing) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        model = {
            "id": serving.config.model_name,
            "object": "model",
            "created": now_unix(),
            "owned_by": "sloserve",
            "max_model_len": serving.engine.max_model_len,
        }
        return {"object": "list", "data": [model]}

    return router
