"""Saving a store alone: :func:`save_checkpoint` (it hands a collective save to
:mod:`.collective`)."""
from __future__ import annotations

import uuid
from typing import Any, List, Optional

from ..errors import CheckpointError, StateStoreValueError
from .collective import save_collective
from .filesystem import prepare_root, remove
from .parquet_guard import MAX_ROWS
from .stream import check_store
from .writer import (DEFAULT_SHARD_BYTES, as_io_error, lock_for_save, metadata_json,
                     remove_stale, save_progress, write_manifest, write_shards)

__all__ = ["save_checkpoint"]


def save_checkpoint(store, path: str, *, shard_bytes: int = DEFAULT_SHARD_BYTES,
                    progress: Optional[bool] = None, metadata: Optional[dict] = None,
                    process_group: Any = "auto", link: bool = True) -> None:
    """Write every state of ``store`` and its optimizer metadata to ``path`` atomically.

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
    _check_arguments(store, shard_bytes, metadata, link)
    store.check_open()
    group = store.process_group if isinstance(process_group, str) and process_group == "auto" \
        else process_group
    if group is not None:
        return save_collective(store, path, group, shard_bytes, progress, metadata, link)
    _check_whole(store, path)
    _save_alone(store, path, shard_bytes, progress, metadata, link)


def _check_arguments(store, shard_bytes: Any, metadata: Any, link: Any) -> None:
    """The arguments' types and values (before the store is asked anything)."""
    check_store(store)
    if not isinstance(link, bool):
        raise StateStoreValueError(f"link must be True or False, got {link!r}")
    if isinstance(shard_bytes, bool) or not isinstance(shard_bytes, int) or shard_bytes <= 0:
        raise StateStoreValueError(f"shard_bytes must be a positive int, got {shard_bytes!r}")
    if metadata is not None and not isinstance(metadata, dict):
        raise StateStoreValueError(f"metadata must be a dict or None, got "
                                   f"{type(metadata).__name__}")


def _check_whole(store, path: str) -> None:
    """A save that is not collective: the store holds every state, and no more than a
    manifest may list."""
    if store.regions:
        name, reg = next(iter(store.regions.items()))
        raise CheckpointError(
            f"this store holds one rank's shard of sharded parameters (parameter {name!r}: "
            f"{reg.describe()}); save it collectively: every rank of the parameters' group "
            f"calls save_checkpoint (process_group='auto', the default, or the group)")
    deferred = store.deferred
    if deferred is not None and deferred.rows:
        raise CheckpointError(
            f"this store holds only rank {deferred.rank}'s shard of checkpoint "
            f"{deferred.path!r}; save it collectively (every rank calls "
            f"save_checkpoint) or build an optimizer on it first")
    if len(store) > MAX_ROWS:       # a manifest no reader would take: refused before writing
        raise CheckpointError(f"checkpoint {path!r}: the store holds {len(store)} states, more "
                              f"than the {MAX_ROWS} a manifest may list "
                              f"(statestore.checkpoint.MAX_ROWS)")


def _save_alone(store, path: str, shard_bytes: int, progress: Optional[bool],
                metadata: Optional[dict], link: bool) -> None:
    """Write the shards, then commit the manifest, under the path's save lock."""
    store.sync()
    meta_json = metadata_json(store, metadata)     # bad metadata: no directory is created
    fs, root = prepare_root(path)
    with lock_for_save(fs, root, path):
        keys = store.keys()
        save_id = uuid.uuid4().hex[:12]
        written: List[str] = []
        bar = save_progress(store, keys, root, progress)
        try:
            rows = write_shards(store, fs, root, keys, f"shard-{save_id}", shard_bytes, bar,
                                written, link)
            write_manifest(fs, root, rows, meta_json, save_id, written)
        except BaseException as e:
            remove(fs, written)         # leave the previous checkpoint (if any) untouched
            raise as_io_error(e, path)
        finally:
            bar.close()
        remove_stale(fs, root, save_id)
