"""Aligned host buffers for direct I/O.

:func:`alloc_buffer` returns 4096-aligned memory, page-locked when asked and possible:

* ``"cuda-registered"``: where CUDA is available, the pages are registered with
  ``cudaHostRegister`` (exact size, no power-of-two rounding as torch's caching host allocator
  does), so GPU copies from them are asynchronous;
* ``"mlocked"``: otherwise ``mlock`` where the process may lock that much memory;
* ``"plain"``: otherwise pageable memory; :attr:`AlignedBuffer.note` says why.

The memory comes from an anonymous ``mmap`` and is returned to the OS when the last tensor
viewing it is freed, so a freed buffer leaves nothing behind in RSS. Buffers of 2 MiB or more
start on a 2 MiB boundary and are advised ``MADV_HUGEPAGE``: where transparent huge pages are
allowed (``always`` or ``madvise``), each 2 MiB is physically contiguous and a direct-I/O
request of several MiB needs a few scatter-gather segments instead of one per 4 KiB page
(docs/nvme.md, "Huge-page buffers").
"""
from __future__ import annotations

import ctypes
import mmap
import weakref
from typing import Any, Tuple

import torch

from statestore.errors import StateStoreValueError

from ._native import native

__all__ = ["ALIGNMENT", "AlignedBuffer", "alloc_buffer", "buffer_address", "byte_view",
           "clear_cuda_error"]

ALIGNMENT = 4096


def _round_up(n: int, a: int = ALIGNMENT) -> int:
    return (n + a - 1) // a * a


class AlignedBuffer:
    """A 4096-aligned host buffer. ``tensor`` is a flat ``uint8`` tensor over all of it.

    Attributes: ``nbytes`` (requested size), ``kind`` (``"cuda-registered"``, ``"mlocked"`` or
    ``"plain"``), ``note`` (why it is not page-locked, if it is not).
    """

    __slots__ = ("tensor", "nbytes", "kind", "note", "__weakref__")

    def __init__(self, tensor: torch.Tensor, kind: str, note: str) -> None:
        self.tensor = tensor
        self.nbytes = tensor.numel()
        self.kind = kind
        self.note = note

    @property
    def locked(self) -> bool:
        return self.kind != "plain"

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()

    def huge_bytes(self) -> int:
        """Bytes of the buffer backed by transparent huge pages now (``AnonHugePages`` of
        its mapping in ``/proc/self/smaps``; 0 where that cannot be read)."""
        lo = self.tensor.data_ptr()
        hi = lo + self.nbytes
        total = 0
        try:
            with open("/proc/self/smaps") as f:
                inside = False
                for line in f:
                    head = line.split(None, 1)[0]
                    if "-" in head and not head.endswith(":"):
                        a, b = (int(x, 16) for x in head.split("-"))
                        inside = a < hi and lo < b
                    elif inside and head == "AnonHugePages:":
                        total += int(line.split()[1]) * 1024
        except (OSError, ValueError):
            return 0
        return min(total, self.nbytes)

    def view(self, dtype: torch.dtype, numel: int, byte_offset: int = 0) -> torch.Tensor:
        """A ``dtype`` tensor of ``numel`` elements starting ``byte_offset`` bytes in."""
        size = numel * dtype.itemsize
        if byte_offset < 0 or byte_offset + size > self.nbytes:
            raise StateStoreValueError(
                f"view of {size} bytes at byte_offset {byte_offset} exceeds the buffer's "
                f"{self.nbytes} bytes")
        return self.tensor[byte_offset:byte_offset + size].view(dtype)

    def __repr__(self) -> str:
        return f"AlignedBuffer(nbytes={self.nbytes}, kind={self.kind!r})"


