"""``POST /v1/chat/completions``: chat messages through the model's chat template, streamed or not."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from sloserve.server.beam_search_api import beam_search_response
from sloserve.server.protocol import ChatCompletionRequest
from sloserve.server.responses import respond
from sloserve.server.serving import OpenAIServing


def chat_router(serving: OpenAIServing) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        if body.use_beam_search:
            return await beam_search_response(serving, body, raw)
        return await respond(serving, raw, await serving.submit_chat(body), "chat")

    return router
