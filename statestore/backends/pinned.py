"""``PinnedCPUStore``: states in page-locked host memory, allocated and accounted here."""
from __future__ import annotations

import ctypes
import mmap
import warnings
from typing import Any, Dict

import torch

from ._slab import SlabStore

__all__ = ["PinnedCPUStore", "page_aligned_zeros"]


def page_aligned_zeros(nbytes: int) -> torch.Tensor:
    """``nbytes`` zeroed bytes that start on a page and own every page they touch.

    ``cudaHostRegister`` locks whole pages: two buffers from the C heap that share a page cannot
    both be registered (the second fails with cudaErrorHostMemoryAlreadyRegistered, which small
    slabs hit at once). An anonymous mapping rounded up to whole pages shares none; the tensor
    keeps the mapping alive, and the kernel gives it back when the last view is freed.
    """
    size = max(1, -(-nbytes // mmap.PAGESIZE)) * mmap.PAGESIZE
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(region, dtype=torch.uint8)[:nbytes]


def _clear_cuda_error() -> None:
    """Read (and so reset) the CUDA runtime's last error after a failed call made outside
    torch: left set, it would be reported by torch's next kernel launch, in unrelated code."""
    try:
        ctypes.CDLL(None).cudaGetLastError()
    except (AttributeError, OSError):
        pass


def _cuda_usable() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception:
        return False


class PinnedCPUStore(SlabStore):
    """States in page-locked host memory, so GPU copies are asynchronous and fast.

    Memory is allocated by the store itself as slabs (one per batch of states created
    together) of whole pages, registered with ``cudaHostRegister``: no power-of-two rounding as
    with torch's caching host allocator, and no page shared with other memory (see
    :func:`page_aligned_zeros`). ``stats()["pinned_bytes"]`` reports the total.
    Where CUDA is absent, memory is pageable and one warning says so.
    """

    _warned = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._pinned = _cuda_usable()
        if not self._pinned and not PinnedCPUStore._warned:
            PinnedCPUStore._warned = True
            warnings.warn("PinnedCPUStore: CUDA is not available, states use pageable memory",
                          RuntimeWarning, stacklevel=2)
        self._pinned_bytes = 0

    def _alloc_bytes(self, nbytes: int) -> torch.Tensor:
        if not self._pinned:
            return torch.zeros(nbytes, dtype=torch.uint8)
        buf = page_aligned_zeros(nbytes)
        cudart = torch.cuda.cudart()
        rc = int(cudart.cudaHostRegister(buf.data_ptr(), buf.numel(), 0))
        if rc != 0:
            _clear_cuda_error()
            try:
                what = cudart.cudaGetErrorString(rc)
            except Exception:
                what = "unknown"
            raise MemoryError(f"PinnedCPUStore: cudaHostRegister of {nbytes} bytes failed "
                              f"(CUDA error {rc}: {what}); page-locked memory is limited by "
                              f"the machine's RAM and `ulimit -l`: use NVMeStore or "
                              f"DeviceStore('cpu') for states that do not fit")
        self._pinned_bytes += nbytes
        return buf

    def _release_slab(self, buffer: torch.Tensor, handle: Any) -> None:
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
            self._pinned_bytes -= buffer.numel()

    def _backend_stats(self) -> Dict[str, Any]:
        return {"pinned": self._pinned, "pinned_bytes": self._pinned_bytes,
                "host_bytes": self._slab_bytes}
