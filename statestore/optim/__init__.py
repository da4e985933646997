"""Optimizers over any state store: ``CPUAdam`` and ``HybridAdam`` (Adam's SIMD and CUDA
kernels) on one base, ``StateStoreOptimizer``."""
from .adam import OPTIMIZER_METADATA_VERSION, CPUAdam, HybridAdam
from .base import StateStoreOptimizer

__all__ = ["CPUAdam", "HybridAdam", "StateStoreOptimizer", "OPTIMIZER_METADATA_VERSION"]
