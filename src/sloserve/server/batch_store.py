"""The Batch API's durable state: files on disk, their metadata, batches and the state of every batch
line in one SQLite database (WAL mode) under the server's ``--data-dir``.

Layout::

    DATA_DIR/sloserve.db        files, batches, lines (the tables below)
    DATA_DIR/files/FILE_ID      each file's bytes (uploads and the output/error files of batches)
    DATA_DIR/lock               held (flock) by the one server using this directory
    DATA_DIR/responses.db       the Responses API's stored responses (response_store.py)

A line goes ``pending`` -> ``running`` (sent to the engine; ``attempts`` + 1) -> ``done`` or
``failed`` (its output line stored in ``result``). A line that was running when the server stopped
or crashed goes back to ``pending`` and runs again; a finished one never does.

NOTE (exactly once): a line's result is stored by one UPDATE guarded by ``status = 'running'``, in
the same transaction as the batch's counts, so a line is answered at most once; an output file is
built from the stored results (one per line, in line order) and written atomically (temporary file,
fsync, rename) before the transaction that marks its batch finished, so after a crash at any point
the batch is finished again from the same rows.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from sloserve.core.errors import ConfigError

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,               -- creation order (listing)
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,              -- batch (uploads), batch_output (outputs and errors)
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    num_lines INTEGER NOT NULL,
    urls TEXT NOT NULL,                 -- JSON {url: first line number}, for a batch input file
    owner TEXT NOT NULL DEFAULT ''      -- the API key's owner id that created it (auth.owner_of); '' without keys
);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,               -- creation order: lines of older batches run first
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER,
    expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
    output_file_id TEXT, error_file_id TEXT,
    errors TEXT,                        -- JSON list of OpenAI's batch errors
    metadata TEXT,                      -- JSON object
    total INTEGER NOT NULL,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0,   -- usage of the answered lines
    output_tokens INTEGER NOT NULL DEFAULT 0,
    owner TEXT NOT NULL DEFAULT ''      -- as files.owner; its output and error files have it too
);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL,
    line_no INTEGER NOT NULL,           -- 1-based, as in the input file
    custom_id TEXT NOT NULL,
    body TEXT NOT NULL,                 -- the request body, JSON
    status TEXT NOT NULL,               -- pending, running, done, failed
    attempts INTEGER NOT NULL DEFAULT 0,
    result TEXT,                        -- the output (or error) file's line, JSON
    PRIMARY KEY (batch_id, line_no)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS lines_by_status ON lines (batch_id, status, line_no);
"""

# Columns added since the first schema: (table, column, definition), added to an older database.
ADDED_COLUMNS = [
    ("files", "owner", "TEXT NOT NULL DEFAULT ''"),
    ("batches", "owner", "TEXT NOT NULL DEFAULT ''"),
]
# Batch statuses (OpenAI's) after which nothing changes.
FINAL = ("completed", "failed", "expired", "cancelled")
COMPLETION_WINDOW_S = {"24h": 24 * 3600}


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class Line:
    batch_id: str
    line_no: int
    custom_id: str
    body: str


class DataDirInUseError(ConfigError):
    pass