def _cuda_register(t: torch.Tensor) -> tuple[bool, str]:
    try:
        cudart = torch.cuda.cudart()
        rc = cudart.cudaHostRegister(t.data_ptr(), t.numel(), 0)
        code = rc if isinstance(rc, int) else getattr(rc, "value", rc)
        if code != 0:
            clear_cuda_error()
            return False, f"cudaHostRegister returned {rc}"
        return True, ""
    except Exception as e:  # noqa: BLE001 - any failure means plain memory, reported
        return False, f"cudaHostRegister failed: {e}"


def clear_cuda_error() -> None:
    """Reads (so resets) the CUDA runtime's last error after a failed call made outside torch:
    left set, torch's next kernel launch reports it, in unrelated code. The runtime is the
    libcudart the process has loaded (torch's), found by name in its global symbols or in
    /proc/self/maps."""
    candidates = [None]
    try:
        with open("/proc/self/maps") as f:
            candidates += sorted({line.split()[-1] for line in f if "libcudart" in line})
    except OSError:
        pass
    for lib in candidates:
        try:
            getattr(ctypes.CDLL(lib), "cudaGetLastError")()
            return
        except (AttributeError, OSError):
            continue


def _cuda_unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - interpreter shutdown; nothing to report to
        pass


def alloc_buffer(nbytes: int, *, pinned: bool = True) -> AlignedBuffer:
    """Allocates ``nbytes`` (rounded up to 4096 internally) of aligned host memory.

    ``pinned=True`` asks for page-locked memory (see the module docstring for how); the result's
    ``kind`` says what was obtained. Never raises because locking failed.
    """
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
        raise StateStoreValueError(f"nbytes must be a positive int, got {nbytes!r}")
    use_cuda = pinned and torch.cuda.is_available()
    if native is not None:
        t, locked, note = native.alloc_aligned(nbytes, bool(pinned) and not use_cuda)
    else:
        # Pure-Python fallback: an anonymous mmap is page-aligned; no mlock without the extension.
        m = mmap.mmap(-1, _round_up(nbytes))
        t = torch.frombuffer(m, dtype=torch.uint8)[:nbytes]
        locked, note = False, "statestore._C_io not built: mlock unavailable"
    kind = "mlocked" if locked else "plain"
    if use_cuda:
        ok, note = _cuda_register(t)
        kind = "cuda-registered" if ok else "plain"
    elif not pinned:
        note = "page-locking not requested"
    buf = AlignedBuffer(t, kind, note)
    if kind == "cuda-registered":
        weakref.finalize(buf, _cuda_unregister, t.data_ptr())
    return buf


def buffer_address(buffer: Any) -> Tuple[int, int, Any]:
    """Where an engine may read or write ``buffer``.

    Args:
        buffer: a contiguous CPU ``torch.Tensor`` or an :class:`AlignedBuffer`.

    Returns:
        ``(address, byte size, object to keep alive while the I/O runs)``.

    Raises:
        StateStoreValueError: ``buffer`` is of another type, not in CPU memory, or not
            contiguous.
    """
    if isinstance(buffer, AlignedBuffer):
        buffer = buffer.tensor
    if not isinstance(buffer, torch.Tensor):
        raise StateStoreValueError(f"buffer must be a CPU torch.Tensor or AlignedBuffer, got "
                                   f"{type(buffer).__name__}")
    if buffer.device.type != "cpu":
        raise StateStoreValueError(f"buffer must be in CPU memory, got device {buffer.device}")
    if not buffer.is_contiguous():
        raise StateStoreValueError("buffer must be contiguous; call .contiguous() first")
    return buffer.data_ptr(), buffer.numel() * buffer.element_size(), buffer


def byte_view(keep: torch.Tensor, ptr: int, nbytes: int):
    """A writable numpy byte view of ``nbytes`` at address ``ptr`` inside tensor ``keep``
    (as :func:`buffer_address` gave them)."""
    flat = keep.reshape(-1).view(torch.uint8)
    start = ptr - flat.data_ptr()
    return flat[start:start + nbytes].numpy()
