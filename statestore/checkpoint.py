"""Checkpoints of stores: safetensors shards plus a Parquet manifest, written atomically.

Format (version :data:`FORMAT_VERSION`; specified in ``docs/checkpoint-format.md``)::

    <path>/manifest.parquet                      one row per tensor; written last
    <path>/shard-<save id>-<n>.safetensors       tensors, stock safetensors files

The manifest's columns are ``key, param, state, file, offset, nbytes, shape, dtype,
checksum`` (``offset``: absolute byte offset of the tensor's data in ``file``; ``checksum``:
xxh3-64 of its bytes, hex). Its schema metadata holds the format name and version, the
statestore version, the checksum algorithm, the save id and the optimizer metadata (JSON:
step counts, param groups with hyperparameters, parameter names, shapes and dtypes).

Saving streams every state through the store's pipeline (so RAM stays within the store's
budget) into shards written under temporary names, fsync'd and renamed; the manifest is
written the same way, last: a checkpoint exists exactly when its manifest does. Shards of an
earlier save at the same path are removed only after the new manifest is in place. Loading
reads the manifest, checks every shard's header against it, streams each tensor into the
store through the pipeline and verifies its checksum on the way.
"""
from __future__ import annotations

import errno
import json
import mmap
import os
import queue
import struct
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Tuple

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import xxhash
from tqdm.auto import tqdm

from ._parquet_guard import MAX_NDIM, ParquetBoundsError, check_parquet_bounds
from ._safetensors_layout import layout
from ._types import Slice, StateKey, StateSpec, dtype_from_name, dtype_name
from .errors import (CheckpointCorruptError, CheckpointError, CheckpointNotFoundError,
                     StateStoreError, StateStoreIOError, StateStoreValueError)

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "MANIFEST", "save_checkpoint", "load_checkpoint",
           "read_manifest", "verify_checkpoint", "Manifest"]

FORMAT_NAME = "statestore-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.parquet"
CHECKSUM = "xxh3_64"
DEFAULT_SHARD_BYTES = 2 * 1024 ** 3
# link() errors that mean "no hard link here" (the states are copied instead)
_NO_LINK = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EACCES}
_MAX_HEADER = 100 * 1024 * 1024

_SCHEMA = pa.schema([
    ("key", pa.string()), ("param", pa.string()), ("state", pa.string()),
    ("file", pa.string()), ("offset", pa.int64()), ("nbytes", pa.int64()),
    ("shape", pa.list_(pa.int64())), ("dtype", pa.string()), ("checksum", pa.string()),
])


def _fs(path: str):
    if not isinstance(path, (str, os.PathLike)):
        raise StateStoreValueError(f"checkpoint path must be a str or os.PathLike, got {path!r}")
    path = os.fspath(path)
    try:
        fs, root = fsspec.core.url_to_fs(path)
    except (ImportError, ValueError) as e:
        raise StateStoreValueError(f"checkpoint path {path!r}: {e}") from e
    return fs, root.rstrip("/") or root


def _is_local(fs) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def _join(root: str, name: str) -> str:
    return f"{root}/{name}"


def _fsync_dir(fs, root: str) -> None:
    if _is_local(fs):
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _commit(fs, f, tmp: str, final: str) -> None:
    """Flush, fsync (local files), close and rename ``tmp`` to ``final``."""
    f.flush()
    if _is_local(fs):
        os.fsync(f.fileno())
    f.close()
    fs.mv(tmp, final)


class _Bar(tqdm):
    """tqdm with a lock of this process only. tqdm's default lock includes a multiprocessing
    semaphore that forked processes share: one killed (``kill -9``) while it held it, in the
    middle of creating a bar, left it held forever, and every sibling's next save or load then
    hung creating its own bar (seen in ``benchmarks/soak.py``)."""


_Bar.set_lock(threading.RLock())


def _progress(total: int, desc: str, enabled: Optional[bool]):
    """A byte progress bar: ``enabled=True`` at once, ``None`` only for work over a second,
    ``False`` never."""
    return _Bar(total=total, desc=desc, unit="B", unit_scale=True,
                delay=0.0 if enabled is True else 1.0, disable=(enabled is False), leave=False)


# ---------------------------------------------------------------------------------- writer
_DIRECT_ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)
WRITE_BUFFERS = 4
WRITE_BUFFER_BYTES = 8 * 1024 * 1024


