"""Optimizers over any state store."""
from .adam import CPUAdam, HybridAdam

__all__ = ["CPUAdam", "HybridAdam"]
