"""``sloserve bench-serve``: replay a workload against any OpenAI-compatible server and measure it.

As vLLM's benchmark_serving does with a length trace: each request sends a prompt of the trace's
prompt length to ``/v1/completions`` with ``max_tokens`` = the trace's output length and ``ignore_eos``,
greedy, streamed. The prompt is random token ids (the length is exact whatever the tokenizer), or,
given the server's tokenizer, text of as many words, each one token of it (``WordPrompts``). Either
way equal ids of a trace's segments (``hash_ids``) give equal tokens, so a server caching prefixes
finds exactly the blocks a simulation finds; the cached tokens it reports are recorded.
Requests leave at their arrival times (Poisson, gamma, the trace's own, or all at once); a workload's
closed-loop batches are sent when the batch before them has completed. BE requests carry
``service_tier: "flex"``, requests with an SLO carry it as ``slo`` (sloserve's extension), and those
with a priority other than 0 carry it as ``priority`` (vLLM's).

From the stream, per request: TTFT (arrival to the first chunk with a choice), TPOT ((last chunk - first
chunk) / (output tokens - 1), with the output tokens from the final usage), the largest gap between
chunks (inter-token latency) and end-to-end latency. The times are the client's, so they include the
network and the server's HTTP work, which is what a user sees.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
import numpy as np

from sloserve.core.errors import ConfigError
from sloserve.core.request import Request, RequestClass, RequestStatus
from sloserve.workload.build import synthetic_prompts  # noqa: F401 (its clients import it from here too)
from sloserve.workload.closed_loop import ClosedLoopBatches


@dataclass
class BenchResult:
    """What the client saw: per-request timestamps are set on ``requests`` (finished ones completed)."""

    requests: list[Request]
    wall_s: float
    errors: dict[int, str] = field(default_factory=dict)  # request id -> what went wrong
    inter_token_s: list[float] = field(default_factory=list)  # gaps between consecutive chunks, all requests
    # When each request's headers were written, on the client's clock (seconds from the start, in order):
    # how long the client itself took to put a burst on the wire
    sent_s: list[float] = field(default_factory=list)


class WordPrompts:
    """Prompts as text that one tokenizer encodes to exactly each request's prompt length.

    The words are the tokenizer's own single tokens that are a space and ASCII letters (" the") and
    encode back to themselves: a pre-tokenizer that splits at spaces (byte-level BPE: GPT-2, Llama 3,
    Qwen, SmolLM) never merges two of them, so a text of n such words is n tokens, and a text that
    starts like another tokenizes like it up to there. A prompt's words are ``synthetic_prompts``'s
    token ids read as indices into the words, so equal segment ids are equal text; the special tokens
    the tokenizer adds in front (a BOS) take the place of the first words.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.words = []
        for token_id in range(tokenizer.vocab_size):
            word = tokenizer.decode([token_id])
            if (
                len(word) >= 3
                and word[0] == " "
                and word[1:].isascii()
                and word[1:].isalpha()
                and tokenizer.encode(word, add_special_tokens=False) == [token_id]
            ):
                self.words.append(word)
        if len(self.words) < 16:
            raise ConfigError(
                f"the tokenizer has {len(self.words)} single-token words (' the'); text prompts need 16 "
                "(a SentencePiece tokenizer has none of this form): leave out --tokenizer to send token ids"
            )
        self.num_special = len(tokenizer.encode(self.words[0])) - 1  # added in front of every prompt

    def texts(self, requests: Sequence[Request], seed: int) -> list[str]:
        """One text per request, checked to encode to its prompt length."""
        indices = synthetic_prompts(requests, len(self.words), seed)
        texts = ["".join(self.words[i] for i in ids[self.num_special :]) for ids in indices]
        for r, text in zip(requests, texts):  # NOTE: every one: a tokenizer may break the rule
            num_tokens = len(self.tokenizer.encode(text))
            if num_tokens != r.num_prompt_tokens:
                raise ConfigError(
                    f"request {r.request_id}: its {r.num_prompt_tokens}-token prompt as text encodes to {num_tokens} "
                    "tokens with this tokenizer (it merges words): leave out --tokenizer to send token ids"
                )
        return texts


