"""An engine's C heap on the CPU (``engine/c_heap.py``): a step's large tensors in the memory the step before freed,
counted in the pages the kernel faults in (not timed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sloserve.core.errors import ConfigError
from sloserve.engine import c_heap
from sloserve.engine.loader import load_model

glibc = pytest.mark.skipif(not c_heap._is_glibc(), reason="glibc's thresholds only")

# Decode attention of 64 requests of 500 tokens (tiny-llama's heads) by the reference backend, as an engine's steps
# run it, the pages faulted in a step counted at glibc's starting thresholds held fixed (every block over 128 KiB
# mapped afresh) and after keep_freed_memory(). NOTE: not against the thresholds glibc raises by itself: what they
# keep depends on the process's history (247 to 1,287 pages a step in three fresh processes), which is the trouble.
DECODE_STEPS = """
import ctypes, json, resource, sys
import torch
from sloserve.engine.attention import AttentionMetadata, TorchAttention
from sloserve.engine.c_heap import keep_freed_memory

torch.set_num_threads(1)
slots, heads, kv_heads, head_dim, batch, context = 65536, 4, 2, 16, 64, 500
k_cache, v_cache = torch.randn(slots, kv_heads, head_dim), torch.randn(slots, kv_heads, head_dim)
table = (torch.arange(batch) * (slots // batch)).unsqueeze(1) + torch.arange(context)  # (batch, context)
q, k, v = torch.randn(batch, heads, head_dim), torch.randn(batch, kv_heads, head_dim), torch.randn(batch, kv_heads, head_dim)
backend = TorchAttention()

def faults_a_step(steps=20):
    for _ in range(3):  # (what a first step allocates for good)
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        step()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / steps

def step():
    meta = AttentionMetadata(slot_mapping=table[:, -1], prefills=[], decode_token_index=torch.arange(batch),
                             decode_slots=table, decode_context_lens=torch.full((batch,), context))
    for _layer in range(2):
        backend.forward(q, k, v, k_cache, v_cache, meta)

libc = ctypes.CDLL(None)
assert libc.mallopt(-3, 128 << 10) and libc.mallopt(-1, 128 << 10)  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
as_started = faults_a_step()
kept = keep_freed_memory()
json.dump({"kept": kept, "as_started": as_started, "kept_freed": faults_a_step()}, sys.stdout)
"""


@glibc
def test_with_freed_memory_kept_a_decode_step_takes_its_large_tensors_from_the_heap():
    env = {k: v for k, v in os.environ.items() if k not in c_heap._USER_SETTINGS and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", DECODE_STEPS], env=env, capture_output=True, text=True, check=True)
    faults = json.loads(out.stdout)
    assert faults["kept"]
    # A step's gathered keys and values alone are 2 x 4 MB a layer: 4,000 pages mapped afresh (4,031-4,067 here)
    assert faults["as_started"] > 3000, faults
    assert faults["kept_freed"] < faults["as_started"] / 10, faults  # (55-100 here)


@glibc
def test_the_process_own_malloc_settings_are_left_as_they_are(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert not c_heap.keep_freed_memory()
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536")
    assert not c_heap.keep_freed_memory()


def test_a_bad_switch_value_stops_the_model_load_by_name(monkeypatch):
    monkeypatch.setenv("SLOSERVE_KEEP_FREED_MEMORY", "on")
    with pytest.raises(ConfigError, match="SLOSERVE_KEEP_FREED_MEMORY must be 0 or 1, got 'on'"):
        load_model("random:tiny-llama")
