"""The engine's Triton kernels compiled for NVIDIA GPUs without one (issue 43): what ptxas gives each kernel as
the engine launches it on Llama-3-8B's shapes (and the options other models' layers take), read from its cubin:
registers a thread, bytes spilled to local memory, shared memory, warps, and so the programs one
multiprocessor can hold at once.

    python benchmarks/kernel_resources.py                # sm_90 (H100, H200), bf16, a table
    python benchmarks/kernel_resources.py --arch 80,90   # and sm_80 (A100): 86 (A10, RTX 30) and 89 (L4, L40) too
    python benchmarks/kernel_resources.py --json         # JSON lines (tests/engine/test_kernel_resources.py)

How: Triton's own JIT compiles each launch of the engine's wrappers (``TritonAttention.forward``,
``fused_ops``' and ``fused_moe``'s) on CPU tensors, its driver told of the GPU (``PaperDriver``) and its
launches compiled only (``JITFunction.run`` as a warm-up): the specialization a CUDA launch makes (dtypes,
16-byte alignment, strides divisible by 16, constexprs, warps) with nothing run. Triton's interpreter cannot
say any of this: it runs the kernels' code with numpy, never the compiler. A kernel that does not compile for
a GPU fails here, on the CPU; one that cannot fit on its multiprocessor (a launch that fails with "out of
resources" there), spills or holds few programs a multiprocessor shows it before a GPU session times it.

NOTE: the figures are the compiler's, not timings: registers and shared memory bound how many programs run
at once (occupancy), which a memory-bound kernel (a decode's attention, the elementwise kernels) needs to keep
loads in flight; whether that costs time only a GPU says (decode_attention.py, fused_ops.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from typing import NamedTuple

os.environ.pop("TRITON_INTERPRET", None)  # (before triton is imported: the compiler, not the interpreter)

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from prefill_attention import BESIDE, backend_for  # noqa: E402
from sloserve.engine import fused_moe, fused_ops  # noqa: E402
from sloserve.engine.attention import AttentionMetadata, PrefillSeq  # noqa: E402
from sloserve.engine.triton_attention import TritonAttention  # noqa: E402


class Multiprocessor(NamedTuple):
    """A multiprocessor's limits (NVIDIA's CUDA C++ Programming Guide, by compute capability): 65,536 registers
    on all of these, allocated 256 a warp; its shared memory, a program's most, and 1 KB of it kept by the system
    a program; its most warps and programs."""

    shared_bytes: int
    shared_bytes_a_program: int
    warps: int
    programs: int
    registers: int = 65_536
    register_unit: int = 256
    shared_reserved: int = 1024


MULTIPROCESSORS = {
    80: Multiprocessor(164 << 10, 163 << 10, 64, 32),  # A100
    86: Multiprocessor(100 << 10, 99 << 10, 48, 16),  # A10, RTX 30
    89: Multiprocessor(100 << 10, 99 << 10, 48, 24),  # L4, L40, RTX 40
    90: Multiprocessor(228 << 10, 227 << 10, 64, 32),  # H100, H200
}


class PaperDriver:
    """What Triton's JIT asks of a driver before it compiles a launch: the device, its stream, its target. Each
    target is a device of its own (its number the compute capability): Triton keeps a device's target and
    compiled kernels for it once it has seen it."""

    def __init__(self) -> None:
        self.target = GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return self.target.arch

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target


def compile_launches(archs: list[int], launch_all) -> list[tuple[int, str, str, object]]:
    """(compute capability, case, kernel name, Triton's compiled kernel) of every launch
    ``launch_all(case_name_setter)`` makes, once for each of ``archs``, each compiled for it and none run; a
    launch of a kernel compiled already (the same specialization: a case before had it) is not listed again.

    NOTE: for this script's process only: Triton's driver and JIT stay as set here (on a machine without a GPU
    Triton has no driver to go back to)."""
    compiled, case = [], [""]
    real_run = JITFunction.run
    paper = PaperDriver()

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = real_run(self, *args, grid=grid, warmup=True, **kwargs)
        if all(kernel is not seen for *_, seen in compiled):
            compiled.append((paper.target.arch, case[0], self.fn.__name__, kernel))
        return kernel

    driver.set_active(paper)
    JITFunction.run = compile_only
    for arch in archs:
        paper.target = GPUTarget("cuda", arch, 32)
        launch_all(lambda name: case.__setitem__(0, name))
    return compiled


def resources(kernel, arch: int) -> dict:
    """A kernel compiled for ``sm_{arch}``: its registers a thread, spilled bytes (its stack frame and local
    memory), shared memory (dynamic and static) and warps, the programs a multiprocessor holds at once, and
    whether it fits one at all (its shared memory within a program's most, at least one program)."""
    sm = MULTIPROCESSORS[arch]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "-res-usage", cubin.name], capture_output=True, text=True, check=True
        ).stdout
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    registers, warps = int(fields["REG"]), kernel.metadata.num_warps
    shared = kernel.metadata.shared + int(fields["SHARED"])
    registers_a_warp = -(-registers * 32 // sm.register_unit) * sm.register_unit
    programs = min(
        sm.programs,
        sm.warps // warps,
        sm.registers // (registers_a_warp * warps),
        sm.shared_bytes // (shared + sm.shared_reserved),
    )
    spilled = int(fields["STACK"]) + int(fields["LOCAL"])
    fits = programs >= 1 and shared <= sm.shared_bytes_a_program
    # (what one program holds of a multiprocessor as allocated: what kernels running side by side share)
    held = {"registers_a_program": registers_a_warp * warps, "shared_bytes_a_program": shared + sm.shared_reserved}
    return {"warps": warps, "registers": registers, "spilled_bytes": spilled, "shared_bytes": shared,
            "programs_an_sm": programs, "fits": fits, **held}  # fmt: skip


def engine_launches(case, dtype: torch.dtype = torch.bfloat16) -> None:
    """The engine's Triton launches on Llama-3-8B's shapes (32 query heads, 8 KV heads of 128, hidden 4,096,
    MLP 14,336) and the options other layers take, each named by ``case(name)`` before it."""
    gen = torch.Generator().manual_seed(0)

    def step(heads: int, kv_heads: int, head_dim: int, keys_only: bool = False):
        """(q, k, v, k_cache, v_cache, meta) of a 30-token chunk after 100 cached tokens beside decodes of 200
        and 700 tokens, on a 4,096-slot cache (v and v_cache None where ``keys_only``)."""
        slots = torch.randperm(4096, generator=gen)
        chunk_context, decode_contexts = slots[:130], (slots[130:331], slots[331:1032])
        table = torch.zeros(2, 704, dtype=torch.int64)  # (a slot table's width: a multiple of 16)
        for row, context in enumerate(decode_contexts):
            table[row, : len(context)] = context
        meta = AttentionMetadata(
            slot_mapping=torch.cat([chunk_context[100:], *(context[-1:] for context in decode_contexts)]),
            prefills=[PrefillSeq(0, 30, chunk_context)],
            decode_token_index=torch.tensor([30, 31]),
            decode_slots=table,
            decode_context_lens=torch.tensor([201, 701]),
        )
        q = torch.randn(32, heads, head_dim, dtype=dtype)
        k, v = (torch.randn(32, kv_heads, head_dim, dtype=dtype) for _ in range(2))
        k_cache, v_cache = (torch.randn(4096, kv_heads, head_dim, dtype=dtype) for _ in range(2))
        return (q, k, None, k_cache, None, meta) if keys_only else (q, k, v, k_cache, v_cache, meta)

    def attention(name: str, inputs, splits: int = 1, in_kernel: bool = False, **options) -> None:
        case(name)
        backend = TritonAttention(
            num_decode_splits=splits, dense_prefill_min_tokens=None, combine_splits_in_kernel=in_kernel
        )
        backend.forward(*inputs, **options)

    llama = step(32, 8, 128)
    attention("llama: a chunk after 100 cached, 2 decodes", llama)
    # the chunk's launch on its own CUDA stream beside the decode kernel (SLOSERVE_OVERLAP_ATTENTION; without CUDA
    # the backend does not make it, so it is told the prefill is beside)
    case("llama: the chunk beside decodes (overlap)")
    backend_for(BESIDE).forward(*llama)  # (the launch prefill_attention.py times as "beside decodes")
    attention("llama: decodes in 4 splits", llama, splits=4)
    attention("llama: 4 splits merged in the kernel", llama, splits=4, in_kernel=True)
    attention("llama: 32 splits merged in the kernel", llama, splits=32, in_kernel=True)
    gemma2 = step(16, 8, 256)
    attention("gemma 2: head 256, softcap, window", gemma2, splits=4, softcap=50.0, window=64)
    gpt_oss = step(64, 8, 64)
    sinks = torch.zeros(64, dtype=dtype)
    attention("gpt-oss: head 64, sinks, window", gpt_oss, splits=4, sinks=sinks, window=128)
    bloom = step(32, 32, 128)
    attention("bloom: ALiBi", bloom, splits=4, alibi=torch.linspace(0.01, 0.5, 32))
    mla = step(16, 1, 576, keys_only=True)
    attention("deepseek-v2-lite: MLA latent, keys only", mla, splits=4, value_dim=512)

    rows = torch.randn(4, 4096, dtype=dtype)
    case("llama: add-and-RMSNorm, 4 rows")
    fused_ops.add_rms_norm_triton(rows, rows, torch.ones(4096, dtype=dtype), 1e-5)
    case("llama: SiLU-and-multiply, 4 rows")
    fused_ops.silu_and_mul_triton(torch.randn(4, 2 * 14336, dtype=dtype))
    case("llama: rotary, q and k of 4 tokens")
    qk = torch.randn(4, 40, 128, dtype=dtype)
    fused_ops.rotary_triton(qk, torch.randn(4, 1, 128), torch.randn(4, 1, 128))
    case("llama: KV write, 4 tokens")
    kv = torch.randn(4, 8, 128, dtype=dtype)
    cache = torch.zeros(64, 8, 128, dtype=dtype)
    fused_ops.write_kv_triton(kv, kv, cache, cache.clone(), torch.arange(4))

    case("qwen3-30b-a3b: a MoE layer, 4 tokens")
    experts, hidden, intermediate, top_k = 128, 2048, 768, 8
    x = torch.randn(4, hidden, dtype=dtype)
    chosen = torch.randperm(experts, generator=gen)[: 4 * top_k].view(4, top_k)
    fused_moe.fused_experts(
        x,
        chosen,
        torch.full((4, top_k), 1 / top_k),
        torch.randn(experts, 2 * intermediate, hidden, dtype=dtype),
        torch.randn(experts, hidden, intermediate, dtype=dtype),
        fused_ops.silu_and_mul_torch,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--arch", default="90", help=f"GPUs' compute capabilities x 10, comma-separated, of {sorted(MULTIPROCESSORS)}"
    )
    parser.add_argument("--json", action="store_true", help="a JSON line a kernel instead of the table")
    args = parser.parse_args()
    archs = [int(x) for x in args.arch.split(",")]
    unknown = sorted(set(archs) - set(MULTIPROCESSORS))
    if unknown:
        parser.error(f"--arch {args.arch}: no multiprocessor limits for {unknown}; known: {sorted(MULTIPROCESSORS)}")
    rows = [
        {"arch": arch, "case": case, "kernel": name, **resources(kernel, arch)}
        for arch, case, name, kernel in compile_launches(archs, engine_launches)
    ]
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return
    print(f"the engine's Triton kernels, bf16, as launched (triton {triton.__version__}); programs a multiprocessor: "
          "the fewest its registers, shared memory and warps allow")  # fmt: skip
    for arch in archs:
        print(f"\nsm_{arch}\n{'case':<44} {'kernel':<24} {'warps':>5} {'registers':>9} {'spilled B':>9} "
              f"{'shared KB':>9} {'programs/SM':>11}")  # fmt: skip
        for row in (row for row in rows if row["arch"] == arch):
            fits = "" if row["fits"] else "  does not fit"
            print(f"{row['case']:<44} {row['kernel']:<24} {row['warps']:>5} {row['registers']:>9} "
                  f"{row['spilled_bytes']:>9} {row['shared_bytes'] / 1024:>9.1f} {row['programs_an_sm']:>11}{fits}")  # fmt: skip


if __name__ == "__main__":
    main()
