"""Engine speed (issue 43's table): decode MBU at batch 1-256, decode over long contexts, prefill MFU
at 1k-16k tokens, a mixed step against the roofline of its parts, and where a step's GPU time goes,
for a random model of a real shape.

    python benchmarks/engine_speed.py                       # random:llama-3-8b, bf16, cuda, the GPU's own peaks
    python benchmarks/engine_speed.py --device cpu --model random:tiny-llama --dtype float32 \\
        --long-context 2048 --mixed 64:128:8 [--gpu h200 --rates 4.24,685]   # (the CPU's ratios mean nothing)

A step is timed as the engine's clock counts it (``StepTimer``: slot tables, attention metadata,
forward pass, logits and sampling), so the figures are what a served request sees: on CUDA a step is
launched before the step before's tokens are back, as the engine's default async scheduling runs them
(decode steps since 2026-11-30, steps with a prefill since 2026-12-04; ``SLOSERVE_ASYNC_SCHEDULING=0`` times
them one by one, as before). On CUDA with the
Triton backend each decode batch is timed eagerly and replaying CUDA graphs, the graphs captured
three times, side by side: as before issue 43 (one program per decode and KV head walking the whole
context; PyTorch's elementwise kernels), with flash decoding's splits of the context
(``triton_attention.decode_splits``), and with the fused rotary, SiLU and add-and-RMSNorm kernels too (``fused_ops``).
A prompt's prefill runs with the prefill kernel and dense (one SDPA call a prompt,
``TritonAttention.dense_prefill_min_tokens``), the latter asking SDPA for FlashAttention first, then for
cuDNN's attention first (``dense_prefill_sdpa``), side by side. Eager steps, the prefills' other kernels, mixed
and profiled steps run as the environment sets the engine (split decodes unless ``SLOSERVE_DECODE_SPLITS=1``,
the fused kernels unless ``SLOSERVE_FUSED_KERNELS=0``, dense prefills unless ``SLOSERVE_DENSE_PREFILL=0``;
``gpu_session.sh`` sets them all on).

MBU = (weight bytes + KV bytes read) per decode step / step time / HBM bandwidth (the datasheet's,
and the device-to-device copy bandwidth measured here, in brackets).
MFU = (2 x matmul parameters x tokens + causal attention FLOPs) / step time / peak dense FLOP/s.
The mixed step (a Sarathi chunk beside decodes) is set against the sum of its parts' rooflines: each
part alone at max(FLOPs / peak, bytes / bandwidth). Beside each figure, its ceiling on this machine
(recorded as ``FIGURE_ceiling``; the mixed step's least ratio as ``mixed_over_roofline_floor``): the
figure of a step whose kernels run one after another at the copy and matmul rates measured here
(``Rates.least_step_s``; ``--rates`` gives them instead), with nothing for the elementwise kernels and
the gaps. A goal beyond it needs kernels that overlap, or rates this machine did not show. Beside it,
the step's matmuls timed alone on its own shapes (``matmuls_alone_s``, eagerly, as one CUDA graph, and as
one graph with cuBLASLt's choice of kernels: ``TORCH_BLAS_PREFER_CUBLASLT=1`` gives the engine that choice)
and the ceiling with their time (the fastest) in place of the rates' (recorded as
``FIGURE_ceiling_timed_matmuls``): what the matmul library reaches at a decode's or a chunk's row
counts, so a step's time beyond its matmuls is the attention's, the elementwise kernels' and the gaps'.
The mixed step and small prompts' steps (``--small-prompts``) are timed eagerly and on piecewise CUDA
graphs (``piecewise_graphs``), side by side, and with ``--compile-pieces`` on piecewise graphs of the
pieces compiled by ``torch.compile`` too.
The kernel tables (``--profile-kernels``, torch.profiler) sum each kernel's GPU time over an eager
decode step, the mixed step and a prefill of up to 8K tokens: what fusing or replacing a kernel can gain.
On CUDA the peaks are the bundled spec of the GPU the run is on (``gpu_of_device``: an H100's 3.35 TB/s, an H200's
4.8); on the CPU, and on a GPU without a spec, the ratios are printed only with --gpu.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import time
from typing import NamedTuple

import torch

from figures import record
from sloserve.cost import get_gpu, gpu_of_device
from sloserve.engine import fused_ops
from sloserve.engine.cuda_graphs import DecodeGraphs, capture_graph
from sloserve.engine.llm_engine import kv_bytes_per_token
from sloserve.engine.loader import LoadedModel, cuda_graphs_supported, load_model, resolve_device
from sloserve.engine.piecewise_graphs import PiecewiseGraphs
from sloserve.engine.profile import StepTimer
from sloserve.engine.triton_attention import TritonAttention, decode_splits, multiprocessors
from timing import copy_rate_bytes_s, median_s


def measure_ceilings(device: torch.device) -> tuple[float, float]:
    """(copy bandwidth B/s, bf16 matmul FLOP/s) measured on ``device``: a 2 GiB device-to-device copy
    (bytes read + written) and an 8192^3 product on random data, medians of CUDA-event timings."""
    copy_rate = copy_rate_bytes_s(device)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn_like(a)
    matmul_s = median_s(lambda: a @ b, device)
    return copy_rate, 2 * 8192**3 / matmul_s


@dataclasses.dataclass(frozen=True)
class Rates:
    """What this machine reached (``measure_ceilings``): a device-to-device copy's bytes/s and a large bf16
    matmul's FLOP/s."""

    copy_bw: float
    matmul_rate: float

    def least_step_s(
        self,
        matmul_flops: float,
        weight_bytes: float,
        kv_bytes: float = 0.0,
        attention_flops: float = 0.0,
        matmuls_s: float | None = None,
    ) -> float:
        """The least time a step can take whose kernels run one after another, each at these rates: the
        matmuls at the slower of their FLOPs and their weights' bytes (a decode of many tokens is
        compute-bound: past ``matmul_rate / copy_bw`` FLOPs a weight byte), then the attention, reading
        the KV's bytes (decodes) and at the matmul rate (a prefill's FLOPs). The elementwise kernels,
        the launches and the gaps between kernels cost nothing here: a figure's ceiling on this machine,
        for a goal to be set against. ``matmuls_s``: the step's matmuls as timed alone (``matmuls_alone_s``)
        in place of their time at these rates, a ceiling with the matmul library's speed at the step's
        own shapes (a 640-row product need not reach an 8192^3 one's rate)."""
        if matmuls_s is None:
            matmuls_s = max(matmul_flops / self.matmul_rate, weight_bytes / self.copy_bw)
        return matmuls_s + kv_bytes / self.copy_bw + attention_flops / self.matmul_rate

    def ceilings_s(
        self,
        matmul_flops: float,
        weight_bytes: float,
        kv_bytes: float = 0.0,
        attention_flops: float = 0.0,
        *,
        matmuls: MatmulTimes,
    ) -> tuple[float, float]:
        """``least_step_s`` with the step's matmuls at these rates, then at their own time alone (the faster
        of ``matmuls``): the two ceilings printed beside each figure."""
        at_rates = self.least_step_s(matmul_flops, weight_bytes, kv_bytes, attention_flops)
        return at_rates, self.least_step_s(matmul_flops, weight_bytes, kv_bytes, attention_flops, matmuls.fastest)


