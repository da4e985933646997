"""statestore: optimizer states in pluggable stores, with exact, atomic checkpoints.

Public API::

    import statestore as ss
    ss.DeviceStore, ss.PinnedCPUStore, ss.FileStore, ss.NVMeStore   # stores
    ss.TensorNVMeStore, ss.TieredStore                               # (by name: statestore.backends.make_store)
    ss.StateStore, ss.StateKey, ss.Slice                             # the interface
    ss.ResidentStore, ss.StreamingStore                              # the bases of backends
    ss.StateStoreError (and subclasses in statestore.errors)
    from statestore.optim import CPUAdam, HybridAdam
    ss.offload_parameters(model, store, prefetch=2)                  # parameters in a store too
"""
# First, before anything loads a compiled extension: refuse ones built for another torch
# (ExtensionMismatchError, naming both releases and the rebuild command).
from ._build_check import check_extensions

check_extensions()

from ._types import Slice, StateKey, StateSpec  # noqa: E402
from .backends import (DeviceStore, FileStore, NVMeStore, PinnedCPUStore, ResidentStore,
                       StreamingStore, TensorNVMeStore, TieredStore)
from .errors import *  # noqa: F401,F403
from .errors import __all__ as _errors_all
from .kernels import kernels_info
from .offload import OffloadHandle, offload_parameters
from .store import DEFAULT_BUDGET_BYTES, StateStore

from ._version import __version__

__all__ = ["StateStore", "ResidentStore", "StreamingStore", "StateKey", "StateSpec", "Slice", "DEFAULT_BUDGET_BYTES",
           "DeviceStore", "PinnedCPUStore", "FileStore", "NVMeStore", "TensorNVMeStore",
           "TieredStore", "kernels_info",
           "offload_parameters", "OffloadHandle",
           "__version__"] + list(_errors_all)