class BatchStore:
    """The database and files of one data directory. Open it once per server (it takes the
    directory's lock); each thread gets its own connection."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = Path(data_dir).expanduser()
        try:
            self.files_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--data-dir {self.data_dir}: {e.strerror}") from None
        self._lock_file = open(self.data_dir / "lock", "a+")  # noqa: SIM115 - held for the store's life
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise DataDirInUseError(
                f"--data-dir {self.data_dir} is in use by another sloserve server; give each server its own"
            ) from None
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._connections_lock = threading.Lock()
        self.db.executescript(SCHEMA)  # NOTE: executescript commits by itself: not in a transaction()
        for table, column, definition in ADDED_COLUMNS:  # a data dir of an older version
            if column not in {row["name"] for row in self.db.execute(f"PRAGMA table_info({table})")}:
                self.db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")
        self._remove_stale_files()

    @property
    def files_dir(self) -> Path:
        return self.data_dir / "files"

    @property
    def db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(
                self.data_dir / "sloserve.db", timeout=30, isolation_level=None, check_same_thread=False
            )
            db.row_factory = sqlite3.Row
            db.execute("PRAGMA journal_mode=WAL")
            # NOTE: NORMAL in WAL mode: a commit survives the process being killed (the WAL is in the
            # OS's page cache); only a power loss may lose the last commits, never corrupt the file.
            db.execute("PRAGMA synchronous=NORMAL")
            self._local.db = db
            with self._connections_lock:
                self._connections.append(db)
        return db

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """``with store.transaction() as db:`` one write transaction, rolled back on an exception."""
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def close(self) -> None:
        with self._connections_lock:
            for db in self._connections:
                db.close()
            self._connections.clear()
        self._local = threading.local()
        self._lock_file.close()  # releases the lock

    def _remove_stale_files(self) -> None:
        """Temporary files of writes a crash interrupted, and output files whose batch never
        committed them (the batch is finished again, into new files)."""
        known = {row["id"] for row in self.db.execute("SELECT id FROM files")}
        for path in self.files_dir.iterdir():
            if path.name not in known:
                path.unlink(missing_ok=True)

    # --- files ---------------------------------------------------------------------------------
    def temp_path(self, file_id: str) -> Path:
        return self.files_dir / f".tmp-{file_id}"

    def file_path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def commit_file(
        self,
        file_id: str,
        filename: str,
        purpose: str,
        num_lines: int,
        urls: dict[str, int],
        db: sqlite3.Connection | None = None,
        owner: str = "",
    ) -> dict[str, Any]:
        """Make the written temporary file ``file_id`` durable and record it as ``owner``'s (in ``db``'s
        open transaction when given). Returns the file object."""
        path = self.file_path(file_id)
        _fsync_and_rename(self.temp_path(file_id), path)
        row = (file_id, filename, purpose, path.stat().st_size, int(time.time()), num_lines, json.dumps(urls), owner)
        insert = (
            "INSERT OR REPLACE INTO files (id, seq, filename, purpose, bytes, created_at, num_lines, urls, owner) "
            "VALUES (?, (SELECT COALESCE(MAX(seq), 0) + 1 FROM files), ?, ?, ?, ?, ?, ?, ?)"
        )
        if db is None:
            with self.transaction() as own:
                own.execute(insert, row)
        else:
            db.execute(insert, row)
        return self.get_file(file_id, db)

    def get_file(
        self, file_id: str, db: sqlite3.Connection | None = None, owner: str | None = None
    ) -> dict[str, Any] | None:
        """The file ``file_id``; None when there is none, or it is not ``owner``'s (None: anyone's)."""
        row = (db or self.db).execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
        return None if row is None or owner not in (None, row["owner"]) else dict(row)

    def list_files(self, purpose: str | None, after: str | None, limit: int, owner: str) -> list[dict[str, Any]]:
        """``owner``'s files, newest first, after the file ``after`` (a cursor), at most ``limit``."""
        query, args = "SELECT * FROM files WHERE owner = ?", [owner]
        if purpose is not None:
            query, args = query + " AND purpose = ?", [*args, purpose]
        if after is not None:
            query, args = query + " AND seq < (SELECT seq FROM files WHERE id = ?)", [*args, after]
        return [dict(r) for r in self.db.execute(query + " ORDER BY seq DESC LIMIT ?", (*args, limit))]

    def delete_file(self, file_id: str, owner: str) -> bool:
        """Delete ``owner``'s file ``file_id``; False when it has none of that id."""
        with self.transaction() as db:
            deleted = db.execute("DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner)).rowcount == 1
        if deleted:
            self.file_path(file_id).unlink(missing_ok=True)
        return deleted

    # --- batches -------------------------------------------------------------------------------
    def create_batch(
        self,
        input_file: dict[str, Any],
        endpoint: str,
        completion_window: str,
        metadata: dict[str, str] | None,
        lines: Iterable[tuple[int, str, str]],
        owner: str = "",
    ) -> dict[str, Any]:
        """``owner``'s batch in ``validating`` with its ``lines`` ((line number, custom_id, body JSON)), in
        one transaction: a batch never exists without all its lines."""
        batch_id, now = new_id("batch_"), int(time.time())
        with self.transaction() as db:
            db.executemany(
                "INSERT INTO lines (batch_id, line_no, custom_id, body, status) VALUES (?, ?, ?, ?, 'pending')",
                ((batch_id, n, custom_id, body) for n, custom_id, body in lines),
            )
            total = db.execute("SELECT COUNT(*) FROM lines WHERE batch_id = ?", (batch_id,)).fetchone()[0]
            db.execute(
                "INSERT INTO batches (id, seq, endpoint, input_file_id, completion_window, status, created_at, expires_at, "
                "metadata, total, owner) "
                "VALUES (?, (SELECT COALESCE(MAX(seq), 0) + 1 FROM batches), ?, ?, ?, 'validating', ?, ?, ?, ?, ?)",
                (
                    batch_id,
                    endpoint,
                    input_file["id"],
                    completion_window,
                    now,
                    now + COMPLETION_WINDOW_S[completion_window],
                    json.dumps(metadata) if metadata is not None else None,
                    total,
                    owner,
                ),
            )
        return self.get_batch(batch_id)

    def get_batch(
        self, batch_id: str, db: sqlite3.Connection | None = None, owner: str | None = None
    ) -> dict[str, Any] | None:
        """The batch ``batch_id``; None when there is none, or it is not ``owner``'s (None: anyone's)."""
        row = (db or self.db).execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return None if row is None or owner not in (None, row["owner"]) else dict(row)

    def list_batches(self, after: str | None, limit: int, owner: str) -> list[dict[str, Any]]:
        """``owner``'s batches, newest first, after the batch ``after`` (a cursor), at most ``limit``."""
        query, args = "SELECT * FROM batches WHERE owner = ?", [owner]
        if after is not None:
            query, args = query + " AND seq < (SELECT seq FROM batches WHERE id = ?)", [*args, after]
        return [dict(r) for r in self.db.execute(query + " ORDER BY seq DESC LIMIT ?", (*args, limit))]

    def batches_in(self, *statuses: str) -> list[dict[str, Any]]:
        marks = ",".join("?" * len(statuses))
        return [
            dict(r) for r in self.db.execute(f"SELECT * FROM batches WHERE status IN ({marks}) ORDER BY seq", statuses)
        ]

    def set_status(self, batch_id: str, status: str, *, only_from: tuple[str, ...]) -> bool:
        """Move a batch to ``status`` (stamping ``<status>_at``) if it is in one of ``only_from``."""
        with self.transaction() as db:
            return _move_batch(db, batch_id, status, only_from, {})

    # --- lines ---------------------------------------------------------------------------------
    def requeue_running(self) -> int:
        """At start: lines a stopped or crashed server had sent to its engine run again."""
        with self.transaction() as db:
            return db.execute("UPDATE lines SET status = 'pending' WHERE status = 'running'").rowcount

    def start_lines(self, batch_id: str, limit: int) -> list[Line]:
        """Up to ``limit`` pending lines of ``batch_id``, in order, marked running."""
        with self.transaction() as db:
            rows = db.execute(
                "SELECT line_no, custom_id, body FROM lines WHERE batch_id = ? AND status = 'pending' "
                "ORDER BY line_no LIMIT ?",
                (batch_id, limit),
            ).fetchall()
            db.executemany(
                "UPDATE lines SET status = 'running', attempts = attempts + 1 WHERE batch_id = ? AND line_no = ?",
                ((batch_id, r["line_no"]) for r in rows),
            )
        return [Line(batch_id, r["line_no"], r["custom_id"], r["body"]) for r in rows]

    def finish_line(
        self, line: Line, result: dict[str, Any], failed: bool, input_tokens: int = 0, output_tokens: int = 0
    ) -> bool:
        """Store ``line``'s output line (once: False if it was not running) and count it and its tokens."""
        with self.transaction() as db:
            cursor = db.execute(
                "UPDATE lines SET status = ?, result = ? WHERE batch_id = ? AND line_no = ? AND status = 'running'",
                ("failed" if failed else "done", json.dumps(result), line.batch_id, line.line_no),
            )
            if cursor.rowcount != 1:
                return False
            column = "failed" if failed else "completed"
            db.execute(
                f"UPDATE batches SET {column} = {column} + 1, input_tokens = input_tokens + ?, "
                "output_tokens = output_tokens + ? WHERE id = ?",
                (input_tokens, output_tokens, line.batch_id),
            )
        return True

    def requeue_line(self, line: Line) -> None:
        """``line`` did not finish (the server is stopping, its batch was cancelled): not answered."""
        with self.transaction() as db:
            db.execute(
                "UPDATE lines SET status = 'pending' WHERE batch_id = ? AND line_no = ? AND status = 'running'",
                (line.batch_id, line.line_no),
            )

    def count_lines(self, batch_id: str, *statuses: str) -> int:
        marks = ",".join("?" * len(statuses))
        return self.db.execute(
            f"SELECT COUNT(*) FROM lines WHERE batch_id = ? AND status IN ({marks})", (batch_id, *statuses)
        ).fetchone()[0]

    def fail_unanswered(self, batch_id: str, make_result) -> None:
        """Every pending line of ``batch_id`` gets ``make_result(custom_id)`` as its error (an expired batch)."""
        with self.transaction() as db:
            rows = db.execute(
                "SELECT line_no, custom_id FROM lines WHERE batch_id = ? AND status = 'pending'", (batch_id,)
            ).fetchall()
            db.executemany(
                "UPDATE lines SET status = 'failed', result = ? WHERE batch_id = ? AND line_no = ?",
                ((json.dumps(make_result(r["custom_id"])), batch_id, r["line_no"]) for r in rows),
            )
            db.execute("UPDATE batches SET failed = failed + ? WHERE id = ?", (len(rows), batch_id))

    def results(self, batch_id: str, status: str) -> Iterator[str]:
        """The stored output lines of ``batch_id``'s lines in ``status`` (done or failed), in line order."""
        db = self.db
        for (result,) in db.execute(
            "SELECT result FROM lines WHERE batch_id = ? AND status = ? ORDER BY line_no", (batch_id, status)
        ):
            yield result

    def finish_batch(self, batch_id: str, status: str, only_from: tuple[str, ...]) -> bool:
        """Write the output file (answered lines) and the error file (failed lines) of ``batch_id``,
        each only when it has lines, then move the batch to ``status`` (completed, cancelled or
        expired) with their ids, if it is still in one of ``only_from``."""
        written: dict[str, tuple[str, int]] = {}
        for line_status, column in (("done", "output_file_id"), ("failed", "error_file_id")):
            if self.count_lines(batch_id, line_status) == 0:
                continue
            file_id = new_id("file-")
            with open(self.temp_path(file_id), "w", encoding="utf-8") as out:
                num_lines = write_lines(out, self.results(batch_id, line_status))
            written[column] = (file_id, num_lines)
        with self.transaction() as db:
            status_now, owner = db.execute("SELECT status, owner FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if status_now not in only_from:
                for file_id, _ in written.values():
                    self.temp_path(file_id).unlink(missing_ok=True)
                return False
            for column, (file_id, num_lines) in written.items():
                kind = "output" if column == "output_file_id" else "error"
                self.commit_file(file_id, f"{batch_id}_{kind}.jsonl", "batch_output", num_lines, {}, db, owner)
            return _move_batch(
                db, batch_id, status, only_from, {column: file_id for column, (file_id, _) in written.items()}
            )


def _move_batch(
    db: sqlite3.Connection, batch_id: str, status: str, only_from: tuple[str, ...], fields: dict[str, Any]
) -> bool:
    """In ``db``'s transaction: ``batch_id`` to ``status``, stamping ``<status>_at`` and setting
    ``fields``, if it is in one of ``only_from``."""
    fields = {f"{status}_at": int(time.time()), **fields}
    assignments = ", ".join(f"{name} = ?" for name in fields)
    marks = ",".join("?" * len(only_from))
    cursor = db.execute(
        f"UPDATE batches SET status = ?, {assignments} WHERE id = ? AND status IN ({marks})",
        (status, *fields.values(), batch_id, *only_from),
    )
    return cursor.rowcount == 1


def _fsync_and_rename(temp: Path, final: Path) -> None:
    with open(temp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(temp, final)
    directory = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def write_lines(out: IO[str], lines: Iterable[str]) -> int:
    count = 0
    for line in lines:
        out.write(line)
        out.write("\n")
        count += 1
    return count
