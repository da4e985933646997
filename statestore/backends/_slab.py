"""Shared machinery of resident backends: states carved out of slabs (one slab per
``create_many`` call), each slab freed when its last state is deleted.

A backend supplies :meth:`_new_slab` (and optionally :meth:`_release_slab`); views are
64-byte aligned for the SIMD kernels.
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch

from .._types import StateKey, StateSpec
from .base import ResidentStore

__all__ = ["SlabStore", "slab_layout"]

_ALIGN = 64
# Large states of one slab start 64 KiB apart beyond their sizes: exp_avg and exp_avg_sq of a
# parameter of a power-of-two size would otherwise sit exactly 2^k bytes apart, and the
# update's two streams then contend (for DRAM banks or cache sets: which, no counters here
# showed). 4 KiB, the first stagger, fixed fp32 moments at 64M parameters but not at 32M,
# and put bf16 moments 2^k + 4 KiB apart, as slow: CPUAdam.step() on DeviceStore("cpu"), 1
# thread, 1.30 against 1.59 ns a parameter (bf16 moments, 64M), 0.98 against 1.30 (fp32,
# 32M); 64 KiB was as fast as the best stagger tried at every size and dtype (16M-64M, fp32,
# bf16, int8). Figures: benchmarks/RESULTS.md, "the slabs' stagger".
STAGGER = 64 << 10
STAGGER_MIN = 1 << 20


def slab_layout(sizes: Sequence[int]) -> Tuple[List[int], int]:
    """Byte offsets of states of these sizes (bytes) in one slab, and the slab's size: each
    state 64-byte aligned, and one of ``STAGGER_MIN`` bytes or more ``STAGGER`` beyond the
    previous state's end (``benchmarks/adam_step.py`` lays its states out the same way)."""
    offsets, pos = [], 0
    for nbytes in sizes:
        pos += (-pos) % _ALIGN
        if pos and nbytes >= STAGGER_MIN:
            pos += STAGGER
        offsets.append(pos)
        pos += nbytes
    return offsets, pos


class _Slab:
    __slots__ = ("buffer", "handle", "live", "nbytes")

    def __init__(self, buffer: torch.Tensor, handle: Any, nbytes: int):
        self.buffer, self.handle, self.nbytes = buffer, handle, nbytes
        self.live = 0


class SlabStore(ResidentStore):
    """A resident store whose states are views into slabs."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._tensors: Dict[StateKey, torch.Tensor] = {}
        self._slab_of: Dict[StateKey, _Slab] = {}
        self._slab_bytes = 0
        self._layout_version = 0

    @property
    def layout_version(self) -> int:
        """A number that changes whenever states are created or removed (``create``,
        ``delete``, ``clear``, ``load_checkpoint``, ``close``): the live tensors handed out
        before may no longer be the store's states once it changed. Optimizers that keep a
        step's tensors between steps (``statestore/optim/_units.py``) check it."""
        return self._layout_version

    def _new_slab(self, entries: Sequence[Tuple[StateKey, StateSpec]]
                  ) -> Tuple[torch.Tensor, Any, Dict[StateKey, int]]:
        """Return a zero-filled uint8 buffer, a handle, and each state's byte offset in it."""
        offs, total = slab_layout([spec.nbytes for _, spec in entries])
        return self._alloc_bytes(max(total, 1)), None, {k: o for (k, _), o in zip(entries, offs)}

    def _alloc_bytes(self, nbytes: int) -> torch.Tensor:
        raise NotImplementedError

    def _release_slab(self, buffer: torch.Tensor, handle: Any) -> None:
        """Called when a slab's last state is deleted (and at close)."""

    def _allocate(self, entries: Sequence[Tuple[StateKey, StateSpec]]) -> None:
        buf, handle, offsets = self._new_slab(entries)
        self._layout_version += 1
        slab = _Slab(buf, handle, buf.numel())
        self._slab_bytes += slab.nbytes
        for k, spec in entries:
            off = offsets[k]
            t = buf[off:off + spec.nbytes].view(spec.dtype).view(spec.shape)
            self._tensors[k] = t
            self._slab_of[k] = slab
            slab.live += 1

    def _free(self, keys: Sequence[StateKey]) -> None:
        self._layout_version += 1
        for k in keys:
            del self._tensors[k]
            slab = self._slab_of.pop(k)
            slab.live -= 1
            if slab.live == 0:
                self._slab_bytes -= slab.nbytes
                self._release_slab(slab.buffer, slab.handle)

    def _view(self, key: StateKey) -> torch.Tensor:
        return self._tensors[key]

    def _close(self) -> None:
        self._layout_version += 1
        slabs = {id(s): s for s in self._slab_of.values()}
        self._tensors.clear()
        self._slab_of.clear()
        for slab in slabs.values():
            self._release_slab(slab.buffer, slab.handle)
        self._slab_bytes = 0
