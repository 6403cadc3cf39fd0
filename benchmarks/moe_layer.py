"""A mixture of experts' layer alone on the GPU: the reference (``models.moe.by_expert``: the pairs grouped by
expert on the host, one pair of matmuls an expert) against the fused kernels (``engine/fused_moe.py``), eagerly
and replayed as a CUDA graph (which only the fused path allows), at decode and prefill token counts.

    python benchmarks/moe_layer.py           # Qwen3-30B-A3B's experts (128 of 2048 x 768, 8 a token), bf16, CUDA
    python benchmarks/moe_layer.py --smoke   # tiny, in Triton's interpreter: checks this script

Each row: the tokens, the experts they reach, the reference's time, the fused kernels' eagerly and graphed,
the graphed fused path's speed-up over the reference, and the bytes of the reached experts' weights read
over the graphed time (a decode's layer is bound by them: the H200's 4.8 TB/s is the ceiling). The routing is a
random router's top 8 of a softmax; the outputs are checked against the reference's.
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial

if "--smoke" in sys.argv:  # (before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from sloserve.engine.cuda_graphs import capture_graph  # noqa: E402
from sloserve.engine.models.moe import Experts, use_fused_experts  # noqa: E402
from timing import median_s  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,8,32,64,256,1024,4096")
    parser.add_argument("--shape", default="128,8,2048,768", help="experts, experts a token, hidden, intermediate")
    parser.add_argument("--smoke", action="store_true", help="tiny, in Triton's interpreter without CUDA")
    args = parser.parse_args()
    if args.smoke:
        args.tokens, args.shape = "1,8", "8,2,64,32"
    num_experts, top_k, hidden, inner = (int(x) for x in args.shape.split(","))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device).manual_seed(0)
    reference = Experts(num_experts, hidden, inner).to(device, dtype)
    fused = Experts(num_experts, hidden, inner).to(device, dtype)
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device=device) * 0.02)
    fused.load_state_dict(reference.state_dict())
    use_fused_experts(fused)
    router = torch.randn(num_experts, hidden, generator=gen, device=device).to(dtype)
    expert_bytes = 3 * hidden * inner * reference.down.element_size()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton's interpreter)"
    print(f"MoE layer alone on {name}, {dtype}: {num_experts} experts of {hidden} x {inner}, {top_k} a token")
    print(f"{'tokens':>6} {'experts':>7} {'reference ms':>12} {'fused ms':>9} {'graphed ms':>10} {'speed-up':>8} "
          f"{'GB/s':>6}")  # fmt: skip
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(num_tokens, hidden, generator=gen, device=device).to(dtype)
        probs = torch.softmax((x @ router.T).float(), dim=-1)
        weights, experts = probs.topk(top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(dtype)
        reached = int(experts.unique().numel())
        with torch.inference_mode():
            want = reference(x, experts, weights).float()
            got = fused(x, experts, weights).float()
            error = float((got - want).norm() / want.norm())
            assert error < 2e-2, f"{num_tokens} tokens: the fused output is {error:.2e} off the reference's"
            run_reference, run_fused = partial(reference, x, experts, weights), partial(fused, x, experts, weights)
            t_reference = median_s(run_reference, device, warmup_ms=20, rep_ms=100)
            t_fused = median_s(run_fused, device, warmup_ms=20, rep_ms=100)
            t_graphed = None
            if device.type == "cuda":
                graph, _ = capture_graph(run_fused, None, device)
                t_graphed = median_s(graph.replay, device, warmup_ms=20, rep_ms=100)
        best = t_graphed or t_fused
        graphed = "-" if t_graphed is None else f"{t_graphed * 1e3:.3f}"
        print(f"{num_tokens:>6} {reached:>7} {t_reference * 1e3:>12.3f} {t_fused * 1e3:>9.3f} {graphed:>10} "
              f"{t_reference / best:>7.1f}x {reached * expert_bytes / best / 1e9:>6.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
