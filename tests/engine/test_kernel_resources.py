"""Every Triton kernel the engine launches compiles for an H100/H200 and an A100, checked on a machine without a
GPU: ``benchmarks/kernel_resources.py`` has Triton's own JIT compile the engine's launches (Llama-3-8B's shapes
and other models' layer options, bf16) for sm_90 and sm_80, nothing run. Triton's interpreter, which the other kernel tests
run here, executes the kernels' code with numpy and never meets the compiler: a kernel that it runs but the
compiler refuses, or whose program needs more shared memory or registers than a multiprocessor has (a launch
that fails with "out of resources" on the GPU), is found here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
KERNELS = {
    "_decode_kernel",
    "_combine_splits_kernel",
    "_prefill_kernel",
    "_add_rms_norm_kernel",
    "_silu_and_mul_kernel",
    "_rotary_kernel",
    "_write_kv_kernel",
    "_expert_matmul_kernel",
}


def _has_nvidia_tools() -> bool:
    try:
        from triton import knobs

        return os.path.exists(knobs.nvidia.ptxas.path) and os.path.exists(knobs.nvidia.cuobjdump.path)
    except Exception:  # (a Triton without its NVIDIA backend)
        return False


@pytest.mark.skipif(not _has_nvidia_tools(), reason="Triton's NVIDIA backend (ptxas, cuobjdump)")
def test_every_kernel_compiles_for_hopper_and_ampere_and_fits_a_multiprocessor(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # (compiled here, not found in a cache another run left)
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "kernel_resources.py"), "--arch", "80,90", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    for arch in (80, 90):
        assert {row["kernel"] for row in rows if row["arch"] == arch} == KERNELS
    for row in rows:  # each launches there: its shared memory within a program's most, a program a multiprocessor
        assert row["fits"] and row["programs_an_sm"] >= 1 and row["registers"] <= 255, row
    by_case = {}
    for row in rows:
        by_case.setdefault((row["arch"], row["case"]), set()).add(row["kernel"])
    # the splits merged by the decode kernel: no combine kernel (a decode kernel of its own specialization)
    assert by_case[90, "llama: 4 splits merged in the kernel"] == {"_decode_kernel"}
    assert "_combine_splits_kernel" in by_case[90, "llama: decodes in 4 splits"]
    # the chunk's prefill programs launched beside the decodes (OVERLAP_PREFILL_LAUNCH) leave a decode program room
    # on a Hopper multiprocessor, where the default launch's two held all its registers
    hopper = {(row["case"], row["kernel"]): row for row in rows if row["arch"] == 90}
    chunk = hopper["llama: a chunk after 100 cached, 2 decodes", "_prefill_kernel"]
    decode = hopper["llama: a chunk after 100 cached, 2 decodes", "_decode_kernel"]
    beside = hopper["llama: the chunk beside decodes (overlap)", "_prefill_kernel"]
    registers, shared = 65_536, 228 << 10
    assert chunk["programs_an_sm"] * chunk["registers_a_program"] + decode["registers_a_program"] > registers
    held = [beside] * beside["programs_an_sm"] + [decode]
    assert sum(row["registers_a_program"] for row in held) <= registers, (beside, decode)
    assert sum(row["shared_bytes_a_program"] for row in held) <= shared, (beside, decode)
