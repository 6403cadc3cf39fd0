"""The Responses API's stored responses (``store``, ``previous_response_id``, ``GET`` and ``DELETE
/v1/responses/{id}``): one SQLite table, in ``DATA_DIR/responses.db`` under ``--data-dir`` (durable,
kept until deleted) or in memory (the newest ``MAX_IN_MEMORY`` responses).

A response is stored with its own input items and the id of the response it continued, so that a
conversation of n turns is stored in O(n): ``conversation`` walks the chain back and returns every
turn's input and output items, oldest first, as the next request's input begins. Each response is
its API key's own (``auth.owner_of``): another key finds nothing.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,               -- storing order (the oldest is dropped first in memory)
    owner TEXT NOT NULL,                -- the API key's owner id; '' without keys
    previous_response_id TEXT,          -- the response this one continued
    input TEXT NOT NULL,                -- JSON list: this request's input items
    response TEXT NOT NULL              -- JSON: the response object
);
CREATE INDEX IF NOT EXISTS responses_by_seq ON responses (seq);  -- MAX(seq) at each store, the eviction
"""
# Responses kept without --data-dir (a server that cannot keep them forever keeps the newest).
MAX_IN_MEMORY = 1000


class PreviousResponseNotFound(LookupError):
    """A response of a chain is not stored (never was, deleted, or dropped from memory)."""

    def __init__(self, response_id: str) -> None:
        super().__init__(response_id)
        self.response_id = response_id


class ResponseStore:
    """Stored responses, in ``data_dir`` (None: in memory). Thread-safe: one connection behind a lock
    (callers on the event loop go through ``asyncio.to_thread``)."""

    def __init__(self, data_dir: Path | None = None) -> None:
        self.durable = data_dir is not None
        path = ":memory:" if data_dir is None else str(Path(data_dir).expanduser() / "responses.db")
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        if self.durable:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")  # as the batch store's: a killed process loses nothing
        self._db.executescript(SCHEMA)
        self._lock = threading.Lock()

    def put(
        self, response: dict[str, Any], input_items: list[dict[str, Any]], previous_response_id: str | None, owner: str
    ) -> None:
        """Store ``response`` (its ``id``), the input items of its request, and the response it continued."""
        with self._lock:
            self._db.execute(
                "INSERT INTO responses VALUES (?, (SELECT COALESCE(MAX(seq), 0) + 1 FROM responses), ?, ?, ?, ?)",
                (response["id"], owner, previous_response_id, json.dumps(input_items), json.dumps(response)),
            )
            if not self.durable:
                self._db.execute("DELETE FROM responses WHERE seq <= (SELECT MAX(seq) FROM responses) - ?",
                                 (MAX_IN_MEMORY,))  # fmt: skip

    def get(self, response_id: str, owner: str) -> dict[str, Any] | None:
        """The response object (None: not stored, or another key's)."""
        row = self._row(response_id, owner)
        return None if row is None else json.loads(row[2])

    def input_items(self, response_id: str, owner: str) -> list[dict[str, Any]] | None:
        """The input items of the response's own request (None: not stored, or another key's)."""
        row = self._row(response_id, owner)
        return None if row is None else json.loads(row[1])

    def conversation(self, response_id: str, owner: str) -> list[dict[str, Any]]:
        """The input and output items of every turn up to ``response_id``, oldest first;
        PreviousResponseNotFound naming the first response of the chain that is not stored."""
        turns: list[list[dict[str, Any]]] = []
        at: str | None = response_id
        while at is not None:
            row = self._row(at, owner)
            if row is None:
                raise PreviousResponseNotFound(at)
            previous, input_items, response = row[0], json.loads(row[1]), json.loads(row[2])
            turns.append(input_items + response["output"])
            at = previous
        return [item for turn in reversed(turns) for item in turn]

    def delete(self, response_id: str, owner: str) -> bool:
        with self._lock:
            deleted = self._db.execute("DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner))
            return deleted.rowcount > 0

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _row(self, response_id: str, owner: str) -> tuple[str | None, str, str] | None:
        with self._lock:
            return self._db.execute(
                "SELECT previous_response_id, input, response FROM responses WHERE id = ? AND owner = ?",
                (response_id, owner),
            ).fetchone()
