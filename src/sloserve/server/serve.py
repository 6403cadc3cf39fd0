"""``sloserve serve``: build the engine and the app, and run them under uvicorn until SIGTERM.

Shutdown (SIGTERM or Ctrl-C): new requests get 503 at once, running ones have ``drain_timeout_s``
to finish, then what is left is aborted (each gets an explicit error) and the process exits 0. A
second signal exits at once.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from sloserve.checkpoint.generation_config import sampling_defaults
from sloserve.core.errors import ConfigError
from sloserve.engine.async_engine import AsyncLLMEngine
from sloserve.engine.chat_template import ChatTemplate
from sloserve.engine.engine_core import EngineSpec
from sloserve.engine.gc_heap import frozen_heap
from sloserve.engine.sampler import SamplingParams
from sloserve.fleet.engine import FleetEngine, FleetOptions
from sloserve.sched.registry import build_config
from sloserve.server.app import build_app
from sloserve.server.batch_api import BatchLimits, BatchService
from sloserve.server.batch_store import BatchStore
from sloserve.server.metrics import ServerMetrics
from sloserve.server.reasoning import REASONING_PARSERS
from sloserve.server.response_store import ResponseStore
from sloserve.server.serving import OpenAIServing, ServerConfig
from sloserve.server.tool_calls import TOOL_CALL_PARSERS

log = logging.getLogger("uvicorn.error")  # uvicorn configures it: our lines go with its own

# Predictors that read a request's true output length: a server cannot know it.
ORACLE_PREDICTORS = frozenset({"oracle", "noisy-oracle"})


def check_servable(scheduler: str, options: dict[str, Any]) -> Any:
    """The config of ``scheduler`` with ``options``; a ConfigError when it needs the true output lengths."""
    config = build_config(scheduler, options)
    predictor = getattr(config, "predictor", "none")
    if predictor in ORACLE_PREDICTORS:
        raise ConfigError(
            f"scheduler {scheduler} predicts response lengths with the {predictor!r} predictor, which reads each "
            "request's true output length: a server cannot know it. Serve with an online predictor: "
            "--set predictor=histogram"
        )
    return config


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str = ""
    max_queued_requests: int = 1024
    rt_ttft_ms: float | None = None
    rt_tpot_ms: float | None = None
    request_log: Path | None = None
    drain_timeout_s: float = 30.0
    log_level: str = "info"
    data_dir: Path | None = None  # the Batch API's files and state; None: no Files or Batches routes
    batch_limits: BatchLimits = field(default_factory=BatchLimits)
    fleet: FleetOptions | None = None  # replicas on Ray Serve; None: one engine process
    api_keys: list[str] = field(default_factory=list)  # none: anyone who reaches the port may use it
    tool_call_parser: str | None = None  # --tool-call-parser: serve tool_choice "auto" (None: refuse it)
    chat_template: str | None = None  # --chat-template: a file or the template (None: the model's)
    trust_request_chat_template: bool = False  # render requests with a chat_template of their own
    reasoning_parser: str | None = None  # --reasoning-parser: chat's reasoning_content (None: all content)
    # --generation-config: the sampling defaults of requests that leave them unset: "auto" (the model's
    # generation_config.json), "vllm" (the API's) or a directory with a generation_config.json
    generation_config: str = "auto"
    # --timeout-keep-alive: how long an idle connection stays open. NOTE: uvicorn's default, 5 s, is no
    # longer than the pools of common clients keep theirs (httpx's, so the openai SDK's: 5 s; aiohttp's:
    # 15 s): a request sent on a connection as the server closes it meets a reset (one in a few hundred
    # in a loopback benchmark). A server's keep-alive must outlive its clients': nginx's 75 s.
    timeout_keep_alive_s: float = 75.0
    # --stream-interval: a streamed choice's tokens after its first, at least this many a chunk (vLLM's)
    stream_interval: int = 1
    # The process's start-up heap frozen while it serves (engine/gc_heap.py; SLOSERVE_FREEZE_GC, read by the CLI)
    freeze_gc: bool = True


def check_address(host: str, port: int) -> None:
    """A ConfigError when ``host:port`` cannot be bound (in use, or not this machine's), before the
    model is loaded rather than after."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ConfigError(f"--host {host!r}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as e:
            raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


def make_app(spec: EngineSpec, options: ServeOptions):
    """Start the engine of ``spec`` in its process (a ConfigError if it cannot be built) and return
    the app serving it, with its metrics and the model's chat template."""
    for name in ("rt_ttft_ms", "rt_tpot_ms"):
        value = getattr(options, name)
        if value is not None and not value > 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    if options.max_queued_requests < 1:
        raise ConfigError(f"--max-queued-requests must be >= 1, got {options.max_queued_requests}")
    if options.stream_interval < 1:
        raise ConfigError(f"--stream-interval must be >= 1, got {options.stream_interval}")
    if options.tool_call_parser is not None and options.tool_call_parser not in TOOL_CALL_PARSERS:
        raise ConfigError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}")
    if options.reasoning_parser is not None and options.reasoning_parser not in REASONING_PARSERS:
        raise ConfigError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}")
    scheduler_config = check_servable(spec.scheduler, spec.scheduler_options)
    defaults = generation_defaults(spec.model, options.generation_config)
    store = None
    if options.data_dir is not None:
        options.batch_limits.check(options.max_queued_requests)
        store = BatchStore(options.data_dir)  # NOTE: before the model loads: a taken --data-dir fails fast
    try:
        template = ChatTemplate.for_checkpoint(spec.model, options.chat_template)
        metrics = ServerMetrics(options.served_model_name, options.request_log)
        if options.fleet is None:
            online = AsyncLLMEngine(spec, max_queued_requests=options.max_queued_requests, observer=metrics)
        else:
            online = FleetEngine(spec, options.fleet, max_queued_requests=options.max_queued_requests, observer=metrics)
        online.start()
    except BaseException:
        if store is not None:
            store.close()
        raise
    config = ServerConfig(
        options.served_model_name,
        options.rt_ttft_ms,
        options.rt_tpot_ms,
        options.tool_call_parser,
        options.reasoning_parser,
        options.trust_request_chat_template,
        getattr(scheduler_config, "waiting_order", "fcfs") == "priority",
        defaults,
        options.stream_interval,
    )
    serving = OpenAIServing(online, config, template)
    batches = None if store is None else BatchService(store, serving, options.batch_limits, metrics)
    stored_responses = ResponseStore(options.data_dir) if options.data_dir is not None else None
    return build_app(serving, metrics, batches, options.api_keys, stored_responses)


