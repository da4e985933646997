"""Whole states streamed through a store's pipeline, chunk by chunk, in bounded RAM.

The two loops every checkpoint byte goes through: :func:`read_states` (save, verification of
linked shards) and :func:`write_state` (load), both on the store's public
:meth:`~statestore.StateStore.stream`; nothing else in the package moves a store's states.
:func:`check_store` checks the store argument of the public functions.
"""
from __future__ import annotations

from typing import Callable, Iterator, List, Tuple

import torch

from .._types import StateKey, StateSpec
from ..errors import StateStoreValueError

__all__ = ["read_states", "write_state", "write_states", "check_store"]


def read_states(store, keys: List[StateKey]) -> Iterator[Tuple[StateKey, memoryview]]:
    """Yield ``(key, bytes)`` of the states ``keys``, in order, chunk by chunk, through ONE
    stream of the store: streaming stores read ahead across tensors within their RAM
    budget (chunks of :attr:`~statestore.StateStore.unit_bytes`, a quarter of it) while the
    caller hashes and writes.

    Args:
        store: the :class:`~statestore.StateStore` holding ``keys``.
        keys: the states to read; empty states yield nothing.

    Returns:
        An iterator of ``(key, memoryview)``: each view is valid until the next item.
    """
    keys = [k for k in keys if store.spec(k).nbytes]
    if not keys:
        return
    with store.stream(keys, "r", chunk_bytes=store.unit_bytes) as chunks:
        for s, t in chunks:
            if t.device.type != "cpu":
                t = t.cpu()
            yield s.key, memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())


def write_state(store, key: StateKey, spec: StateSpec,
                fill: Callable[[memoryview], None]) -> None:
    """Write the whole state ``key`` (already created, of ``spec``) through one stream of
    ``store``: ``fill(view)`` is called for each chunk in order and fills its bytes.

    Args:
        store: the :class:`~statestore.StateStore` holding ``key``.
        key: the state to write.
        spec: its shape and dtype.
        fill: fills a writable byte view with the state's next bytes; its exception stops
            the write (and propagates).
    """
    if not spec.nbytes:
        return
    with store.stream(key, "w") as chunks:
        for _, t in chunks:
            if t.device.type == "cpu" and t.is_contiguous():
                fill(memoryview(t.view(-1).view(torch.uint8).numpy()))
            else:
                tmp = torch.empty(t.numel(), dtype=t.dtype)
                fill(memoryview(tmp.view(torch.uint8).numpy()))
                t.copy_(tmp.view(t.shape))


def write_states(store, items: List[Tuple[StateKey, StateSpec]],
                 fill: Callable[[StateKey, memoryview], None],
                 finished: Callable[[StateKey], None]) -> None:
    """Write the whole states ``items`` (already created) through ONE stream of ``store``,
    in order: ``fill(key, view)`` fills each chunk's bytes in order, ``finished(key)`` is
    called once a state's last chunk is filled (before it is written back: it may raise,
    and then nothing of that unit is written). Many small states then share pipeline units
    (and, on an ``NVMeStore``, packed extents) instead of a stream each.

    Args:
        store: the :class:`~statestore.StateStore` holding the keys.
        items: ``(key, spec)`` of the states to write.
        fill: fills a writable byte view with the state's next bytes; its exception stops
            the write (and propagates).
        finished: called after a state's last chunk (an exception stops the write).
    """
    specs = dict(items)
    keys = [k for k, spec in items if spec.nbytes]
    if not keys:
        return
    with store.stream(keys, "w") as chunks:
        for s, t in chunks:
            if t.device.type == "cpu" and t.is_contiguous():
                fill(s.key, memoryview(t.view(-1).view(torch.uint8).numpy()))
            else:
                tmp = torch.empty(t.numel(), dtype=t.dtype)
                fill(s.key, memoryview(tmp.view(torch.uint8).numpy()))
                t.copy_(tmp.view(t.shape))
            if s.stop == specs[s.key].numel:
                finished(s.key)


def check_store(store) -> None:
    """Raise :class:`StateStoreValueError` unless ``store`` is a :class:`~statestore.StateStore`."""
    from ..store import StateStore
    if not isinstance(store, StateStore):
        raise StateStoreValueError(f"store must be a statestore.StateStore, got "
                                   f"{type(store).__name__}")
