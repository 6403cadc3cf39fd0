"""OpenAI's Files and Batch API on ``sloserve serve --data-dir DIR``.

Routes: ``POST /v1/files`` (multipart: ``file``, ``purpose=batch``), ``GET /v1/files``,
``GET /v1/files/{id}``, ``GET /v1/files/{id}/content``, ``DELETE /v1/files/{id}``,
``POST /v1/batches``, ``GET /v1/batches`` (``after``, ``limit``), ``GET /v1/batches/{id}``,
``POST /v1/batches/{id}/cancel``. Objects, statuses and output lines are OpenAI's.

An upload is checked whole before it is stored: at most ``max_file_bytes`` (else 413) and
``max_file_lines`` lines, each a JSON object with a unique ``custom_id``, ``method`` POST, a ``url``
this server serves and a ``body`` object (else 400 naming the line). What a line's body asks for is
checked when the line runs, as the same request sent online would be: a bad body or a prompt too
long is that line's answer in the batch's error file, and the batch goes on.
"""

from __future__ import annotations

import asyncio
import codecs
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any, Literal

import pydantic_core
from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse
from pydantic import ConfigDict, field_validator

from sloserve.core.errors import ConfigError
from sloserve.server.auth import request_owner
from sloserve.server.batch_runner import BODY_MODELS, BatchRunner
from sloserve.server.batch_store import BatchStore, new_id
from sloserve.server.metrics import ServerMetrics
from sloserve.server.protocol import RequestBody
from sloserve.server.serving import ApiError, OpenAIServing

ENDPOINTS = tuple(BODY_MODELS)
MAX_CUSTOM_ID_CHARS = 512
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's metadata limits
# Bytes a multipart body may have beyond its file (boundaries, headers, the purpose field).
MULTIPART_OVERHEAD = 64 * 1024


@dataclass(frozen=True)
class BatchLimits:
    """What one upload and the engine may hold (OpenAI's limits are 200 MB and 50,000 requests)."""

    max_file_bytes: int = 200 * 1024 * 1024
    max_file_lines: int = 50_000
    max_lines_in_engine: int = 256  # batch lines admitted to the engine at once

    def check(self, max_queued_requests: int) -> None:
        """A ConfigError naming the ``sloserve serve`` option that is out of range."""
        for option, value in (
            ("--max-batch-file-mb", self.max_file_bytes / 2**20),
            ("--max-batch-lines", self.max_file_lines),
            ("--max-batch-lines-in-engine", self.max_lines_in_engine),
        ):
            if value <= 0:
                raise ConfigError(f"{option} must be > 0, got {value:g}")
        if self.max_lines_in_engine >= max_queued_requests:
            raise ConfigError(
                f"--max-batch-lines-in-engine ({self.max_lines_in_engine}) must be below "
                f"--max-queued-requests ({max_queued_requests}): online requests need room in the queue"
            )


class CreateBatch(RequestBody):
    model_config = ConfigDict(extra="ignore")
    input_file_id: str
    endpoint: Literal["/v1/completions", "/v1/chat/completions", "/v1/responses"]  # ENDPOINTS
    completion_window: Literal["24h"]  # COMPLETION_WINDOW_S
    metadata: dict[str, str] | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return value
        if len(value) > MAX_METADATA_PAIRS:
            raise ValueError(f"at most {MAX_METADATA_PAIRS} key-value pairs, got {len(value)}")
        for key, item in value.items():
            if len(key) > MAX_METADATA_KEY or len(item) > MAX_METADATA_VALUE:
                raise ValueError(
                    f"keys are at most {MAX_METADATA_KEY} characters and values {MAX_METADATA_VALUE}: {key[:80]!r}"
                )
        return value


