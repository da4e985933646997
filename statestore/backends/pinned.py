"""``PinnedCPUStore``: states in page-locked host memory, allocated and accounted here."""
from __future__ import annotations

import warnings
from typing import Any, Dict

import torch

from ..io.buffers import alloc_buffer
from ._slab import SlabStore

__all__ = ["PinnedCPUStore"]


def _cuda_usable() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception:
        return False


class PinnedCPUStore(SlabStore):
    """States in page-locked host memory, so GPU copies are asynchronous and fast.

    Memory is allocated by the store itself as slabs (one per batch of states created
    together) of whole pages from anonymous mappings, registered with ``cudaHostRegister``: no
    power-of-two rounding as with torch's caching host allocator. A slab is unregistered before
    its pages can be unmapped, also when the store is dropped without :meth:`close` (the CUDA
    driver keeps a registration by address: memory freed while registered failed the next
    registration that reused the address with error 712). ``stats()["pinned_bytes"]`` reports
    the total.
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
        # data_ptr -> the AlignedBuffer owning that slab: dropping it unregisters the pages
        # (its finalizer), while any view still keeps them mapped
        self._owners: Dict[int, Any] = {}

    def _alloc_bytes(self, nbytes: int) -> torch.Tensor:
        if not self._pinned:
            return torch.zeros(nbytes, dtype=torch.uint8)
        owner = alloc_buffer(nbytes, pinned=True)
        if owner.kind != "cuda-registered":
            raise MemoryError(f"PinnedCPUStore: page-locking {nbytes} bytes failed "
                              f"({owner.note}); page-locked memory is bounded by the machine's "
                              f"RAM: keep states that do not fit in NVMeStore or "
                              f"DeviceStore('cpu')")
        self._owners[owner.data_ptr()] = owner
        self._pinned_bytes += nbytes
        return owner.tensor

    def _release_slab(self, buffer: torch.Tensor, handle: Any) -> None:
        if self._owners.pop(buffer.data_ptr(), None) is not None:
            self._pinned_bytes -= buffer.numel()

    def _backend_stats(self) -> Dict[str, Any]:
        return {"pinned": self._pinned, "pinned_bytes": self._pinned_bytes,
                "host_bytes": self._slab_bytes}
