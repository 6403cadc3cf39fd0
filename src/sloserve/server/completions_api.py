"""``POST /v1/completions``: OpenAI's legacy completions, streamed or not."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from sloserve.server.beam_search_api import beam_search_response
from sloserve.server.bodies import openapi_body, validated_off_loop
from sloserve.server.protocol import CompletionRequest
from sloserve.server.responses import respond
from sloserve.server.serving import OpenAIServing


def completions_router(serving: OpenAIServing) -> APIRouter:
    router = APIRouter()

    body_as_model = Depends(validated_off_loop(serving, CompletionRequest))

    @router.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
    async def completions(raw: Request, body: CompletionRequest = body_as_model) -> Response:
        if body.use_beam_search:
            return await beam_search_response(serving, body, raw)
        return await respond(serving, raw, await serving.submit_completion(body), "completion")

    return router
