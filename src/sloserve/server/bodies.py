"""Request bodies validated beside the event loop.

FastAPI validates a route's body model on the event loop, before the route runs: a body of 200,000 chat
messages (8.8 MB) held every other request for 1.4 s there (its validators run per message). The routes
that take prompts or tokens get their body as JSON instead (decoded by FastAPI, with Python's C decoder:
0.07 s for those 8.8 MB) and validate it in the tokenizer threads (``OpenAIServing.off_loop``), where
the loop keeps serving; a body the model refuses is the same 400 as before.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar

from fastapi import Body, FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from sloserve.server.serving import OpenAIServing

M = TypeVar("M", bound=BaseModel)
COMPONENT_REF = "#/components/schemas/{model}"


def validated_off_loop(serving: OpenAIServing, model: type[M]) -> Callable[..., Awaitable[M]]:
    """A FastAPI dependency: the request's JSON body (an object) as ``model``, validated in a tokenizer
    thread; the route's ``openapi_extra`` is ``openapi_body(model)``, to document it.

    NOTE: a route takes it as a parameter's default, ``body: Model = Depends(...)``: FastAPI evaluates
    an annotation (``Annotated[Model, Depends(...)]``, a string under ``from __future__ import
    annotations``) in the route's module, where ``serving`` is not."""

    async def body_as_model(payload: Annotated[dict[str, Any], Body()]) -> M:
        try:
            return await serving.off_loop(model.model_validate, payload)
        except ValidationError as e:  # NOTE: as FastAPI raises it, the errors' places in the body
            raise RequestValidationError([{**error, "loc": ("body", *error["loc"])} for error in e.errors()],
                                         body=payload) from None  # fmt: skip

    return body_as_model


def openapi_body(model: type[BaseModel]) -> dict[str, Any]:
    """A route's ``openapi_extra``: its request body is ``model`` (validated by ``validated_off_loop``),
    whose nested models are in the document's components (``add_body_schemas``)."""
    schema = model.model_json_schema(ref_template=COMPONENT_REF)
    schema.pop("$defs", None)
    return {"requestBody": {"content": {"application/json": {"schema": schema}}, "required": True}}


def add_body_schemas(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Put the nested models of ``models`` (the bodies ``openapi_body`` describes) in the components of
    ``app``'s OpenAPI document, where their references point."""
    schemas: dict[str, Any] = {}
    for model in models:
        schemas.update(model.model_json_schema(ref_template=COMPONENT_REF).get("$defs", {}))

    def openapi() -> dict[str, Any]:
        document = FastAPI.openapi(app)  # NOTE: made once and kept by FastAPI; updated in place
        document.setdefault("components", {}).setdefault("schemas", {}).update(schemas)
        return document

    app.openapi = openapi  # type: ignore[method-assign]
