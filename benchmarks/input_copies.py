"""What a decode step's input copies cost the host (issue 43 item 4). Under the served load of the third GPU
session (H200, 2026-12-04) py-spy found the engine core thread in ``copy_to_device`` under
``DecodeGraphs.forward`` for 11-13% of its samples, about 0.7 ms of a 20 ms step: the step's two copies (the
inputs, 5 x B int64, and the slot table, B x W int64, into views of the graphs' static buffers), each pinned
by ``Tensor.pin_memory`` then copied without blocking. Which part costs that?

    python benchmarks/input_copies.py            # on CUDA
    python benchmarks/input_copies.py --smoke    # on the CPU: a check of the script, its times mean nothing

Each variant is timed on the host (microseconds a call, the median of --calls calls) while the GPU runs a
long kernel queued first, as under async scheduling, where the forward pass before is in flight: a copy
that waits for the device shows as milliseconds. The variants: ``InputStaging.copy``, as the graphs copy
their inputs since 2026-12-04 (pinned buffers kept, two in turn); ``copy_to_device``, as they did before
(each array pinned by ``Tensor.pin_memory``, then copied), into the buffers' views and into a contiguous
destination; ``pin_memory`` alone; a copy from one pinned buffer made once (no wait for its copy before
the last); and from pageable memory (a wait).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from sloserve.engine.async_scheduling import InputStaging

MAX_BATCH, TABLE_BLOCKS = 256, 256  # a decode graph's largest batch; a 4,096-token context's 16-slot blocks


def copy_to_device(destination: torch.Tensor, host: torch.Tensor) -> None:
    """How the graphs copied their inputs before ``InputStaging``: pinned by ``pin_memory`` each call."""
    if destination.device.type != "cuda":
        destination.copy_(host)
    else:
        destination.copy_(host.pin_memory(), non_blocking=True)


# (destination view, a contiguous destination, a pinned copy of the array made once, the buffer's staging,
# the array) -> one copy
Copy = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, InputStaging, np.ndarray], object]
VARIANTS: dict[str, Copy] = {
    "InputStaging.copy, into the buffers' views": lambda view, dense, pinned, staging, a: staging.copy(view, a),
    "copy_to_device, into the buffers' views": lambda view, dense, pinned, staging, a: copy_to_device(
        view, torch.from_numpy(a)
    ),
    "copy_to_device, into contiguous tensors": lambda view, dense, pinned, staging, a: copy_to_device(
        dense, torch.from_numpy(a)
    ),
    "pin_memory alone": lambda view, dense, pinned, staging, a: (
        torch.from_numpy(a).pin_memory() if view.is_cuda else None
    ),
    "from a pinned buffer made once (views)": lambda view, dense, pinned, staging, a: view.copy_(
        pinned, non_blocking=True
    ),
    "from pageable memory (views)": lambda view, dense, pinned, staging, a: view.copy_(torch.from_numpy(a)),
}


def host_us(fn: Callable[[], object], calls: int, busy: Callable[[], None]) -> float:
    """Median microseconds of ``fn`` on the host, each call after ``busy`` (a kernel queued ahead)."""
    times = []
    for _ in range(calls):
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # NOTE: the copies before this one have run, as in the engine (its step before's)
        busy()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="8,64,256")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--smoke", action="store_true", help="on the CPU, a few calls")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    calls = 5 if args.smoke else args.calls
    # (the GPU kept busy 2 ms ahead of each call: torch.cuda._sleep spins for a count of clock cycles)
    busy = (lambda: torch.cuda._sleep(4_000_000)) if cuda else (lambda: None)
    inputs = torch.zeros(5, MAX_BATCH, dtype=torch.int64, device=device)  # (5, max batch): the graphs' buffers
    tables = torch.zeros(MAX_BATCH, TABLE_BLOCKS * 2, dtype=torch.int64, device=device)  # (max batch, width)
    print(f"a decode step's input copies on {torch.cuda.get_device_name() if cuda else 'the CPU'}: host us a call")
    print(f"\n{'batch':>5} {'what':<44} {'inputs us':>10} {'table us':>9}")
    rng = np.random.default_rng(0)
    for b in (int(x) for x in args.batches.split(",")):
        host_inputs = rng.integers(0, 1 << 20, size=(5, b))  # (5, b) int64
        host_table = rng.integers(0, 1 << 20, size=(b, TABLE_BLOCKS))  # (b, W) int64
        pinned = [torch.from_numpy(a).pin_memory() if cuda else torch.from_numpy(a) for a in (host_inputs, host_table)]
        dense = [torch.empty(a.shape, dtype=torch.int64, device=device) for a in (host_inputs, host_table)]
        target = [inputs[:, :b], tables[:b, :TABLE_BLOCKS]]  # the buffers' views, as DecodeGraphs.forward's
        staging = [InputStaging(device), InputStaging(device)]
        for what, copy in VARIANTS.items():
            us = [
                host_us(partial(copy, target[i], dense[i], pinned[i], staging[i], a), calls, busy)
                for i, a in enumerate((host_inputs, host_table))
            ]
            print(f"{b:>5} {what:<44} {us[0]:>10.1f} {us[1]:>9.1f}")
    print(f"\n(the table {TABLE_BLOCKS} blocks wide; each call after a ~2 ms kernel queued ahead on CUDA)")


if __name__ == "__main__":
    main()
