"""The two kinds of backend, as the bases a backend subclasses: :class:`ResidentStore`
(states in addressable memory, handed out as live views) and :class:`StreamingStore` (states
moved through the pipeline's ring of host buffers). Each declares, abstract, the primitives
its kind must implement; everything else is :class:`~statestore.StateStore`'s, written once.
A store made of other stores (``TieredStore``) subclasses ``StateStore`` itself and delegates.
"""
from __future__ import annotations

from abc import abstractmethod

import torch

from .._types import Slice, StateKey, as_key
from ..store import StateStore

__all__ = ["ResidentStore", "StreamingStore"]


class ResidentStore(StateStore):
    """Base of stores whose states live in addressable memory (a torch device, pinned or
    pageable RAM, an mmap'd file): the pipeline hands out views of the live tensors, ``get``
    returns the live tensor and ``put`` copies into it; nothing is in flight.

    A backend implements :meth:`_allocate` (zero-filled), :meth:`_free`, :meth:`_view` and
    :attr:`device`, or subclasses ``backends._slab.SlabStore`` and implements
    ``_alloc_bytes``.
    """

    resident = True

    @abstractmethod
    def _view(self, key: StateKey) -> torch.Tensor:
        """The live tensor of ``key`` (its shape and dtype)."""

    def get(self, key) -> torch.Tensor:
        """The live tensor of the state (a view: changes to it change the store); see
        :meth:`StateStore.get`."""
        self._check_open()
        k = as_key(key)
        self.spec(k)
        self._in_flight.raise_error()
        self._check_files()
        return self._view(k)

    def put(self, key, value: torch.Tensor) -> None:
        """Copy ``value`` into the state's live tensor; see :meth:`StateStore.put`."""
        k, _ = self._check_put(key, value)
        self._in_flight.raise_error()
        self._check_files()
        self._view(k).copy_(value)


class StreamingStore(StateStore):
    """Base of stores whose states live where the CPU cannot address them (files moved with
    direct I/O): every access goes through the pipeline's ring of host buffers of
    ``budget_bytes``, reads ahead and writes behind (``store.in_flight``).

    A backend sets :attr:`alignment` (and :attr:`transfer_alignment`), implements
    :meth:`_allocate`, :meth:`_free`, :meth:`_submit_read` and :meth:`_submit_write`, and
    usually :meth:`_alloc_host_buffer` (aligned, page-locked) and :meth:`_flush` (fsync).
    """

    resident = False

    @abstractmethod
    def _submit_read(self, s: Slice, out: torch.Tensor):
        """Start reading slice ``s`` into ``out`` (1-D, ``s.numel`` elements of the state's
        dtype, inside an aligned buffer whose rounded-up size is writable); returns a
        Future-like object (``done()``, ``result()``)."""

    @abstractmethod
    def _submit_write(self, s: Slice, src: torch.Tensor, *, optimizer_pass: bool = False):
        """Start writing ``src`` to slice ``s``; returns a Future-like object. ``src`` stays
        untouched until it completes. ``optimizer_pass``: an optimizer pass (pipeline mode
        ``"rw"``) computes between writes, so the write does no extra work in the caller's
        time or on a helper thread that would take a core from its compute threads
        (NVMeStore: no checksum; a save reads the state back to hash it)."""
