"""Prefix caching for a model with state layers (kv/cached_states.py) on the bundled multi-turn workload
``chat-sessions`` (2,000 ShareGPT turns resending their history and a 600-token system prompt), simulated: LFM2-1.2B's
shape (10 short convolutions, 6 attention layers; on an L4) or Qwen3.5-9B's (transformers' defaults: 24 gated
DeltaNets, 8 attention layers; on an H100) with caching off and on, beside the same shape with attention in every
layer (its KV alone decides what is found), on one GPU.

    python benchmarks/state_prefix_caching.py [--model lfm2-1.2b|qwen3.5-9b] [--gpu l4] [--scheduler vllm] [--rate 1.5]

A prompt's states are saved at its last full block before its last token, so a turn finds the turn before's
prompt (system prompt and history), not that turn's answer, nor the system prompt alone (another session's);
the all-attention shape finds all three. The table gives each run's hit rate, TTFT and throughput, and the
hybrid's found tokens as a share of the all-attention shape's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from sloserve.runs import SimOptions, run_simulation, setup_from_options
from sloserve.workload import build_workload, load_workload_spec

# LFM2-1.2B's config.json as the Hub has it (its model card's 1,170,340,608 parameters: tests/engine/test_short_conv.py)
LFM2_1_2B = {
    "architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "vocab_size": 65536, "hidden_size": 2048,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 128000,
    "block_ff_dim": 12288, "block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": 1.0,
    "block_multiple_of": 256, "full_attn_idxs": [2, 5, 8, 10, 12, 14], "conv_L_cache": 3, "conv_bias": False,
    "norm_eps": 1e-5, "rope_theta": 1000000.0, "tie_embedding": True, "torch_dtype": "bfloat16", "bos_token_id": 1,
    "eos_token_id": 7,
}  # fmt: skip


# Qwen3.5-9B's language model as transformers' Qwen3_5TextConfig defaults have it (9.0B parameters; a request's
# states 51.5 MB: 24 DeltaNets' S of 32 heads x 128 x 128 in float32, and their convolutions' last inputs)
QWEN3_5_9B = {
    "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-06, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.25, "rope_type": "default"},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}  # fmt: skip
# Each model, the same shape with every layer attending, and the GPU it runs on by default
MODELS = {
    "lfm2-1.2b": ("LFM2-1.2B", LFM2_1_2B, {**LFM2_1_2B, "full_attn_idxs": list(range(16))}, "l4"),
    "qwen3.5-9b": ("Qwen3.5-9B", QWEN3_5_9B, {**QWEN3_5_9B, "layer_types": ["full_attention"] * 32}, "h100"),
}


def model_dir(root: Path, name: str, config: dict) -> str:
    path = root / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="lfm2-1.2b")
    parser.add_argument("--gpu", help="(default: the model's, above)")
    parser.add_argument("--scheduler", default="vllm")
    parser.add_argument("--rate", type=float, default=1.5, help="new sessions per second")
    args = parser.parse_args()

    console = Console(width=140)
    label, hybrid, attention, gpu = MODELS[args.model]
    args.gpu = args.gpu or gpu
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        models = {
            label: model_dir(root, "hybrid", hybrid),
            "same, all attention": model_dir(root, "attention", attention),
        }
        spec = load_workload_spec("chat-sessions")
        spec = dataclasses.replace(
            spec,
            streams=[
                dataclasses.replace(s, arrival=dataclasses.replace(s.arrival, rate=args.rate)) for s in spec.streams
            ],
        )
        runs = {}
        for name, path in models.items():
            setup = setup_from_options(SimOptions(model=path, gpu=args.gpu))
            workload = build_workload(spec, seed=0, context_len=8192)
            for caching in (False, True):
                options = dataclasses.replace(setup.options, enable_prefix_caching=caching)
                runs[name, caching] = run_simulation(dataclasses.replace(setup, options=options), args.scheduler, {},
                                                     workload)  # fmt: skip
        found = {key: sum(r.num_cached_tokens for r in s["_result"][0]) for key, s in runs.items()}
        table = Table(
            title=f"chat-sessions at {args.rate:g} sessions/s, {args.scheduler} on one {args.gpu}: caching off / on"
        )
        for col in ("model", "caching", "KV tokens", "hit rate", "found / all-attention's", "TTFT mean s",
                    "TTFT p99 s", "TTFT mean on/off", "out tok/s"):  # fmt: skip
            table.add_column(col, justify="right")
        for (name, caching), s in runs.items():
            off = runs[name, False]
            table.add_row(
                name, "on" if caching else "off", f"{s['kv_capacity_tokens']:,}", f"{s['prefix_cache_hit_rate']:.3f}",
                f"{found[name, caching] / found['same, all attention', True]:.3f}" if caching else "",
                f"{s['ttft_s']['mean']:.3f}", f"{s['ttft_s']['p99']:.3f}",
                f"{s['ttft_s']['mean'] / off['ttft_s']['mean']:.2f}x" if caching else "",
                f"{s['throughput_tps']:,.0f}",
            )  # fmt: skip
        console.print(table)


if __name__ == "__main__":
    main()