class _DirectWriter:
    """Sequential writer of one local shard with ``O_DIRECT``, overlapped with the caller.

    The caller's bytes are copied into one of :data:`WRITE_BUFFERS` page-aligned staging
    buffers of :data:`WRITE_BUFFER_BYTES` (32 MiB in all: the save's RAM on top of the
    store's pipeline budget); a full buffer goes to a writer thread, which ``pwrite``s it
    (the GIL is released) while the caller hashes and copies the next. Direct I/O bypasses
    the page cache: the shard is not read back into RAM and the final ``fsync`` has nothing
    to flush but metadata. :meth:`flush` writes the last, partial buffer padded to 4096
    bytes and truncates the file to its exact size. Where the filesystem refuses
    ``O_DIRECT`` (tmpfs), the same code writes through the page cache.
    """

    def __init__(self, path: str):
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        self._direct = bool(_O_DIRECT)
        try:
            self._fd = os.open(path, flags | _O_DIRECT, 0o644)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._fd = os.open(path, flags, 0o644)
            self._direct = False
        self.path = path
        self._bufs = [mmap.mmap(-1, WRITE_BUFFER_BYTES) for _ in range(WRITE_BUFFERS)]
        self._free: "queue.Queue[int]" = queue.Queue()
        for i in range(WRITE_BUFFERS):
            self._free.put(i)
        self._work: "queue.Queue[Optional[Tuple[int, int, int]]]" = queue.Queue()
        self._error: Optional[BaseException] = None
        self._pos = 0                 # bytes accepted
        self._cur: Optional[int] = None
        self._fill = 0
        self._file_off = 0            # offset of the current buffer in the file
        self._finished = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="statestore-ckpt-writer",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            i, n, off = item
            try:
                if self._error is None:
                    self._write_buffer(i, n, off)
            except BaseException as e:      # reported to the caller at its next call
                # Without its traceback: the frames would keep views of the buffer exported,
                # and closing the buffers would then fail, masking this error.
                self._error = e.with_traceback(None)
            finally:
                self._free.put(i)

    def _write_buffer(self, i: int, n: int, off: int) -> None:
        with memoryview(self._bufs[i]) as view:
            done = 0
            while done < n:
                with view[done:n] as chunk:
                    try:
                        w = os.pwrite(self._fd, chunk, off + done)
                    except OSError as e:
                        if e.errno != errno.EINVAL or not self._direct:
                            raise
                        # O_DIRECT refused the transfer: a limit (RLIMIT_FSIZE, a quota) cut it
                        # to an unaligned size, or the filesystem changed its mind. Go on through
                        # the page cache, where the real cause (EFBIG, ENOSPC) is reported.
                        self._go_buffered()
                        continue
                if w <= 0:
                    raise OSError(errno.EIO, f"short write to {self.path}")
                done += w

    def _go_buffered(self) -> None:
        import fcntl
        fl = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        fcntl.fcntl(self._fd, fcntl.F_SETFL, fl & ~_O_DIRECT)
        self._direct = False

    def _check(self) -> None:
        if self._error is not None:
            e = self._error
            if isinstance(e, OSError):
                raise StateStoreIOError(e.errno, f"writing {self.path} failed: {e}") from e
            raise e

    def _submit(self, nbytes: int) -> None:
        self._work.put((self._cur, nbytes, self._file_off))
        self._file_off += nbytes
        self._cur, self._fill = None, 0

    def write(self, data) -> int:
        self._check()
        mv = memoryview(data).cast("B")
        done = 0
        while done < len(mv):
            if self._cur is None:
                self._cur = self._free.get()
                self._check()
            n = min(len(mv) - done, WRITE_BUFFER_BYTES - self._fill)
            self._bufs[self._cur][self._fill:self._fill + n] = mv[done:done + n]
            self._fill += n
            done += n
            if self._fill == WRITE_BUFFER_BYTES:
                self._submit(WRITE_BUFFER_BYTES)
        self._pos += done
        return done

    def tell(self) -> int:
        return self._pos

    def fileno(self) -> int:
        return self._fd

    def flush(self) -> None:
        """Write everything accepted so far and set the file's exact size; no write may
        follow."""
        if self._finished:
            return
        self._finished = True
        if self._cur is not None and self._fill:
            padded = -(-self._fill // _DIRECT_ALIGN) * _DIRECT_ALIGN
            self._bufs[self._cur][self._fill:padded] = bytes(padded - self._fill)
            self._submit(padded)
        self._drain()                          # the queue is FIFO: every write is done
        self._check()
        os.ftruncate(self._fd, self._pos)

    def _drain(self) -> None:
        self._work.put(None)
        self._thread.join()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            self._drain()
        os.close(self._fd)
        for b in self._bufs:
            b.close()


def _close_quietly(f) -> None:
    """Close ``f`` after a failure without masking the exception being raised."""
    try:
        f.close()
    except Exception:
        pass


def _open_for_write(fs, path: str):
    if _is_local(fs):
        return _DirectWriter(path)
    return fs.open(path, "wb")


# ---------------------------------------------------------------------------------- save
def _prepare_root(path: str):
    fs, root = _fs(path)
    if fs.exists(root) and not fs.isdir(root):
        raise StateStoreValueError(f"checkpoint path {path!r} exists and is not a directory")
    try:
        fs.makedirs(root, exist_ok=True)
    except OSError as e:
        raise StateStoreIOError(e.errno, f"cannot create checkpoint directory {path!r}: {e}") from e
    return fs, root


def _metadata_json(store, metadata: Optional[dict]) -> str:
    meta = metadata if metadata is not None else store.metadata()
    meta = {} if meta is None else meta
    problem = optimizer_metadata_problem(meta)
    if problem:
        raise StateStoreValueError(f"checkpoint metadata: {problem}")
    try:
        return json.dumps(meta)
    except (TypeError, ValueError, RecursionError) as e:
        raise StateStoreValueError(f"checkpoint metadata is not JSON-serializable: {e}") from e


def _write_shards(store, fs, root: str, keys: List[StateKey], stem: str, shard_bytes: int,
                  bar, written: List[str], link: bool = True) -> Dict[str, list]:
    """Write ``keys`` into shards ``<stem>-<n>.safetensors`` (temporary name, fsync, rename);
    returns the manifest rows. Every file created is listed in ``written`` (for clean-up).

    With ``link``, the store's own files that can serve as shards (``NVMeStore`` files on
    the same local filesystem, ``StateStore._linkable``) are hard-linked and frozen instead of
    copied: only states whose checksum the store does not know are read. The rest is copied."""
    rows: Dict[str, list] = {n: [] for n in _SCHEMA.names}
    n = 0
    order = None
    if link and _is_local(fs):
        for k in keys:
            store._check_damaged(k)     # as reading it to copy would: no stale state saved
        linked = set()
        for lf in store._linkable(keys, root, shard_bytes):
            name = f"{stem}-{n:05d}.safetensors"
            final, tmp = _join(root, name), _join(root, f".{name}.tmp")
            try:
                lf.link(tmp)
            except OSError as e:
                if e.errno in _NO_LINK:
                    continue        # copied below
                raise
            written.append(tmp)
            _link_rows(store, lf, name, rows, bar)
            os.rename(tmp, final)
            written[-1] = final
            linked.update(k for k, _ in lf.rows)
            n += 1
        if linked:
            order = keys
            keys = [k for k in keys if k not in linked]
            _fsync_dir(fs, root)
    shards: List[List[StateKey]] = []
    size = 0
    for k in keys:
        nb = store.spec(k).nbytes
        if not shards or (size + nb > shard_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += nb
    for i, shard_keys in enumerate(shards):
        name = f"{stem}-{n + i:05d}.safetensors"
        final, tmp = _join(root, name), _join(root, f".{name}.tmp")
        lay = layout([(str(k), store.spec(k).dtype, store.spec(k).shape) for k in shard_keys],
                     align=64, metadata={"format": FORMAT_NAME})
        written.append(tmp)
        f = _open_for_write(fs, tmp)
        try:
            f.write(lay.header)
            hashes = {k: xxhash.xxh3_64() for k in shard_keys}
            for k, chunk in _read_states(store, shard_keys):
                entry = lay.entries[str(k)]
                if f.tell() < entry.offset:
                    f.write(b"\0" * (entry.offset - f.tell()))
                hashes[k].update(chunk)
                f.write(chunk)
                bar.update(len(chunk))
            for k in shard_keys:
                _add_row(rows, store, k, name, lay.entries[str(k)].offset, hashes[k].hexdigest())
            _commit(fs, f, tmp, final)
        except BaseException:
            _close_quietly(f)
            raise
        written[-1] = final
    if order is not None:
        # Rows in the store's key order, as a copying save writes them: a load creates the
        # states in this order (a TieredStore places them by it).
        rank = {str(k): i for i, k in enumerate(order)}
        perm = sorted(range(len(rows["key"])), key=lambda j: rank[rows["key"][j]])
        rows = {c: [v[j] for j in perm] for c, v in rows.items()}
    return rows


def _add_row(rows: Dict[str, list], store, k: StateKey, name: str, offset: int,
             checksum: str) -> None:
    spec = store.spec(k)
    rows["key"].append(str(k))
    rows["param"].append(k.param)
    rows["state"].append(k.state)
    rows["file"].append(name)
    rows["offset"].append(offset)
    rows["nbytes"].append(spec.nbytes)
    rows["shape"].append(list(spec.shape))
    rows["dtype"].append(dtype_name(spec.dtype))
    rows["checksum"].append(checksum)


def _link_rows(store, lf, name: str, rows: Dict[str, list], bar) -> None:
    """Manifest rows of a linked store file; checksums the store does not know (it hashes
    states as it writes them in order) are computed by reading the (now frozen) states
    through the store's pipeline."""
    todo = [k for k, _ in lf.rows if k not in lf.hashes]
    hashes = {k: xxhash.xxh3_64() for k in todo}
    for k, chunk in _read_states(store, todo):
        hashes[k].update(chunk)
        bar.update(len(chunk))
    for k, h in hashes.items():
        lf.hashes[k] = h.hexdigest()
    for k, off in lf.rows:
        if k not in hashes:
            bar.update(store.spec(k).nbytes)
        _add_row(rows, store, k, name, off, lf.hashes[k])


def _write_manifest(fs, root: str, rows: Dict[str, list], meta_json: str, save_id: str,
                    written: List[str], world_size: int = 1) -> None:
    from ._manifest_digest import KEY, manifest_digest
    smeta = {
        "statestore.format": FORMAT_NAME,
        "statestore.format_version": str(FORMAT_VERSION),
        "statestore.version": _version(),
        "statestore.checksum": CHECKSUM,
        "statestore.save_id": save_id,
        "statestore.saved_at": str(time.time()),
        "statestore.world_size": str(world_size),
        "statestore.metadata": meta_json,
    }
    smeta[KEY] = manifest_digest(_SCHEMA.names, rows, smeta)
    table = pa.Table.from_pydict(rows, schema=_SCHEMA).replace_schema_metadata(smeta)
    mtmp = _join(root, f".{MANIFEST}.{save_id}.tmp")
    written.append(mtmp)
    f = fs.open(mtmp, "wb")
    try:
        pq.write_table(table, f)
        _commit(fs, f, mtmp, _join(root, MANIFEST))
    except BaseException as e:
        _close_quietly(f)
        if isinstance(e, OSError) and not isinstance(e, StateStoreError):
            # Name the file: in a linked save the manifest is the only data written.
            raise StateStoreIOError(e.errno, f"writing {mtmp} failed: {e}", mtmp) from e
        raise
    # Committed: the new manifest names the shards, so from here on a failure must not
    # remove them (that would leave neither the new nor the previous checkpoint).
    written.clear()
    if _is_local(fs):
        _fsync_dir(fs, root)


def _remove(fs, paths: List[str]) -> None:
    for p in paths:
        try:
            fs.rm(p)
        except Exception:
            pass


def _remove_stale(fs, root: str, save_id: str) -> None:
    """Remove shards and temporaries of earlier (or failed) saves once the manifest of
    ``save_id`` is in place."""
    if not _is_local(fs):
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
    _remove(fs, stale)


def _as_io_error(e: BaseException, path: str) -> BaseException:
    if isinstance(e, OSError) and not isinstance(e, StateStoreError):
        err = StateStoreIOError(e.errno, f"saving checkpoint {path!r} failed: {e}")
        err.__cause__ = e
        return err
    return e


def save_checkpoint(store, path: str, *, shard_bytes: int = DEFAULT_SHARD_BYTES,
                    progress: Optional[bool] = None, metadata: Optional[dict] = None,
                    process_group: Any = "auto", link: bool = True) -> None:
    """Write every state of ``store`` and its optimizer metadata to ``path`` atomically.

    ``path`` is a local directory or any fsspec URL. Shards hold at most ``shard_bytes``
    (a larger single tensor gets a shard of its own). RAM use is bounded by the store's
    pipeline budget. ``metadata`` overrides the store's attached metadata.

    ``process_group``: ``"auto"`` (default) saves collectively over the group the store's
    states are sharded on (the ``process_group`` of the optimizer attached to it, or the
    group a checkpoint was loaded over), else alone. When collective, every rank of the
    group must call it: each writes the states it holds into its own shards, then rank 0
    writes the one manifest after all have finished; see ``docs/distributed.md``.

    ``link`` (default True): where the checkpoint is a local directory on the filesystem of
    an :class:`~statestore.NVMeStore`'s files, those files become the shards by hard link
    (the store freezes them and writes later updates to new files, so the checkpoint never
    changes); the save writes no state bytes, and reads only states whose checksum the
    store did not compute as it wrote them. ``False`` copies every state. See
    ``docs/checkpoint-format.md``.
    """
    _check_store(store)
    if not isinstance(link, bool):
        raise StateStoreValueError(f"link must be True or False, got {link!r}")
    if isinstance(shard_bytes, bool) or not isinstance(shard_bytes, int) or shard_bytes <= 0:
        raise StateStoreValueError(f"shard_bytes must be a positive int, got {shard_bytes!r}")
    if metadata is not None and not isinstance(metadata, dict):
        raise StateStoreValueError(f"metadata must be a dict or None, got "
                                   f"{type(metadata).__name__}")
    store._check_open()
    group = store._process_group if isinstance(process_group, str) and process_group == "auto" \
        else process_group
    if group is not None:
        return _save_collective(store, path, group, shard_bytes, progress, metadata, link)
    if store._deferred is not None and store._deferred.rows:
        raise CheckpointError(
            f"this store holds only rank {store._deferred.rank}'s shard of checkpoint "
            f"{store._deferred.path!r}; save it collectively (every rank calls "
            f"save_checkpoint) or build an optimizer on it first")
    store.sync()
    meta_json = _metadata_json(store, metadata)     # bad metadata: no directory is created
    fs, root = _prepare_root(path)
    with _lock_for_save(fs, root, path):
        keys = store.keys()
        save_id = uuid.uuid4().hex[:12]
        written: List[str] = []
        bar = _progress(sum(store.spec(k).nbytes for k in keys), f"save {os.path.basename(root)}",
                        progress)
        try:
            rows = _write_shards(store, fs, root, keys, f"shard-{save_id}", shard_bytes, bar,
                                 written, link)
            _write_manifest(fs, root, rows, meta_json, save_id, written)
        except BaseException as e:
            _remove(fs, written)        # leave the previous checkpoint (if any) untouched
            raise _as_io_error(e, path)
        finally:
            bar.close()
        _remove_stale(fs, root, save_id)


def _lock_for_save(fs, root: str, path: str):
    """The save lock of a local checkpoint directory (:mod:`statestore._save_lock`); a
    no-op context elsewhere (fsspec URLs: the commit is verified instead)."""
    import contextlib
    from ._save_lock import SaveLock
    return SaveLock(root, path) if _is_local(fs) else contextlib.nullcontext()


def _merge_metadata(metas: List[str], rows: List[Dict[str, list]]) -> str:
    """One optimizer metadata from every rank's: rank 0's, with each parameter's step count
    taken from the rank that saved its states."""
    parsed = [json.loads(m) for m in metas]
    merged = next((m for m in parsed if m), {})
    if not isinstance(merged, dict):
        return json.dumps(merged)
    steps: Dict[str, Any] = {}
    for m in parsed:                       # parameters without states: any rank's count
        if isinstance(m, dict) and isinstance(m.get("steps"), dict):
            for k, v in m["steps"].items():
                steps.setdefault(k, v)
    for m, r in zip(parsed, rows):         # parameters with states: their owner's count
        own = m.get("steps") if isinstance(m, dict) else None
        if isinstance(own, dict):
            for name in set(r["param"]):
                if name in own:
                    steps[name] = own[name]
    if steps or "steps" in merged:
        merged = dict(merged, steps=steps)
    return json.dumps(merged)


def _save_collective(store, path: str, group, shard_bytes: int, progress, metadata,
                     link: bool = True) -> None:
    from .distributed import Collective
    comm = Collective(group)
    error: Optional[BaseException] = None
    lock = None
    try:                    # a rank failing here must still take part in the collectives
        store.sync()
        meta_json = _metadata_json(store, metadata)
        fs, root = _prepare_root(path)
        if comm.rank == 0:      # rank 0 holds the path's save lock for the whole collective
            lock = _lock_for_save(fs, root, path)
    except Exception as e:
        error = e
    try:
        _save_collective_locked(store, path, comm, error, fs if error is None else None,
                                root if error is None else None, shard_bytes, progress,
                                meta_json if error is None else None, link)
    finally:
        if lock is not None:
            lock.__exit__(None, None, None)


def _save_collective_locked(store, path: str, comm, error, fs, root, shard_bytes: int,
                            progress, meta_json, link: bool) -> None:
    # Rank 0's save id; every rank's keys; any rank's early failure.
    first_round = comm.all_gather((uuid.uuid4().hex[:12], [str(k) for k in store.keys()],
                                   None if error is None else repr(error)))
    early = [(r, msg) for r, (_, _, msg) in enumerate(first_round) if msg is not None]
    if early:
        if error is not None:
            raise error
        raise CheckpointError(f"collective save of checkpoint {path!r} failed on rank "
                              f"{early[0][0]}: {early[0][1]}; nothing was written")
    save_id = first_round[0][0]
    # A state held by several ranks (replicated, not sharded) is written once, by the lowest.
    first: Dict[str, int] = {}
    for r, (_, ks, _) in enumerate(first_round):
        for k in ks:
            first.setdefault(k, r)
    keys = [k for k in store.keys() if first[str(k)] == comm.rank]
    written: List[str] = []
    bar = _progress(sum(store.spec(k).nbytes for k in keys), f"save {os.path.basename(root)}",
                    progress)
    rows: Dict[str, list] = {n: [] for n in _SCHEMA.names}
    try:
        rows = _write_shards(store, fs, root, keys, f"shard-{save_id}-r{comm.rank:05d}",
                             shard_bytes, bar, written, link)
    except Exception as e:
        error = e
    finally:
        bar.close()
    gathered = comm.all_gather((rows, meta_json, None if error is None else repr(error)))
    failed = [(r, msg) for r, (_, _, msg) in enumerate(gathered) if msg is not None]
    status, committed = None, False
    if not failed and comm.rank == 0:
        try:
            all_rows = {n: [v for g in gathered for v in g[0][n]] for n in _SCHEMA.names}
            merged = _merge_metadata([g[1] for g in gathered], [g[0] for g in gathered])
            _write_manifest(fs, root, all_rows, merged, save_id, written,
                            world_size=comm.world)
        except Exception as e:
            error = e
            status = repr(e)
        committed = not written      # the manifest is in place (cleared on its rename)
    if not failed:
        status, committed = comm.broadcast((status, committed))
    if failed or status is not None:
        if not committed:            # shards the new manifest names must stay
            _remove(fs, written)
        if error is not None:
            raise _as_io_error(error, path)
        who = failed[0] if failed else (0, status)
        raise CheckpointError(f"collective save of checkpoint {path!r} failed on rank "
                              f"{who[0]}: {who[1]}; the previous checkpoint (if any) is intact")
    if comm.rank == 0:
        _remove_stale(fs, root, save_id)


def _read_states(store, keys: List[StateKey]):
    """Yield ``(key, bytes)`` of the states ``keys``, in order, chunk by chunk, through ONE
    pipeline of the store: non-resident stores read ahead across tensors within their RAM
    budget (chunks of a quarter of it) while the caller hashes and writes."""
    units = []
    for k in keys:
        spec = store.spec(k)
        if spec.nbytes == 0:
            continue
        chunks = store._chunks(spec, None if store.resident else store.unit_bytes)
        units += [[Slice(k, a, b)] for a, b in chunks]
    if not units:
        return
    with store.pipeline(units, mode="r") as pipe:
        for (s,), (t,) in zip(units, pipe):
            if t.device.type != "cpu":
                t = t.cpu()
            yield s.key, memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())


def _version() -> str:
    from . import __version__
    return __version__


# ---------------------------------------------------------------------------------- manifest
class Manifest:
    """A parsed, validated manifest: ``rows`` (list of dicts), ``metadata`` (optimizer
    metadata dict), ``info`` (format fields), ``root`` and ``fs``."""

    def __init__(self, fs, root: str, rows: List[Dict[str, Any]], metadata: dict, info: dict):
        self.fs, self.root, self.rows, self.metadata, self.info = fs, root, rows, metadata, info

    @property
    def files(self) -> List[str]:
        return sorted({r["file"] for r in self.rows})

    @property
    def nbytes(self) -> int:
        return sum(r["nbytes"] for r in self.rows)


def _check_store(store) -> None:
    from .store import StateStore
    if not isinstance(store, StateStore):
        raise StateStoreValueError(f"store must be a statestore.StateStore, got "
                                   f"{type(store).__name__}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def optimizer_metadata_problem(meta) -> Optional[str]:
    """What is wrong with the optimizer metadata ``meta`` (None when nothing is).

    Any JSON object is accepted; the keys the optimizers, ``inspect`` and ``convert`` read must
    have the documented shape (``docs/checkpoint-format.md``): ``steps`` maps parameter keys to
    non-negative ints, ``params`` maps them to ``{"shape": [ints], "dtype": str}``,
    ``param_groups`` is a list of objects whose ``params`` lists parameter keys (each in one
    group only) and whose hyperparameters have their types."""
    if not isinstance(meta, dict):
        return f"must be a JSON object, got {type(meta).__name__}"
    steps = meta.get("steps")
    if "steps" in meta:
        if not isinstance(steps, dict):
            return "'steps' must map parameter keys to step counts"
        for k, v in steps.items():
            if not _is_int(v) or v < 0:
                return f"'steps'[{k!r}] must be a non-negative int, got {v!r}"
    params = meta.get("params")
    if "params" in meta:
        if not isinstance(params, dict):
            return "'params' must map parameter keys to {shape, dtype}"
        for k, v in params.items():
            if not isinstance(v, dict):
                return f"'params'[{k!r}] must be an object, got {v!r}"
            shape = v.get("shape", [])
            if not isinstance(shape, list) or len(shape) > MAX_NDIM \
                    or not all(_is_int(d) and d >= 0 for d in shape):
                return f"'params'[{k!r}]['shape'] must be a list of non-negative ints"
            if not isinstance(v.get("dtype", ""), str):
                return f"'params'[{k!r}]['dtype'] must be a string"
    groups = meta.get("param_groups")
    if "param_groups" in meta:
        if not isinstance(groups, list):
            return "'param_groups' must be a list"
        seen = set()
        for i, g in enumerate(groups):
            if not isinstance(g, dict):
                return f"'param_groups'[{i}] must be an object, got {g!r}"
            names = g.get("params", [])
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                return f"'param_groups'[{i}]['params'] must be a list of parameter keys"
            for n in names:
                if n in seen:
                    return f"parameter {n!r} is listed in more than one param group"
                seen.add(n)
            for k in ("lr", "eps", "weight_decay"):
                if k in g and not _is_num(g[k]):
                    return f"'param_groups'[{i}][{k!r}] must be a number, got {g[k]!r}"
            if "betas" in g and (not isinstance(g["betas"], list) or len(g["betas"]) != 2
                                 or not all(_is_num(b) for b in g["betas"])):
                return f"'param_groups'[{i}]['betas'] must be a pair of numbers"
            for k in ("amsgrad", "maximize", "adamw_mode"):
                if k in g and not isinstance(g[k], bool):
                    return f"'param_groups'[{i}][{k!r}] must be true or false, got {g[k]!r}"
    for k, kind in (("optimizer", str), ("version", int)):
        if k in meta and not isinstance(meta[k], kind):
            return f"{k!r} must be a {kind.__name__}, got {meta[k]!r}"
    return None


#: Manifest columns read dictionary-encoded: a string repeated on every row is then held
#: once, whatever the number of rows.
_STRING_COLUMNS = ("key", "param", "state", "file", "dtype", "checksum")


def _column_values(col: "pa.ChunkedArray") -> list:
    """A column as a Python list, dictionary arrays expanded by reference (one str object per
    distinct value, not per row)."""
    out: list = []
    for chunk in col.chunks:
        if pa.types.is_dictionary(chunk.type):
            values = chunk.dictionary.to_pylist()
            out.extend(None if i is None else values[i] for i in chunk.indices.to_pylist())
        else:
            out.extend(chunk.to_pylist())
    return out


def _read_manifest_bytes(fs, mpath: str) -> bytes:
    """The manifest's bytes, refusing before reading anything what is not a regular file
    (a FIFO, a device), a symlink out of the checkpoint directory, or a file larger than
    :data:`statestore._shard_check.MAX_MANIFEST_BYTES`."""
    from ._shard_check import MAX_MANIFEST_BYTES, check_local_file
    if _is_local(fs):
        size = check_local_file(os.path.dirname(mpath), mpath, "the manifest").st_size
    else:
        info = fs.info(mpath)
        if info.get("type", "file") != "file":
            raise CheckpointCorruptError(f"{mpath}: the manifest is not a file")
        size = info.get("size")
    if not _is_int(size) or size > MAX_MANIFEST_BYTES:
        raise CheckpointCorruptError(f"{mpath}: the manifest has {size} bytes, more than the "
                                     f"{MAX_MANIFEST_BYTES} read at most; refused")
    with fs.open(mpath, "rb") as f:
        raw = f.read(size)          # what it held when checked, never more
    return raw if isinstance(raw, bytes) else bytes(raw)


def _read_table(fs, mpath: str) -> "pa.Table":
    """Read the manifest's bytes and decode them within the bounds of ``_parquet_guard``."""
    try:
        raw = _read_manifest_bytes(fs, mpath)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointCorruptError(f"{mpath}: unreadable manifest: {e}") from e
    try:
        check_parquet_bounds(raw)
        # ParquetFile, not read_table: the same decoding without the dataset layer (4x
        # faster on a small manifest).
        table = pq.ParquetFile(pa.BufferReader(raw), read_dictionary=list(_STRING_COLUMNS),
                               thrift_string_size_limit=max(len(raw), 1),
                               thrift_container_size_limit=max(len(raw), 1)).read(use_threads=False)
        table.validate(full=True)     # offsets and dictionary indices, before Python reads them
        return table
    except ParquetBoundsError as e:
        raise CheckpointCorruptError(f"{mpath}: unreadable manifest: {e}") from None
    except Exception as e:
        raise CheckpointCorruptError(f"{mpath}: unreadable manifest: {e}") from e


def _column_type_ok(table: "pa.Table", name: str) -> bool:
    t, want = table.schema.field(name).type, _SCHEMA.field(name).type
    if pa.types.is_dictionary(t):
        return want == pa.string() and t.value_type == pa.string()
    return t == want


def _check_digest(mpath: str, columns: Dict[str, list], smeta: Dict[str, str]) -> None:
    """The manifest's own checksum (:mod:`statestore._manifest_digest`) must match every
    decoded column value and metadata entry: checked last, after the structural checks, so a
    malformed manifest is still named for what is wrong with it."""
    from ._manifest_digest import KEY, manifest_digest
    want = smeta.get(KEY)
    if want is None:
        raise CheckpointCorruptError(f"{mpath}: the manifest has no checksum ({KEY} is "
                                     f"missing): damaged, or not written by statestore")
    try:
        got = manifest_digest(_SCHEMA.names, columns, smeta)
    except (TypeError, ValueError) as e:
        raise CheckpointCorruptError(f"{mpath}: manifest checksum: {e}") from None
    if got != want:
        raise CheckpointCorruptError(f"{mpath}: manifest checksum mismatch (the manifest's rows "
                                     f"or metadata were altered or damaged)")


def read_manifest(path: str) -> Manifest:
    """Read and validate the manifest of the checkpoint at ``path``.

    Raises :class:`CheckpointNotFoundError` when there is no complete checkpoint, and
    :class:`CheckpointCorruptError` naming the problem when the manifest is unreadable, of
    another format or version, or inconsistent. Decoding is bounded: see
    :mod:`statestore._parquet_guard`.
    """
    fs, root = _fs(path)
    mpath = _join(root, MANIFEST)
    try:
        found = fs.exists(mpath)
        if not found and fs.exists(root) and not fs.isdir(root):
            raise CheckpointNotFoundError(f"{path!r} is a file, not a checkpoint directory")
        if not found and fs.exists(root):
            from ._foreign import missing_manifest_message
            raise CheckpointNotFoundError(missing_manifest_message(fs, root, path, MANIFEST))
    except CheckpointError:
        raise
    except (OSError, ValueError) as e:
        raise CheckpointNotFoundError(f"cannot look for a checkpoint at {path!r}: {e}") from e
    if not found:
        raise CheckpointNotFoundError(f"no checkpoint at {path!r}")
    table = _read_table(fs, mpath)
    smeta = {k.decode(errors="replace"): v.decode(errors="replace")
             for k, v in (table.schema.metadata or {}).items()}
    if smeta.get("statestore.format") != FORMAT_NAME:
        raise CheckpointCorruptError(f"{mpath}: not a statestore checkpoint manifest")
    version = smeta.get("statestore.format_version")
    if version != str(FORMAT_VERSION):
        raise CheckpointError(f"{mpath}: checkpoint format version {version}, this statestore "
                              f"({_version()}) reads version {FORMAT_VERSION}")
    if smeta.get("statestore.checksum") != CHECKSUM:
        raise CheckpointCorruptError(f"{mpath}: unknown checksum "
                                     f"{smeta.get('statestore.checksum')!r}")
    missing = [n for n in _SCHEMA.names if n not in table.column_names]
    if missing:
        raise CheckpointCorruptError(f"{mpath}: manifest lacks columns {missing}")
    for n in _SCHEMA.names:
        if table.column_names.count(n) != 1:
            raise CheckpointCorruptError(f"{mpath}: manifest has column {n!r} "
                                         f"{table.column_names.count(n)} times")
        if not _column_type_ok(table, n):
            raise CheckpointCorruptError(f"{mpath}: manifest column {n!r} has type "
                                         f"{table.schema.field(n).type}, expected "
                                         f"{_SCHEMA.field(n).type}")
    try:
        metadata = json.loads(smeta.get("statestore.metadata", "{}"))
    except (ValueError, RecursionError) as e:
        raise CheckpointCorruptError(f"{mpath}: optimizer metadata is not valid JSON: "
                                     f"{type(e).__name__}: {str(e)[:200]}") from None
    problem = optimizer_metadata_problem(metadata)
    if problem:
        raise CheckpointCorruptError(f"{mpath}: optimizer metadata: {problem}")
    try:
        columns = {n: _column_values(table.column(n)) for n in _SCHEMA.names}
    except Exception as e:
        raise CheckpointCorruptError(f"{mpath}: unreadable manifest: {e}") from e
    rows = [dict(zip(_SCHEMA.names, vals)) for vals in zip(*columns.values())]
    seen = set()
    for r in rows:
        where = f"{mpath}: tensor {r.get('key')!r}"
        if any(r[c] is None for c in _SCHEMA.names) or any(d is None for d in r["shape"]):
            raise CheckpointCorruptError(f"{where}: null field")
        if r["key"] in seen:
            raise CheckpointCorruptError(f"{where}: listed twice")
        seen.add(r["key"])
        try:
            k = StateKey.parse(r["key"])
            dtype = dtype_from_name(r["dtype"])
        except ValueError as e:
            raise CheckpointCorruptError(f"{where}: {e}") from None
        if (k.param, k.state) != (r["param"], r["state"]):
            raise CheckpointCorruptError(f"{where}: key disagrees with param/state columns")
        if len(r["shape"]) > MAX_NDIM:
            raise CheckpointCorruptError(f"{where}: {len(r['shape'])} dimensions (at most "
                                         f"{MAX_NDIM})")
        if any(d < 0 for d in r["shape"]) or r["offset"] < 0:
            raise CheckpointCorruptError(f"{where}: negative shape or offset")
        spec = StateSpec(tuple(r["shape"]), dtype)
        if spec.nbytes != r["nbytes"]:
            raise CheckpointCorruptError(f"{where}: {r['nbytes']} bytes listed, shape and dtype "
                                         f"give {spec.nbytes}")
        name = r["file"]
        if "/" in name or "\\" in name or "\0" in name or name in ("", ".", "..") \
                or len(name.encode("utf-8", "surrogatepass")) > 255:
            raise CheckpointCorruptError(f"{where}: bad file name {name!r} (a plain name in "
                                         f"the checkpoint directory is expected)")
        r["spec"] = spec
        r["state_key"] = k
    _check_digest(mpath, columns, smeta)
    info = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION,
            "statestore_version": smeta.get("statestore.version"),
            "save_id": smeta.get("statestore.save_id"), "checksum": CHECKSUM}
    return Manifest(fs, root, rows, metadata, info)


def _check_shard_header(m: Manifest, name: str, rows: List[Dict[str, Any]]) -> int:
    """Check a shard's safetensors header against the manifest; returns the file size.

    After it, every listed tensor lies in the shard's data section, inside the file, and no
    two overlap: loading allocates at most the shard's size for them, and reads nothing
    outside it."""
    from ._shard_check import check_layout, check_local_file, check_zeros, pad_ranges
    fpath = _join(m.root, name)
    keys = [r["key"] for r in rows]
    try:
        if _is_local(m.fs):     # before opening it: a FIFO would block, /dev/zero never end
            check_local_file(m.root, fpath, "the shard")
        size = m.fs.size(fpath)
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{fpath}: shard missing (tensors {keys[:3]}...)") from None
    except (OSError, ValueError) as e:
        raise CheckpointCorruptError(f"{fpath}: cannot read the shard: {e}") from None
    if not _is_int(size) or size < 8:
        raise CheckpointCorruptError(f"{fpath}: truncated (no safetensors header)")
    try:
        with m.fs.open(fpath, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > min(size - 8, _MAX_HEADER):
                raise CheckpointCorruptError(f"{fpath}: header length {n} exceeds the file "
                                             f"({size} bytes)")
            header = json.loads(f.read(n))
            if not isinstance(header, dict):
                raise CheckpointCorruptError(f"{fpath}: bad safetensors header: not a JSON "
                                             f"object")
    except CheckpointError:
        raise
    except (ValueError, UnicodeDecodeError, RecursionError, struct.error) as e:
        raise CheckpointCorruptError(f"{fpath}: bad safetensors header: "
                                     f"{type(e).__name__}: {str(e)[:200]}") from None
    except OSError as e:
        raise CheckpointCorruptError(f"{fpath}: cannot read the shard: {e}") from None
    data_start = 8 + n
    prev_end, prev_key = data_start, None
    for r in sorted(rows, key=lambda r: (r["offset"], r["nbytes"])):
        h = header.get(r["key"])
        if not isinstance(h, dict) or "data_offsets" not in h:
            raise CheckpointCorruptError(f"{fpath}: tensor {r['key']!r} missing from the shard header")
        offs = h["data_offsets"]
        if not isinstance(offs, list) or len(offs) != 2 or not all(_is_int(x) for x in offs) \
                or not 0 <= offs[0] <= offs[1]:
            raise CheckpointCorruptError(f"{fpath}: tensor {r['key']!r}: bad data_offsets "
                                         f"{str(offs)[:100]}")
        a, b = offs
        shape = h.get("shape")
        if data_start + a != r["offset"] or b - a != r["nbytes"] or h.get("dtype") != r["dtype"] \
                or not isinstance(shape, list) or shape != list(r["shape"]):
            raise CheckpointCorruptError(f"{fpath}: tensor {r['key']!r}: shard header disagrees "
                                         f"with the manifest")
        if r["offset"] + r["nbytes"] > size:
            raise CheckpointCorruptError(f"{fpath}: truncated: tensor {r['key']!r} ends at byte "
                                         f"{r['offset'] + r['nbytes']}, file has {size}")
        if r["nbytes"] and r["offset"] < prev_end:
            raise CheckpointCorruptError(f"{fpath}: tensor {r['key']!r} overlaps tensor "
                                         f"{prev_key!r}")
        if r["nbytes"]:
            prev_end, prev_key = r["offset"] + r["nbytes"], r["key"]
    # The whole file, not only the listed tensors: layout, exact length, zero pads.
    check_layout(fpath, header, data_start, size)
    pads = pad_ranges(header, data_start)
    if pads:
        try:
            with m.fs.open(fpath, "rb") as f:
                check_zeros(f, fpath, pads)
        except OSError as e:
            raise CheckpointCorruptError(f"{fpath}: cannot read the shard: {e}") from None
    return size


def _by_file(rows: List[Dict[str, Any]]) -> Dict[str, List[Dict[str, Any]]]:
    """Manifest ``rows`` grouped by shard file, each group in file order."""
    out: Dict[str, List[Dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(r["file"], []).append(r)
    for rows in out.values():
        rows.sort(key=lambda r: r["offset"])
    return out


def _read_exact(f, view: memoryview, fpath: str, key: str) -> None:
    got = 0
    while got < len(view):
        try:
            n = f.readinto(view[got:]) if hasattr(f, "readinto") else None
            if n is None:
                data = f.read(len(view) - got)
                n = len(data)
                view[got:got + n] = data
        except OSError as e:
            if isinstance(e, StateStoreError):
                raise
            raise StateStoreIOError(e.errno, f"{fpath}: reading tensor {key!r} failed: "
                                    f"{e}") from e
        if not n:
            raise CheckpointCorruptError(f"{fpath}: truncated while reading tensor {key!r}")
        got += n


# ---------------------------------------------------------------------------------- load
class Deferred:
    """States of a checkpoint that a sharded load left on disk (other ranks' shards): the
    optimizer built on the store fetches those it turns out to need (another partition, or
    no sharding at all) with :meth:`StateStore.load_deferred`."""

    def __init__(self, path: str, save_id: Optional[str], rows: List[Dict[str, Any]],
                 rank: int, world: int):
        self.path, self.save_id, self.rows, self.rank, self.world = path, save_id, rows, rank, world


def load_checkpoint(store, path: str, *, progress: Optional[bool] = None,
                    process_group: Any = "auto", link: bool = True) -> None:
    """Replace the states of ``store`` with the checkpoint at ``path``, verifying every
    checksum while streaming. On any error the store is left empty (never half-loaded) and
    the exception names the file and tensor.

    ``process_group``: ``"auto"`` (default) is the default group when torch.distributed is
    initialized with more than one rank, else None. With a group, each rank loads only the
    states of the parameters it owns at the group's size (the optimizer's partition,
    computed from the checkpoint's manifest; any world size the checkpoint was saved at),
    reading only their byte ranges; the others stay on disk until an optimizer asks for them.

    An optimizer already attached to ``store`` (torch's order: build the optimizer, then
    load) takes the checkpoint's step counts and param-group hyperparameters once the states
    are loaded; it raises :class:`CheckpointMismatchError` when they do not fit it.

    ``link`` (default True): an :class:`~statestore.NVMeStore` on the checkpoint's local
    filesystem takes the shards a linked save wrote by hard link instead of copying them
    (copy-on-write: the store never writes them), their checksums still verified; ``False``
    copies every state.
    """
    if not isinstance(link, bool):
        raise StateStoreValueError(f"link must be True or False, got {link!r}")
    _check_store(store)
    from .distributed import group_info, owners_from_metadata, resolve_load_group
    store._check_open()
    # The store's states are replaced (or, on failure, removed): the metadata of the optimizer
    # that used them no longer describes them. Detached, an optimizer built next takes its
    # step counts from this checkpoint, not from the optimizer the store had before.
    store._metadata_provider = None
    group = resolve_load_group(process_group)
    try:
        m = read_manifest(path)
    except BaseException:
        store.clear()
        raise
    rows, later = m.rows, []
    rank = world = 1
    if group is not None:
        rank, world = group_info(group)
        if world > 1:
            numels: Dict[str, int] = {}
            for r in m.rows:
                numels.setdefault(r["param"], r["spec"].numel)
            owners = owners_from_metadata(m.metadata, numels, world)
            rows = [r for r in m.rows if owners[r["param"]] == rank]
            later = [r for r in m.rows if owners[r["param"]] != rank]
    store.clear()
    _load_rows(store, m, rows, progress, on_error=store.clear, link=link)
    store._loaded_metadata = m.metadata
    store._deferred = Deferred(path, m.info.get("save_id"), later, rank, world) if later else None
    store._process_group = group if later else None
    store._loaded()             # an optimizer already on the store takes the checkpoint's steps


def load_deferred(store, params) -> None:
    """Load the states of ``params`` (names) that a sharded load left on disk."""
    d = store._deferred
    if d is None:
        return
    want = set(params)
    rows = [r for r in d.rows if r["param"] in want]
    if not rows:
        return
    m = read_manifest(d.path)
    if m.info.get("save_id") != d.save_id:
        raise CheckpointError(f"checkpoint {d.path!r} was replaced since it was loaded (save "
                              f"{d.save_id}, now {m.info.get('save_id')}); load it again")
    created = [r["state_key"] for r in rows]

    def undo():
        store.delete([k for k in created if k in store])
    _load_rows(store, m, rows, None, on_error=undo)
    d.rows = [r for r in d.rows if r["param"] not in want]
    if not d.rows:
        store._deferred = None
        store._process_group = None


def _load_rows(store, m: Manifest, rows: List[Dict[str, Any]], progress, on_error,
               link: bool = True) -> None:
    """Create ``rows``' states in ``store`` and stream them in (``link``: shards the store
    can take by hard link are linked, :mod:`statestore._linked_load`); ``on_error()`` on
    failure."""
    try:
        groups = _by_file(rows)
        for name, rs in groups.items():
            _check_shard_header(m, name, rs)
    except BaseException:
        on_error()
        raise
    try:
        from ._linked_load import link_shards, verify_linked
        linked = link_shards(store, m, groups) if link else {}     # docs/scale.md
        store.create_many([(r["state_key"], r["spec"].shape, r["spec"].dtype, None) for r in rows
                           if r["file"] not in linked])
        bar = _progress(sum(r["nbytes"] for r in rows), f"load {os.path.basename(m.root)}",
                        progress)
        try:
            verify_linked(store, m, linked, bar)
            with _reader_pool() as pool:
                for name, rs in groups.items():
                    if name in linked:
                        continue
                    fpath = _join(m.root, name)
                    with _ShardReader(m.fs, fpath, pool) as f:
                        for r in rs:
                            _load_tensor(store, f, fpath, r, bar)
        finally:
            bar.close()
        store.sync()
    except BaseException:
        try:
            on_error()
        except Exception:
            pass
        raise


READ_PIECE = 8 * 1024 * 1024
READ_THREADS = 4


class _ShardReader:
    """Reads byte ranges of one shard. Local files: pieces of :data:`READ_PIECE` bytes with
    up to :data:`READ_THREADS` ``preadv`` calls in flight (a disk serves several requests
    faster than one stream: on this project's disk 0.8-1 GB/s against 0.3-0.5), hashed in
    order as they arrive. Other filesystems: fsspec's sequential reads."""

    def __init__(self, fs, fpath: str, pool: Optional[ThreadPoolExecutor]):
        self.fpath, self.pool, self.fd, self.f = fpath, pool, None, None
        try:
            if pool is not None and _is_local(fs):
                self.fd = os.open(fpath, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            else:
                self.f = fs.open(fpath, "rb")
        except OSError as e:
            raise CheckpointCorruptError(f"{fpath}: cannot read the shard: {e}") from e

    def read(self, view: memoryview, offset: int, key: str, on_piece=None) -> None:
        """Fill ``view`` from byte ``offset``; ``on_piece(piece)`` sees the bytes in order."""
        if self.fd is None:
            self.f.seek(offset)
            _read_exact(self.f, view, self.fpath, key)
            if on_piece is not None:
                on_piece(view)
            return
        n = len(view)
        starts = range(0, n, READ_PIECE)
        if len(starts) <= 1:
            self._piece(view, offset, key)
            if on_piece is not None:
                on_piece(view)
            return
        futs = [self.pool.submit(self._piece, view[a:a + READ_PIECE], offset + a, key)
                for a in starts]
        err: Optional[BaseException] = None
        for a, fu in zip(starts, futs):
            try:
                fu.result()
                if on_piece is not None and err is None:
                    on_piece(view[a:a + READ_PIECE])
            except BaseException as e:      # wait for every piece: none may write later
                err = err or e
        if err is not None:
            raise err

    def _piece(self, mv: memoryview, offset: int, key: str) -> None:
        got = 0
        while got < len(mv):
            try:
                n = os.preadv(self.fd, [mv[got:]], offset + got)
            except OSError as e:
                raise StateStoreIOError(e.errno, f"{self.fpath}: reading tensor {key!r} "
                                                 f"failed: {e.strerror}") from e
            if n == 0:
                raise CheckpointCorruptError(f"{self.fpath}: truncated while reading tensor "
                                             f"{key!r}")
            got += n

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.f is not None:
            self.f.close()
            self.f = None

    def __enter__(self) -> "_ShardReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _reader_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(READ_THREADS, thread_name_prefix="statestore-ckpt-read")


def _load_tensor(store, f: _ShardReader, fpath: str, r: Dict[str, Any], bar) -> None:
    k, spec = r["state_key"], r["spec"]
    h = xxhash.xxh3_64()
    if spec.nbytes:
        offset = r["offset"]
        chunks = store._chunks(spec)
        with store.pipeline([[Slice(k, a, b)] for a, b in chunks], mode="w") as pipe:
            for (t,) in pipe:
                if t.device.type == "cpu" and t.is_contiguous():
                    view = memoryview(t.view(-1).view(torch.uint8).numpy())
                    f.read(view, offset, r["key"], h.update)
                else:
                    tmp = torch.empty(t.numel(), dtype=t.dtype)
                    view = memoryview(tmp.view(torch.uint8).numpy())
                    f.read(view, offset, r["key"], h.update)
                    t.copy_(tmp.view(t.shape))
                offset += len(view)
                bar.update(len(view))
    if h.hexdigest() != r["checksum"]:
        raise CheckpointCorruptError(f"{fpath}: checksum mismatch in tensor {r['key']!r} "
                                     f"(the file was altered or damaged)")


def verify_checkpoint(path: str, *, progress: Optional[bool] = None) -> List[str]:
    """Check a checkpoint without loading it: manifest, shard headers and every checksum.
    Returns the list of problems found (empty when the checkpoint is intact)."""
    try:
        m = read_manifest(path)
    except CheckpointError as e:
        return [str(e)]
    problems: List[str] = []
    bar = _progress(m.nbytes, "verify", progress)
    buf = bytearray(min(4 * READ_PIECE, max((r["nbytes"] for r in m.rows), default=0)))
    mv = memoryview(buf)
    with _reader_pool() as pool:
        for name, rows in _by_file(m.rows).items():
            fpath = _join(m.root, name)
            try:
                _check_shard_header(m, name, rows)
                f = _ShardReader(m.fs, fpath, pool)
            except CheckpointError as e:
                problems.append(str(e))
                continue
            with f:
                for r in rows:
                    h = xxhash.xxh3_64()
                    offset, left = r["offset"], r["nbytes"]
                    try:
                        while left:
                            n = min(left, len(buf))
                            f.read(mv[:n], offset, r["key"], h.update)
                            offset += n
                            left -= n
                            bar.update(n)
                    except StateStoreError as e:
                        problems.append(str(e))
                        continue
                    if h.hexdigest() != r["checksum"]:
                        problems.append(f"{fpath}: checksum mismatch in tensor {r['key']!r}")
    bar.close()
    return problems
