"""The seam between parameter offload and statestore's optimizers.

A parameter offloaded by an :class:`~statestore.offload.OffloadHandle` carries its handle in
the attribute :data:`HANDLE_ATTR`. The optimizers (``statestore/optim``) call
:func:`update_begin` before they update a pipeline unit's parameters and :func:`update_end`
after, so each offloaded parameter is materialized around its update and written back after
its last slice; :func:`param_value` reads a parameter's value whether or not it is offloaded.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from torch import Tensor

__all__ = ["PARAM_STATE", "HANDLE_ATTR", "UPDATES_OFFLOADED", "is_offloaded", "param_value",
           "update_begin", "update_end", "updates_offloaded"]

#: State name under which a parameter's data is kept in the store: ``(name, "param")``.
PARAM_STATE = "param"
#: Attribute set on every offloaded Parameter: its handle.
HANDLE_ATTR = "_statestore_offload"
#: Class attribute, True on an optimizer that updates offloaded parameters a unit at a time
#: through :func:`update_begin`/:func:`update_end` (statestore's own); any other optimizer
#: gets every parameter it holds materialized around its ``step()``.
UPDATES_OFFLOADED = "updates_offloaded_parameters"


def updates_offloaded(optimizer: Any) -> bool:
    """True when ``optimizer`` updates offloaded parameters through this seam."""
    return getattr(type(optimizer), UPDATES_OFFLOADED, False) is True


def is_offloaded(p: Tensor) -> bool:
    """True when ``p`` is a parameter of an open :class:`~statestore.offload.OffloadHandle`."""
    return getattr(p, HANDLE_ATTR, None) is not None


def param_value(p: Tensor) -> Tensor:
    """``p``'s current value as a tensor (``p.detach()`` when it is not offloaded; for an
    offloaded parameter the stored value, read if needed, without keeping it materialized)."""
    h = getattr(p, HANDLE_ATTR, None)
    if h is None:
        return p.detach()
    return h._value(p)


def update_begin(entries) -> Optional[list]:
    """Before an optimizer updates ``entries`` (``(param, start, stop, ...)`` tuples, one
    pipeline unit): materialize the offloaded ones. Returns a token for :func:`update_end`
    (None when none is offloaded)."""
    by_handle: Optional[Dict[Any, list]] = None
    for e in entries:
        h = getattr(e[0], HANDLE_ATTR, None)
        if h is not None:
            if by_handle is None:
                by_handle = {}
            by_handle.setdefault(h, []).append((e[0], e[1], e[2]))
    if by_handle is None:
        return None
    token = list(by_handle.items())
    for h, items in token:
        h._opt_acquire(items)
    return token


def update_end(token: Optional[list]) -> None:
    """After the update of :func:`update_begin`'s entries: a parameter whose last slice was
    updated is written back to its store and released."""
    if token is None:
        return
    for h, items in token:
        h._opt_done(items)
