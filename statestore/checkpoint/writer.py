"""The steps of a save, shared by a save alone and a collective one (both driven by
:class:`.save.CheckpointWriter`): shards (copied or hard-linked), the manifest (the commit
point), and the clean-up of earlier saves' files; and :class:`SavedStates`, what a store hands
a save (its states, metadata and the means to read them), so that no step calls the store.

Every state is streamed through the store's pipeline (:func:`.stream.read_states`) into shards
written under temporary names, fsync'd and renamed; the manifest is written the same way,
last: a checkpoint exists exactly when its manifest does. Shards of an earlier save at the
same path are removed only after the new manifest is in place (``docs/checkpoint-io.md``,
"Saving: the atomic commit protocol").
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from .._safetensors_layout import layout
from .._links import FileLinks
from .._regions import Region
from .._types import StateKey, StateSpec, check_key
from ..errors import CheckpointError, StateStoreError, StateStoreIOError, StateStoreValueError
from .digest import KEY, manifest_digest
from .filesystem import (close_quietly, commit, fsync_dir, is_local, join, open_for_write,
                         remove)
from .filesystem import progress as progress_bar
from .format import (CHECKSUM, COLUMNS, FORMAT_NAME, FORMAT_VERSION, MANIFEST,
                     REGION_FORMAT_VERSION, REGION_SCHEMA, SCHEMA, ManifestRow, columns,
                     statestore_version)
from .manifest import read_manifest
from .metadata import optimizer_metadata_problem
from .parquet_guard import MAX_ROWS
from .save_lock import SaveLock
from .stream import read_states

__all__ = ["DEFAULT_SHARD_BYTES", "SavedStates", "metadata_json", "save_progress", "write_shards",
           "write_manifest", "remove_stale", "lock_for_save", "as_io_error"]

DEFAULT_SHARD_BYTES = 2 * 1024 ** 3
# link() errors that mean "no hard link here" (the states are copied instead)
_NO_LINK = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EACCES}


@dataclass(frozen=True)
class SavedStates:
    """What a store hands :class:`~statestore.checkpoint.save.CheckpointWriter` (built by
    ``StateStore.save_checkpoint`` once the store's writes are durable): the save reads
    everything it needs from it and never calls the store back.

    Attributes:
        keys: every state, in the store's order.
        specs: each state's shape and dtype.
        metadata: ``() -> dict or None``: the attached optimizer's metadata (else the last
            loaded checkpoint's); called only when the save is given none.
        process_group: the group the states are sharded over (``"auto"`` saves over it).
        regions: ``{parameter: Region}`` of the parameters held in part.
        deferred: the states a sharded load left on disk for other ranks, or None.
        links: the store's :class:`~statestore._links.FileLinks` (linked saves).
        check_damaged: ``(key) -> None``, raises when the state's last write failed.
        open_stream: ``(keys, mode, chunk_bytes, wait) -> StateStream``: the store's pipeline
            access (``PipelineAccess.stream``), which :func:`.stream.read_states` reads by.
        check_files: ``() -> None``, the store's check of its files (raises
            ``StateStoreIOError`` for a truncated or removed one), made before each stream as
            the store's own ``stream`` makes it (a mapping of a truncated file would SIGBUS).
        unit_bytes: the chunk size a save reads by (None: whole states).
        error: the store's failure before the save (waiting for its writes), or None: the
            save fails with it (a collective one on every rank).
    """
    keys: List[StateKey]
    specs: Dict[StateKey, StateSpec]
    metadata: Callable[[], Optional[dict]]
    process_group: Any
    regions: Dict[str, Region]
    deferred: Any
    links: FileLinks
    check_damaged: Callable[[StateKey], None]
    open_stream: Callable[..., Any]
    check_files: Callable[[], None]
    unit_bytes: Optional[int]
    error: Optional[BaseException] = None

    def spec(self, key: StateKey) -> StateSpec:
        """The shape and dtype of ``key``."""
        return self.specs[key]

    def stream(self, keys, mode: str = "r", *, chunk_bytes: Optional[int] = None,
               wait: bool = True):
        """The states ``keys`` chunk by chunk, as ``store.stream`` (the store was found open
        before it handed the states over; its files are checked here, as ``stream`` does)."""
        self.check_files()
        return self.open_stream(keys, mode, chunk_bytes, wait)


def save_progress(states: SavedStates, keys: List[StateKey], root: str,
                  enabled: Optional[bool]):
    """The byte progress bar of a save of ``keys``."""
    return progress_bar(sum(states.spec(k).nbytes for k in keys),
                        f"save {os.path.basename(root)}", enabled)


def metadata_json(states: SavedStates, metadata: Optional[dict]) -> str:
    """The optimizer metadata to save (``metadata``, else the store's), checked, as JSON.

    Raises:
        StateStoreValueError: it has the wrong shape or is not JSON-serializable.
    """
    meta = metadata if metadata is not None else states.metadata()
    meta = {} if meta is None else meta
    problem = optimizer_metadata_problem(meta)
    if problem:
        raise StateStoreValueError(f"checkpoint metadata: {problem}")
    try:
        return json.dumps(meta)
    except (TypeError, ValueError, RecursionError) as e:
        raise StateStoreValueError(f"checkpoint metadata is not JSON-serializable: {e}") from e


def write_shards(states: SavedStates, fs, root: str, keys: List[StateKey], stem: str, shard_bytes: int,
                 bar, written: List[str], link: bool = True) -> List[ManifestRow]:
    """Write ``keys`` into shards ``<stem>-<n>.safetensors`` (temporary name, fsync, rename);
    returns the manifest rows. Every file created is listed in ``written`` (for clean-up).

    With ``link``, the store's own files that can serve as shards (``NVMeStore`` files on
    the same local filesystem, ``states.links``) are hard-linked and frozen instead of
    copied: only states whose checksum the store does not know are read. The rest is copied."""
    for k in keys:
        check_key(k)        # nothing written that the loader would refuse (keys pass it at
        # creation; this holds for a backend that bypassed create_many too)
    rows: List[ManifestRow] = []
    n = 0
    order = None
    if link and is_local(fs):
        for k in keys:
            states.check_damaged(k)     # as reading it to copy would: no stale state saved
        linked = set()
        for lf in states.links.linkable(keys, root, shard_bytes):
            name = f"{stem}-{n:05d}.safetensors"
            final, tmp = join(root, name), join(root, f".{name}.tmp")
            try:
                lf.link(tmp)
            except OSError as e:
                if e.errno in _NO_LINK:
                    continue        # copied below
                raise
            written.append(tmp)
            rows += _link_rows(states, lf, name, bar)
            os.rename(tmp, final)
            written[-1] = final
            linked.update(k for k, _ in lf.rows)
            n += 1
        if linked:
            order = keys
            keys = [k for k in keys if k not in linked]
            fsync_dir(fs, root)
    shards: List[List[StateKey]] = []
    size = 0
    for k in keys:
        nb = states.spec(k).nbytes
        if not shards or (size + nb > shard_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += nb
    for i, shard_keys in enumerate(shards):
        name = f"{stem}-{n + i:05d}.safetensors"
        final, tmp = join(root, name), join(root, f".{name}.tmp")
        lay = layout([(str(k), states.spec(k).dtype, states.spec(k).shape) for k in shard_keys],
                     align=64, metadata={"format": FORMAT_NAME})
        written.append(tmp)
        f = open_for_write(fs, tmp)
        try:
            f.write(lay.header)
            hashes = {k: xxhash.xxh3_64() for k in shard_keys}
            for k, chunk in read_states(states, shard_keys):
                entry = lay.entries[str(k)]
                if f.tell() < entry.offset:
                    f.write(b"\0" * (entry.offset - f.tell()))
                hashes[k].update(chunk)
                f.write(chunk)
                bar.update(len(chunk))
            for k in shard_keys:
                rows.append(ManifestRow.of(k, states.spec(k), name, lay.entries[str(k)].offset,
                                           hashes[k].hexdigest()))
            commit(fs, f, tmp, final, then=lambda: written.__setitem__(-1, final))
        except BaseException:
            close_quietly(f)
            raise
    if shards:
        # The shards' names durable before the manifest's: after a power loss a manifest is
        # never present without the shards it lists (the linked ones are synced above).
        fsync_dir(fs, root)
    if order is not None:
        # Rows in the store's key order, as a copying save writes them: a load creates the
        # states in this order (a TieredStore places them by it).
        rank = {str(k): i for i, k in enumerate(order)}
        rows.sort(key=lambda r: rank[r.key])
    return rows


def _link_rows(states: SavedStates, lf, name: str, bar) -> List[ManifestRow]:
    """Manifest rows of a linked store file; checksums the store does not know (it hashes
    states as it writes them in order) are computed by reading the (now frozen) states
    through the store's pipeline (``states``)."""
    todo = [k for k, _ in lf.rows if k not in lf.hashes]
    hashes = {k: xxhash.xxh3_64() for k in todo}
    for k, chunk in read_states(states, todo):
        hashes[k].update(chunk)
        bar.update(len(chunk))
    for k, h in hashes.items():
        lf.hashes[k] = h.hexdigest()
    rows = []
    for k, off in lf.rows:
        if k not in hashes:
            bar.update(states.spec(k).nbytes)
        rows.append(ManifestRow.of(k, states.spec(k), name, off, lf.hashes[k]))
    return rows


