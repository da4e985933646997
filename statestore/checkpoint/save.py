"""Saving: :class:`CheckpointWriter`, the one object a store hands its states to (its call
order: the class docstring), and :func:`save_checkpoint`, the function form of
``store.save_checkpoint``."""
from __future__ import annotations

import uuid
from typing import Any, List, Optional

from .._signals import deferred_signals
from ..distributed import Collective
from ..errors import CheckpointError, StateStoreValueError
from .collective import CollectiveSave
from .filesystem import prepare_root, remove
from .parquet_guard import MAX_ROWS
from .stream import check_store
from .writer import (DEFAULT_SHARD_BYTES, SavedStates, as_io_error, lock_for_save,
                     metadata_json, remove_stale, save_progress, write_manifest, write_shards)

__all__ = ["save_checkpoint", "CheckpointWriter"]


def save_checkpoint(store, path: str, *, shard_bytes: int = DEFAULT_SHARD_BYTES,
                    progress: Optional[bool] = None, metadata: Optional[dict] = None,
                    process_group: Any = "auto", link: bool = True) -> None:
    """Write every state of ``store`` and its optimizer metadata to ``path`` atomically:
    ``store.save_checkpoint(path, ...)``, which hands its states to a
    :class:`CheckpointWriter`.

    RAM use is bounded by the store's pipeline budget (plus 32 MiB of write buffers for a
    local path). A failed save removes what it wrote and leaves the previous checkpoint at
    ``path`` (if any) intact.

    Args:
        store: the :class:`~statestore.StateStore` to save.
        path: a local directory or any fsspec URL; created if missing.
        shard_bytes: the most bytes a shard holds (a larger single tensor gets a shard of
            its own).
        progress: a byte progress bar: True always, None (default) for saves over a second,
            False never.
        metadata: optimizer metadata to save instead of the store's attached metadata
            (:meth:`StateStore.metadata`); a JSON-serializable dict.
        process_group: ``"auto"`` (default) saves collectively over the group the store's
            states are sharded on (the ``process_group`` of the optimizer attached to it, or
            the group a checkpoint was loaded over), else alone; a group saves collectively
            over it; None saves alone. When collective, every rank of the group must call it:
            each writes the states it holds into its own shards, then rank 0 writes the one
            manifest after all have finished (``docs/distributed.md``).
        link: where the checkpoint is a local directory on the filesystem of an
            :class:`~statestore.NVMeStore`'s files, those files become the shards by hard
            link (the store freezes them and writes later updates to new files, so the
            checkpoint never changes); the save writes no state bytes, and reads only states
            whose checksum the store did not compute as it wrote them. False copies every
            state (``docs/checkpoint-io.md``).

    Raises:
        StateStoreValueError: a bad argument, or metadata of the wrong shape or not
            JSON-serializable (nothing is written).
        StateStoreClosedError: the store is closed.
        CheckpointError: the store holds only one rank's shard of a loaded checkpoint and
            the save is not collective, or a collective save failed on another rank.
        StateStoreIOError: writing failed (names the file); ``errno.EBUSY`` when another
            save to the same local path is in progress.
    """
    check_store(store)
    store.save_checkpoint(path, shard_bytes=shard_bytes, progress=progress, metadata=metadata,
                          process_group=process_group, link=link)


