"""``GET /health`` (503 with an error object once the engine failed or while the server drains) and
``GET /metrics`` (Prometheus: sloserve's families, and vLLM's names for them, vllm_metrics.py)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from sloserve.engine.async_engine import AsyncLLMEngine
from sloserve.server.metrics import ServerMetrics
from sloserve.server.protocol import error_body
from sloserve.server.responses import json_error
from sloserve.server.serving import ErrorResponse


def metrics_router(engine: AsyncLLMEngine, metrics: ServerMetrics) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        if engine.error is not None:
            return json_error(
                ErrorResponse(
                    503, error_body(f"the engine failed: {engine.error}", "service_unavailable", code="engine_failed")
                )
            )
        if engine.draining:
            return json_error(
                ErrorResponse(
                    503, error_body("the server is shutting down", "service_unavailable", code="shutting_down")
                )
            )
        return JSONResponse({"status": "ok"})

    @router.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return router
