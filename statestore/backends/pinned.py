"""``PinnedCPUStore``: states in page-locked host memory, allocated and accounted here."""
from __future__ import annotations

import warnings
from typing import Any, Dict

import torch

from ._slab import SlabStore

__all__ = ["PinnedCPUStore"]


def _cuda_usable() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception:
        return False


class PinnedCPUStore(SlabStore):
    """States in page-locked host memory, so GPU copies are asynchronous and fast.

    Memory is allocated by the store itself as exact-size slabs (one per batch of states
    created together) and registered with ``cudaHostRegister``: no power-of-two rounding as
    with torch's caching host allocator. ``stats()["pinned_bytes"]`` reports the total.
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
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        if self._pinned:
            rc = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)
            if int(rc) != 0:
                raise MemoryError(f"PinnedCPUStore: cudaHostRegister of {nbytes} bytes failed "
                                  f"(error {int(rc)})")
            self._pinned_bytes += nbytes
        return buf

    def _release_slab(self, buffer: torch.Tensor, handle: Any) -> None:
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
            self._pinned_bytes -= buffer.numel()

    def _backend_stats(self) -> Dict[str, Any]:
        return {"pinned": self._pinned, "pinned_bytes": self._pinned_bytes,
                "host_bytes": self._slab_bytes}
