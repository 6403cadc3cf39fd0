"""Engine speed: decode throughput and model bandwidth utilization (MBU) at batch 1-256, prefill model
FLOPs utilization (MFU) at 1k-16k tokens, for a random model of a real shape.

    python benchmarks/engine_speed.py                       # random:llama-3-8b, bf16, cuda, H200 peaks
    python benchmarks/engine_speed.py --device cpu --model random:tiny-llama --dtype float32

A step is timed as the engine's clock counts it (``StepTimer``: slot tables, attention metadata,
forward pass, logits and sampling), so the figures are what a served request sees. On CUDA with the
Triton backend, each decode batch is timed both eagerly and replaying CUDA graphs (``--cuda-graphs``
of the engine), side by side.
MBU = (weight bytes + KV bytes read) per decode step / step time / HBM bandwidth.
MFU = (2 x matmul parameters x tokens + causal attention FLOPs) / step time / peak dense FLOP/s.
Goals on the H200 (issue 6): MBU >= 70% at batch >= 64, MFU >= 50% at >= 4k prompt tokens.
On the CPU there are no published peaks: the ratios are printed only with --gpu.
"""

from __future__ import annotations

import argparse

import torch

from sloserve.cost import get_gpu
from sloserve.engine.llm_engine import kv_bytes_per_token
from sloserve.engine.loader import cuda_graphs_supported, load_model, resolve_attention_backend, resolve_device
from sloserve.engine.profile import StepTimer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:llama-3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention-backend", default="auto", help="auto (triton on CUDA), torch or triton")
    parser.add_argument("--gpu", default=None, help="GPU spec for the peaks [h200 on cuda, none on cpu]")
    parser.add_argument("--batch-sizes", default="1,8,32,64,128,256")
    parser.add_argument("--kv-len", type=int, default=1024, help="tokens cached per decoding request")
    parser.add_argument("--prefill", default="1024,4096,8192,16384")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-cuda-graphs", action="store_true", help="time decode steps eagerly only")
    args = parser.parse_args()

    device = resolve_device(args.device)
    backend = resolve_attention_backend(args.attention_backend, device)
    cuda_graphs = not args.no_cuda_graphs and cuda_graphs_supported(device, backend)
    loaded = load_model(
        args.model,
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        cuda_graphs=cuda_graphs,
    )
    gpu_name = args.gpu or ("h200" if loaded.device.type == "cuda" else None)
    gpu = get_gpu(gpu_name) if gpu_name else None
    c = loaded.config
    params = sum(p.numel() for p in loaded.model.parameters())
    embed = c.vocab_size * (c.word_embed_proj_dim or c.hidden_size)
    # A decode step reads every weight but the input embedding table (only B rows of it, unless the
    # LM head shares it); a prefill multiplies every token by the layers, and one token per
    # sequence by the LM head.
    weight_bytes = (params - (0 if c.tie_word_embeddings else embed)) * loaded.dtype.itemsize
    layer_params = params - embed * (1 if c.tie_word_embeddings else 2)
    args.kv_len = min(args.kv_len, c.max_position_embeddings - 1)
    batches = [int(x) for x in args.batch_sizes.split(",")]
    prompts = [int(x) for x in args.prefill.split(",") if int(x) <= c.max_position_embeddings]
    timer = StepTimer(
        loaded,
        max(
            StepTimer.blocks_needed([], [args.kv_len] * max(batches)),
            StepTimer.blocks_needed([(max(prompts, default=1), 0)], []),
        ),
        max_context=max([args.kv_len + 1, *prompts]),
    )
    graphs = timer.executor.graphs
    per_token_kv = kv_bytes_per_token(loaded)
    device_name = (
        f"{loaded.device} ({torch.cuda.get_device_name(loaded.device)})" if loaded.device.type == "cuda" else "cpu"
    )
    print(
        f"{args.model}, {loaded.dtype}, {device_name}, {loaded.attention_backend} attention; "
        f"{params / 1e9:.2f} B parameters; peaks: "
        f"{f'{gpu.name} {gpu.hbm_bandwidth / 1e12:.2f} TB/s, {gpu.peak_flops / 1e12:.0f} TFLOP/s' if gpu else 'none'}"
    )
    print(
        f"\n{'decode batch':>12} {'KV/req':>7} {'eager ms':>9} {'graph ms':>9} {'speedup':>8} {'tok/s':>10} "
        f"{'MBU eager':>10} {'MBU graph':>10}"
    )

    def mbu(bytes_read: int, t: float | None) -> str:
        return f"{bytes_read / t / gpu.hbm_bandwidth:.1%}" if gpu and t else "-"

    for b in batches:
        read = weight_bytes + b * (args.kv_len + 1) * per_token_kv
        timer.executor.graphs = None
        eager = timer.time([], [args.kv_len] * b, repeats=args.repeats)
        timer.executor.graphs = graphs
        graphed = timer.time([], [args.kv_len] * b, repeats=args.repeats) if graphs else None
        best = min(eager, graphed or eager)
        print(
            f"{b:>12} {args.kv_len:>7} {eager * 1e3:>9.3f} {f'{graphed * 1e3:.3f}' if graphed else '-':>9} "
            f"{f'{eager / graphed:.2f}x' if graphed else '-':>8} {b / best:>10.1f} {mbu(read, eager):>10} "
            f"{mbu(read, graphed):>10}"
        )
    print(f"\n{'prefill tokens':>14} {'step ms':>9} {'tok/s':>10} {'MFU':>7}")
    for n in prompts:
        t = timer.time([(n, 0)], [], repeats=args.repeats)
        # Causal attention: QK^T and PV, 2 FLOPs per multiply-add, half the n x n scores.
        attention = 2 * 2 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * n * n / 2
        flops = 2 * layer_params * n + 2 * embed + attention
        mfu = f"{flops / t / gpu.peak_flops:.1%}" if gpu else "-"
        print(f"{n:>14} {t * 1e3:>9.3f} {n / t:>10.1f} {mfu:>7}")


if __name__ == "__main__":
    main()
