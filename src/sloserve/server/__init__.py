"""``sloserve serve``: the engine behind an OpenAI-compatible HTTP API (``app``; ``serving`` turns
request bodies into engine requests and answers), its metrics and request log (``metrics``), the
Files and Batch API (``batch_api`` routes, ``batch_runner`` feeding batch lines to the engine,
``batch_store`` their SQLite state), and the load client that replays traces against any
OpenAI-compatible server (``bench``). Chat templates are the engine's (``engine.chat_template``).

Needs the ``serve`` extra (FastAPI, uvicorn, prometheus-client, python-multipart, aiohttp) and, to
serve, the ``engine`` extra.
"""
