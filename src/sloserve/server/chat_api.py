"""``POST /v1/chat/completions``: chat messages through the model's chat template, streamed or not."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from sloserve.server.beam_search_api import beam_search_response
from sloserve.server.bodies import openapi_body, validated_off_loop
from sloserve.server.protocol import ChatCompletionRequest
from sloserve.server.responses import respond
from sloserve.server.serving import OpenAIServing


def chat_router(serving: OpenAIServing) -> APIRouter:
    router = APIRouter()

    body_as_model = Depends(validated_off_loop(serving, ChatCompletionRequest))

    @router.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))
    async def chat_completions(raw: Request, body: ChatCompletionRequest = body_as_model) -> Response:
        if body.use_beam_search:
            return await beam_search_response(serving, body, raw)
        return await respond(serving, raw, await serving.submit_chat(body), "chat")

    return router
