"""Asynchronous direct I/O for statestore's disk stores.

* :func:`make_engine` / :func:`available_engines` / :class:`IOEngine`: io_uring, libaio and a
  thread pool (``statestore._C_io``);
* :class:`TensorNVMeEngine`: TensorNVMe (when installed) behind a keyed interface that contains
  its defects (the engine of ``TensorNVMeStore``);
* :class:`IOFile`: O_DIRECT where the filesystem supports it, buffered with one warning and the
  page cache dropped otherwise;
* :func:`alloc_buffer`: 4096-aligned, optionally page-locked host buffers;
* :class:`DirectWriter`: a sequential ``O_DIRECT`` writer overlapped with its caller (the
  shards of a local checkpoint).

See ``docs/nvme.md``.
"""
from .buffers import ALIGNMENT, AlignedBuffer, alloc_buffer
from .direct_writer import DirectWriter
from .engine import (
    ENGINE_NAMES,
    IOEngine,
    IOFuture,
    NativeEngine,
    PyThreadsEngine,
    available_engines,
    make_engine,
    probe_engine,
)
from .files import DIRECT_ALIGNMENT, IOFile, drop_page_cache
from .requests import Op
from ._tensornvme import TensorNVMeEngine

__all__ = [
    "ALIGNMENT",
    "AlignedBuffer",
    "alloc_buffer",
    "DirectWriter",
    "ENGINE_NAMES",
    "IOEngine",
    "IOFuture",
    "Op",
    "TensorNVMeEngine",
    "NativeEngine",
    "PyThreadsEngine",
    "available_engines",
    "make_engine",
    "probe_engine",
    "DIRECT_ALIGNMENT",
    "IOFile",
    "drop_page_cache",
]
