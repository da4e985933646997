"""Store backends, one module each."""
from .device import DeviceStore
from .file import FileStore
from .pinned import PinnedCPUStore

__all__ = ["DeviceStore", "PinnedCPUStore", "FileStore"]