def record_ceilings(figure: str, values: list[float], **where) -> list[str]:
    """A ratio figure's two ceilings (``Rates.ceilings_s``), recorded as ``FIGURE_ceiling`` and
    ``FIGURE_ceiling_timed_matmuls``; their columns."""
    for suffix, value in zip(("_ceiling", "_ceiling_timed_matmuls"), values, strict=True):
        record(figure + suffix, value, **where)
    return [f"{value:.1%}" for value in values]


class MatmulTimes(NamedTuple):
    """Seconds a step's matmuls took alone (``matmuls_alone_s``): launched one by one, replayed as one CUDA
    graph (the BLAS library as this process prefers it: the engine's), and as one graph captured with cuBLASLt
    preferred (``torch.backends.cuda.preferred_blas_library``, which ``TORCH_BLAS_PREFER_CUBLASLT=1`` sets for a
    whole process: its own heuristics pick the kernels of these decode-sized products); None on the CPU, or
    where a capture failed."""

    eager: float
    graphed: float | None
    graphed_cublaslt: float | None = None

    @property
    def fastest(self) -> float:
        return min(t for t in self if t is not None)

    def column(self) -> str:
        """In ms, eager/graphed/graphed with cuBLASLt ("-": not captured); eager alone on the CPU."""
        if self.graphed is None and self.graphed_cublaslt is None:
            return f"{self.eager * 1e3:.3f}"
        return "/".join("-" if t is None else f"{t * 1e3:.3f}" for t in self)


