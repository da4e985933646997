"""Optimizers over any state store: ``CPUAdam`` and ``HybridAdam`` (Adam's SIMD and CUDA
kernels), ``StoreOptimizer`` (any torch optimizer), all on one base,
``StateStoreOptimizer``."""
from .adam import OPTIMIZER_METADATA_VERSION, CPUAdam, HybridAdam
from .base import StateStoreOptimizer
from .store_optimizer import StoreOptimizer

__all__ = ["CPUAdam", "HybridAdam", "StoreOptimizer", "StateStoreOptimizer",
           "OPTIMIZER_METADATA_VERSION"]
