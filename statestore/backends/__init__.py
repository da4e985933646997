"""Store backends, one module each; :mod:`.registry` names them (``make_store``,
``register_store``) and holds :func:`~.registry.nvme_store`, the factory that picks the disk
store by engine."""
from .base import ResidentStore, StreamingStore
from .device import DeviceStore
from .file import FileStore
from .nvme import NVMeStore
from .pinned import PinnedCPUStore
from .registry import known_stores, make_store, nvme_store, register_store, store_class
from .tensornvme import TensorNVMeStore
from .tiered import TieredStore

__all__ = ["ResidentStore", "StreamingStore", "DeviceStore", "PinnedCPUStore", "FileStore",
           "NVMeStore", "TensorNVMeStore", "TieredStore", "known_stores", "make_store",
           "nvme_store", "register_store", "store_class"]
