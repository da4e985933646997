"""``CheckpointRecord``: what a :class:`~statestore.StateStore` records between its
checkpoints and its optimizer, an object each store holds: the attached optimizer's metadata
provider and ``on_load`` callback (both held weakly when bound methods), the metadata, group
and deferred states of the last load, why a load failed, and the regions of parameters held
in part. The store's public names (``attach_metadata``, ``metadata()``, ``regions``,
``record_regions``, ``load_error``, ``loaded_metadata``) hand over to it; the store hands the
record itself to a load (``CheckpointReader.set_up``, ``checkpoint/load.py``) and what a
save reads of it to the ``CheckpointWriter`` (``SavedStates``).

A load's calls on the record, in order (the mirror of the writer's steps): :meth:`begin_load`
(before the store's states are replaced: the attached optimizer's metadata no longer
describes them), then, once every state is in, :meth:`record_regions` and :meth:`loaded`
(which tells the attached optimizer); a load that fails after emptying the store ends with
:meth:`load_failed` instead (the store calls it). A deferred load (``load_deferred``) reads
:attr:`deferred`, then calls :meth:`record_regions` and, once nothing is left on disk,
:meth:`record_deferred_loaded`."""
from __future__ import annotations

import weakref
from contextlib import suppress
from typing import Any, Callable, Dict, Optional

from ._regions import Region
from ._signals import deferred_signals
from .errors import StateStoreValueError

__all__ = ["CheckpointRecord"]


def _weakly(f: Callable) -> Callable[[], Optional[Callable]]:
    """``() -> f``, or None once ``f``'s object is collected when ``f`` is a bound method."""
    if hasattr(f, "__self__") and hasattr(f, "__func__"):
        return weakref.WeakMethod(f)
    return lambda: f


class CheckpointRecord:
    """A store's record of its optimizer and its last checkpoint load (module docstring).

    Attributes:
        process_group: the group the store's states are sharded over, else None.
        deferred: the states a sharded load left on disk for other ranks, else None.
        loaded_metadata: the optimizer metadata of the checkpoint last loaded, else None.
        load_error: why the last load failed after emptying the store, else None.
        clears: how many times the store was cleared (a load that failed after a clear
            emptied the store).
    """

    def __init__(self) -> None:
        self._provider: Optional[Callable[[], Optional[Callable]]] = None
        self._on_load: Optional[Callable[[], Optional[Callable]]] = None
        self._regions: Dict[str, Region] = {}
        self.process_group: Any = None
        self.deferred: Any = None
        self.loaded_metadata: Optional[dict] = None
        self.load_error: Optional[str] = None
        self.clears = 0

    def attach(self, provider: Callable[[], Optional[dict]], process_group: Any,
               on_load: Optional[Callable]) -> None:
        """The store's ``attach_metadata``: ``provider()`` returns a JSON-serializable dict
        (bound methods are held weakly). ``process_group``: the ``torch.distributed`` group
        the optimizer shards the store's states over (None: not sharded; ``"keep"``: left
        as it is); the store's ``save_checkpoint`` is then a collective over it.
        ``on_load``: called as ``on_load(store)`` after ``load_checkpoint`` has replaced the
        states (held weakly when a bound method), so that an optimizer that already exists
        takes the checkpoint's step counts and hyperparameters (torch's order: build the
        optimizer, then load); it attaches its metadata again when it accepts the checkpoint.

        Raises:
            StateStoreValueError: ``provider`` (or ``on_load``) is not callable.
        """
        if not callable(provider):
            raise StateStoreValueError(f"attach_metadata: provider must be callable, got "
                                       f"{type(provider).__name__}")
        if on_load is not None and not callable(on_load):
            raise StateStoreValueError(f"attach_metadata: on_load must be callable or None, "
                                       f"got {type(on_load).__name__}")
        self._provider = _weakly(provider)
        self._on_load = None if on_load is None else _weakly(on_load)
        if not (isinstance(process_group, str) and process_group == "keep"):
            self.process_group = process_group

    def begin_load(self) -> None:
        """A load is about to replace the store's states: forget the metadata provider (an
        optimizer built next takes its step counts from the checkpoint; ``on_load`` stays)."""
        self._provider = None

    def metadata(self) -> Optional[dict]:
        """The attached optimizer's metadata now, else :attr:`loaded_metadata`."""
        provider = self._provider() if self._provider is not None else None
        meta = provider() if provider is not None else None
        return meta if meta is not None else self.loaded_metadata

    @property
    def regions(self) -> Dict[str, Region]:
        """``{parameter name: Region}`` of the parameters held in part (a copy)."""
        return dict(self._regions)

    def record_regions(self, regions: Dict[str, Region]) -> None:
        """The store's ``record_regions``: a whole region removes the parameter's entry.

        Raises:
            StateStoreValueError: a value that is not a Region fitting its global shape.
        """
        for name, r in regions.items():
            if not isinstance(r, Region) or r.problem():
                raise StateStoreValueError(f"record_regions: parameter {name!r}: not a region "
                                           f"({r!r})")
        for name, r in regions.items():
            if r.is_whole:
                self._regions.pop(name, None)
            else:
                self._regions[name] = r

    def loaded(self, store, metadata: Optional[dict], deferred: Any,
               process_group: Any) -> None:
        """A load into ``store`` completed: its metadata, deferred states and group (no
        error); then the attached optimizer takes the checkpoint whole (signals deferred).

        Raises:
            CheckpointMismatchError: the attached optimizer does not fit the checkpoint.
        """
        self.loaded_metadata, self.deferred = metadata, deferred
        self.process_group, self.load_error = process_group, None
        with deferred_signals():
            self.tell_loaded(store)

    def record_deferred_loaded(self) -> None:
        """Every deferred state was loaded: the store holds the whole checkpoint."""
        self.deferred = self.process_group = None

    def cleared(self) -> None:
        """The store's states were all deleted: no loaded metadata, deferred or regions."""
        self.loaded_metadata = self.deferred = None
        self._regions = {}

    def load_failed(self, store, error: BaseException, clears: int) -> None:
        """A load into ``store`` raised ``error`` and left it without states: when it had
        cleared the store (after the count ``clears``), the store is a failed load's
        remains (:attr:`load_error`) and the attached optimizer learns its states are gone."""
        if self.clears == clears:
            return
        with deferred_signals():
            self.load_error = f"{type(error).__name__}: {error}"[:500]
            with suppress(Exception):
                self.tell_loaded(store)

    def tell_loaded(self, store) -> None:
        """The store's states were replaced by a load: call the attached optimizer's
        ``on_load(store)`` if it is still alive (it may raise: the checkpoint does not fit)."""
        cb = self._on_load() if self._on_load is not None else None
        if cb is None:
            self._on_load = None
            return
        cb(store)
