"""``sloserve serve`` and ``bench-serve``: the OpenAI-compatible server, and the load client for any
such server."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import click

from sloserve.cli.app import main
from sloserve.cli.options import (
    ProgressBar,
    check_out,
    engine_options,
    engine_prefix_caching_option,
    print_table,
    table_width,
    workload_options,
)
from sloserve.core.errors import ConfigError
from sloserve.runs import (
    SimOptions,
    fresh_workload,
    make_workload_from_options,
)
from sloserve.server.reasoning import REASONING_PARSERS  # NOTE: pydantic only, no serve extra
from sloserve.server.tool_calls import TOOL_CALL_PARSERS
from sloserve.workload.limits import MAX_LENGTH_TOKENS

# Largest --vocab-size of bench-serve's random prompt ids: far past any model's (Gemma's 262,144).
MAX_VOCAB_SIZE = 10_000_000


def _import_serve_extra(module: str):
    """A module that needs the serve extra (``sloserve.server.X``, ``sloserve.bench.client``), or a
    ConfigError naming the extra."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"this command needs the serve extra: pip install 'sloserve[serve]' ({exc})") from None


@main.command()
@click.option("--scheduler", default="vllm", show_default=True, help="Scheduler name (see `sloserve schedulers`).")
@click.option("--set", "set_pairs", multiple=True, metavar="KEY=VALUE", help="Scheduler option; repeatable.")
@engine_options
@engine_prefix_caching_option
@click.option("--cost-model", help="Preset or JSON file for policies that estimate batch times (BROS).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option(
    "--served-model-name", help="The name clients send as `model` [the model's directory name or GGUF file stem]."
)
@click.option(
    "--api-key",
    "api_keys",
    multiple=True,
    help="Clients must send `Authorization: Bearer KEY`; repeatable (also $SLOSERVE_API_KEY). Files and "
    "batches belong to the key that made them.",
)
@click.option("--api-key-file", type=click.Path(path_type=Path), help="API keys, one per line.")
@click.option(
    "--max-queued-requests",
    type=int,
    default=1024,
    show_default=True,
    help="Requests waiting for their first token; beyond it, 429.",
)
@click.option(
    "--stream-interval",
    type=int,
    default=1,
    show_default=True,
    help="A streamed response's tokens after its first are sent at least this many a chunk (vLLM's): "
    "fewer, larger chunks cost the server less under many streams.",
)
@click.option("--rt-ttft-ms", type=float, help="Default TTFT SLO of real-time requests (ms).")
@click.option("--rt-tpot-ms", type=float, help="Default TPOT SLO of real-time requests (ms).")
@click.option("--request-log", type=click.Path(path_type=Path), help="Append one JSONL line per request here.")
@click.option(
    "--step-log",
    type=click.Path(path_type=Path),
    help="Write one CSV row per engine step here (afresh): its shape and measured time, as `run --out`'s "
    "steps.csv, and the engine loop's parts around it (docs/serving.md). One engine only.",
)
@click.option(
    "--drain-timeout",
    type=float,
    default=30.0,
    show_default=True,
    help="Seconds running requests get to finish after SIGTERM.",
)
@click.option("--log-level", default="info", show_default=True, help="uvicorn's log level.")
@click.option(
    "--timeout-keep-alive",
    type=float,
    default=75.0,
    show_default=True,
    help="Seconds an idle HTTP connection stays open (longer than clients keep theirs).",
)
@click.option(
    "--data-dir",
    type=click.Path(path_type=Path),
    help="Serve the Files and Batch API, keeping files and batches here (SQLite; a restart resumes them), "
    "and keep the Responses API's stored responses here (else the newest 1000 in memory).",
)
@click.option("--max-batch-file-mb", type=float, default=200, show_default=True, help="Largest upload to /v1/files.")
@click.option("--max-batch-lines", type=int, default=50_000, show_default=True, help="Most requests in one batch.")
@click.option(
    "--max-batch-lines-in-engine",
    type=int,
    default=256,
    show_default=True,
    help="Batch lines in the engine at once (best-effort requests; the rest wait in the data dir).",
)
@click.option(
    "--replicas",
    type=int,
    default=1,
    show_default=True,
    help="Engine replicas behind this server, on Ray Serve (pip install 'sloserve[fleet]'); 1: no Ray.",
)
@click.option(
    "--router",
    default="least-outstanding",
    show_default=True,
    help="How requests are spread over the replicas: round-robin, least-outstanding, prefix-affinity or slo "
    "(the simulator's policies, docs/simulator.md).",
)
@click.option("--ray-address", help="An existing Ray cluster to deploy the replicas on [a local Ray for the run].")
@click.option("--cpus-per-replica", type=int, help="On the CPU, cores of each replica [the cores split evenly].")
@click.option(
    "--replica-start-timeout",
    type=float,
    default=600.0,
    show_default=True,
    help="Seconds to wait for the replicas to be placed and loaded (a cluster may be adding nodes) before giving up.",
)
@click.option(
    "--chat-template",
    help="The chat template to render chat requests with: a Jinja file, or the template itself [the model's].",
)
@click.option(
    "--scheduling-policy",
    type=click.Choice(["fcfs", "priority"]),
    help="vLLM's flag: priority admits waiting requests by their priority field, the lower first, and evicts "
    "the largest first (--set waiting_order=priority; the vllm, sarathi, orca and infermax presets).",
)
@click.option(
    "--trust-request-chat-template",
    is_flag=True,
    help="Render a chat request with the chat_template it sends (else a 400): only for clients you trust.",
)
@click.option(
    "--enable-auto-tool-choice",
    is_flag=True,
    help='Serve tool_choice "auto" (the default with tools): the model decides, --tool-call-parser finds its calls.',
)
@click.option(
    "--tool-call-parser",
    type=click.Choice(TOOL_CALL_PARSERS),
    help="The format of the model's tool calls (hermes: <tool_call> blocks, as Hermes and Qwen write them; "
    "llama3_json: Llama 3's JSON calls; pythonic: a Python list of calls, as Llama 3.2 and 4 write them; "
    "mistral: the calls after [TOOL_CALLS], as Mistral's models write them).",
)
@click.option(
    "--reasoning-parser",
    type=click.Choice(REASONING_PARSERS),
    help="Split chat answers of reasoning models into reasoning_content (<think>...</think>) and content.",
)
@click.option(
    "--generation-config",
    default="auto",
    show_default=True,
    help="vLLM's flag: the sampling defaults of a request that does not set temperature, top_p, top_k, min_p or "
    "repetition_penalty: auto, the model's generation_config.json; vllm, the API's (1.0, no filter); or a directory "
    "that holds a generation_config.json.",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(path_type=Path),
    help="A deploy.yaml from `sloserve plan`: its scheduler, options, replicas, router and SLO (flags given here win).",
)
def serve(
    scheduler: str,
    set_pairs: tuple[str, ...],
    cost_model: str | None,
    seed: int,
    host: str,
    port: int,
    served_model_name: str | None,
    api_keys: tuple[str, ...],
    api_key_file: Path | None,
    max_queued_requests: int,
    stream_interval: int,
    rt_ttft_ms: float | None,
    rt_tpot_ms: float | None,
    request_log: Path | None,
    step_log: Path | None,
    drain_timeout: float,
    log_level: str,
    timeout_keep_alive: float,
    data_dir: Path | None,
    max_batch_file_mb: float,
    max_batch_lines: int,
    max_batch_lines_in_engine: int,
    replicas: int,
    router: str,
    ray_address: str | None,
    cpus_per_replica: int | None,
    replica_start_timeout: float,
    chat_template: str | None,
    scheduling_policy: str | None,
    trust_request_chat_template: bool,
    enable_auto_tool_choice: bool,
    tool_call_parser: str | None,
    reasoning_parser: str | None,
    generation_config: str,
    config_path: Path | None,
    **options: Any,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions,
    /v1/responses, /v1/models, /health, /metrics) with the chosen scheduler. Requests with service_tier "flex" are
    best-effort; the others real-time. With --data-dir, also the Files and Batch API (/v1/files,
    /v1/batches), whose lines run best-effort beside online traffic. With --replicas N, N engines on
    Ray Serve behind the same API, each request routed by --router."""
    from sloserve.checkpoint import check_engine_model
    from sloserve.sched import parse_set_options

    set_options = parse_set_options(set_pairs)
    if config_path is not None:
        planned = _planned(config_path)
        given = _given_on_command_line()
        scheduler = scheduler if "scheduler" in given else planned.scheduler
        set_options = {**planned.scheduler_options, **set_options}
        replicas = replicas if "replicas" in given else planned.replicas
        router = router if "router" in given else planned.router
        if "rt_ttft_ms" not in given and planned.slo.ttft_s is not None:
            rt_ttft_ms = planned.slo.ttft_s * 1000
        if "rt_tpot_ms" not in given and planned.slo.tpot_s is not None:
            rt_tpot_ms = planned.slo.tpot_s * 1000
        if "enable_prefix_caching" not in given and planned.enable_prefix_caching is not None:
            options["enable_prefix_caching"] = planned.enable_prefix_caching
    if scheduling_policy is not None:  # NOTE: fcfs is every scheduler's own order: nothing to set
        given = set_options.get("waiting_order")
        if given is not None and (given == "priority") != (scheduling_policy == "priority"):
            raise ConfigError(
                f"--scheduling-policy {scheduling_policy} and --set waiting_order={given} disagree: give one"
            )
        if scheduling_policy == "priority":
            set_options["waiting_order"] = "priority"
    if not 0 < port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {port}")
    if not (drain_timeout >= 0 and math.isfinite(drain_timeout)):
        raise ConfigError(f"--drain-timeout must be a finite number of seconds >= 0, got {drain_timeout}")
    if not (timeout_keep_alive > 0 and math.isfinite(timeout_keep_alive)):
        raise ConfigError(f"--timeout-keep-alive must be a finite number of seconds > 0, got {timeout_keep_alive}")
    if not (max_batch_file_mb > 0 and math.isfinite(max_batch_file_mb)):
        raise ConfigError(f"--max-batch-file-mb must be a finite number > 0, got {max_batch_file_mb}")
    if enable_auto_tool_choice != (tool_call_parser is not None):
        raise ConfigError("--enable-auto-tool-choice and --tool-call-parser go together: give both, or neither")
    if step_log is not None and replicas > 1:
        raise ConfigError(f"--step-log is one engine's steps: it cannot be given with --replicas {replicas}")
    # NOTE: the model before the server's modules, which import torch (2-3 s): a typo in --model is answered at once
    check_engine_model(options["model"])
    serve_module = _import_serve_extra("sloserve.server.serve")
    serve_module.check_address(host, port)
    keys = _import_serve_extra("sloserve.server.auth").load_api_keys(api_keys, api_key_file)
    if not keys and not serve_module.is_loopback(host):
        click.echo(
            f"warning: --host {host} without --api-key: anyone who can reach port {port} can use this server "
            "(and, with --data-dir, read every file and batch)",
            err=True,
        )
    from sloserve.engine.engine_core import EngineSpec
    from sloserve.engine.gc_heap import freeze_switch
    from sloserve.engine.step_log import check_step_log_path

    if step_log is not None:
        check_step_log_path(step_log)

    spec = EngineSpec(
        options["model"],
        scheduler,
        device=options["device"],
        dtype=options["dtype"],
        seed=seed,
        attention_backend=options["attention_backend"],
        cuda_graphs=options["cuda_graphs"],
        kv_capacity_tokens=options["kv_capacity_tokens"],
        max_model_len=options["max_model_len"],
        cost_model=cost_model,
        scheduler_options=set_options,
        enable_prefix_caching=options["enable_prefix_caching"],
        step_log=None if step_log is None else str(step_log),
    )
    serve_options = serve_module.ServeOptions(
        host=host,
        port=port,
        served_model_name=served_model_name or model_name(options["model"]),
        max_queued_requests=max_queued_requests,
        stream_interval=stream_interval,
        rt_ttft_ms=rt_ttft_ms,
        rt_tpot_ms=rt_tpot_ms,
        request_log=request_log,
        drain_timeout_s=drain_timeout,
        log_level=log_level,
        timeout_keep_alive_s=timeout_keep_alive,
        data_dir=data_dir,
        api_keys=keys,
        tool_call_parser=tool_call_parser,
        chat_template=chat_template,
        trust_request_chat_template=trust_request_chat_template,
        reasoning_parser=reasoning_parser,
        generation_config=generation_config,
        fleet=_fleet_options(replicas, router, ray_address, cpus_per_replica, replica_start_timeout),
        freeze_gc=freeze_switch(),
        batch_limits=_import_serve_extra("sloserve.server.batch_api").BatchLimits(
            max_file_bytes=int(max_batch_file_mb * 1024 * 1024),
            max_file_lines=max_batch_lines,
            max_lines_in_engine=max_batch_lines_in_engine,
        ),
    )
    app = serve_module.make_app(spec, serve_options)
    fleet = f" on {replicas} replicas ({router})" if serve_options.fleet is not None else ""
    click.echo(
        f"serving {serve_options.served_model_name} with {scheduler}{fleet} on http://{host}:{port}/v1", err=True
    )
    serve_module.run_server(app, serve_options)


def model_name(model: str) -> str:
    """The name a model is served under by default: its directory's name or its GGUF file's stem
    (``random:NAME`` as given), not its whole path."""
    if model.startswith("random:"):
        return model
    path = Path(model).expanduser()
    return path.stem if path.suffix == ".gguf" else path.resolve().name or model


def _planned(path: Path):
    """The deployment of ``serve --config`` (a ConfigError for one that cannot be served)."""
    from sloserve.plan.deploy import load_deployment

    planned = load_deployment(path)
    what = planned.simulated_only()
    if what is not None:
        raise ConfigError(
            f"--config {path}: {what}: serve a plan without it (sloserve plan --tp 1 --layouts colocated)"
        )
    return planned


def _given_on_command_line() -> set[str]:
    """The parameters of the running command that its command line set (not defaults)."""
    ctx = click.get_current_context()
    return {
        name
        for name in ctx.params
        if ctx.get_parameter_source(name)
        in (click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT)
    }


def _fleet_options(
    replicas: int, router: str, ray_address: str | None, cpus_per_replica: int | None, start_timeout_s: float
):
    """The fleet of ``serve --replicas N`` (None: one engine in this server, no Ray); ``FleetEngine``
    checks it."""
    if replicas == 1 and ray_address is None:
        return None
    from sloserve.fleet.engine import FleetOptions

    return FleetOptions(replicas, router, ray_address, cpus_per_replica, start_timeout_s)


@main.command(name="bench-serve")
@click.option(
    "--base-url",
    default="http://127.0.0.1:8000/v1",
    show_default=True,
    help="The server's OpenAI API root (ours or any OpenAI-compatible one, e.g. vLLM's).",
)
@click.option("--model", "served_model", required=True, help="The model name the server serves.")
@click.option(
    "--api-key",
    envvar="OPENAI_API_KEY",
    help="Sent as 'Authorization: Bearer KEY', to a server started with API keys [$OPENAI_API_KEY, as vLLM's "
    "benchmark and the openai client read it].",
)
@workload_options
@click.option("--max-model-len", type=int, help="Clip requests to this context [the server's max_model_len].")
@click.option(
    "--vocab-size",
    type=int,
    default=256,
    show_default=True,
    help="Prompt token ids are drawn from [0, this): ids every model has by default.",
)
@click.option(
    "--tokenizer",
    "tokenizer_path",
    type=click.Path(path_type=Path),
    help="The server's tokenizer (a tokenizer.json, a model directory or a .gguf file): send text prompts that "
    "it encodes to exactly the trace's lengths, one word per token, instead of token ids.",
)
@click.option("--timeout", "timeout_s", type=float, default=600.0, show_default=True, help="Per-request timeout (s).")
@click.option(
    "--reset-prefix-cache",
    is_flag=True,
    help="POST the server's /reset_prefix_cache (vLLM's) first: the run's prompts find nothing an earlier run "
    "left cached (runs of the same trace otherwise find their prompts cached).",
)
@click.option("--out", type=click.Path(path_type=Path), help="Write summary.json, requests.csv and latency_cdf.png.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
def bench_serve(
    base_url: str,
    served_model: str,
    api_key: str | None,
    max_model_len: int | None,
    vocab_size: int,
    tokenizer_path: Path | None,
    timeout_s: float,
    reset_prefix_cache: bool,
    out: Path | None,
    as_json: bool,
    **options: Any,
) -> None:
    """Replay a trace or workload against a running server (streamed completions, prompts of the
    trace's lengths, max_tokens = its output lengths with ignore_eos) and measure TTFT, TPOT,
    inter-token and end-to-end latency as the client sees them. Prompts of a trace with prefix
    structure repeat the same tokens for the same segment ids, so the server's prefix cache is tried
    as in a simulation; the cached tokens the server reports go in the summary."""
    bench = _import_serve_extra("sloserve.bench.client")
    check_out(out)
    if not 1 <= vocab_size <= MAX_VOCAB_SIZE:
        raise ConfigError(f"--vocab-size must be in 1..{MAX_VOCAB_SIZE:,}, got {vocab_size:,}")
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise ConfigError(f"--timeout must be a finite number of seconds > 0, got {timeout_s}")
    if max_model_len is None:
        max_model_len = bench.server_max_model_len(base_url, served_model, api_key)
    elif not 2 <= max_model_len <= MAX_LENGTH_TOKENS:
        raise ConfigError(f"--max-model-len must be in 2..{MAX_LENGTH_TOKENS:,}, got {max_model_len:,}")
    workload = make_workload_from_options(SimOptions.of_workload(options), max_model_len)
    requests, chains = fresh_workload(workload)
    if tokenizer_path is None:
        prompts = bench.synthetic_prompts(requests, vocab_size, options["seed"])
    else:
        from sloserve.engine.tokenizer import load_tokenizer_file

        try:
            tokenizer = load_tokenizer_file(tokenizer_path)
        except ImportError as exc:  # tokenizers, gguf
            raise ConfigError(f"--tokenizer needs the engine extra: pip install 'sloserve[engine]' ({exc})") from None
        prompts = bench.WordPrompts(tokenizer).texts(requests, options["seed"])
    if reset_prefix_cache:
        bench.reset_server_prefix_cache(base_url, api_key)
    with ProgressBar(len(requests), f"bench-serve {served_model}", enabled=not as_json) as on_progress:
        result = bench.run_benchmark(
            base_url,
            served_model,
            requests,
            prompts,
            chains=chains,
            timeout_s=timeout_s,
            on_progress=on_progress,
            api_key=api_key,
        )
    summary = bench.summarize_benchmark(
        result,
        extra={
            "base_url": base_url,
            "model": served_model,
            "workload": workload.name,
            "num_clipped": workload.num_clipped,
            "seed": options["seed"],
            "max_model_len": max_model_len,
            "prefix_cache_reset": reset_prefix_cache,
        },
    )
    if out is not None:
        bench.write_outputs(out, summary, result)
    if result.errors:
        first = min(result.errors)
        click.echo(f"note: {len(result.errors)} requests failed; request {first}: {result.errors[first]}", err=True)
    if as_json:
        from sloserve.metrics import summary_to_json

        click.echo(summary_to_json(summary))
        return
    from sloserve.metrics import compare_table

    print_table(
        compare_table(
            {served_model: summary},
            f"bench-serve: {base_url}, {workload.name}, {len(requests)} requests",
            table_width(),
        )
    )
    if out is not None:
        click.echo(f"wrote {out}/summary.json, requests.csv and latency_cdf.png")
