"""The fused elementwise kernels alone (issue 43 item 2): add-and-RMSNorm, SiLU-and-multiply, the rotary
embedding and the KV write (``engine/fused_ops.py``), each beside its PyTorch form, at a decode's few rows and
a prefill's thousands, as the decode graphs run them.

    python benchmarks/fused_ops.py            # Llama-3-8B's sizes in bf16, on CUDA
    python benchmarks/fused_ops.py --smoke    # tiny sizes in Triton's interpreter: checks this script

Why: the graphed batch-1 decode step of the third GPU session (H200, 2026-12-04) took 4.77 ms, 4.0 of it the
matmuls; of the rest, add-and-RMSNorm took 3.1 us a call (64 a step) where SiLU-and-multiply, which moves
more bytes, took 1.4. Add-and-RMSNorm runs one program per row, so a decode's row of 4,096 numbers is one
SM's work, and its warps set how many loads that SM has in flight: it is timed at 4 warps (Triton's
default, the engine's) and at 8, 16 and 32 (vLLM's CUDA kernel gives a row 1,024 threads: 32 warps).

Each variant is timed on copies of its inputs (at least ``ROTATED_BYTES`` in all, at most ``MAX_COPIES``: a
step's layers each read their own), its calls captured in one CUDA graph and replayed
(``timing.graphed_median_s``), and checked against the PyTorch form. The table gives each call's time, the
bytes it moves (read and written) over that time, that rate against a device copy's, and the PyTorch form's
time over the kernel's. Then the decode step's share: the fused kernels of a layer (two add-and-RMSNorms,
one each of the others) times the model's layers, at each variant's best.
"""

from __future__ import annotations

import argparse
import os
import sys

if "--smoke" in sys.argv:  # (before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from sloserve.engine import fused_ops  # noqa: E402
from timing import copy_rate_bytes_s, graphed_median_s  # noqa: E402

ROTATED_BYTES = 256 << 20  # what a variant's graph reads at least: 5x an H100's or H200's L2 cache (50 MB)
MAX_COPIES = 32  # and the most copies of its inputs it rotates (a Llama-3-8B step's layers)
WARPS = (4, 8, 16, 32)  # add-and-RMSNorm's warps a program (4: Triton's default, the engine's)
ENGINES = " (the engine's)"  # how the name of the variant the engine runs ends


class Sizes:
    """A model's sizes for these kernels: hidden H, intermediate I, query and KV heads, head dim, layers."""

    def __init__(self, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, layers: int):
        self.hidden, self.intermediate, self.layers = hidden, intermediate, layers
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim


LLAMA_3_8B = Sizes(4096, 14336, 32, 8, 128, 32)
TINY = Sizes(64, 176, 4, 2, 16, 2)