class CheckpointWriter:
    """Writes one checkpoint of the states a store hands it (``StateStore.save_checkpoint``
    makes these calls, in this order, as DCP's ``StorageWriter`` is driven):

    0. ``CheckpointWriter(path, shard_bytes=..., progress=..., metadata=...,
       process_group=..., link=...)``: the arguments checked; nothing touched. A context
       manager: leaving it runs step 5.
    1. :meth:`set_up` ``(states)``: the store's :class:`~.writer.SavedStates` (the store
       waited for its writes first); the group chosen (``"auto"``: ``states.process_group``);
       alone, a store holding one rank's shard is refused; the metadata checked (nothing
       created when it is bad), the directory created and its save lock taken.
    2. :meth:`plan`: the save id and the states this process writes (collective: every
       rank's keys and regions gathered; a failure on any rank fails all, nothing written).
    3. :meth:`write_data`: the shards: the store's files hard-linked where they can be
       (``states.links``), every other state read through ``states`` (the store's pipeline)
       into shards written under temporary names, fsync'd and renamed.
    4. :meth:`finish`: the manifest written and renamed into place, the commit point
       (collective: by rank 0, once every rank's rows are gathered), then the files of earlier
       saves removed.
    5. ``__exit__``: a save that did not commit removes what it wrote (the previous
       checkpoint stays intact) and raises a plain ``OSError`` as a ``StateStoreIOError``
       naming the path; the lock is released.

    Raises (as :func:`save_checkpoint`): at construction, ``StateStoreValueError`` for a bad
    argument; then each step's errors.
    """

    def __init__(self, path: str, *, shard_bytes: int = DEFAULT_SHARD_BYTES,
                 progress: Optional[bool] = None, metadata: Optional[dict] = None,
                 process_group: Any = "auto", link: bool = True):
        _check_arguments(shard_bytes, metadata, link)
        self.path, self.shard_bytes, self.progress = path, shard_bytes, progress
        self.metadata, self.link, self._group_arg = metadata, link, process_group
        self._collective: Optional[CollectiveSave] = None
        self._fs = self._root = self._lock = None
        self._written: List[str] = []
        self._rows: list = []

    def __enter__(self) -> "CheckpointWriter":
        return self

    def set_up(self, states: SavedStates) -> None:
        """Step 1 (class docstring)."""
        self._states = states
        arg = self._group_arg
        group = states.process_group if isinstance(arg, str) and arg == "auto" else arg
        if group is not None:
            comm = Collective(group, f"collective save of checkpoint {self.path!r}")
            self._collective = CollectiveSave(comm, self.path, self.shard_bytes,
                                              self.progress, self.metadata, self.link)
            return self._collective.set_up(states)
        _check_whole(states, self.path)
        if states.error is not None:
            raise states.error
        self._meta_json = metadata_json(states, self.metadata)  # bad: no directory created
        self._fs, self._root = prepare_root(self.path)
        self._lock = lock_for_save(self._fs, self._root, self.path)

    def plan(self) -> None:
        """Step 2 (class docstring)."""
        if self._collective is not None:
            return self._collective.plan()
        self._keys = list(self._states.keys)
        self._save_id = uuid.uuid4().hex[:12]

    def write_data(self) -> None:
        """Step 3 (class docstring)."""
        if self._collective is not None:
            return self._collective.write_data()
        bar = save_progress(self._states, self._keys, self._root, self.progress)
        try:
            self._rows = write_shards(self._states, self._fs, self._root, self._keys,
                                      f"shard-{self._save_id}", self.shard_bytes, bar,
                                      self._written, self.link)
        finally:
            bar.close()

    def finish(self) -> None:
        """Step 4 (class docstring)."""
        if self._collective is not None:
            return self._collective.finish()
        write_manifest(self._fs, self._root, self._rows, self._meta_json, self._save_id,
                       self._written)
        remove_stale(self._fs, self._root, self._save_id)

    def __exit__(self, exc_type, exc, tb) -> None:
        """Step 5 (class docstring)."""
        try:
            if exc is not None and self._written:
                remove(self._fs, self._written)     # the previous checkpoint untouched
        finally:
            with deferred_signals():    # a Ctrl-C between these left the lock held for good
                lock, self._lock = self._lock, None
                if lock is not None:
                    lock.__exit__(None, None, None)
            if self._collective is not None:
                self._collective.close()
        if exc is not None and self._collective is None:
            err = as_io_error(exc, self.path)
            if err is not exc:
                raise err


def _check_arguments(shard_bytes: Any, metadata: Any, link: Any) -> None:
    """The arguments' types and values (before the store is asked anything)."""
    if not isinstance(link, bool):
        raise StateStoreValueError(f"link must be True or False, got {link!r}")
    if isinstance(shard_bytes, bool) or not isinstance(shard_bytes, int) or shard_bytes <= 0:
        raise StateStoreValueError(f"shard_bytes must be a positive int, got {shard_bytes!r}")
    if metadata is not None and not isinstance(metadata, dict):
        raise StateStoreValueError(f"metadata must be a dict or None, got "
                                   f"{type(metadata).__name__}")


def _check_whole(states: SavedStates, path: str) -> None:
    """A save that is not collective: the store holds every state, and no more than a
    manifest may list."""
    if states.regions:
        name, reg = next(iter(states.regions.items()))
        raise CheckpointError(
            f"this store holds one rank's shard of sharded parameters (parameter {name!r}: "
            f"{reg.describe()}); save it collectively: every rank of the parameters' group "
            f"calls save_checkpoint (process_group='auto', the default, or the group)")
    deferred = states.deferred
    if deferred is not None and deferred.rows:
        raise CheckpointError(
            f"this store holds only rank {deferred.rank}'s shard of checkpoint "
            f"{deferred.path!r}; save it collectively (every rank calls "
            f"save_checkpoint) or build an optimizer on it first")
    if len(states.keys) > MAX_ROWS:       # a manifest no reader would take: refused before writing
        raise CheckpointError(f"checkpoint {path!r}: the store holds {len(states.keys)} states, more "
                              f"than the {MAX_ROWS} a manifest may list "
                              f"(statestore.checkpoint.MAX_ROWS)")