def request_body(model: str, request: Request, prompt: list[int] | str) -> dict:
    body: dict = {
        "model": model,
        "prompt": prompt,
        "max_tokens": request.true_output_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if request.request_class is RequestClass.BE:
        body["service_tier"] = "flex"
    slo = request.slo
    if slo.ttft_s is not None or slo.tpot_s is not None:
        body["slo"] = {k: v * 1000 for k, v in (("ttft_ms", slo.ttft_s), ("tpot_ms", slo.tpot_s)) if v is not None}
    if request.priority:
        body["priority"] = request.priority
    return body


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The header that carries ``api_key`` to the server (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _auth_hint(status: int) -> str:
    """What to do about an HTTP ``status`` the server answered with (a hint for a 401)."""
    return " (the server wants an API key: give it with --api-key or OPENAI_API_KEY)" if status == 401 else ""


class _Client:
    """Streams requests over one aiohttp session (its C HTTP parser keeps the client's own cost per
    token low: the client shares the machine with the server in a loopback benchmark)."""

    def __init__(self, base_url: str, model: str, timeout_s: float, api_key: str | None = None) -> None:
        self.url = base_url.rstrip("/") + "/completions"
        self.models_url = base_url.rstrip("/") + "/models"
        self.model = model
        # NOTE: a pooled connection is reused only within 4 s of its last response: uvicorn's servers
        # (vLLM's) close idle ones after 5 s, and a request sent as one closes meets a reset (aiohttp
        # keeps them 15 s by default)
        written = aiohttp.TraceConfig()
        written.on_request_headers_sent.append(self._written)
        self.http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0),
            headers=auth_headers(api_key),
            trace_configs=[written],
        )
        self.start = time.perf_counter()
        self.inter_token_s: list[float] = []
        self.sent_s: list[float] = []

    async def _written(self, session, context, params: aiohttp.TraceRequestHeadersSentParams) -> None:
        if params.url.path.endswith("/completions"):  # (not the check of the model list before the load)
            self.sent_s.append(self.clock())

    def clock(self) -> float:
        return time.perf_counter() - self.start

    async def send(self, request: Request, prompt: list[int] | str) -> str | None:
        """Send one request at once and record its times on it; returns an error message or None."""
        request.arrival_time = self.clock()
        chunk_times: list[float] = []
        num_tokens = None
        try:
            async with self.http.post(self.url, json=request_body(self.model, request, prompt)) as response:
                if response.status != 200:
                    return f"HTTP {response.status}: {(await response.read()).decode(errors='replace')[:300]}"
                async for raw in response.content:  # one line at a time
                    line = raw.strip()
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        return f"error event: {event['error'].get('message')}"
                    if event.get("usage"):
                        usage = event["usage"]
                        num_tokens = usage["completion_tokens"]
                        request.num_cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                    if event.get("choices"):  # a step's tokens (text may be held back), as vLLM's client counts
                        chunk_times.append(self.clock())
        except (TimeoutError, aiohttp.ClientError) as e:
            return f"{type(e).__name__}: {e}"
        end = self.clock()
        if num_tokens is None:
            return "the stream ended without usage (stream_options.include_usage)"
        if not chunk_times:  # a server that sends no chunk per token: the end is the first token
            chunk_times = [end]
        gaps = np.diff(chunk_times)
        self.inter_token_s.extend(gaps.tolist())
        request.first_token_time, request.last_token_time = chunk_times[0], chunk_times[-1]
        request.max_token_gap = float(gaps.max()) if gaps.size else math.nan
        request.finish_time = end
        request.set_output_tokens(num_tokens)
        request.status = RequestStatus.FINISHED
        return None

    async def close(self) -> None:
        await self.http.close()


