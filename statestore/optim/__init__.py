"""Optimizers over any state store."""
from .adam import OPTIMIZER_METADATA_VERSION, CPUAdam, HybridAdam

__all__ = ["CPUAdam", "HybridAdam", "OPTIMIZER_METADATA_VERSION"]