def file_object(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": row["id"],
        "object": "file",
        "bytes": row["bytes"],
        "created_at": row["created_at"],
        "filename": row["filename"],
        "purpose": row["purpose"],
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


def batch_object(row: dict[str, Any]) -> dict[str, Any]:
    stamps = (
        "created_at",
        "in_progress_at",
        "expires_at",
        "finalizing_at",
        "completed_at",
        "failed_at",
        "expired_at",
        "cancelling_at",
        "cancelled_at",
    )
    errors = json.loads(row["errors"]) if row["errors"] else None
    return {
        "id": row["id"],
        "object": "batch",
        "endpoint": row["endpoint"],
        "input_file_id": row["input_file_id"],
        "completion_window": row["completion_window"],
        "status": row["status"],
        "output_file_id": row["output_file_id"],
        "error_file_id": row["error_file_id"],
        "errors": None if errors is None else {"object": "list", "data": errors},
        **{name: row[name] for name in stamps},
        "request_counts": {"total": row["total"], "completed": row["completed"], "failed": row["failed"]},
        "metadata": json.loads(row["metadata"]) if row["metadata"] else None,
        "usage": {
            "input_tokens": row["input_tokens"],
            "output_tokens": row["output_tokens"],
            "total_tokens": row["input_tokens"] + row["output_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        },
    }


def page(objects: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    """OpenAI's list object of the first ``limit`` of ``objects`` (one more was fetched to see if there are more)."""
    data = objects[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(objects) > limit,
    }


def check_batch_lines(upload: IO[bytes], out: IO[bytes], limits: BatchLimits) -> tuple[int, dict[str, int]]:
    """Copy ``upload`` to ``out``, checking it is a batch input file within ``limits``. Returns its
    number of requests and ``{url: first line number}``; an ApiError names the first bad line."""
    seen: dict[str, int] = {}
    urls: dict[str, int] = {}
    num_bytes = 0
    for number, raw in enumerate(upload, start=1):
        num_bytes += len(raw)
        if num_bytes > limits.max_file_bytes:
            raise ApiError(
                413, f"the file is over the limit of {limits.max_file_bytes} bytes", "file", "file_too_large"
            )
        out.write(raw)
        if not raw.strip():
            continue  # NOTE: blank lines are skipped; line numbers stay those of the file
        if len(seen) >= limits.max_file_lines:
            raise ApiError(
                400,
                f"line {number}: the file has more than {limits.max_file_lines} requests, the limit of one batch",
                "file",
                "too_many_lines",
            )
        custom_id, url = _check_line(number, raw, seen)
        seen[custom_id] = number
        urls.setdefault(url, number)
    if not seen:
        raise ApiError(400, "the file has no requests: a batch input file has one JSON request per line", "file")
    return len(seen), urls


def _parse_line(raw: bytes) -> Any:
    """One line of a batch input file, read at upload and again when the batch is made. NOTE: pydantic's
    parser, which reads the body when the line runs: no lone surrogate (as \\ud800), at most 200 levels
    deep. A UTF-8 byte order mark (Windows editors write one) is skipped, as json.loads does."""
    return pydantic_core.from_json(raw.removeprefix(codecs.BOM_UTF8))


def _check_line(number: int, raw: bytes, seen: dict[str, int]) -> tuple[str, str]:
    def bad(message: str) -> ApiError:
        return ApiError(400, f"line {number}: {message}", "file", "invalid_batch_line")

    try:
        request = _parse_line(raw)
    except ValueError as e:
        raise bad(f"not valid JSON ({e})") from None
    if not isinstance(request, dict):
        raise bad("a request is a JSON object with custom_id, method, url and body")
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID_CHARS:
        raise bad(f"custom_id must be a string of 1 to {MAX_CUSTOM_ID_CHARS} characters, got {custom_id!r:.80}")
    if custom_id in seen:
        raise bad(f"custom_id {custom_id!r} is also on line {seen[custom_id]}; custom_ids are unique within a file")
    if request.get("method") != "POST":
        raise bad(f"method must be 'POST', got {request.get('method')!r:.80}")
    url = request.get("url")
    if url not in ENDPOINTS:
        raise bad(f"url {url!r:.80} is not supported; supported: {', '.join(ENDPOINTS)}")
    if not isinstance(request.get("body"), dict):
        raise bad("body must be a JSON object (the request's body)")
    return custom_id, url


def read_batch_lines(path) -> Iterator[tuple[int, str, str]]:
    """(line number, custom_id, body JSON) of a checked batch input file."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if raw.strip():
                request = _parse_line(raw)
                yield number, request["custom_id"], json.dumps(request["body"])


def _no_file(file_id: str) -> ApiError:
    return ApiError(404, f"No such File object: {file_id}", "id", "file_not_found")


class BatchService:
    """The Files and Batches routes over ``store``, and the runner that serves the batches."""

    def __init__(
        self, store: BatchStore, serving: OpenAIServing, limits: BatchLimits, metrics: ServerMetrics | None = None
    ) -> None:
        self.store = store
        self.limits = limits
        self.runner = BatchRunner(store, serving, limits.max_lines_in_engine, metrics)

    def start(self) -> None:
        self.runner.start()

    async def stop(self) -> None:
        await self.runner.stop()

    def close(self) -> None:
        self.store.close()

    # --- files ---------------------------------------------------------------------------------
    def _store_upload(self, upload: IO[bytes], filename: str, owner: str) -> dict[str, Any]:
        file_id = new_id("file-")
        temp = self.store.temp_path(file_id)
        try:
            with open(temp, "wb") as out:
                num_lines, urls = check_batch_lines(upload, out, self.limits)
            return self.store.commit_file(file_id, filename, "batch", num_lines, urls, owner=owner)
        finally:
            temp.unlink(missing_ok=True)

    def _file(self, file_id: str, owner: str) -> dict[str, Any]:
        """``owner``'s file ``file_id``: another owner's is as unknown as one that does not exist."""
        row = self.store.get_file(file_id, owner=owner)
        if row is None:
            raise _no_file(file_id)
        return row

    def _batch(self, batch_id: str, owner: str) -> dict[str, Any]:
        row = self.store.get_batch(batch_id, owner=owner)
        if row is None:
            raise ApiError(404, f"No such Batch object: {batch_id}", "id", "batch_not_found")
        return row

    def _create_batch(self, body: CreateBatch, owner: str) -> dict[str, Any]:
        input_file = self._file(body.input_file_id, owner)
        if input_file["purpose"] != "batch":
            raise ApiError(
                400,
                f"file {body.input_file_id} has purpose {input_file['purpose']!r}; a batch's input "
                "file is uploaded with purpose 'batch'",
                "input_file_id",
            )
        for url, number in json.loads(input_file["urls"]).items():
            if url != body.endpoint:
                raise ApiError(
                    400,
                    f"line {number} of file {body.input_file_id} has url {url!r}, but the batch's "
                    f"endpoint is {body.endpoint!r}: every line must use the batch's endpoint",
                    "input_file_id",
                    "invalid_batch_line",
                )
        lines = read_batch_lines(self.store.file_path(input_file["id"]))
        return self.store.create_batch(input_file, body.endpoint, body.completion_window, body.metadata, lines, owner)

    def _cancel(self, batch_id: str, owner: str) -> dict[str, Any]:
        batch = self._batch(batch_id, owner)
        if batch["status"] in ("validating", "in_progress"):
            self.store.set_status(batch_id, "cancelling", only_from=("validating", "in_progress"))
            self.runner.wake()
        elif batch["status"] != "cancelling":
            raise ApiError(
                400,
                f"batch {batch_id} is {batch['status']}: only a validating or in-progress batch can be cancelled",
                "id",
                "batch_not_cancellable",
            )
        return self._batch(batch_id, owner)

    def router(self) -> APIRouter:
        router = APIRouter()
        limits = self.limits

        @router.post("/v1/files")
        async def create_file(request: Request) -> dict[str, Any]:
            declared = request.headers.get("content-length")
            if (
                declared is not None
                and declared.isdigit()
                and int(declared) > limits.max_file_bytes + MULTIPART_OVERHEAD
            ):
                raise ApiError(
                    413,
                    f"the upload has {declared} bytes, over the file limit of {limits.max_file_bytes}",
                    "file",
                    "file_too_large",
                )
            if not request.headers.get("content-type", "").startswith("multipart/form-data"):
                raise ApiError(
                    400, "upload the file as multipart/form-data with the fields 'file' and 'purpose'", "file"
                )
            form = await request.form(max_files=1, max_fields=8)
            try:
                purpose, upload = form.get("purpose"), form.get("file")
                if purpose != "batch":
                    raise ApiError(
                        400,
                        f"purpose {purpose!r} is not supported: this server stores files for the Batch "
                        "API (purpose 'batch')",
                        "purpose",
                    )
                if upload is None or isinstance(upload, str):
                    raise ApiError(400, "the form has no file: send it as the field 'file'", "file")
                filename = upload.filename or "upload.jsonl"
                stored = await asyncio.to_thread(self._store_upload, upload.file, filename, request_owner(request))
                return file_object(stored)
            finally:
                await form.close()

        @router.get("/v1/files")
        async def list_files(
            request: Request,
            purpose: str | None = None,
            after: str | None = None,
            limit: int = Query(default=10_000, ge=1, le=10_000),
        ) -> dict[str, Any]:
            owner = request_owner(request)
            if after is not None:
                self._file(after, owner)
            return page([file_object(r) for r in self.store.list_files(purpose, after, limit + 1, owner)], limit)

        @router.get("/v1/files/{file_id}")
        async def retrieve_file(file_id: str, request: Request) -> dict[str, Any]:
            return file_object(self._file(file_id, request_owner(request)))

        @router.get("/v1/files/{file_id}/content")
        async def file_content(file_id: str, request: Request) -> FileResponse:
            row = self._file(file_id, request_owner(request))
            return FileResponse(self.store.file_path(file_id), media_type="application/jsonl", filename=row["filename"])

        @router.delete("/v1/files/{file_id}")
        async def delete_file(file_id: str, request: Request) -> dict[str, Any]:
            if not self.store.delete_file(file_id, request_owner(request)):
                raise _no_file(file_id)
            return {"id": file_id, "object": "file", "deleted": True}

        @router.post("/v1/batches")
        async def create_batch(body: CreateBatch, request: Request) -> dict[str, Any]:
            batch = await asyncio.to_thread(self._create_batch, body, request_owner(request))
            self.runner.wake()
            return batch_object(batch)

        @router.get("/v1/batches")
        async def list_batches(
            request: Request, after: str | None = None, limit: int = Query(default=20, ge=1, le=100)
        ) -> dict[str, Any]:
            owner = request_owner(request)
            if after is not None:
                self._batch(after, owner)
            return page([batch_object(r) for r in self.store.list_batches(after, limit + 1, owner)], limit)

        @router.get("/v1/batches/{batch_id}")
        async def retrieve_batch(batch_id: str, request: Request) -> dict[str, Any]:
            return batch_object(self._batch(batch_id, request_owner(request)))

        @router.post("/v1/batches/{batch_id}/cancel")
        async def cancel_batch(batch_id: str, request: Request) -> dict[str, Any]:
            return batch_object(self._cancel(batch_id, request_owner(request)))

        return router