async def _replay(
    client: _Client,
    requests: Sequence[Request],
    prompts: Sequence[list[int] | str],
    chains: Sequence[Sequence[Sequence[Request]]],
    on_progress: Callable[[int], None] | None,
) -> dict[int, str]:
    """Send every request at its arrival time (closed-loop batches when their predecessor is done)."""
    index = {id(r): i for i, r in enumerate(requests)}
    closed_loop = ClosedLoopBatches(chains)
    errors: dict[int, str] = {}
    done = 0
    tasks: set[asyncio.Task] = set()

    async def one(request: Request, delay: float) -> None:
        nonlocal done
        if delay > 0:
            await asyncio.sleep(delay)
        error = await client.send(request, prompts[index[id(request)]])
        if error is not None:
            errors[request.request_id] = error
        done += 1
        if on_progress is not None:
            on_progress(done)
        for r in closed_loop.done(request):  # a failed request is done too: its batch goes on
            launch(r, r.think_time_s)

    def launch(request: Request, delay: float) -> None:
        task = asyncio.create_task(one(request, delay))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    for r in requests:
        if closed_loop.arrives_on_its_own(r):
            launch(r, r.arrival_time - client.clock())
    while tasks:
        await asyncio.gather(*list(tasks))
    return errors


def run_benchmark(
    base_url: str,
    model: str,
    requests: Sequence[Request],
    prompts: Sequence[list[int] | str],
    *,
    chains: Sequence[Sequence[Sequence[Request]]] = (),
    timeout_s: float = 600.0,
    on_progress: Callable[[int], None] | None = None,
    api_key: str | None = None,
) -> BenchResult:
    """Replay ``requests`` (arrival times relative to the start) against ``base_url`` (``.../v1``), with
    ``api_key`` as a bearer token where the server wants one."""
    if len(prompts) != len(requests):
        raise ConfigError(f"{len(prompts)} prompts for {len(requests)} requests")

    async def main() -> BenchResult:
        client = _Client(base_url, model, timeout_s, api_key)
        try:
            await _check_server(client)
            client.start = time.perf_counter()
            errors = await _replay(client, requests, prompts, chains, on_progress)
        finally:
            await client.close()
        return BenchResult(list(requests), client.clock(), errors, client.inter_token_s, client.sent_s)

    return asyncio.run(main())


async def _check_server(client: _Client) -> None:
    """One clear error when the server is not there or does not serve ``model``."""
    try:
        async with client.http.get(client.models_url) as response:
            status = response.status
            body = await response.json(content_type=None) if status == 200 else None
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:
        raise ConfigError(f"--base-url: cannot read {client.models_url} ({type(e).__name__}: {e})") from None
    if status != 200:
        raise ConfigError(f"--base-url: GET {client.models_url} answered HTTP {status}{_auth_hint(status)}")
    names = [m.get("id") for m in body.get("data", [])]
    if client.model not in names:
        raise ConfigError(
            f"--model {client.model!r} is not served at {client.models_url}; it serves: {', '.join(map(str, names))}"
        )


