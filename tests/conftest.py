import os
import sys
from pathlib import Path

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
