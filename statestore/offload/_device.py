"""Copies between a store's memory and the device modules compute on."""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["Mover"]


class Mover:
    """Copies between the store's memory and the compute device. CUDA: host tensors are
    staged in pinned memory and copied on a side stream the compute stream waits for."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._inflight: list = []

    def host_buffer(self, numel: int, dtype: torch.dtype) -> Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=self.cuda)

    def to_device(self, src: Tensor, owned: bool) -> Tensor:
        """``src`` on the compute device; a copy unless ``owned`` and already there."""
        if src.device == self.device:
            return src if owned else src.clone()
        if not self.cuda or src.device.type != "cpu":
            return src.to(self.device, copy=True)
        if not src.is_pinned():
            src = src.pin_memory()
        cur = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(cur)
        with torch.cuda.stream(self.stream):
            dst = torch.empty(src.shape, dtype=src.dtype, device=self.device)
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        cur.wait_event(ev)
        dst.record_stream(cur)
        self._inflight.append((ev, src))            # the pinned source lives until copied
        self._inflight = [(e, s) for e, s in self._inflight if not e.query()]
        return dst

    def to_host(self, t: Tensor) -> Tensor:
        return t if t.device.type == "cpu" else t.to("cpu")
