"""The attention backends by name (``--attention-backend``), beside what it chooses from: the
PyTorch reference (attention.py) and the Triton kernels (triton_attention.py, imported only when
chosen: it needs the triton package)."""

from __future__ import annotations

from collections.abc import Callable

from sloserve.core.errors import ConfigError
from sloserve.engine.attention import AttentionBackend, TorchAttention


def _triton() -> AttentionBackend:
    try:
        from sloserve.engine.triton_attention import TritonAttention
    except ImportError as e:
        raise ConfigError(
            f"attention backend 'triton' needs the triton package ({e}); CUDA builds of torch bring it"
        ) from e
    return TritonAttention()


def triton_available() -> bool:
    """Whether the ``triton`` backend can be built here (the package imports)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# name -> factory. The loader's "auto" picks triton on CUDA when it is installed, torch elsewhere.
BACKENDS: dict[str, Callable[[], AttentionBackend]] = {"torch": TorchAttention, "triton": _triton}