def write_manifest(fs, root: str, rows: List[ManifestRow], meta_json: str, save_id: str,
                   written: List[str], world_size: int = 1) -> None:
    """Write and commit the manifest of ``rows``: the save's commit point. ``written`` is
    cleared once the manifest is in place (its shards must then stay).

    Raises:
        CheckpointError: more rows than a manifest may list (``MAX_ROWS``): a reader would
            refuse it.
    """
    if len(rows) > MAX_ROWS:
        raise CheckpointError(f"checkpoint {root!r}: {len(rows)} tensors, more than the "
                              f"{MAX_ROWS} a manifest may list (statestore.checkpoint.MAX_ROWS)")
    cols = columns(rows)
    regions = len(cols) > len(COLUMNS)      # rows holding regions: version 2 (format.py)
    smeta = {
        "statestore.format": FORMAT_NAME,
        "statestore.format_version": str(REGION_FORMAT_VERSION if regions else FORMAT_VERSION),
        "statestore.version": statestore_version(),
        "statestore.checksum": CHECKSUM,
        "statestore.save_id": save_id,
        "statestore.saved_at": str(time.time()),
        "statestore.world_size": str(world_size),
        "statestore.metadata": meta_json,
    }
    smeta[KEY] = manifest_digest(list(cols), cols, smeta)
    schema = pa.schema(list(SCHEMA) + (list(REGION_SCHEMA) if regions else []))
    table = pa.Table.from_pydict(cols, schema=schema).replace_schema_metadata(smeta)
    mtmp = join(root, f".{MANIFEST}.{save_id}.tmp")
    written.append(mtmp)
    # Serialized in memory, then written: parquet's writer calls back into the Python file
    # object (fsspec's `closed`, `write`), and turns a Ctrl-C landing in those calls into
    # "ValueError: I/O operation on closed file"; from f.write it stays KeyboardInterrupt.
    f = fs.open(mtmp, "wb")
    try:
        buf = pa.BufferOutputStream()
        pq.write_table(table, buf)
        f.write(buf.getvalue())
        # Committed with the rename: the new manifest names the shards, so from here on a
        # failure must not remove them (that would leave neither the new nor the previous
        # checkpoint); a Ctrl-C lands before or after both (commit).
        commit(fs, f, mtmp, join(root, MANIFEST), then=written.clear)
    except BaseException as e:
        close_quietly(f)
        if isinstance(e, OSError) and not isinstance(e, StateStoreError):
            # Name the file: in a linked save the manifest is the only data written.
            raise StateStoreIOError(e.errno, f"writing {mtmp} failed: {e}", mtmp) from e
        raise
    if is_local(fs):
        fsync_dir(fs, root)


