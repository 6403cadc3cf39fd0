"""sloserve: SLO-aware scheduling for LLM serving (EconoServe, InferMax, BROS) in one code base."""

__version__ = "0.1.0"


def __getattr__(name: str):
    """``sloserve.LLM`` and ``sloserve.SamplingParams`` load the engine (and torch) on first use."""
    if name in ("LLM", "SamplingParams", "BeamSearchParams", "StructuredOutputsParams", "RequestOutput",
                "CompletionOutput"):  # fmt: skip
        from sloserve import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'sloserve' has no attribute {name!r}")
