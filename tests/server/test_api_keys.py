"""API keys: 401 without one, files and batches visible to their own key only, keys never written
down; the served model's default name and the warning of an open server."""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("multipart")

from test_batch_api import completion_line, read_jsonl, upload, wait_final  # noqa: E402

from served_model import MODEL, Server  # noqa: E402
from sloserve.bench.client import free_loopback_port  # noqa: E402
from sloserve.core.errors import ConfigError  # noqa: E402
from sloserve.server.auth import load_api_keys  # noqa: E402
from sloserve.server.batch_store import SCHEMA, BatchStore  # noqa: E402

KEYS = ["sk-alice-0123456789", "sk-bob-9876543210"]


@pytest.fixture(scope="module")
def server(chat_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("keys")
    s = Server(chat_model_dir, data_dir=root / "data", request_log=root / "requests.jsonl", api_keys=KEYS)
    s.log_path = root / "requests.jsonl"
    yield s
    s.stop()


def client(server, key: str | None):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key or "wrong", max_retries=0)


def test_every_route_but_health_and_metrics_needs_a_key(server):
    for header in (None, f"Bearer {KEYS[0]}x", f"Basic {KEYS[0]}", "Bearer"):
        headers = {"Authorization": header} if header is not None else {}
        for method, path in (
            ("GET", "/v1/models"),
            ("POST", "/v1/completions"),
            ("GET", "/v1/files"),
            ("POST", "/tokenize"),
            ("POST", "/v1/responses"),
            ("GET", "/version"),
        ):
            response = httpx.request(method, server.url + path, headers=headers, json={})
            assert response.status_code == 401, (header, path)
            assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        client(server, None).completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    for key in KEYS:
        assert client(server, key).completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.total_tokens > 0
    assert server.metric("sloserve_requests_rejected_total", reason="unauthorized") >= 10


def test_bench_serve_sends_its_key_from_the_flag_or_openai_api_key(server, monkeypatch):
    """bench-serve against a server with keys: refused in one line saying how to give the key without one;
    with ``--api-key`` or $OPENAI_API_KEY (as vLLM's benchmark reads it), every request and the prefix cache
    reset go through."""
    from click.testing import CliRunner

    from sloserve.cli import main

    args = ["bench-serve", "--base-url", server.url + "/v1", "--model", MODEL, "--trace", "sharegpt", "--rate", "50"]
    args += ["--num-requests", "4", "--max-tokens", "2", "--vocab-size", "64", "--reset-prefix-cache", "--json"]
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    refused = CliRunner().invoke(main, args)
    assert (
        refused.exit_code == 2
        and "401" in refused.output
        and "give it with --api-key or OPENAI_API_KEY" in refused.output
    )
    for extra, env in (([f"--api-key={KEYS[1]}"], {}), ([], {"OPENAI_API_KEY": KEYS[0]})):
        result = CliRunner().invoke(main, args + extra, env=env)
        assert result.exit_code == 0, result.output
        assert json.loads(result.output)["completed"] == 4 and KEYS[0] not in result.output


def test_files_and_batches_belong_to_the_key_that_made_them(server):
    alice, bob = client(server, KEYS[0]), client(server, KEYS[1])
    file = upload(alice, [completion_line(f"q-{i}", "Hello world", 3) for i in range(3)])
    batch = alice.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
    batch = wait_final(alice, batch.id)
    assert batch.status == "completed"
    assert len(read_jsonl(alice, batch.output_file_id)) == 3
    for file_id in (file.id, batch.output_file_id):
        for call in (bob.files.retrieve, bob.files.content, bob.files.delete):
            with pytest.raises(openai.NotFoundError):
                call(file_id)
    with pytest.raises(openai.NotFoundError):
        bob.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        bob.batches.cancel(batch.id)
    with pytest.raises(openai.NotFoundError):  # nor can another's file start a batch
        bob.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
    assert [f.id for f in bob.files.list()] == [] and [b.id for b in bob.batches.list()] == []
    assert {f.id for f in alice.files.list()} == {file.id, batch.output_file_id}
    assert [b.id for b in alice.batches.list()] == [batch.id]
    assert alice.files.delete(file.id).deleted


