"""``DeviceStore``: states in a torch device's memory (GPU, or plain RAM with ``"cpu"``)."""
from __future__ import annotations

from typing import Any, Dict

import torch

from ..errors import StateStoreValueError
from ._slab import SlabStore

__all__ = ["DeviceStore"]


class DeviceStore(SlabStore):
    """States in the memory of ``device`` (default ``"cuda"``; ``"cpu"`` is plain RAM).

    The pipeline hands out views of the live tensors. Raises
    :class:`~statestore.errors.StateStoreValueError` for a device that does not exist here.
    """

    def __init__(self, device="cuda", **kwargs):
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise StateStoreValueError(f"DeviceStore: invalid device {device!r}: "
                                       f"{str(e).splitlines()[0]}") from None
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise StateStoreValueError(
                    f"DeviceStore: device {device!r} requested but CUDA is not available; "
                    f"use DeviceStore('cpu') or PinnedCPUStore()")
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            elif dev.index >= torch.cuda.device_count():
                raise StateStoreValueError(f"DeviceStore: no CUDA device {dev.index} "
                                           f"({torch.cuda.device_count()} present)")
        elif dev.type == "meta":
            raise StateStoreValueError(f"DeviceStore: device {device!r} holds no data (meta "
                                       f"tensors have shapes only)")
        elif dev.type != "cpu":
            try:
                torch.empty(1, device=dev)
            except Exception as e:
                raise StateStoreValueError(f"DeviceStore: device {device!r} unusable: {e}") from None
        super().__init__(**kwargs)
        self._device = dev

    @property
    def device(self) -> torch.device:
        return self._device

    def _alloc_bytes(self, nbytes: int) -> torch.Tensor:
        return torch.zeros(nbytes, dtype=torch.uint8, device=self._device)

    def _backend_stats(self) -> Dict[str, Any]:
        return {"device_bytes": self._slab_bytes}
