import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

sys.path.insert(0, str(Path(__file__).parent))

# Deterministic by default (the same examples on every run and in CI); HYPOTHESIS_PROFILE=explore
# draws fresh random examples to hunt for new failures.
settings.register_profile("deterministic", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))

# Under pytest-xdist (pyproject.toml) every worker runs torch: one thread each (and in the servers they start),
# since two workers of two threads on CI's two cores spend their time contending (measured: the suite took
# 877 s with two threads per worker, against 964 s on one worker).
XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if XDIST_WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# Without CUDA, the engine's Triton kernels run in Triton's interpreter (numpy on the CPU), so their
# tests check them against the reference here too. Set before triton compiles anything.
try:
    import torch
except ImportError:
    pass
else:
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
        from triton_interpreter import skip_repeated_patches

        skip_repeated_patches()
    elif XDIST_WORKERS > 1:
        # On a GPU each engine without a KV capacity takes 90% of the memory free (as vLLM): the workers
        # share the GPU, so each may take its share and no more (the engine sizes its KV cache within it;
        # seen on an H200, 2026-11-29: the workers took it from each other, 15 tests ran out of memory).
        torch.cuda.set_per_process_memory_fraction(1 / XDIST_WORKERS)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Under pytest-xdist (``-n``, ``--dist loadgroup``: pyproject.toml), each test file runs whole on one
    worker, so a module's fixtures (a model, a server) are built once and its tests keep their order; the tests
    marked ``ray`` all run on one worker, one after another: they start and stop Ray on this machine
    (``ray stop --force`` would end another worker's cluster). Runs before xdist reads the groups."""
    for item in items:
        group = "ray" if item.get_closest_marker("ray") else item.path.name
        item.add_marker(pytest.mark.xdist_group(group))


class _HFDirs(dict):
    """Each architecture of ``hf_models`` saved as a local HF directory (config.json + model.safetensors), the
    first time a test asks for it."""

    def __init__(self, tmp_path_factory) -> None:
        super().__init__()
        self.tmp_path_factory = tmp_path_factory

    def __missing__(self, arch: str) -> str:
        from hf_models import hf_cached, save_as_the_hub

        path = self.tmp_path_factory.mktemp(f"hf-{arch}")
        save_as_the_hub(hf_cached(arch), path)
        self[arch] = str(path)
        return self[arch]


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory) -> dict[str, str]:
    """``hf_dirs[arch]``: the directory of ``hf_models.hf_model(arch)`` (engine/test_engine.py,
    engine/test_architectures.py)."""
    return _HFDirs(tmp_path_factory)


@pytest.fixture(scope="session")
def bpe_tokenizer():
    """``gguf_files.llama3_tokenizer()``, trained once (engine/test_gguf_mamba.py and the hybrids' GGUF tests)."""
    from gguf_files import llama3_tokenizer

    return llama3_tokenizer()


# Fixtures of the server tests (server/test_serve.py, server/test_batch_api.py); they need torch and transformers,
# imported when a test asks for them.
@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama saved as an HF directory with a trained BPE tokenizer and a chat template."""
    from chat_model import make_chat_model

    return make_chat_model(tmp_path_factory.mktemp("hf-chat"))


@pytest.fixture(scope="session")
def thinking_model_dir(tmp_path_factory) -> Path:
    """``chat_model_dir`` with ``<think>`` and ``</think>`` as tokens of its vocabulary (not special ones)."""
    from chat_model import make_chat_model

    return make_chat_model(tmp_path_factory.mktemp("hf-thinking"), think_tokens=True)


@pytest.fixture(scope="session")
def reference_llm(chat_model_dir):
    """The engine offline on ``chat_model_dir``: the reference served outputs are compared with."""
    from sloserve import LLM

    return LLM(str(chat_model_dir), "vllm", kv_capacity_tokens=4096)
