"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: the served model's tokenizer, and its chat
template, for clients that count or build tokens themselves (RL trainers read the prompt tokens a chat
request will feed the model)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from sloserve.server.protocol import DetokenizeRequest, TokenizeRequest
from sloserve.server.serving import OpenAIServing


def tokenize_router(serving: OpenAIServing) -> APIRouter:
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return await serving.off_loop(serving.tokenize, body)

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return await serving.off_loop(serving.detokenize, body)

    return router