def generation_defaults(model: str, generation_config: str) -> dict[str, float]:
    """The sampling defaults of ``--generation-config`` for ``model`` (``sampling_defaults``), checked
    as a request's would be; logged, as vLLM logs them."""
    if generation_config == "vllm":
        return {}
    directory = Path(model if generation_config == "auto" else generation_config).expanduser()
    if generation_config != "auto" and not directory.is_dir():
        raise ConfigError(f"--generation-config must be auto, vllm or a directory, got {generation_config!r}")
    defaults = sampling_defaults(directory)
    try:
        SamplingParams(**defaults)
    except ConfigError as e:
        raise ConfigError(f"{directory / 'generation_config.json'}: {e}") from None
    if defaults:
        log.info("sampling defaults from the model's generation config (--generation-config vllm: none): %s", defaults)
    return defaults


class DrainingServer(uvicorn.Server):
    """uvicorn that drains the engine on the first SIGTERM/SIGINT before it stops: 503 for new
    requests, ``drain_timeout_s`` for running ones."""

    def __init__(
        self,
        config: uvicorn.Config,
        engine: AsyncLLMEngine,
        drain_timeout_s: float,
        batches: BatchService | None = None,
    ) -> None:
        super().__init__(config)
        self.engine = engine
        self.batches = batches
        self.drain_timeout_s = drain_timeout_s
        self._draining: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining is not None:  # a second signal: stop now
            self.should_exit = self.force_exit = True
            return
        log.info(
            "shutting down: draining %d requests (at most %.0f s)", self.engine.num_unfinished, self.drain_timeout_s
        )
        self.engine.begin_shutdown()
        if self.batches is not None:  # NOTE: batch lines in the engine go back to pending, not drained
            self.batches.runner.stop_admitting_threadsafe()

        def drain() -> None:
            drained = self.engine.drain(self.drain_timeout_s)
            if not drained:
                log.warning("aborted the requests still running after %.0f s", self.drain_timeout_s)
            self.should_exit = True  # NOTE: uvicorn checks it every tick; the signal is not re-raised

        self._draining = threading.Thread(target=drain, name="sloserve-drain", daemon=True)
        self._draining.start()


def uvicorn_config(app, options: ServeOptions) -> uvicorn.Config:
    """How uvicorn serves ``app``: the address, the log level, and an idle connection's life."""
    return uvicorn.Config(
        app,
        host=options.host,
        port=options.port,
        log_level=options.log_level,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=options.timeout_keep_alive_s,
    )


def run_server(app, options: ServeOptions) -> None:
    """Serve ``app`` until a signal drains and stops it, with the heap the process started with frozen
    (``engine/gc_heap.py``)."""
    server = DrainingServer(uvicorn_config(app, options), app.state.engine, options.drain_timeout_s, app.state.batches)
    with frozen_heap(options.freeze_gc):
        server.run()
