"""Store backends, one module each."""
from .base import ResidentStore, StreamingStore
from .device import DeviceStore
from .file import FileStore
from .pinned import PinnedCPUStore

__all__ = ["ResidentStore", "StreamingStore", "DeviceStore", "PinnedCPUStore", "FileStore"]
