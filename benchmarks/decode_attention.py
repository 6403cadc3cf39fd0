"""Flash decoding's split count and tile on the GPU (issue 43): the decode attention alone
(``TritonAttention.forward`` on a decode-only step), timed for each split count and ``BLOCK_N`` at
several batches and contexts, to tune ``triton_attention.decode_splits`` (WAVES, MIN_SPLIT_TOKENS) and
the tile from measurements rather than reasoning.

    python benchmarks/decode_attention.py             # Llama-3-8B's heads (32 query, 8 KV, 128) in bf16, on CUDA
    python benchmarks/decode_attention.py --smoke     # tiny cases in Triton's interpreter: checks this script
    python benchmarks/decode_attention.py --mla 16    # DeepSeek-V2-Lite's: 16 query heads on one 576-number
                                                      # latent key, its first 512 the value (keys only)

Each case is BATCH decodes of CONTEXT tokens each, in 16-slot blocks at random places of the cache (as
paged), with the slot table as wide as the batch's longest context (an eager step's) or as
--max-model-len (a CUDA graph's: ``decode_splits`` counts its splits over the table's width, and a
split past a short context reads nothing). ``decode_splits``' pick at the default tile runs twice: its
splits merged by the combine kernel, and by the decode kernel's last split (``combine_splits_in_kernel``;
"k" in the table: one launch fewer). Every variant's output is checked against one split's. The table
gives per case the fastest variant, the pick (both ways) and one split: the time of one layer's call (the
KV write, the kernel, the combine) and the KV bytes read over it.

On CUDA a variant is timed as the engine's decode graphs run it: calls on copies of the KV cache (an
engine's layers, each with its own, at least ``ROTATED_BYTES`` read in all, so that no call finds the one
before's KV in the L2 cache) captured in one CUDA graph and replayed (``timing.graphed_median_s``). Until
2026-12-04 each call was launched and timed alone: under about 100 us a call the figure was the launches'
(59 us at batch 1 and 1K tokens for a kernel whose profile took 11).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from functools import partial

if "--smoke" in sys.argv:  # (before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from sloserve.engine.attention import AttentionMetadata  # noqa: E402
from sloserve.engine.kv_cache import expand_block_ids  # noqa: E402
from sloserve.engine.triton_attention import TritonAttention, decode_splits, multiprocessors  # noqa: E402
from timing import graphed_median_s  # noqa: E402

BLOCK_SIZE = 16  # the KV manager's default block
MLA_LATENT, MLA_ROPE = 512, 64  # DeepSeek-V2's and V3's kv_lora_rank and qk_rope_head_dim
ROTATED_BYTES = 256 << 20  # the KV the graph of a variant's calls reads at least: 5x an H100's or H200's L2 (50 MB)
MAX_COPIES = 32  # and the most copies of the cache it rotates (a Llama-3-8B step's layers)


def decode_step(
    batch: int,
    context: int,
    width: int,
    heads: tuple[int, int, int],
    dtype: torch.dtype,
    device: torch.device,
    keys_only: bool = False,
) -> tuple[tuple[torch.Tensor | None, ...], AttentionMetadata]:
    """(q, k, v, k_cache, v_cache) and the metadata of ``batch`` decodes of ``context`` tokens, the slot
    table ``width`` slots wide; v and v_cache None when ``keys_only`` (MLA's cache)."""
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(batch * 100_003 + context)
    blocks_per_row = -(-context // BLOCK_SIZE)
    ids = torch.zeros((batch, -(-width // BLOCK_SIZE)), dtype=torch.int64)  # past a context: block 0
    ids[:, :blocks_per_row] = (torch.randperm(batch * blocks_per_row, generator=gen) + 1).view(batch, -1)
    table = expand_block_ids(ids.to(device), BLOCK_SIZE)  # (B, >= width)
    num_slots = (batch * blocks_per_row + 1) * BLOCK_SIZE

    def rand(*shape):  # (random: zeros would hide unwritten outputs, and can run faster)
        return torch.randn(*shape, generator=gen).to(device, dtype)

    tensors = (
        rand(batch, num_heads, head_dim),  # q
        rand(batch, num_kv_heads, head_dim),  # k
        None if keys_only else rand(batch, num_kv_heads, head_dim),  # v
        rand(num_slots, num_kv_heads, head_dim),  # k_cache
        None if keys_only else rand(num_slots, num_kv_heads, head_dim),  # v_cache
    )
    rows = torch.arange(batch, device=device)
    meta = AttentionMetadata(
        slot_mapping=table[rows, context - 1],  # the new token's slot
        prefills=[],
        decode_token_index=rows,
        decode_slots=table,
        decode_context_lens=torch.full((batch,), context, dtype=torch.int64, device=device),
    )
    return tensors, meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--cases", default="1x1024,1x8192,8x1024,8x32768,32x1024,64x1024,256x1024", help="BATCHxCONTEXT"
    )
    parser.add_argument("--max-model-len", type=int, default=8192, help="a CUDA graph's table width")
    parser.add_argument("--splits", default="1,2,4,8,16,32,64")
    parser.add_argument("--block-n", default="32,64", help="(128 is cut to 64 for 128-wide heads: TILE_NUMBERS)")
    parser.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head dim")
    parser.add_argument(
        "--mla", type=int, help="this many query heads on DeepSeek's latent instead (one 576-number key, 512 its value)"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny cases (in Triton's interpreter without CUDA)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.smoke:
        args.cases, args.max_model_len, args.splits, args.block_n, args.heads = (
            "1x128,2x300",
            512,
            "1,2,4",
            "16,64",
            "4,2,16",
        )
    heads = tuple(int(x) for x in args.heads.split(","))
    value_dim = None
    if args.mla:  # (the smoke's: 32 + 8, as the tests' tiny DeepSeek)
        value_dim = 32 if args.smoke else MLA_LATENT
        heads = (args.mla, 1, value_dim + (8 if args.smoke else MLA_ROPE))
    split_counts = [int(x) for x in args.splits.split(",")]
    default_tile = TritonAttention(num_decode_splits=1).block_n
    # (MLA: the default tile only, which the backend cuts to the latent's width: the others would be cut alike)
    tiles = [default_tile] if value_dim else [int(x) for x in args.block_n.split(",")]
    # (a tile the backend would cut to fewer keys, TritonAttention.tiles, would be another tile's run)
    cut = [tile for tile in tiles if TritonAttention(block_n=tile).tiles(heads[2])[1] != tile]
    if cut:
        print(f"BLOCK_N {cut}: cut by the backend to fewer keys for {heads[2]}-wide heads; not timed")
        tiles = [tile for tile in tiles if tile not in cut]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton's interpreter)"
    layout = f"keys only, values their first {value_dim}" if value_dim else "K and V"
    print(
        f"decode attention alone on {name}, {dtype}, heads {heads} ({layout}); one layer's call; "
        f"KV in {BLOCK_SIZE}-slot blocks"
    )

    rows = []
    for case in args.cases.split(","):
        batch, context = (int(x) for x in case.split("x"))
        for width in sorted({context, max(context, args.max_model_len)}):
            inputs, meta = decode_step(batch, context, width, heads, dtype, device, value_dim is not None)
            tensors = 1 if value_dim else 2  # (K and V, or keys only)
            kv_bytes = tensors * batch * context * heads[1] * heads[2] * inputs[3].element_size()
            # the calls of a graph: each on a cache of its own (the first: the inputs'), as an engine's layers
            q, k, v, k_cache, v_cache = inputs
            copies = min(MAX_COPIES, -(-ROTATED_BYTES // kv_bytes)) if device.type == "cuda" else 1
            caches = [(k_cache, v_cache)] + [
                (torch.randn_like(k_cache), None if v_cache is None else torch.randn_like(v_cache))
                for _ in range(copies - 1)
            ]
            times, reference = {}, None
            picked = decode_splits(batch, heads[1], width, multiprocessors(device))
            # (the pick both ways, whether or not --splits names it)
            variants = [(splits, tile, False) for tile in tiles for splits in sorted({*split_counts, picked})]
            variants += [(picked, default_tile, True)] if picked > 1 else []
            for splits, tile, in_kernel in variants:
                if splits > 1 and splits * tile > width:  # (the same work as fewer splits)
                    continue
                backend = TritonAttention(
                    block_n=tile,
                    num_decode_splits=splits,
                    dense_prefill_min_tokens=None,
                    combine_splits_in_kernel=in_kernel,
                )
                calls = [partial(backend.forward, q, k, v, *kv, meta, value_dim=value_dim) for kv in caches]
                out = calls[0]().float()
                if reference is None:
                    reference = out
                error = float((out - reference).norm() / reference.norm())
                assert error < 2e-2 and not out.isnan().any(), (
                    f"{case} width {width}: {splits} splits, tile {tile}, in kernel {in_kernel}: {error}"
                )
                times[splits, tile, in_kernel] = graphed_median_s(calls, device, rep_ms=40)
            best_variant, best = min(times.items(), key=lambda item: item[1])
            rows.append((batch, context, width, best_variant, best, picked, times.get((picked, default_tile, False)),
                         times.get((picked, default_tile, True)), times.get((1, default_tile, False)), kv_bytes))  # fmt: skip

    def us(t: float | None) -> str:
        return "-" if t is None else f"{t * 1e6:.1f}"

    print(f"\n{'batch':>5} {'context':>7} {'table':>6} {'best':>12} {'us':>8} {'GB/s':>7} {'picked':>6} {'us':>8} "
          f"{'k us':>8} {'1 split us':>10} {'best gain':>9}")  # fmt: skip
    for batch, context, width, (splits, tile, in_kernel), best, picked, t_picked, t_in_kernel, t_one, kv_bytes in rows:
        gain = "-" if t_one is None else f"{t_one / best:.2f}x"
        best_name = f"{splits} x {tile}{' k' if in_kernel else ''}"
        print(f"{batch:>5} {context:>7} {width:>6} {best_name:>12} {us(best):>8} {kv_bytes / best / 1e9:>7.0f} "
              f"{picked:>6} {us(t_picked):>8} {us(t_in_kernel):>8} {us(t_one):>10} {gain:>9}")  # fmt: skip
    print(
        f"(best: splits x BLOCK_N, k: merged in the decode kernel; picked: decode_splits' count at BLOCK_N "
        f"{default_tile}, merged by the combine kernel (us) and in the decode kernel (k us); "
        f"{multiprocessors(device)} multiprocessors; KV bytes {math.prod(heads[1:])} x {2 - bool(value_dim)} x context "
        "x batch x itemsize; a wide head's tile is cut to triton_attention.TILE_NUMBERS)"
    )


if __name__ == "__main__":
    main()
