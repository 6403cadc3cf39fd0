"""Async scheduling (issue 43 item 1, vLLM v1's ``--async-scheduling``): the host schedules step t+1 and
builds its inputs while the device still runs step t.

The tokens step t samples stay on the device (``SampledOnDevice``); step t+1's decodes take their input
token from there by a gather, so its forward pass is launched before step t's tokens are known on the
host. Only then does the host wait for them (``SampledOnDevice.token_ids``, during step t+1's forward
pass), append them, and find which requests they ended. The scheduler works from tokens to come, as it
does for the simulator's cohorts: it scheduled step t+1 as if no request ended on step t's token, so a
request that sampled EOS (or a stop token) in step t ran one more token in step t+1, which is dropped,
and the scheduler hears of its end with step t+1, before it counts that step's tokens
(``StepResult.ended_before``): its output count and token times are its kept tokens'. A request that reaches
``max_tokens`` ends by count, so the scheduler hears of that on time; its last token follows a step
later (``LLMEngine.take_finished``). The scheduler times a step's tokens when the step returns, before
they exist on a GPU: a request's first and last token times and its end are set again to when those
tokens reached the host (``EngineExecutor._accept``, ``LLMEngine.take_finished``).

Log-probabilities (of the sampled tokens and of prompt positions) are computed on the device too and
come back with the tokens (``PendingLogprobs``); the score controls that read a request's tokens take
its last one on the device (the penalties count it there, ``min_tokens`` counts it, a bad word of
several tokens matches it there, the tokens before it on the host). A grammar's matcher takes each
token on the host before it masks the next step's scores: a step with such a request waits for the
step before's tokens after its forward pass is launched and before it samples (vLLM v1 fills its
grammar bitmasks so too), so its forward pass still overlaps the wait. A step runs synchronously (its
tokens on the host before it returns, as without async scheduling) only where a chunk of several
tokens needs the last step's token (a preempted request's refill). Where the executor keeps a step log
(``run --out``), a step launched early on a GPU is logged with its own time on the device (CUDA
events), its host time having overlapped the step before's.

NOTE: a copy from pageable host memory to the GPU waits for every kernel queued before it, which would
make the host wait for step t while it prepares step t+1; so a step's inputs go to the device from
pinned memory without blocking: the graphs' static buffers' through pinned buffers they keep
(``InputStaging``), the others' through ``to_device`` (the caching host allocator keeps each pinned buffer
until its copy has run).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from sloserve.core.request import Request
from sloserve.engine.logprobs import PendingLogprobs


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``; to a GPU from pinned memory without blocking the host."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class InputStaging:
    """Pinned host memory that a static device buffer's inputs are written into, step after step, and copied
    from without blocking (vLLM v1 keeps its step inputs so, ``CpuGpuBuffer``): no pinned allocation a step.
    The graphs' static buffers each have one (``DecodeGraphs``, ``PiecewiseGraphs``).

    NOTE: a copy without blocking reads the host memory when the device reaches it, after the kernels queued
    before it, so that memory must not be rewritten until then: the staging alternates between two host
    buffers and waits for a buffer's last copy (an event) before it writes it again. In the engine that copy
    belongs to the step before the last one, whose tokens the host already has (async scheduling launches
    one step ahead), so the wait returns at once."""

    NUM_BUFFERS = 2

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.int64) -> None:
        """``device``: where the copies go (from plain memory on a CPU); ``dtype``: the numbers'."""
        self._pinned = device.type == "cuda"
        # NOTE: each buffer grows to the largest copy made through it (doubling), not to the destination's
        # size: a graph's table of 128k-token contexts would pin hundreds of MiB that short ones never use
        self._buffers = [torch.empty(0, dtype=dtype) for _ in range(self.NUM_BUFFERS)]
        self._copied = [torch.cuda.Event() if self._pinned else None for _ in range(self.NUM_BUFFERS)]
        self._next = 0

    def copy(self, destination: torch.Tensor, values: np.ndarray) -> None:
        """Copy ``values`` (of ``destination``'s shape) into ``destination``, through the next host buffer."""
        i, self._next = self._next, (self._next + 1) % self.NUM_BUFFERS
        copied = self._copied[i]
        if copied is not None and not copied.query():  # (an event never recorded has nothing to wait for)
            copied.synchronize()
        buffer = self._buffers[i]
        if values.size > buffer.numel():  # (the old one is freed once its last copy has run: the allocator's)
            size = max(values.size, 2 * buffer.numel())
            buffer = self._buffers[i] = torch.empty(size, dtype=buffer.dtype, pin_memory=self._pinned)
        host = buffer[: values.size].view(values.shape)  # contiguous, so copied in one piece
        host.numpy()[...] = values
        destination.copy_(host, non_blocking=copied is not None)
        if copied is not None:
            copied.record()


def fill_at(tensor: torch.Tensor, index: tuple[torch.Tensor, ...], value: float) -> None:
    """``tensor[index] = value`` (``index``: tensors on ``tensor``'s device), the value made on the device.
    NOTE: an indexed assignment of a Python number copies it from pageable host memory to a GPU tensor's
    device (``index_put_`` moves a CPU scalar there), which waits for every kernel queued before it."""
    tensor.index_put_(index, torch.full((), value, dtype=tensor.dtype, device=tensor.device))


def index_tensor(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device`` (``to_device``)."""
    return to_device(torch.tensor(values, dtype=torch.int64), device)


def float_tensor(values: Sequence[float], device: torch.device) -> torch.Tensor:
    """``values`` (ints taken too) as a float32 tensor on ``device`` (``to_device``)."""
    return to_device(torch.tensor(values, dtype=torch.float32), device)


class SampledOnDevice:
    """What one step sampled, still on the device: one row per request that sampled, and the
    log-probabilities of those rows and prompt positions that ask for them (``PendingLogprobs``)."""

    __slots__ = ("device_ids", "rows", "logprobs", "prompt_logprobs", "_host", "_copied")

    def __init__(
        self,
        device_ids: torch.Tensor,  # (N,) int64, row i sampled by requests[i]
        requests: list[Request],
        logprobs: PendingLogprobs | None = None,  # of some of the N rows (``rows`` their indices)
        prompt_logprobs: Sequence[PendingLogprobs] = (),  # of prompt positions (``rows``: their sequences)
    ) -> None:
        self.device_ids = device_ids
        self.rows = {request: row for row, request in enumerate(requests)}
        self.logprobs, self.prompt_logprobs = logprobs, list(prompt_logprobs)
        self._copied = None
        if device_ids.device.type == "cuda":
            # NOTE: started now, so that reading them waits for this step's sampling only, not for the
            # step launched after it
            self._host = _start_host_copy(device_ids)
            for pending in (*self.prompt_logprobs, *([logprobs] if logprobs is not None else [])):
                pending.found = pending.found._make(_start_host_copy(t) for t in pending.found)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            self._host = device_ids

    def token_ids(self) -> list[int]:
        """The sampled tokens on the host, row by row (waits for them, and for the log-probabilities)."""
        if self._copied is not None:
            self._copied.synchronize()
        return self._host.tolist()


def _start_host_copy(device: torch.Tensor) -> torch.Tensor:
    """A pinned host tensor that ``device`` is being copied into, without blocking."""
    host = torch.empty(device.shape, dtype=device.dtype, pin_memory=True)
    host.copy_(device, non_blocking=True)
    return host
