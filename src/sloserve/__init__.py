"""sloserve: SLO-aware scheduling for LLM serving (EconoServe, InferMax, BROS) in one code base."""

__version__ = "0.1.0"
