"""Pieces of :class:`~statestore.optim.StoreOptimizer`'s unit update: the runs a joined
update is made in (:func:`parts`), the store as it creates a step's states (:class:`Noting`),
the parameter the class is handed for a range (:func:`range_proxy`) and a ``p.data = ...`` of
the class carried to the parameter (:func:`replace_data`)."""
from __future__ import annotations

from typing import Dict, List

from torch import Tensor

from ..errors import StateStoreError
from ..pipeline import pack_runs
from ..store import StateStore
from ._dtensor import local, local_grad
from ._torch_layout import class_name

__all__ = ["JOIN_TOTAL", "parts", "Noting", "range_proxy", "replace_data"]

#: elements of one joined update at most (it copies parameters, gradients and states)
JOIN_TOTAL = 1 << 20


def parts(items: list) -> List[list]:
    """``items`` (``((parameter, start, stop, ...), gradient)``) in runs of at most
    :data:`JOIN_TOTAL` elements."""
    return pack_runs(((it, it[0][2] - it[0][1]) for it in items), JOIN_TOTAL)


class Noting:
    """``store`` as :func:`~statestore.optim._plan.ensure_states` uses it, noting in
    ``created`` the keys it creates."""

    __slots__ = ("_store", "_created")

    def __init__(self, store: StateStore, created: set):
        self._store, self._created = store, created

    def __contains__(self, key) -> bool:
        return key in self._store

    def create_many(self, entries) -> None:
        """Create them name by name (every parameter's first state, then every second...):
        a resident store then lays each name's states back to back, which a joined update
        takes as one view (:func:`~statestore.optim._resident.joined_view`)."""
        order: Dict[str, int] = {}
        entries = sorted(entries, key=lambda e: order.setdefault(e[0].state, len(order)))
        self._store.create_many(entries)
        self._created.update(e[0] for e in entries)

    def __getattr__(self, name: str):
        return getattr(self._store, name)


def replace_data(cls: type, proxy: Tensor, target: Tensor, key: str) -> None:
    """The class ``cls`` assigned ``proxy.data`` (``p.data = ...``, as many hand-written
    optimizers do) where ``proxy`` stands for ``target``, a range of the parameter: copy
    the new value there, as the assignment does to the parameter itself."""
    if proxy.shape != target.shape or proxy.dtype != target.dtype:
        raise StateStoreError(
            f"{class_name(cls)} replaced the data of parameter {key!r} "
            f"(p.data = ...) with a tensor of shape {tuple(proxy.shape)} and dtype "
            f"{proxy.dtype}; StoreOptimizer writes an update back into the parameter, so "
            f"it must keep the shape {tuple(target.shape)} and dtype {target.dtype} it was "
            f"handed")
    target.copy_(proxy)

def range_proxy(p: Tensor, a: int, b: int, g: Tensor):
    """The parameter the class updates for elements ``[a, b)`` of ``p``: ``p`` itself when
    whole (its gradient as it is), else a flat range of it (a copy, written back after,
    when ``p`` is not contiguous) with the gradient's range. Returns ``(proxy,
    writeback, target)``: ``target`` is where the proxy's elements live when it is not
    ``p`` itself (a new ``proxy.data`` is copied there)."""
    w = local(p)
    if a == 0 and b == w.numel():
        if w is p:
            return p, None, None
        proxy = w.detach()
        proxy.grad = local_grad(p, p.grad)
        return proxy, None, w.detach()
    if w.is_contiguous():
        target = w.detach().view(-1)[a:b]
        proxy = target.detach()
        writeback = None
    else:
        proxy = w.detach().reshape(-1)[a:b].clone()
        target = None
        writeback = (p, (a, proxy))
    proxy.grad = g.view(-1)[a:b]
    return proxy, writeback, target
