"""Optimizers over any state store: ``CPUAdam`` and ``HybridAdam`` (Adam's SIMD and CUDA
kernels), ``StoreOptimizer`` (any torch optimizer), all classes on one base,
``StateStoreOptimizer``, whose ``StateLayout`` says what an optimizer keeps per parameter
(``docs/extending.md``, "Adding an optimizer")."""
from ._layout import StateLayout
from .adam import OPTIMIZER_METADATA_VERSION, CPUAdam, HybridAdam
from .base import StateStoreOptimizer
from .store_optimizer import StoreOptimizer

__all__ = ["CPUAdam", "HybridAdam", "StoreOptimizer", "StateStoreOptimizer", "StateLayout",
           "OPTIMIZER_METADATA_VERSION"]
