"""The Batch API's SQLite store under random interleavings of line starts, answers, requeues and
crashes (the store dropped without closing, as a SIGKILL leaves it, then opened again): every
custom_id ends in the output exactly once, and a line answered before a crash is never run again."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sloserve.server.batch_store import BatchStore, DataDirInUseError

NUM_LINES = 12


def _open_batch(data_dir: Path) -> tuple[BatchStore, str]:
    store = BatchStore(data_dir)
    file_row = {"id": "file-input"}
    lines = [(n, f"id-{n}", json.dumps({"n": n})) for n in range(1, NUM_LINES + 1)]
    batch = store.create_batch(file_row, "/v1/completions", "24h", None, lines)
    store.set_status(batch["id"], "in_progress", only_from=("validating",))
    return store, batch["id"]


def _crash(store: BatchStore, data_dir: Path) -> BatchStore:
    """Drop the store as a killed process would (its connections and lock go with it) and reopen."""
    store.close()  # NOTE: closing a connection commits nothing: an open transaction would roll back
    (data_dir / "files" / ".tmp-file-halfwritten").write_text("partial")  # a write the crash cut off
    (data_dir / "files" / "file-never-committed").write_text("orphan")
    reopened = BatchStore(data_dir)
    reopened.requeue_running()
    return reopened


operations = st.lists(
    st.one_of(
        st.tuples(st.just("start"), st.integers(1, 5)),
        st.tuples(st.just("answer"), st.integers(0, 20)),
        st.tuples(st.just("requeue"), st.integers(0, 20)),
        st.tuples(st.just("crash"), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(operations)
def test_every_line_is_answered_exactly_once_across_crashes(ops):
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp)
        store, batch_id = _open_batch(data_dir)
        running, answered, runs = [], {}, {}
        for op, arg in ops:
            if op == "start":
                for line in store.start_lines(batch_id, arg):
                    assert line.custom_id not in answered, "an answered line was started again"
                    running.append(line)
                    runs[line.custom_id] = runs.get(line.custom_id, 0) + 1
            elif op in ("answer", "requeue") and running:
                line = running.pop(arg % len(running))
                if op == "answer":
                    assert store.finish_line(line, {"custom_id": line.custom_id, "run": runs[line.custom_id]}, False)
                    answered[line.custom_id] = runs[line.custom_id]
                else:
                    store.requeue_line(line)
            elif op == "crash":
                store = _crash(store, data_dir)
                for line in running:  # pending again: an answer for it now is refused
                    assert not store.finish_line(line, {"custom_id": line.custom_id}, False)
                running = []
        for line in running:
            assert store.finish_line(line, {"custom_id": line.custom_id, "run": runs[line.custom_id]}, False)
            answered[line.custom_id] = runs[line.custom_id]
        while store.count_lines(batch_id, "pending"):
            for line in store.start_lines(batch_id, 4):
                assert store.finish_line(line, {"custom_id": line.custom_id}, False)
                assert not store.finish_line(line, {"custom_id": line.custom_id}, False)  # never twice
        assert store.count_lines(batch_id, "running") == 0
        store.set_status(batch_id, "finalizing", only_from=("in_progress",))
        assert store.finish_batch(batch_id, "completed", ("finalizing",))
        batch = store.get_batch(batch_id)
        assert (batch["status"], batch["completed"], batch["failed"]) == ("completed", NUM_LINES, 0)
        output = [json.loads(x) for x in store.file_path(batch["output_file_id"]).read_text().splitlines()]
        assert [o["custom_id"] for o in output] == [f"id-{n}" for n in range(1, NUM_LINES + 1)]
        for out in output:  # the answer kept is the first one given
            if out["custom_id"] in answered:
                assert out["run"] == answered[out["custom_id"]]
        assert {p.name for p in store.files_dir.iterdir()} == {batch["output_file_id"]}
        store.close()


def test_a_finished_batch_is_not_finished_again(tmp_path):
    store, batch_id = _open_batch(tmp_path)
    for line in store.start_lines(batch_id, NUM_LINES):
        store.finish_line(line, {"custom_id": line.custom_id}, failed=line.line_no % 3 == 0)
    store.set_status(batch_id, "finalizing", only_from=("in_progress",))
    assert store.finish_batch(batch_id, "completed", ("finalizing",))
    first = store.get_batch(batch_id)
    assert not store.finish_batch(batch_id, "completed", ("finalizing",))
    assert store.get_batch(batch_id) == first
    errors = store.file_path(first["error_file_id"]).read_text().splitlines()
    assert len(errors) == first["failed"] == NUM_LINES // 3
    assert sorted(p.name for p in store.files_dir.iterdir()) == sorted(
        [first["output_file_id"], first["error_file_id"]]
    )
    store.close()


def test_one_data_dir_one_server(tmp_path):
    store = BatchStore(tmp_path)
    with pytest.raises(DataDirInUseError, match="in use by another sloserve server"):
        BatchStore(tmp_path)
    store.close()
    BatchStore(tmp_path).close()  # free again once closed
