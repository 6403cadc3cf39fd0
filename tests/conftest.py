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

# Without CUDA, the engine's Triton kernels run in Triton's interpreter (numpy on the CPU), so their
# tests check them against the reference here too. Set before triton compiles anything.
try:
    import torch
except ImportError:
    pass
else:
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


# Fixtures of the server tests (server/test_serve.py, server/test_batch_api.py); they need torch and transformers,
# imported when a test asks for them.
@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama saved as an HF directory with a trained BPE tokenizer and a chat template."""
    from served_model import make_chat_model

    return make_chat_model(tmp_path_factory.mktemp("hf-chat"))


@pytest.fixture(scope="session")
def reference_llm(chat_model_dir):
    """The engine offline on ``chat_model_dir``: the reference served outputs are compared with."""
    from sloserve import LLM

    return LLM(str(chat_model_dir), "vllm", kv_capacity_tokens=4096)
