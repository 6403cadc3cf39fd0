"""The papers' experiments as commands (`sloserve experiment NAME`)."""

from sloserve.experiments.infermax import EXPERIMENTS

__all__ = ["EXPERIMENTS"]
