"""Dequantizing a GGUF model's matrices: gguf-py (numpy, the CPU) against torch (checkpoint/gguf_dequant.py) on
the CPU and, where there is one, on CUDA, side by side on the same random blocks, in alternating order.

    python benchmarks/gguf_dequant.py                    # a 4096 x 4096 matrix of each format
    python benchmarks/gguf_dequant.py --rows 14336       # Llama-3-8B's MLP matrices

A CUDA time starts from the bytes on the host (the file's pages) and ends with the float32 weights on the
device, synchronized: the copy of the quantized bytes is in it. The last column scales the fastest time to a
Llama-3-8B's 8.03e9 weights (the rate of that format alone; a ``Q4_K_M`` file mixes Q4_K and Q6_K).
"""

from __future__ import annotations

import argparse
import time

import gguf
import numpy as np
import torch

from sloserve.checkpoint.gguf_dequant import dequantize

FORMATS = ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q2_K", "Q3_K", "MXFP4", "F16", "BF16"]
LLAMA3_8B_WEIGHTS = 8.03e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--columns", type=int, default=4096)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    shape = (args.rows, args.columns)
    print(f"{args.rows} x {args.columns} weights, best of {args.repeats}; torch {torch.get_num_threads()} threads")
    print("| format | gguf-py s | torch CPU s | CPU ratio | torch CUDA s | CUDA ratio | 8B model at the best s |")
    print("|---|---|---|---|---|---|---|")
    for name in args.formats.split(","):
        tensor_type = gguf.GGMLQuantizationType[name]
        block_weights, block_bytes = gguf.GGML_QUANT_SIZES[tensor_type]
        rng = np.random.default_rng(0)
        # Random bytes, each below 0x40: every float16 or bfloat16 in them (a block's scales, an F16 weight) is
        # finite and normal, as a real file's are, and any bytes are blocks
        raw = rng.integers(0, 0x40, (args.rows, args.columns // block_weights * block_bytes), dtype=np.uint8)
        as_read = raw.view(np.float16) if name == "F16" else raw  # (as GGUFReader gives an F16 tensor)
        host = torch.from_numpy(raw)
        runs: dict[str, list[float]] = {"gguf-py": [], "cpu": [], "cuda": []}
        for _ in range(args.repeats):  # alternating: a drift of the machine falls on each
            start = time.perf_counter()
            gguf.quants.dequantize(as_read, tensor_type)
            runs["gguf-py"].append(time.perf_counter() - start)
            start = time.perf_counter()
            dequantize(host, int(tensor_type), shape)
            runs["cpu"].append(time.perf_counter() - start)
            if cuda:
                torch.cuda.synchronize()
                start = time.perf_counter()
                dequantize(host.to("cuda"), int(tensor_type), shape)
                torch.cuda.synchronize()
                runs["cuda"].append(time.perf_counter() - start)
        best = {k: min(v) for k, v in runs.items() if v}
        on_cuda = f"{best['cuda']:.4f} | {best['gguf-py'] / best['cuda']:.1f}x" if cuda else "- | -"
        per_weight = min(best.values()) / (args.rows * args.columns)
        print(
            f"| {name} | {best['gguf-py']:.4f} | {best['cpu']:.4f} | {best['gguf-py'] / best['cpu']:.2f}x | "
            f"{on_cuda} | {per_weight * LLAMA3_8B_WEIGHTS:.1f} |"
        )


if __name__ == "__main__":
    main()