def test_stored_responses_belong_to_the_key_that_made_them_and_live_in_the_data_dir(server):
    alice, bob = client(server, KEYS[0]), client(server, KEYS[1])
    response = alice.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    assert alice.responses.retrieve(response.id).id == response.id
    for call in (bob.responses.retrieve, bob.responses.delete, bob.responses.input_items.list):
        with pytest.raises(openai.NotFoundError):
            call(response.id)
    with pytest.raises(openai.BadRequestError, match="Previous response with id"):
        bob.responses.create(model=MODEL, input="more", max_output_tokens=2, previous_response_id=response.id)
    assert alice.responses.create(model=MODEL, input="more", max_output_tokens=2, previous_response_id=response.id)
    with sqlite3.connect(server.app.state.batches.store.data_dir / "responses.db") as db:
        assert db.execute("SELECT COUNT(*) FROM responses WHERE id = ?", (response.id,)).fetchone() == (1,)


def test_keys_are_never_written_down(server):
    client(server, KEYS[1]).completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    stored = server.log_path.read_text() + b"".join(
        p.read_bytes() for p in (server.app.state.batches.store.data_dir).rglob("*") if p.is_file()
    ).decode("utf-8", "replace")
    assert server.log_path.read_text() and not any(key in stored for key in KEYS)


def test_keys_come_from_flags_a_file_and_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "keys.txt"
    path.write_text("# team keys\nsk-one\n\n  sk-two  \nsk-one\n")
    monkeypatch.setenv("SLOSERVE_API_KEY", "sk-env")
    assert load_api_keys(["sk-flag"], path) == ["sk-flag", "sk-one", "sk-two", "sk-env"]
    with pytest.raises(ConfigError, match="--api-key-file .*missing.txt"):
        load_api_keys([], tmp_path / "missing.txt")
    with pytest.raises(ConfigError, match="API key 1 is empty or holds a blank"):
        load_api_keys(["two words"], None)
    # each once served: with no key at all (an empty file), or with one no client could send
    path.write_text("# the keys go here\n\n")
    with pytest.raises(
        ConfigError, match=r"--api-key-file .*keys.txt holds no key \(only blank lines and # comments\)"
    ):
        load_api_keys([], path)
    path.write_bytes(b"\xff\xfesk-one\n")
    with pytest.raises(
        ConfigError, match=r"--api-key-file .*keys.txt: not UTF-8 text \(invalid start byte at byte 0\)"
    ):
        load_api_keys([], path)
    with pytest.raises(ConfigError, match="API key 2 holds a character outside printable ASCII"):
        load_api_keys(["sk-one", "sk-clé"], None)


def test_a_data_dir_of_an_older_version_gets_owners(tmp_path):
    """Files and batches made before keys existed are the keyless owner's."""
    old_schema = re.sub(r",(\s+--[^\n]*)?\n\s+owner TEXT[^\n]*", r"\1", SCHEMA)
    assert "owner" not in old_schema
    with sqlite3.connect(tmp_path / "sloserve.db") as db:
        db.executescript(old_schema)
        db.execute("INSERT INTO files VALUES ('file-old', 1, 'a.jsonl', 'batch', 0, 0, 0, '{}')")
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "file-old").write_text("")
    store = BatchStore(tmp_path)
    assert store.get_file("file-old", owner="")["owner"] == "" and store.get_file("file-old", owner="x") is None
    store.close()


def test_serve_warns_when_open_beyond_this_machine_and_names_models_by_their_directory(chat_model_dir):
    """The warning comes before anything else (here a bad --rt-ttft-ms ends the start); the default
    model name is the directory's name, not its path."""
    proc = subprocess.run(
        [sys.executable, "-m", "sloserve.cli", "serve", "--model", str(chat_model_dir), "--host", "0.0.0.0",
         "--port", str(free_loopback_port()), "--rt-ttft-ms", "-1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("warning: --host 0.0.0.0 without --api-key") and "--rt-ttft-ms" in lines[-1]
    from sloserve.cli.serve import model_name

    assert model_name(str(chat_model_dir) + "/") == chat_model_dir.name
    assert model_name("~/models/SmolLM2-135M-Instruct-Q8_0.gguf") == "SmolLM2-135M-Instruct-Q8_0"
    assert model_name("random:tiny-llama") == "random:tiny-llama"
