"""Engine host time: what the CPU spends on one decode step besides the model, against the time the
GPU needs for that step, at batch 1-256.

A decode step's host work (the flat token lists, every decode's context table, the graph's input
buffers, the sampler's bookkeeping) adds to the step unless it hides behind the GPU's, and the
engine's clock counts it (``StepTimer``, as ``engine_speed.py`` does). This measures it on the CPU,
with the model replaced by ``NoForward`` (zeros of the right shapes), on the CUDA-graph path
(``DecodeGraphs`` with ``capture=False``: its padded static buffers, without a graph). It prints:

- the decodes' context tables as the engine builds them for a paged manager (``block_id_tables``:
  block ids, expanded to slots on the device) next to per-token slot tables of the same requests
  (``slot_tables``: what the engine sent before), and their ratio; both start from the block arrays
  the manager keeps, so the ratio is the per-token expansion's cost. Then the tables of EconoServe's
  pipelined manager, whose slots move one token at a time, so its tables are per token;
- the whole host step, and the H200 roofline time of the same step for Llama-3-8B in bf16 (weights
  + KV read at HBM bandwidth), with the host's share of the sum: the MBU an engine that does not
  overlap the host with the GPU loses to it (goal, issue 6: >= 70% MBU at batch >= 64);
- then a whole engine step (``LLMEngine.step`` with ``NoForward``, the eager path) split between the
  scheduler (``schedule``, ``update``) and the executor's host work, per scheduler: what scheduling
  step t+1 while the GPU runs step t (vLLM v1's async scheduling, issue 43 item 1) could hide. The
  scheduler's share is hidden by that alone; the executor's only if the next step's inputs are
  prepared during the GPU's step too.

NOTE: on the CPU, ``expand_block_ids`` (device work on a GPU) runs on the host, so the host step
here is an upper bound.

    python benchmarks/engine_host.py [--batch-sizes 1,64,128,256] [--kv-lens 1024,4096] [--repeats 30]
        [--schedulers vllm,sarathi,bros] [--steps 100]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from sloserve.core.request import Request
from sloserve.cost import get_gpu, get_model
from sloserve.engine.cuda_graphs import DecodeGraphs
from sloserve.engine.llm_engine import LLMEngine
from sloserve.engine.loader import load_model
from sloserve.engine.profile import StepTimer
from sloserve.engine.sampler import SamplingParams
from sloserve.kv import PagedKVManager
from sloserve.kv.pipelined import PipelinedKVManager

REFERENCE_MODEL, REFERENCE_GPU = "llama-3-8b", "h200"
# The whole step's split: prompts of this many tokens, so that 256 of them fit in tiny-llama's 1,024
# positions with room to decode through a chunking policy's prefills and the timed steps.
SPLIT_PROMPT_TOKENS = 512


class NoForward(nn.Module):
    """The model's interface with no work behind it: zero hidden states and logits."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        self.hidden_size, self.vocab_size = hidden_size, vocab_size

    def forward(self, token_ids, positions, kv_cache, meta) -> torch.Tensor:  # (T, H)
        return torch.zeros(token_ids.shape[0], self.hidden_size)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (N, H) -> (N, vocab)
        return torch.zeros(hidden.shape[0], self.vocab_size)


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def table_times(batch: int, kv_len: int, repeats: int) -> tuple[float, float, float]:
    """ms of (a paged manager's block_id_tables, its slot_tables, a pipelined manager's
    block_id_tables) for ``batch`` decodes of ``kv_len`` cached tokens."""
    bs = StepTimer.BLOCK_SIZE
    num_blocks = batch * (kv_len // bs + 2)
    paged, pipelined = PagedKVManager(num_blocks, bs), PipelinedKVManager(num_blocks, bs)
    requests = [Request(i, 0.0, kv_len + 1, 1, 1) for i in range(batch)]
    for kv in (paged, pipelined):
        for request in requests:
            assert kv.allocate_slots(request, kv_len + 1)
    lengths = np.full(batch, kv_len + 1)
    ids_ms, slots_ms, pipelined_ms = (
        median_ms(lambda read=read: read(requests, lengths), repeats)
        for read in (paged.block_id_tables, paged.slot_tables, pipelined.block_id_tables)
    )
    return ids_ms, slots_ms, pipelined_ms


def step_split(loaded, scheduler: str, batch: int, kv_len: int, steps: int) -> dict[str, float] | str:
    """ms per decode step of ``batch`` requests with ``kv_len`` prompt tokens, by part of
    ``LLMEngine.step``: the scheduler's ``schedule`` and ``update``, the executor's ``execute`` (host
    only: ``NoForward``), and the whole step. Timed once every request decodes; why not, where the policy
    never runs them all together for ``steps`` steps (one that runs requests to their end a few at a time)."""
    max_model_len = loaded.config.max_position_embeddings
    engine = LLMEngine(loaded, scheduler, kv_capacity_tokens=(batch + 1) * max_model_len, max_model_len=max_model_len)
    engine.executor.model = NoForward(loaded.config.hidden_size, loaded.config.vocab_size)
    rng = np.random.default_rng(0)
    # NOTE: as long as the context allows: a policy that chunks prompts (Sarathi's 512-token budget)
    # decodes the first requests while it prefills the last
    params = SamplingParams(max_tokens=max_model_len - kv_len, temperature=0.0, ignore_eos=True)
    requests = [
        engine.add_request(rng.integers(0, loaded.config.vocab_size, kv_len).tolist(), params) for _ in range(batch)
    ]
    while min(r.num_output_tokens for r in requests) < 2:
        engine.step()  # until every request has decoded once (EconoServe's join their cohort)
    left = min(r.max_tokens - r.num_output_tokens for r in requests)
    if left < steps:
        return f"{scheduler} at batch {batch}: {left} decode steps left before a request ends once all decoded, need {steps}"
    spent = {"schedule": 0.0, "update": 0.0, "execute": 0.0}

    def timed(name: str, call):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t0

        return wrapper

    # NOTE: instance attributes over the bound methods: the replica's loop calls these
    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)
    engine.scheduler.update = timed("update", engine.scheduler.update)
    engine.executor.execute = timed("execute", engine.executor.execute)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    spent["step"] = time.perf_counter() - t0
    return {name: seconds / steps * 1e3 for name, seconds in spent.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,64,128,256")
    parser.add_argument("--kv-lens", default="1024,4096", help="tokens cached per decoding request")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--schedulers", default="vllm,sarathi,bros", help="for the whole step's split")
    parser.add_argument("--steps", type=int, default=100, help="decode steps timed per scheduler and batch")
    args = parser.parse_args()
    batches = [int(x) for x in args.batch_sizes.split(",")]
    kv_lens = [int(x) for x in args.kv_lens.split(",")]

    loaded = load_model("random:tiny-llama", device="cpu", dtype="float32")
    timer = StepTimer(loaded, StepTimer.blocks_needed([], [max(kv_lens)] * max(batches)), max_context=max(kv_lens) + 1)
    executor = timer.executor
    executor.model = NoForward(loaded.config.hidden_size, loaded.config.vocab_size)
    executor.graphs = DecodeGraphs(
        executor.model,
        executor.cache,
        max(kv_lens) + 1,
        timer.kv.table_block_size,
        max_batch_size=max(batches),
        capture=False,
    )
    model, gpu = get_model(REFERENCE_MODEL), get_gpu(REFERENCE_GPU)

    table = Table(title=f"Host time of a decode step (CPU) vs the {gpu.name} roofline of {model.name} bf16")
    for column in (
        "batch",
        "KV/req",
        "block ids ms",
        "slot table ms",
        "ratio",
        "pipelined ms",
        "host step ms",
        f"{gpu.name} ms",
        "host share",
    ):
        table.add_column(column, justify="right")
    for kv_len in kv_lens:
        for batch in batches:
            ids_ms, slots_ms, pipelined_ms = table_times(batch, kv_len, args.repeats)
            host_ms = timer.time([], [kv_len] * batch, repeats=args.repeats) * 1e3
            gpu_ms = (model.weight_bytes + batch * (kv_len + 1) * model.kv_bytes_per_token) / gpu.hbm_bandwidth * 1e3
            table.add_row(
                str(batch),
                str(kv_len),
                f"{ids_ms:.3f}",
                f"{slots_ms:.3f}",
                f"{slots_ms / ids_ms:.1f}x",
                f"{pipelined_ms:.3f}",
                f"{host_ms:.2f}",
                f"{gpu_ms:.2f}",
                f"{host_ms / (host_ms + gpu_ms):.0%}",
            )
    Console(width=140).print(table)

    kv_len = SPLIT_PROMPT_TOKENS
    split = Table(title=f"A whole engine step's host time (CPU, eager, {kv_len}+ KV tokens a request), by part")
    for column in ("scheduler", "batch", "schedule ms", "update ms", "execute ms", "step ms", f"{gpu.name} ms",
                   "scheduler share", "host share"):  # fmt: skip
        split.add_column(column, justify="right")
    skipped: list[str] = []
    for name in args.schedulers.split(","):
        for batch in batches:
            ms = step_split(loaded, name, batch, kv_len, args.steps)
            if isinstance(ms, str):
                skipped.append(ms)
                continue
            gpu_ms = (model.weight_bytes + batch * (kv_len + 1) * model.kv_bytes_per_token) / gpu.hbm_bandwidth * 1e3
            split.add_row(
                name,
                str(batch),
                f"{ms['schedule']:.3f}",
                f"{ms['update']:.3f}",
                f"{ms['execute']:.3f}",
                f"{ms['step']:.3f}",
                f"{gpu_ms:.2f}",
                f"{(ms['schedule'] + ms['update']) / (ms['step'] + gpu_ms):.1%}",
                f"{ms['step'] / (ms['step'] + gpu_ms):.1%}",
            )
    Console(width=140).print(split)
    for why in skipped:
        print(f"not timed: {why}")


if __name__ == "__main__":
    main()
