"""The server tests' served model: ``make_app`` under a real uvicorn on a free loopback port (``Server``),
on the tiny chat model of ``chat_model.py``."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from pathlib import Path

import httpx
import openai
import uvicorn

from sloserve import LLM, SamplingParams
from sloserve.bench.client import free_loopback_port
from sloserve.engine.engine_core import EngineSpec
from sloserve.server.serve import ServeOptions, make_app, uvicorn_config

MODEL = "tiny"


class Server:
    """``make_app`` under a real uvicorn in a thread, on a free loopback port."""

    def __init__(
        self,
        model_dir: Path,
        scheduler: str = "vllm",
        kv_capacity_tokens: int | None = 4096,
        scheduler_options: dict | None = None,
        **options,
    ) -> None:
        spec = EngineSpec(
            str(model_dir), scheduler, kv_capacity_tokens=kv_capacity_tokens, scheduler_options=scheduler_options or {}
        )
        self.port = free_loopback_port()
        serve_options = ServeOptions(port=self.port, served_model_name=MODEL, **{"log_level": "warning", **options})
        self.app = make_app(spec, serve_options)
        self.server = uvicorn.Server(uvicorn_config(self.app, serve_options))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)
        self.async_client = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    @property
    def engine(self):
        return self.app.state.engine

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(self.url + "/metrics").text
        wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.splitlines():
            m = re.fullmatch(rf"{name}(?:{{(.*)}})? (\S+)", line)
            if m and ",".join(sorted((m.group(1) or "").split(","))) == wanted:
                return float(m.group(2))
        return 0.0

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def generate(llm: LLM, prompt_ids: list[int], max_tokens: int) -> tuple[str, list[int]]:
    out = llm.generate({"prompt_token_ids": prompt_ids}, SamplingParams(max_tokens=max_tokens, temperature=0))[0]
    return out.outputs[0].text, out.outputs[0].token_ids


def start_order_by_priority(server: Server) -> list[str]:
    """Requests of priorities 5, 5, -1 and 2 sent while a long one runs, on a server that runs one at a time
    in the order of ``waiting_order=priority``: the order they finish in (by name)."""

    async def main() -> list[str]:
        finished: list[str] = []

        async def one(name: str, priority: int, max_tokens: int = 4) -> None:
            await server.async_client.completions.create(
                model=MODEL, prompt=name, max_tokens=max_tokens, extra_body={"priority": priority, "ignore_eos": True}
            )
            finished.append(name)

        running = await server.async_client.completions.create(
            model=MODEL, prompt="first", max_tokens=200, stream=True, extra_body={"ignore_eos": True}
        )
        await anext(aiter(running))  # it runs: the next ones queue behind it
        tasks = []
        deadline = time.monotonic() + 30
        # NOTE: one at a time, each accepted before the next is sent: over four connections their
        # arrival order would be the connections' race, and low-a must arrive before low-b
        for k, (name, priority) in enumerate((("low-a", 5), ("low-b", 5), ("high", -1), ("mid", 2)), 1):
            tasks.append(asyncio.ensure_future(one(name, priority)))
            while server.engine.num_queued < k:
                assert time.monotonic() < deadline, f"{name} was not accepted"
                await asyncio.sleep(0.005)
        assert server.engine.num_unfinished == 5  # all four accepted while "first" runs (~200 steps to go)
        async for _ in running:
            pass
        await asyncio.gather(*tasks)
        return finished

    return asyncio.run(main())
