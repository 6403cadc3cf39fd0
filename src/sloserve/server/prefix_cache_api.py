"""vLLM's ``POST /reset_prefix_cache``: the engine (each replica of a fleet) forgets its cached prefixes, so the
next requests compute their prompts afresh: a benchmark's runs start alike, and a trainer that changed the
model's weights leaves no KV of the old ones to be found.

200 with an empty body once reset. 409 while a request is served (its blocks cannot leave the cache; requests
that have ended are dropped first, so a client that has its answers finds the cache reset), as vLLM answers.
``reset_external`` is accepted (this server has no cache outside the engine); ``reset_running_requests``, which
in vLLM preempts the running requests to reset under them, is refused with a 400. Unlike vLLM, which serves
the route only with VLLM_SERVER_DEV_MODE=1, it is always served, behind ``--api-key`` when there is one (a
reset changes no answer, only how soon the next ones come).
"""

from __future__ import annotations

from fastapi import APIRouter, Query
from fastapi.responses import Response

from sloserve.engine.async_engine import AsyncLLMEngine
from sloserve.server.serving import ApiError


def prefix_cache_router(engine: AsyncLLMEngine) -> APIRouter:
    router = APIRouter()

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache(
        reset_running_requests: bool = Query(default=False), reset_external: bool = Query(default=False)
    ) -> Response:
        if reset_running_requests:
            raise ApiError(
                400,
                "reset_running_requests is not supported: the cache is reset once no request is served",
                "reset_running_requests",
            )
        if not await engine.reset_prefix_cache():
            raise ApiError(
                409,
                f"the prefix cache cannot be reset while requests hold KV ({engine.num_unfinished} unfinished): "
                "retry once they have finished",
                code="requests_running",
            )
        return Response(status_code=200)

    return router
