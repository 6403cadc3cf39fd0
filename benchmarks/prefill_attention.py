"""The prefill kernel's tile, warps and pipeline stages on the GPU (issue 43): the attention of a chunked
prefill alone (``TritonAttention.forward`` on a prefill-only step, dense prefills off), timed for each
(BLOCK_M, BLOCK_N, warps, stages) at the shapes the engine gives it, to pick the kernel's launch from
measurements rather than FlashAttention-2's defaults (64 x 64, 4 warps, Triton's 3 stages).

    python benchmarks/prefill_attention.py           # Llama-3-8B's heads (32 query, 8 KV, 128) in bf16, on CUDA
    python benchmarks/prefill_attention.py --smoke   # tiny cases in Triton's interpreter: checks this script

Why: every chunk after cached tokens runs this kernel (Sarathi's chunks, a prompt whose prefix was cached),
and so does a mixed step's chunk: on the H200 (2026-12-04) a 512-token chunk after 1,024 cached tokens took 1.4
ms of the mixed step's 19.0 ms of kernels, about 245 TFLOP/s where its matmuls ran at 687, and the step's goal
(1.25x its parts' rooflines) needs about 1.2 ms less. The kernel runs Hopper's asynchronous matmuls (wgmma) on
one warpgroup a program at 4 warps; at 8 warps a program may take 128 query rows (two warpgroups), as Triton's
own fused-attention tutorial does on Hopper. ``benchmarks/kernel_resources.py`` gives each variant's registers,
spills and shared memory without a GPU.

Each case is one prefill (CACHED tokens then a CHUNK of new ones) in 16-slot blocks at random places of the
cache; each variant is timed on copies of the cache (an engine's layers, each with its own), its calls captured
in one CUDA graph and replayed (``timing.graphed_median_s``), and checked against the default's output. The
table gives per case every variant's time of one layer's call (the KV write and the kernel) and its rate in
TFLOP/s (4 x heads x head_dim per visible query-key pair: the two matmuls), fastest first; "beside decodes" is the
launch a mixed step's chunk gets on its own stream beside the decode kernel (``OVERLAP_PREFILL_LAUNCH``: 64 x 32,
2 stages, at most 192 registers a thread), timed alone: what that launch costs where nothing runs beside it.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from functools import partial

if "--smoke" in sys.argv:  # (before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402

from sloserve.engine.attention import AttentionMetadata, PrefillSeq  # noqa: E402
from sloserve.engine.kv_cache import expand_block_ids  # noqa: E402
from sloserve.engine.triton_attention import TritonAttention  # noqa: E402
from timing import graphed_median_s  # noqa: E402

BLOCK_SIZE = 16  # the KV manager's default block
ROTATED_BYTES = 256 << 20  # the KV the graph of a variant's calls reads at least: 5x an H100's or H200's L2 (50 MB)
MAX_COPIES = 32  # and the most copies of the cache it rotates (a Llama-3-8B step's layers)
DEFAULT = (64, 64, 4, None)  # TritonAttention's: BLOCK_M, BLOCK_N, warps, stages (None: Triton's default, 3)
# The launch of a prefill beside the decode kernel (SLOSERVE_OVERLAP_ATTENTION: OVERLAP_PREFILL_LAUNCH), here alone
BESIDE = "beside decodes"


def backend_for(variant) -> TritonAttention:
    """The backend that launches the prefill kernel as ``variant`` says: a (BLOCK_M, BLOCK_N, warps, stages), or
    ``BESIDE`` (the default backend's launch beside the decodes, as on the mixed step's second stream)."""
    if variant == BESIDE:
        backend = TritonAttention(num_decode_splits=1, dense_prefill_min_tokens=None)
        as_launched = backend.prefill_launch
        backend.prefill_launch = lambda settings, _: as_launched(settings, beside=True)
        return backend
    block_m, block_n, warps, stages = variant
    return TritonAttention(
        block_m=block_m,
        block_n=block_n,
        num_decode_splits=1,
        dense_prefill_min_tokens=None,
        prefill_num_warps=warps,
        prefill_num_stages=stages,
    )


def label(variant) -> str:
    if variant == BESIDE:
        return BESIDE
    block_m, block_n, warps, stages = variant
    return f"{block_m} x {block_n}, {warps}w, {'-' if stages is None else stages}s"


def prefill_step(
    cached: int, chunk: int, heads: tuple[int, int, int], dtype: torch.dtype, device: torch.device
) -> tuple[tuple[torch.Tensor, ...], AttentionMetadata]:
    """(q, k, v, k_cache, v_cache) and the metadata of one prefill of ``chunk`` tokens after ``cached``."""
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(cached * 100_003 + chunk)
    context = cached + chunk
    blocks = -(-context // BLOCK_SIZE)
    ids = torch.randperm(blocks, generator=gen) + 1  # (block 0 unused)
    slots = expand_block_ids(ids.view(1, -1).to(device), BLOCK_SIZE)[0, :context]  # (context,)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    tensors = (
        rand(chunk, num_heads, head_dim),  # q
        rand(chunk, num_kv_heads, head_dim),  # k
        rand(chunk, num_kv_heads, head_dim),  # v
        rand((blocks + 1) * BLOCK_SIZE, num_kv_heads, head_dim),  # k_cache
        rand((blocks + 1) * BLOCK_SIZE, num_kv_heads, head_dim),  # v_cache
    )
    meta = AttentionMetadata(
        slot_mapping=slots[cached:],
        prefills=[PrefillSeq(0, chunk, slots)],
        decode_token_index=torch.zeros(0, dtype=torch.int64, device=device),
        decode_slots=torch.zeros(0, BLOCK_SIZE, dtype=torch.int64, device=device),
        decode_context_lens=torch.zeros(0, dtype=torch.int64, device=device),
    )
    return tensors, meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="1024+512,0+1024,0+4096,2048+256", help="CACHED+CHUNK")
    parser.add_argument("--block-m", default="64,128")
    parser.add_argument("--block-n", default="32,64", help="(128 is cut to 64 for 128-wide heads: TILE_NUMBERS)")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--stages", default="2,3")
    parser.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head dim")
    parser.add_argument("--smoke", action="store_true", help="tiny cases (in Triton's interpreter without CUDA)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.smoke:
        args.cases, args.block_m, args.block_n, args.warps, args.stages, args.heads = (
            "40+24,0+40", "16,32", "16", "4,8", "2", "4,2,16"
        )  # fmt: skip
    heads = tuple(int(x) for x in args.heads.split(","))
    variants = []
    for block_m, block_n, warps, stages in itertools.product(
        *([int(x) for x in option.split(",")] for option in (args.block_m, args.block_n, args.warps, args.stages))
    ):
        # (a tile the backend would cut to fewer rows or keys is another variant's: TritonAttention.tiles)
        backend = TritonAttention(block_m=block_m, block_n=block_n, prefill_num_warps=warps)
        if backend.tiles(heads[2]) == (block_m, block_n):
            variants.append((block_m, block_n, warps, stages))
    variants = [DEFAULT, BESIDE, *(v for v in variants if v[:3] != DEFAULT[:3] or v[3] != 3)]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton's interpreter)"
    print(f"prefill attention alone on {name}, {dtype}, heads {heads}; one layer's call; KV in {BLOCK_SIZE}-slot "
          "blocks; variants BLOCK_M x BLOCK_N, warps, stages (- : Triton's default, 3)")  # fmt: skip

    for case in args.cases.split(","):
        cached, chunk = (int(x) for x in case.split("+"))
        inputs, meta = prefill_step(cached, chunk, heads, dtype, device)
        q, k, v, k_cache, v_cache = inputs
        visible_pairs = chunk * cached + chunk * (chunk + 1) // 2
        flops = 4 * heads[0] * heads[2] * visible_pairs
        kv_bytes = 2 * k_cache.numel() * k_cache.element_size()
        copies = min(MAX_COPIES, -(-ROTATED_BYTES // kv_bytes)) if device.type == "cuda" else 1
        caches = [(k_cache, v_cache)] + [
            (torch.randn_like(k_cache), torch.randn_like(v_cache)) for _ in range(copies - 1)
        ]
        times, reference = {}, None
        for variant in variants:
            backend = backend_for(variant)
            calls = [partial(backend.forward, q, k, v, *kv, meta) for kv in caches]
            try:
                out = calls[0]().float()
            except OutOfResources as error:  # (more shared memory than a multiprocessor has)
                print(f"  {case}: {label(variant)}: {error}")
                continue
            if reference is None:
                reference = out
            error = float((out - reference).norm() / reference.norm())
            assert error < 2e-2 and not out.isnan().any(), f"{case}: {label(variant)}: {error}"
            times[variant] = graphed_median_s(calls, device, rep_ms=40)
        default = times[DEFAULT]
        print(f"\n{cached} cached + {chunk} new tokens ({flops / 1e9:.1f} GFLOP a layer):")
        print(f"{'variant':>22} {'us':>9} {'TFLOP/s':>8} {'vs default':>10}")
        for variant, t in sorted(times.items(), key=lambda item: item[1]):
            print(f"{label(variant):>22} {t * 1e6:>9.1f} {flops / t / 1e12:>8.1f} {default / t:>9.2f}x")


if __name__ == "__main__":
    main()