def cases(sizes: Sizes, tokens: int, dtype: torch.dtype, device: torch.device):
    """(kernel, bytes a call moves, make_inputs, {variant: call}, check) for ``tokens`` rows. ``make_inputs()``
    gives one copy of the inputs; a variant's ``call(inputs)`` runs the kernel on them and returns its output;
    ``check(out, reference)`` raises where a variant's output is not the PyTorch form's."""
    e = torch.finfo(dtype).bits // 8
    h, i, nh, nkv, hd = sizes.hidden, sizes.intermediate, sizes.heads, sizes.kv_heads, sizes.head_dim

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=dtype, device=device)

    def close(out, reference) -> None:
        for a, b in zip(out, reference, strict=True):
            torch.testing.assert_close(a, b, rtol=4 * torch.finfo(dtype).eps, atol=4 * torch.finfo(dtype).eps)

    def norm_inputs():
        return randn(tokens, h), randn(tokens, h), randn(h), 1e-5

    norm = {"PyTorch (add, then rms_norm)": lambda a: fused_ops.add_rms_norm_torch(*a)}
    for warps in WARPS:
        name = f"fused, {warps} warps" + (ENGINES if warps == 4 else "")
        norm[name] = lambda a, w=warps: fused_ops.add_rms_norm_triton(*a, num_warps=w)
    yield "add-and-RMSNorm", (4 * tokens * h + h) * e, norm_inputs, norm, close

    silu = {"PyTorch (silu, then mul)": lambda a: (fused_ops.silu_and_mul_torch(a[0]),)}
    silu["fused" + ENGINES] = lambda a: (fused_ops.silu_and_mul_triton(a[0]),)
    yield "SiLU-and-multiply", 3 * tokens * i * e, lambda: (3 * randn(tokens, 2 * i),), silu, close

    def rotary_inputs():
        qkv = randn(tokens, nh + 2 * nkv, hd)  # the fused QKV projection's output: Q and K rotated in a view
        angles = torch.rand(tokens, 1, hd // 2, device=device) * 6.3
        cos = torch.cat((angles.cos(), angles.cos()), dim=-1).to(dtype)  # (T, 1, hd), rotate-half layout
        sin = torch.cat((angles.sin(), angles.sin()), dim=-1).to(dtype)
        return qkv[:, : nh + nkv], cos, sin

    rotary = {"PyTorch (5 kernels)": lambda a: (fused_ops.rotary_torch(*a),)}
    rotary["fused" + ENGINES] = lambda a: (fused_ops.rotary_triton(*a),)
    yield "rotary (Q and K)", (2 * tokens * (nh + nkv) * hd + 2 * tokens * hd) * e, rotary_inputs, rotary, close

    def kv_inputs():
        qkv = randn(tokens, nh + 2 * nkv, hd)
        slots = 4 * tokens
        caches = (torch.zeros(slots, nkv, hd, dtype=dtype, device=device) for _ in range(2))
        mapping = torch.randperm(slots, device=device)[:tokens]
        return qkv[:, nh : nh + nkv], qkv[:, nh + nkv :], *caches, mapping

    def written(write):
        def call(a):
            write(*a)
            return a[2], a[3]  # the caches (the check compares them whole)

        return call

    write = {"PyTorch (2 index copies)": written(fused_ops.write_kv_torch)}
    write["fused" + ENGINES] = written(fused_ops.write_kv_triton)

    def stored(out, reference) -> None:
        assert all(torch.equal(a, b) for a, b in zip(out, reference, strict=True)), "a slot not written as PyTorch"

    yield "KV write", (4 * tokens * nkv * hd * e + 8 * tokens), kv_inputs, write, stored


def seeded(make_inputs):
    """The same inputs each call (a fresh copy: a KV write's caches are written)."""
    torch.manual_seed(1)
    return make_inputs()


def time_call(call, make_inputs, num_bytes: int, device: torch.device) -> float:
    """Seconds of one ``call``, on copies of its inputs captured in one graph (``graphed_median_s``)."""
    copies = [make_inputs() for _ in range(max(1, min(MAX_COPIES, ROTATED_BYTES // max(num_bytes, 1))))]
    return graphed_median_s([lambda a=a: call(a) for a in copies], device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,8,64,256,4096", help="rows a call: decodes, or a prefill's tokens")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (Triton's interpreter)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    sizes, dtype = (TINY, torch.float32) if args.smoke else (LLAMA_3_8B, torch.bfloat16)
    tokens_list = [1, 8] if args.smoke else [int(t) for t in args.tokens.split(",")]
    torch.manual_seed(0)
    copy_rate = copy_rate_bytes_s(device) if device.type == "cuda" else None
    title = f"Fused elementwise kernels on {torch.cuda.get_device_name() if device.type == 'cuda' else 'the CPU'}"
    table = Table(title=f"{title}, {dtype}, hidden {sizes.hidden}, intermediate {sizes.intermediate}")
    for column in ("kernel", "rows", "variant", "us a call", "GB/s", "of a copy's", "PyTorch / this"):
        table.add_column(column, justify="left" if column in ("kernel", "variant") else "right")
    measured: dict[tuple[str, int], dict[str, float]] = {}  # (kernel, rows) -> variant -> seconds a call
    for tokens in tokens_list:
        for kernel, num_bytes, make_inputs, variants, check in cases(sizes, tokens, dtype, device):
            reference_name = next(iter(variants))
            reference = variants[reference_name](seeded(make_inputs))
            times = measured[kernel, tokens] = {}
            for name, call in variants.items():
                if name != reference_name:  # (on inputs of its own, equal to the reference's)
                    check(call(seeded(make_inputs)), reference)
                times[name] = time_call(call, make_inputs, num_bytes, device)
            for name, seconds in times.items():
                rate = num_bytes / seconds
                table.add_row(
                    kernel,
                    str(tokens),
                    name,
                    f"{seconds * 1e6:.2f}",
                    f"{rate / 1e9:,.0f}",
                    "-" if copy_rate is None else f"{rate / copy_rate:.0%}",
                    f"{times[reference_name] / seconds:.2f}x",
                )
            table.add_section()
    console = Console(width=140)
    console.print(table)
    if copy_rate is not None:
        console.print(f"a device copy: {copy_rate / 1e12:.2f} TB/s (bytes read and written)")
    calls_a_layer = {"add-and-RMSNorm": 2, "SiLU-and-multiply": 1, "rotary (Q and K)": 1, "KV write": 1}
    for tokens in tokens_list:
        engine, fastest, picks = 0.0, 0.0, []
        for kernel, calls in calls_a_layer.items():
            fused = {name: t for name, t in measured[kernel, tokens].items() if name.startswith("fused")}
            pick = min(fused, key=fused.get)
            engine += calls * next(t for name, t in fused.items() if name.endswith(ENGINES))
            fastest += calls * fused[pick]
            picks.append(f"{kernel}: {pick}")
        console.print(
            f"{tokens} rows: a step's fused elementwise kernels ({sizes.layers} layers) {engine * sizes.layers * 1e3:.3f}"
            f" ms as the engine runs them, {fastest * sizes.layers * 1e3:.3f} ms at each one's fastest ({'; '.join(picks)})"
        )


if __name__ == "__main__":
    main()