def matmuls_alone_s(loaded: LoadedModel, tokens: int, sequences: int) -> MatmulTimes:
    """Seconds a step's matmuls take alone, one after another on the model's own weights: every linear
    layer of the decoder on ``tokens`` rows, then the LM head on ``sequences`` rows (a step's logits
    are one row a sequence). What a step takes beyond it is the attention, the elementwise kernels and
    the gaps between kernels: ours to shrink, where the matmuls are the library's. The graph's time is
    their GPU time without the host's launches; the two apart say whether capturing changes the kernels."""
    head = loaded.model.lm_head
    calls = [(m, tokens) for m in loaded.model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    calls.append((head, sequences))
    inputs = {
        (layer.in_features, n): torch.randn(n, layer.in_features, dtype=loaded.dtype, device=loaded.device)
        for layer, n in calls
    }

    @torch.inference_mode()
    def run() -> None:
        for layer, n in calls:
            layer(inputs[layer.in_features, n])

    eager = median_s(run, loaded.device)
    if loaded.device.type != "cuda":
        return MatmulTimes(eager, None)
    graphed = []
    library = torch.backends.cuda.preferred_blas_library()  # (the engine's: this process's)
    for preferred in (library, "cublaslt"):
        try:
            torch.backends.cuda.preferred_blas_library(preferred)  # (read at each call: a capture keeps its kernels)
            graph, _ = capture_graph(run, torch.cuda.graph_pool_handle(), loaded.device)
            graphed.append(median_s(graph.replay, loaded.device))
        except Exception as e:  # (a diagnosis: the figures around it still run)
            print(f"  the matmuls of {tokens} rows could not be captured with {preferred} preferred: {e!r}")
            graphed.append(None)
        finally:
            torch.backends.cuda.preferred_blas_library(library)
    return MatmulTimes(eager, *graphed)


def extend_positions(loaded: LoadedModel, positions: int) -> None:
    """Let a random model's rotary table cover ``positions`` (a Llama-3.1-length context for the
    long-context row; the weights are random, so no checkpoint's limit applies)."""
    if positions <= loaded.config.max_position_embeddings:
        return
    loaded.config = dataclasses.replace(loaded.config, max_position_embeddings=positions)
    rotary = loaded.model.rotary
    rotary.config, rotary._tables = loaded.config, None


def kernel_table(
    timer: StepTimer,
    what: str,
    prefills: list[tuple[int, int]],
    decode_lens: list[int],
    steps: int = 5,
    top: int = 20,
) -> list[str]:
    """Lines: the ``top`` kernels by GPU time in an eager step (``what``) of ``prefills`` ((c, m): c
    tokens after m cached) and ``decode_lens``, per step."""
    from torch.profiler import ProfilerActivity, profile

    timer.time(prefills, decode_lens, repeats=1)  # warm
    saved, timer.async_scheduling = timer.async_scheduling, False  # (``steps`` steps, no untimed one first)
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            timer.time(prefills, decode_lens, repeats=steps, warmup=0)
    finally:
        timer.async_scheduling = saved
    per_kernel: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = per_kernel[event.name]
            entry[0] += event.time_range.elapsed_us() / steps
            entry[1] += 1 / steps
    total = sum(t for t, _ in per_kernel.values())
    count = sum(n for _, n in per_kernel.values())
    lines = [f"  eager {what}: {count:.0f} kernels, {total / 1e3:.3f} ms of GPU time"]
    for name, (t, n) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {t / 1e3:>8.3f} ms {t / total:>6.1%} x{n:>5.0f}  {name[:90]}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:llama-3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention-backend", default="auto", help="auto (triton on CUDA), torch or triton")
    parser.add_argument("--gpu", default=None, help="GPU spec for the peaks [the device's on cuda, none on cpu]")
    parser.add_argument("--batch-sizes", default="1,8,32,64,128,256")
    parser.add_argument("--kv-len", type=int, default=1024, help="tokens cached per decoding request")
    parser.add_argument("--long-context", type=int, default=32768, help="the long-context row's cached tokens")
    parser.add_argument("--long-batch", type=int, default=8, help="the long-context row's decodes (0: no row)")
    parser.add_argument("--mixed", default="512:1024:128", help="CHUNK:CACHED:DECODES of the mixed step ('': none)")
    parser.add_argument("--prefill", default="1024,4096,8192,16384")
    parser.add_argument("--small-prompts", default="64,256", help="prompts timed eagerly and on piecewise graphs")
    parser.add_argument(
        "--compile-pieces", action="store_true", help="time the small prompts and the mixed step on compiled pieces too"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-cuda-graphs", action="store_true", help="time decode steps eagerly only")
    parser.add_argument("--no-ceilings", action="store_true", help="skip measuring copy bandwidth and matmul rate")
    parser.add_argument(
        "--rates", help="COPY_TBPS,MATMUL_TFLOPS: the ceilings' rates, given instead of measured (another run's)"
    )
    parser.add_argument(
        "--profile-kernels",
        default="1,64",
        help="decode batches whose kernels are listed, and the mixed step's ('': none)",
    )
    args = parser.parse_args()

    device = resolve_device(args.device)
    # Graphs are captured here, for the benchmark's batch sizes only (the engine captures 35 sizes).
    loaded = load_model(
        args.model, device=args.device, dtype=args.dtype, attention_backend=args.attention_backend, cuda_graphs=False
    )
    graphs_ok = not args.no_cuda_graphs and cuda_graphs_supported(device, loaded.attention_backend)
    backend = next(m.backend for m in loaded.model.modules() if hasattr(m, "backend"))
    splitting = isinstance(backend, TritonAttention)
    gpu = get_gpu(args.gpu) if args.gpu else None
    if gpu is None and loaded.device.type == "cuda":  # the peaks of the GPU the run is on
        device_name = torch.cuda.get_device_name(loaded.device)
        gpu = gpu_of_device(device_name)
        if gpu is None:
            print(f"no bundled peaks for {device_name!r}: --gpu names a spec to compute MBU and MFU against; the "
                  "times below are measured all the same")  # fmt: skip
    rates = None
    if args.rates:
        try:
            copy_tbps, matmul_tflops = (float(x) for x in args.rates.split(","))
        except ValueError:
            parser.error(f"--rates expects COPY_TBPS,MATMUL_TFLOPS (two numbers), got {args.rates!r}")
        rates = Rates(copy_tbps * 1e12, matmul_tflops * 1e12)
    elif loaded.device.type == "cuda" and not args.no_ceilings:
        rates = Rates(*measure_ceilings(loaded.device))
        torch.cuda.empty_cache()
    c = loaded.config
    params = sum(p.numel() for p in loaded.model.parameters())
    embed = c.vocab_size * (c.word_embed_proj_dim or c.hidden_size)
    # A decode step reads every weight but the input embedding table (only B rows of it, unless the
    # LM head shares it); a prefill multiplies every token by the layers, and one token per
    # sequence by the LM head.
    weight_bytes = (params - (0 if c.tie_word_embeddings else embed)) * loaded.dtype.itemsize
    layer_params = params - embed * (1 if c.tie_word_embeddings else 2)
    per_token_kv = kv_bytes_per_token(loaded)
    args.kv_len = min(args.kv_len, c.max_position_embeddings - 1)
    batches = [int(x) for x in args.batch_sizes.split(",") if x]
    prompts = [int(x) for x in args.prefill.split(",") if x and int(x) <= c.max_position_embeddings]
    mixed = [int(x) for x in args.mixed.split(":")] if args.mixed else None
    small_prompts = [int(x) for x in args.small_prompts.split(",") if x]
    device_name = (
        f"{loaded.device} ({torch.cuda.get_device_name(loaded.device)})" if loaded.device.type == "cuda" else "cpu"
    )
    print(
        f"{args.model}, {loaded.dtype}, {device_name}, {loaded.attention_backend} attention; "
        f"{params / 1e9:.2f} B parameters; peaks: "
        f"{f'{gpu.name} {gpu.hbm_bandwidth / 1e12:.2f} TB/s, {gpu.peak_flops / 1e12:.0f} TFLOP/s' if gpu else 'none'}"
    )
    if rates:
        print(
            f"{'given' if args.rates else 'measured here'}: copy {rates.copy_bw / 1e12:.2f} TB/s, bf16 matmul 8192^3 "
            f"{rates.matmul_rate / 1e12:.0f} TFLOP/s; a figure's ceiling: its step's kernels in sequence at these rates"
        )
    # A token's matmuls: 2 FLOPs a weight of the layers, and of the LM head
    token_matmul_flops = 2 * layer_params + 2 * embed

    def mbu(bytes_read: float, t: float | None) -> str:
        if not (gpu and t):
            return "-"
        measured = f" ({bytes_read / t / rates.copy_bw:.0%})" if rates else ""
        return f"{bytes_read / t / gpu.hbm_bandwidth:.1%}{measured}"

    def roofline(flops: float, bytes_moved: float) -> float:
        return max(flops / gpu.peak_flops, bytes_moved / gpu.hbm_bandwidth)

    def capture(timer: StepTimer, sizes: list[int], splits: int | None, fused: bool) -> DecodeGraphs:
        """Graphs of ``sizes`` with ``splits`` decode splits (None: the backend's choice) and the
        fused elementwise kernels on or off: each graph keeps the kernels it was captured with."""
        saved = getattr(backend, "num_decode_splits", None), fused_ops.ENABLED
        if splitting:
            backend.num_decode_splits = splits
        fused_ops.ENABLED = fused
        graphs = DecodeGraphs(
            loaded.model, timer.executor.cache, timer.max_context, timer.kv.table_block_size, batch_sizes=sizes
        )
        if splitting:
            backend.num_decode_splits = saved[0]
        fused_ops.ENABLED = saved[1]
        return graphs

    def decode_rows(timer: StepTimer, sizes: list[int], kv_len: int, figure: str = "decode_mbu") -> None:
        """One row a batch: eager, and graphed three ways: as before issue 43 (one split, unfused), with
        flash decoding's splits, and with the fused elementwise kernels too (the engine's default); the
        fastest one's MBU recorded as ``figure``."""
        variants = {}
        if graphs_ok:
            variants = {
                "before": capture(timer, sizes, 1, False),
                "split": capture(timer, sizes, None, False),
                "fused": capture(timer, sizes, None, True),
            }
        for b in sizes:
            read = weight_bytes + b * (kv_len + 1) * per_token_kv
            timer.executor.graphs = None
            eager = timer.time([], [kv_len] * b, repeats=args.repeats)
            times = {}
            for name, graphs in variants.items():
                timer.executor.graphs = graphs
                times[name] = timer.time([], [kv_len] * b, repeats=args.repeats)
            timer.executor.graphs = None
            best = min([eager, *times.values()])
            n_splits = (
                decode_splits(b, c.num_key_value_heads, timer.max_context, multiprocessors(loaded.device))
                if splitting
                else 1
            )
            graphed = {
                name: f"{times[name] * 1e3:.3f}" if name in times else "-" for name in ("before", "split", "fused")
            }
            gain = f"{times['before'] / times['fused']:.2f}x" if times else "-"
            matmuls = matmuls_alone_s(loaded, b, b)
            ceilings = ["-", "-"]
            if gpu:
                record(figure, read / best / gpu.hbm_bandwidth, batch=b, kv=kv_len)
            if gpu and rates:
                kv_read = b * (kv_len + 1) * per_token_kv
                least = rates.ceilings_s(token_matmul_flops * b, weight_bytes, kv_read, matmuls=matmuls)
                ceilings = record_ceilings(figure, [read / t / gpu.hbm_bandwidth for t in least], batch=b, kv=kv_len)
            print(
                f"{b:>6} {kv_len:>7} {n_splits:>6} {eager * 1e3:>9.3f} {graphed['before']:>10} {graphed['split']:>10} "
                f"{graphed['fused']:>10} {gain:>7} {b / best:>10.1f} {mbu(read, eager):>15} "
                f"{mbu(read, times.get('fused')):>15} {matmuls.column():>23} {ceilings[0]:>8} {ceilings[1]:>8}"
            )

    # Graphed ms: "before" (one split, unfused), "+split" (flash decoding), "+fused" (and the fused
    # elementwise kernels: the engine's default); gain = before / +fused; "matmuls ms e/g/Lt": the step's
    # matmuls alone (``matmuls_alone_s``), eagerly / on a CUDA graph / on one with cuBLASLt preferred; the
    # ceiling at the measured rates, then with the matmuls' own time (the fastest).
    header = (
        f"\n{'batch':>6} {'KV/req':>7} {'splits':>6} {'eager ms':>9} {'before ms':>10} {'+split ms':>10} "
        f"{'+fused ms':>10} {'gain':>7} {'tok/s':>10} {'MBU eager':>15} {'MBU +fused':>15} {'matmuls ms e/g/Lt':>23} "
        f"{'ceiling':>8} {'ceil. mm':>8}"
    )
    if batches:
        print(header)
    max_prompt = max([*prompts, *small_prompts], default=1)
    blocks = max(
        StepTimer.blocks_needed([], [args.kv_len] * max(batches, default=0)),
        StepTimer.blocks_needed([(max_prompt, 0)], []),
        StepTimer.blocks_needed([(mixed[0], mixed[1])], [args.kv_len] * mixed[2]) if mixed else 0,
    )
    max_context = max([args.kv_len + 1, max_prompt, sum(mixed[:2]) if mixed else 0])
    timer = StepTimer(loaded, blocks, max_context=max_context)
    timer.executor.piecewise = None  # (each table below picks its path itself)
    decode_rows(timer, batches, args.kv_len)

    # A prompt's step with its attention by the prefill kernel ("step ms"; the reference's on the torch
    # backend) and, on the Triton backend, dense (one SDPA call: ``dense_prefill_min_tokens``) whatever the
    # environment says, asking SDPA for FlashAttention first, then for cuDNN's attention first
    # (``dense_prefill_sdpa``; on the CPU both run torch's CPU kernel); tok/s and MFU of the fastest.
    if prompts:
        print(
            f"\n{'prefill tokens':>14} {'step ms':>9} {'flash ms':>9} {'cuDNN ms':>9} {'tok/s':>10} {'MFU':>7} "
            f"{'matmuls ms e/g/Lt':>23} {'ceiling':>8} {'ceil. mm':>8}"
        )
    for n in prompts:
        t_dense = {}
        if splitting:
            saved = backend.dense_prefill_min_tokens, backend.dense_prefill_sdpa
            backend.dense_prefill_min_tokens = None
            t = timer.time([(n, 0)], [], repeats=args.repeats)
            backend.dense_prefill_min_tokens = 1
            for sdpa in ("flash", "cudnn"):
                backend.dense_prefill_sdpa = sdpa
                t_dense[sdpa] = timer.time([(n, 0)], [], repeats=args.repeats)
            backend.dense_prefill_min_tokens, backend.dense_prefill_sdpa = saved
        else:
            t = timer.time([(n, 0)], [], repeats=args.repeats)
        best = min([t, *t_dense.values()])
        # Causal attention: QK^T and PV, 2 FLOPs per multiply-add, half the n x n scores.
        attention = 2 * 2 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * n * n / 2
        flops = 2 * layer_params * n + 2 * embed + attention
        matmuls = matmuls_alone_s(loaded, n, 1)
        mfu, ceilings = "-", ["-", "-"]
        if gpu:
            mfu = f"{flops / best / gpu.peak_flops:.1%}"
            record("prefill_mfu", flops / best / gpu.peak_flops, tokens=n)
        if gpu and rates:
            least = rates.ceilings_s(flops - attention, weight_bytes, attention_flops=attention, matmuls=matmuls)
            ceilings = record_ceilings("prefill_mfu", [flops / t / gpu.peak_flops for t in least], tokens=n)
        dense = {sdpa: f"{t_dense[sdpa] * 1e3:.3f}" if sdpa in t_dense else "-" for sdpa in ("flash", "cudnn")}
        print(
            f"{n:>14} {t * 1e3:>9.3f} {dense['flash']:>9} {dense['cudnn']:>9} {n / best:>10.1f} {mfu:>7} "
            f"{matmuls.column():>23} {ceilings[0]:>8} {ceilings[1]:>8}"
        )

    # Steps with a prefill eagerly and on piecewise graphs (captured here for the sizes below, whatever
    # SLOSERVE_PIECEWISE_GRAPHS says): small prompts, where an eager step is the host's launch time.
    # With --compile-pieces, also on pieces compiled by torch.compile (``piecewise_graphs.compiled_pieces``),
    # captured the same way: the compile is timed on its own line. (On the CPU the pieces run uncaptured:
    # the smoke run's check of this code, not a figure.)
    pieces = compiled = None
    on_gpu = loaded.device.type == "cuda"
    if (graphs_ok or not on_gpu) and getattr(loaded.model, "supports_piecewise_graphs", False):
        sizes = sorted({*small_prompts, *([mixed[0] + mixed[2]] if mixed else [])})
        pieces = PiecewiseGraphs(loaded.model, timer.executor.cache, sizes=sizes, capture=on_gpu)
        if args.compile_pieces and sizes:
            start = time.perf_counter()
            compiled = PiecewiseGraphs(loaded.model, timer.executor.cache, sizes=sizes, capture=on_gpu, compile=True)
            if not on_gpu:  # (compiled at its first run)
                timer.executor.piecewise = compiled
                timer.time([(sizes[0], 0)], [], repeats=1)
            captured = f" and captured them at {len(sizes)} sizes" if on_gpu else ""
            print(f"\ncompiled the pieces{captured} in {time.perf_counter() - start:.1f} s")

    def eager_and_piecewise(prefills: list[tuple[int, int]], decode_lens: list[int]) -> list[float | None]:
        """The step's time eagerly, on the piecewise graphs and on the compiled ones (None: not built)."""
        saved = timer.executor.piecewise
        times = []
        for graphs in (None, pieces, compiled):
            timer.executor.piecewise = graphs
            ran = graphs is not None or not times
            times.append(timer.time(prefills, decode_lens, repeats=args.repeats) if ran else None)
        timer.executor.piecewise = saved
        return times

    def ms(t: float | None) -> str:
        return "-" if t is None else f"{t * 1e3:.3f}"

    if small_prompts:
        if not on_gpu:
            print("\n(on the CPU the pieces run uncaptured: the columns check the code, they time no graph)")
        print(f"\n{'prompt tokens':>14} {'eager ms':>9} {'piecewise ms':>13} {'compiled ms':>12}")
        for n in small_prompts:
            eager, piecewise, on_compiled = eager_and_piecewise([(n, 0)], [])
            print(f"{n:>14} {ms(eager):>9} {ms(piecewise):>13} {ms(on_compiled):>12}")

    if mixed:
        chunk, cached, num_decodes = mixed
        t_eager, t_pieces, t_compiled = eager_and_piecewise([(chunk, cached)], [args.kv_len] * num_decodes)
        t_mixed = min(t for t in (t_eager, t_pieces, t_compiled) if t is not None)
        # The same with the chunk's attention on a second stream beside the decodes' (SLOSERVE_OVERLAP_ATTENTION,
        # off by default until timed here: triton_attention.SideStream)
        overlapped = []
        if splitting and not backend.overlap_prefill_decode:
            backend.overlap_prefill_decode = True
            overlapped = eager_and_piecewise([(chunk, cached)], [args.kv_len] * num_decodes)
            backend.overlap_prefill_decode = False
        t_prefill = timer.time([(chunk, cached)], [], repeats=args.repeats)
        t_decode = timer.time([], [args.kv_len] * num_decodes, repeats=args.repeats)
        matmuls = matmuls_alone_s(loaded, chunk + num_decodes, 1 + num_decodes)
        print(
            f"\nmixed step: a {chunk}-token chunk after {cached} cached + {num_decodes} decodes of {args.kv_len}: "
            f"{ms(t_eager)} ms eager, {ms(t_pieces)} ms on piecewise graphs, {ms(t_compiled)} ms compiled; "
            f"alone: chunk {ms(t_prefill)} ms, "
            f"decodes {ms(t_decode)} ms (as the environment sets the engine); its matmuls alone {matmuls.column()} ms"
        )
        if overlapped:
            print(
                f"  the chunk's attention beside the decodes' (a second stream): {ms(overlapped[0])} ms eager, "
                f"{ms(overlapped[1])} ms on piecewise graphs, {ms(overlapped[2])} ms compiled"
            )
        if gpu:
            # The chunk attends to cached + its own causal half; each decode reads its context once.
            chunk_attention = (
                2 * 2 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * chunk * (cached + chunk / 2)
            )
            prefill_roof = roofline(
                2 * layer_params * chunk + chunk_attention, weight_bytes + (cached + chunk) * per_token_kv
            )
            decode_roof = roofline(
                2 * layer_params * num_decodes, weight_bytes + num_decodes * (args.kv_len + 1) * per_token_kv
            )
            floor = ""
            if rates:
                # NOTE: one pass over the weights for both parts; the chunk reads its cached context too
                least = rates.ceilings_s(
                    2 * layer_params * (chunk + num_decodes) + 2 * embed * (1 + num_decodes),
                    weight_bytes,
                    (cached + num_decodes * (args.kv_len + 1)) * per_token_kv,
                    chunk_attention,
                    matmuls=matmuls,
                )
                floors = [t / (prefill_roof + decode_roof) for t in least]
                floor = (
                    f"; at least {floors[0]:.2f}x with its kernels in sequence here, "
                    f"{floors[1]:.2f}x with its matmuls' own time"
                )
                record("mixed_over_roofline_floor", floors[0])
                record("mixed_over_roofline_floor_timed_matmuls", floors[1])
            print(
                f"  rooflines of the parts: {prefill_roof * 1e3:.3f} + {decode_roof * 1e3:.3f} ms; "
                f"mixed / their sum: {t_mixed / (prefill_roof + decode_roof):.2f}x (goal <= 1.25x){floor}"
            )
            record("mixed_over_roofline", t_mixed / (prefill_roof + decode_roof))
            if overlapped:
                ratio = min(t for t in overlapped if t is not None) / (prefill_roof + decode_roof)
                print(f"  with the chunk's attention beside the decodes': {ratio:.2f}x")
                record("mixed_over_roofline_overlapped", ratio)

    if args.profile_kernels and loaded.device.type == "cuda":
        print("\nWhere an eager step's GPU time goes (torch.profiler; kernels of one step):")
        steps = [(f"decode step, batch {b}", [], [args.kv_len] * b) for b in map(int, args.profile_kernels.split(","))]
        if mixed:
            steps.append(("mixed step", [(mixed[0], mixed[1])], [args.kv_len] * mixed[2]))
        # The longest prompt of the prefill MFU goal's 4-8K tokens: the kernels its step spends time in beside the matmuls
        long_prompt = max((n for n in prompts if n <= 8192), default=0)
        if long_prompt:
            steps.append((f"prefill step, {long_prompt} tokens", [(long_prompt, 0)], []))
        for what, prefills, decode_lens in steps:
            try:
                print("\n".join(kernel_table(timer, what, prefills, decode_lens)))
            except Exception as e:  # the profiler is a diagnosis: the long-context row still runs
                print(f"  {what}: the profiler failed: {e!r}")

    if args.long_batch:
        del timer
        pieces = compiled = None  # (their graphs' memory pool, for the long contexts' KV)
        gc.collect()
        if loaded.device.type == "cuda":
            torch.cuda.empty_cache()
        n = args.long_context
        extend_positions(loaded, n + 1)
        long_timer = StepTimer(loaded, StepTimer.blocks_needed([], [n] * args.long_batch), max_context=n + 1)
        long_timer.executor.piecewise = None
        print(
            f"\nlong contexts ({args.long_batch} decodes of {n} cached tokens; KV read per step "
            f"{args.long_batch * (n + 1) * per_token_kv / 1e9:.2f} GB):"
        )
        print(header)
        decode_rows(long_timer, [args.long_batch], n, figure="decode_mbu_long")


if __name__ == "__main__":
    main()