def wait_until_ready(server_url: str, *, process=None, timeout_s: float = 120.0) -> None:
    """Poll ``server_url/health`` (the server's root, not ``/v1``) until it answers 200. A
    RuntimeError when ``process`` (a ``subprocess.Popen`` of the server) exits first, or at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(server_url.rstrip("/") + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:  # refused while starting, or 503 (HTTPError) while loading
            pass
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode} before it was ready")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{server_url} was not ready within {timeout_s:.0f} s")
        time.sleep(0.1)


# Where Linux lists its ephemeral ports, which a bind to port 0 and the source port of every outgoing
# connection come from (32768-60999 by default), and Ray's worker ports (its min_worker_port to
# max_worker_port): a server's port picked from either may be taken before the server binds it.
EPHEMERAL_PORTS_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
RAY_WORKER_PORTS = range(10002, 20000)


def first_ephemeral_port() -> int:
    """The first port of the system's ephemeral range (Linux's setting; elsewhere its default)."""
    try:
        with open(EPHEMERAL_PORTS_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux
        return 32768


def free_loopback_port() -> int:
    """A port free on 127.0.0.1 now, and one that nothing else takes before a server started on it binds
    it (seconds later: a fleet's server binds once its replicas are up). A port from the OS (a bind to
    port 0) would come from the ephemeral range, from which the system gives the source port of every
    connection opened meanwhile, and Ray's processes open hundreds on loopback. So: one between Ray's
    worker ports and the ephemeral range, drawn from the system's entropy (test processes that seed
    ``random`` alike still draw different ports)."""
    candidates = range(RAY_WORKER_PORTS.stop, first_ephemeral_port())
    for port in random.SystemRandom().sample(candidates, min(len(candidates), 200)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use
                continue
            return port
    with socket.socket() as s:  # a system without such a gap, or every port tried in use: the OS's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_max_model_len(base_url: str, model: str, api_key: str | None = None) -> int:
    """The context the server reports for ``model`` in ``/v1/models`` (vLLM and sloserve do)."""
    url = base_url.rstrip("/") + "/models"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=auth_headers(api_key)), timeout=30) as response:
            data = json.loads(response.read()).get("data", [])
    except urllib.error.HTTPError as e:
        raise ConfigError(f"--base-url: cannot read {url} ({e}){_auth_hint(e.code)}") from None
    except (OSError, ValueError) as e:  # URLError
        raise ConfigError(f"--base-url: cannot read {url} ({e})") from None
    for entry in data:
        if entry.get("id") == model:
            if isinstance(entry.get("max_model_len"), int):
                return entry["max_model_len"]
            raise ConfigError(f"{url} does not say {model}'s context length: give --max-model-len")
    raise ConfigError(
        f"--model {model!r} is not served at {url}; it serves: {', '.join(str(m.get('id')) for m in data)}"
    )


def reset_server_prefix_cache(base_url: str, api_key: str | None = None) -> None:
    """POST the server's ``/reset_prefix_cache`` (vLLM's route, beside the API root ``base_url``), so a run's
    prompts find nothing an earlier run left cached. A ConfigError says why the server would not."""
    root = base_url.rstrip("/").removesuffix("/v1")
    url = root + "/reset_prefix_cache"
    try:
        urllib.request.urlopen(
            urllib.request.Request(url, method="POST", headers=auth_headers(api_key)), timeout=60
        ).close()
    except urllib.error.HTTPError as e:
        try:
            reason = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            reason = e.reason
        if e.code == 404:
            reason = "the server has no such route (vLLM serves it only with VLLM_SERVER_DEV_MODE=1)"
        raise ConfigError(f"--reset-prefix-cache: POST {url} answered {e.code}: {reason}{_auth_hint(e.code)}") from None
    except OSError as e:  # URLError
        raise ConfigError(f"--reset-prefix-cache: cannot POST {url} ({e})") from None


def summarize_benchmark(result: BenchResult, extra: dict) -> dict:
    """The simulator's summary of the client-side timestamps (no step timeline: the client sees none),
    with the inter-token gaps and the failures added."""
    from sloserve.metrics import summarize
    from sloserve.metrics.summary import latency_stats
    from sloserve.metrics.timeline import Timeline

    summary = summarize(
        result.requests,
        Timeline(),
        kv_capacity_tokens=1,
        sim_wall_s=result.wall_s,
        extra={"client": "bench-serve", **extra},
    )
    for key in (
        "kv_capacity_tokens",
        "kv_utilization_mean",
        "kv_allocated_mean",
        "forward_size",
        "batch_size",
        "num_steps",
        "preemptions",
        "allocation_failures",
        "swapped_bytes",
        "sched_time_per_step_s",
        "sched_time_share",
        "sim_wall_s",
    ):
        summary.pop(key, None)  # the server's side: a client cannot see them
    summary["inter_token_latency_s"] = latency_stats(np.asarray(result.inter_token_s, dtype=np.float64))
    summary["num_failed"] = len(result.errors)
    summary["wall_s"] = result.wall_s
    return summary


def write_outputs(out, summary: dict, result: BenchResult) -> None:
    """``summary.json``, ``requests.csv`` and ``latency_cdf.png`` (all or nothing, as for simulate)."""
    from sloserve.metrics import write_run_outputs

    write_run_outputs(out, summary, result.requests, None)
