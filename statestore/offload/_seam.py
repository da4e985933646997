"""The seam between parameter offload and the code that updates or saves parameters.

:class:`OffloadSeam` is the whole of what statestore's optimizers (``statestore/optim``) and
the offload checkpoint (:mod:`._checkpoint`) use of an :class:`~statestore.offload.OffloadHandle`:
public methods, nothing else. Which handle offloads a parameter is kept in a side table of
this module (weak, by identity): parameters carry no attribute of statestore's.

The optimizers call :func:`update_begin` before they update a pipeline unit's parameters and
:func:`update_end` after, so each offloaded parameter is materialized around its update and
written back after its last slice; :func:`param_value` reads a parameter's value whether or
not it is offloaded.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Protocol, Sequence, Tuple

from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from .._types import Slice

__all__ = ["PARAM_STATE", "UPDATES_OFFLOADED", "OffloadSeam", "attach", "detach",
           "handle_of", "is_offloaded", "param_value", "update_begin", "update_end",
           "updates_offloaded"]

#: State name under which a parameter's data is kept in the store: ``(name, "param")``.
PARAM_STATE = "param"
#: Class attribute, True on an optimizer that updates offloaded parameters a unit at a time
#: through :func:`update_begin`/:func:`update_end` (statestore's own); any other optimizer
#: gets every parameter it holds materialized around its ``step()``.
UPDATES_OFFLOADED = "updates_offloaded_parameters"

#: An update's items: ``(parameter, start, stop)``, a range of the flattened parameter.
Items = Sequence[Tuple[Tensor, int, int]]


class OffloadSeam(Protocol):
    """What an offload handle offers the code that updates or saves its parameters
    (:class:`~statestore.offload.OffloadHandle` implements it).

    Optimizers: :meth:`value`, :meth:`begin_update`, :meth:`end_update` (through this
    module's functions). Checkpoints: the rest.
    """

    model: nn.Module
    store: Any

    def value(self, p: Tensor) -> Tensor:
        """``p``'s current value (read from the store if needed, not kept materialized)."""

    def begin_update(self, items: Items) -> None:
        """Materialize the parameters of ``items`` for an optimizer's update."""

    def end_update(self, items: Items) -> None:
        """After the update of ``items``: a parameter whose last range was updated is
        written back and released."""

    @property
    def in_model_pass(self) -> bool:
        """True during the model's forward or backward."""

    def sync(self) -> None:
        """Write every updated parameter back and wait until the store has it."""

    def release_all(self) -> None:
        """Release every materialized parameter (its value stays in the store)."""

    def chunks(self, p: Tensor) -> Iterator[Tensor]:
        """``p``'s value, flattened, piece by piece (bounded by the store's unit size)."""

    def slices(self, p: Tensor) -> List[Slice]:
        """The store slices that hold ``p``, in order (pipeline units of one slice each)."""

    def names(self, p: Tensor) -> List[str]:
        """Every name of ``p`` in the model (tied weights have several), its first first."""


_handles = WeakIdKeyDictionary()     # parameter -> the handle that offloads it


def handle_of(p: Tensor) -> Optional[OffloadSeam]:
    """The open handle that offloads ``p``, or None."""
    return _handles.get(p)


def attach(p: Tensor, handle: OffloadSeam) -> None:
    """Record that ``handle`` offloads ``p`` (the handle calls it)."""
    _handles[p] = handle


def detach(p: Tensor, handle: OffloadSeam) -> None:
    """Forget ``p`` if ``handle`` offloads it (the handle calls it when it lets ``p`` go)."""
    if _handles.get(p) is handle:
        del _handles[p]


def updates_offloaded(optimizer: Any) -> bool:
    """True when ``optimizer`` updates offloaded parameters through this seam."""
    return getattr(type(optimizer), UPDATES_OFFLOADED, False) is True


def is_offloaded(p: Tensor) -> bool:
    """True when ``p`` is a parameter of an open :class:`~statestore.offload.OffloadHandle`."""
    return p in _handles


def param_value(p: Tensor) -> Tensor:
    """``p``'s current value as a tensor (``p.detach()`` when it is not offloaded; for an
    offloaded parameter the stored value, read if needed, without keeping it materialized)."""
    h = _handles.get(p)
    if h is None:
        return p.detach()
    return h.value(p)


def update_begin(entries) -> Optional[list]:
    """Before an optimizer updates ``entries`` (``(param, start, stop, ...)`` tuples, one
    pipeline unit): materialize the offloaded ones. Returns a token for :func:`update_end`
    (None when none is offloaded)."""
    if not _handles:
        return None
    by_handle: Optional[Dict[Any, list]] = None
    for e in entries:
        h = _handles.get(e[0])
        if h is not None:
            if by_handle is None:
                by_handle = {}
            by_handle.setdefault(h, []).append((e[0], e[1], e[2]))
    if by_handle is None:
        return None
    token = list(by_handle.items())
    for h, items in token:
        h.begin_update(items)
    return token


def update_end(token: Optional[list]) -> None:
    """After the update of :func:`update_begin`'s entries: a parameter whose last slice was
    updated is written back and released."""
    if token is None:
        return
    for h, items in token:
        h.end_update(items)
