"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: the served model's tokenizer, and its chat
template, for clients that count or build tokens themselves (RL trainers read the prompt tokens a chat
request will feed the model)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from sloserve.server.bodies import openapi_body, validated_off_loop
from sloserve.server.protocol import DetokenizeRequest, TokenizeRequest
from sloserve.server.serving import OpenAIServing


def tokenize_router(serving: OpenAIServing) -> APIRouter:
    router = APIRouter()

    tokenize_body = Depends(validated_off_loop(serving, TokenizeRequest))
    detokenize_body = Depends(validated_off_loop(serving, DetokenizeRequest))

    @router.post("/tokenize", openapi_extra=openapi_body(TokenizeRequest))
    async def tokenize(body: TokenizeRequest = tokenize_body) -> dict[str, Any]:
        return await serving.off_loop(serving.tokenize, body)

    @router.post("/detokenize", openapi_extra=openapi_body(DetokenizeRequest))
    async def detokenize(body: DetokenizeRequest = detokenize_body) -> dict[str, Any]:
        return await serving.off_loop(serving.detokenize, body)

    return router
