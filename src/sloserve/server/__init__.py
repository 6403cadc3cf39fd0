"""``sloserve serve``: the engine behind an OpenAI-compatible HTTP API (``app``), its metrics and
request log (``metrics``), chat templates (``chat_template``), and the load client that replays
traces against any OpenAI-compatible server (``bench``).

Needs the ``serve`` extra (FastAPI, uvicorn, prometheus-client, Jinja2, httpx) and, to serve, the
``engine`` extra.
"""
