"""API keys (``serve --api-key``): every route but ``/health`` and ``/metrics`` needs
``Authorization: Bearer KEY`` with one of the server's keys, else a 401 OpenAI error object.

Each key has an owner id, a hash of the key: the Batch API's files and batches and the stored
responses belong to the owner that created them (another key gets 404 on them and does not see them
listed). The key itself is
never stored, logged or written to the request log.

NOTE: a pure ASGI middleware, not Starlette's ``BaseHTTPMiddleware``: that one runs the route in
another task and hides the client's disconnect from it, which the server needs to abort a request
whose client went away.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable
from pathlib import Path

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from sloserve.core.errors import ConfigError
from sloserve.server.protocol import error_body

# Routes any caller may read: probes and scrapers carry no key (vLLM leaves them open too).
OPEN_PATHS = frozenset({"/health", "/metrics"})
# The environment variable that adds a key (vLLM's is VLLM_API_KEY).
API_KEY_ENV = "SLOSERVE_API_KEY"
# The owner of everything when the server has no keys.
NO_OWNER = ""


def owner_of(key: str) -> str:
    """The owner id of ``key``: a hash that names it without revealing it."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:24]


def request_owner(request) -> str:
    """The owner id of the key a request (a Starlette ``Request``) came with; ``NO_OWNER`` for every
    request when the server has no keys."""
    return getattr(request.state, "owner", NO_OWNER)


def load_api_keys(keys: Iterable[str], key_file: Path | None) -> list[str]:
    """The keys given on the command line, in ``key_file`` (one per line; blank lines and ``#``
    comments skipped) and in $SLOSERVE_API_KEY. A ConfigError names a file that cannot be read or
    holds no key, or a key that is not one word of printable ASCII (a client sends it in an HTTP
    header: no other key could ever match)."""
    found = list(keys)
    if key_file is not None:
        try:
            lines = Path(key_file).expanduser().read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise ConfigError(f"--api-key-file {key_file}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"--api-key-file {key_file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        in_file = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not in_file:  # NOTE: a key file is asked for: serving without a key is not what was meant
            raise ConfigError(f"--api-key-file {key_file} holds no key (only blank lines and # comments)")
        found += in_file
    if os.environ.get(API_KEY_ENV):
        found.append(os.environ[API_KEY_ENV])
    for i, key in enumerate(found):
        if not key or any(c.isspace() for c in key):
            raise ConfigError(f"API key {i + 1} is empty or holds a blank: a key is one word")
        if not (key.isascii() and key.isprintable()):
            raise ConfigError(f"API key {i + 1} holds a character outside printable ASCII, which no client can send")
    return list(dict.fromkeys(found))


class ApiKeyAuth:
    """ASGI middleware: a request outside ``OPEN_PATHS`` must carry one of ``keys``; the route then
    finds its owner id in ``request.state.owner``."""

    def __init__(self, app: ASGIApp, keys: Iterable[str], on_refused=None) -> None:
        self.app = app
        self._owners = [(key.encode("utf-8"), owner_of(key)) for key in keys]
        self.on_refused = on_refused  # called once per refused request (a metrics counter)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        owner = self._owner(scope)
        if owner is None:
            if self.on_refused is not None:
                self.on_refused()
            body = error_body(
                "Incorrect or missing API key: send 'Authorization: Bearer KEY' with a key this server was "
                "started with",
                "invalid_request_error",
                code="invalid_api_key",
            )
            await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        scope.setdefault("state", {})["owner"] = owner
        await self.app(scope, receive, send)

    def _owner(self, scope: Scope) -> str | None:
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        token = token.strip()
        owner = None
        for key, key_owner in self._owners:  # NOTE: every key compared, in constant time each
            if hmac.compare_digest(key, token):
                owner = key_owner
        return owner