def remove_stale(fs, root: str, save_id: str) -> None:
    """Remove shards and temporaries of earlier (or failed) saves once the manifest of
    ``save_id`` is in place."""
    if not is_local(fs):
        # No lock there: a save racing to the same URL may have replaced our manifest. Then
        # its shards are not stale, and ours are not named: fail without removing anything.
        try:
            now = read_manifest(f"{fs.unstrip_protocol(root)}").info.get("save_id")
        except Exception:
            now = None
        if now != save_id:
            raise CheckpointError(f"checkpoint {root!r}: another save replaced this one's "
                                  f"manifest (save {save_id}, now {now}); concurrent saves to "
                                  f"one path are not supported")
    stale = []
    for p in fs.ls(root, detail=False):
        base = p.rstrip("/").rsplit("/", 1)[-1]
        if base.startswith(f"shard-{save_id}-"):
            continue
        if base.startswith("shard-") or base.startswith(".shard-") \
                or base.startswith(f".{MANIFEST}."):
            stale.append(p)
    remove(fs, stale)


def as_io_error(e: BaseException, path: str) -> BaseException:
    """``e`` as the save's exception: a plain ``OSError`` becomes a
    :class:`StateStoreIOError` naming ``path``."""
    if isinstance(e, OSError) and not isinstance(e, StateStoreError):
        err = StateStoreIOError(e.errno, f"saving checkpoint {path!r} failed: {e}")
        err.__cause__ = e
        return err
    return e


def lock_for_save(fs, root: str, path: str):
    """The save lock of a local checkpoint directory (:mod:`.save_lock`); a no-op context
    elsewhere (fsspec URLs: the commit is verified instead)."""
    return SaveLock(root, path) if is_local(fs) else contextlib.nullcontext()
