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


def _progress(total: int, desc: str, enabled: Optional[bool]):
    """A byte progress bar: ``enabled=True`` at once, ``None`` only for work over a second,
    ``False`` never."""
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True,
                delay=0.0 if enabled is True else 1.0, disable=(enabled is False), leave=False)


# ---------------------------------------------------------------------------------- writer
_DIRECT_ALIGN = 4096
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
        try:
            self._fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o644)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._fd = os.open(path, flags, 0o644)
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
                    view = memoryview(self._bufs[i])
                    done = 0
                    while done < n:
                        w = os.pwrite(self._fd, view[done:n], off + done)
                        if w <= 0:
                            raise OSError(errno.EIO, f"short write to {self.path}")
                        done += w
            except BaseException as e:      # reported to the caller at its next call
                self._error = e
            finally:
                self._free.put(i)

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


def _open_for_write(fs, path: str):
    if _is_local(fs):
        return _DirectWriter(path)
    return fs.open(path, "wb")


# ---------------------------------------------------------------------------------- save
def save_checkpoint(store, path: str, *, shard_bytes: int = DEFAULT_SHARD_BYTES,
                    progress: Optional[bool] = None, metadata: Optional[dict] = None) -> None:
    """Write every state of ``store`` and its optimizer metadata to ``path`` atomically.

    ``path`` is a local directory or any fsspec URL. Shards hold at most ``shard_bytes``
    (a larger single tensor gets a shard of its own). RAM use is bounded by the store's
    pipeline budget. ``metadata`` overrides the store's attached metadata.
    """
    _check_store(store)
    if isinstance(shard_bytes, bool) or not isinstance(shard_bytes, int) or shard_bytes <= 0:
        raise StateStoreValueError(f"shard_bytes must be a positive int, got {shard_bytes!r}")
    if metadata is not None and not isinstance(metadata, dict):
        raise StateStoreValueError(f"metadata must be a dict or None, got "
                                   f"{type(metadata).__name__}")
    store._check_open()
    fs, root = _fs(path)
    if fs.exists(root) and not fs.isdir(root):
        raise StateStoreValueError(f"checkpoint path {path!r} exists and is not a directory")
    store.sync()
    meta = metadata if metadata is not None else store.metadata()
    meta = {} if meta is None else meta
    problem = optimizer_metadata_problem(meta)
    if problem:
        raise StateStoreValueError(f"checkpoint metadata: {problem}")
    try:
        meta_json = json.dumps(meta)
    except (TypeError, ValueError, RecursionError) as e:
        raise StateStoreValueError(f"checkpoint metadata is not JSON-serializable: {e}") from e
    try:
        fs.makedirs(root, exist_ok=True)
    except OSError as e:
        raise StateStoreIOError(e.errno, f"cannot create checkpoint directory {path!r}: {e}") from e

    keys = store.keys()
    shards: List[List[StateKey]] = []
    size = 0
    for k in keys:
        nb = store.spec(k).nbytes
        if not shards or (size + nb > shard_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += nb
    save_id = uuid.uuid4().hex[:12]
    rows: Dict[str, list] = {n: [] for n in _SCHEMA.names}
    total = sum(store.spec(k).nbytes for k in keys)
    written_files: List[str] = []
    bar = _progress(total, f"save {os.path.basename(root)}", progress)
    try:
        for n, shard_keys in enumerate(shards):
            name = f"shard-{save_id}-{n:05d}.safetensors"
            final, tmp = _join(root, name), _join(root, f".{name}.tmp")
            lay = layout([(str(k), store.spec(k).dtype, store.spec(k).shape) for k in shard_keys],
                         align=64, metadata={"format": FORMAT_NAME})
            written_files.append(tmp)
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
                    spec = store.spec(k)
                    entry = lay.entries[str(k)]
                    h = hashes[k]
                    rows["key"].append(str(k))
                    rows["param"].append(k.param)
                    rows["state"].append(k.state)
                    rows["file"].append(name)
                    rows["offset"].append(entry.offset)
                    rows["nbytes"].append(spec.nbytes)
                    rows["shape"].append(list(spec.shape))
                    rows["dtype"].append(dtype_name(spec.dtype))
                    rows["checksum"].append(h.hexdigest())
                _commit(fs, f, tmp, final)
            except BaseException:
                f.close()
                raise
            written_files[-1] = final
        table = pa.Table.from_pydict(rows, schema=_SCHEMA).replace_schema_metadata({
            "statestore.format": FORMAT_NAME,
            "statestore.format_version": str(FORMAT_VERSION),
            "statestore.version": _version(),
            "statestore.checksum": CHECKSUM,
            "statestore.save_id": save_id,
            "statestore.saved_at": str(time.time()),
            "statestore.metadata": meta_json,
        })
        mtmp = _join(root, f".{MANIFEST}.{save_id}.tmp")
        written_files.append(mtmp)
        f = fs.open(mtmp, "wb")
        try:
            pq.write_table(table, f)
            _commit(fs, f, mtmp, _join(root, MANIFEST))
        except BaseException:
            f.close()
            raise
        written_files.pop()
        _fsync_dir(fs, root) if _is_local(fs) else None
    except BaseException as e:
        for p in written_files:     # leave the previous checkpoint (if any) untouched
            try:
                fs.rm(p)
            except Exception:
                pass
        bar.close()
        if isinstance(e, OSError) and not isinstance(e, StateStoreError):
            raise StateStoreIOError(e.errno, f"saving checkpoint {path!r} failed: {e}") from e
        raise
    bar.close()
    keep = {f"shard-{save_id}-{n:05d}.safetensors" for n in range(len(shards))} | {MANIFEST}
    for p in fs.ls(root, detail=False):
        base = p.rstrip("/").rsplit("/", 1)[-1]
        if base not in keep and (base.startswith("shard-") or base.startswith(".shard-")
                                 or base.startswith(f".{MANIFEST}.")):
            try:
                fs.rm(p)
            except Exception:
                pass


def _read_states(store, keys: List[StateKey]):
    """Yield ``(key, bytes)`` of the states ``keys``, in order, chunk by chunk, through ONE
    pipeline of the store: non-resident stores read ahead across tensors within their RAM
    budget (chunks of a quarter of it) while the caller hashes and writes."""
    units = []
    for k in keys:
        spec = store.spec(k)
        if spec.nbytes == 0:
            continue
        if store.resident:
            chunks = store._chunks(spec)
        else:
            item = spec.itemsize
            align = max(1, store.alignment // item)
            step = max(align, (store.unit_bytes // item) // align * align)
            chunks = [(a, min(a + step, spec.numel)) for a in range(0, spec.numel, step)]
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


def _read_table(fs, mpath: str) -> "pa.Table":
    """Read the manifest's bytes and decode them within the bounds of ``_parquet_guard``."""
    try:
        with fs.open(mpath, "rb") as f:
            raw = f.read()
        if not isinstance(raw, bytes):
            raw = bytes(raw)
    except Exception as e:
        raise CheckpointCorruptError(f"{mpath}: unreadable manifest: {e}") from e
    try:
        check_parquet_bounds(raw)
        table = pq.read_table(pa.BufferReader(raw), read_dictionary=list(_STRING_COLUMNS),
                              use_threads=False, thrift_string_size_limit=max(len(raw), 1),
                              thrift_container_size_limit=max(len(raw), 1))
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
            raise CheckpointNotFoundError(f"{path!r} holds no complete checkpoint "
                                          f"({MANIFEST} is missing: a save that never finished?)")
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
    info = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION,
            "statestore_version": smeta.get("statestore.version"),
            "save_id": smeta.get("statestore.save_id"), "checksum": CHECKSUM}
    return Manifest(fs, root, rows, metadata, info)


def _check_shard_header(m: Manifest, name: str, rows: List[Dict[str, Any]]) -> int:
    """Check a shard's safetensors header against the manifest; returns the file size.

    After it, every listed tensor lies in the shard's data section, inside the file, and no
    two overlap: loading allocates at most the shard's size for them, and reads nothing
    outside it."""
    fpath = _join(m.root, name)
    keys = [r["key"] for r in rows]
    try:
        size = m.fs.size(fpath)
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
    except CheckpointError:
        raise
    except (ValueError, UnicodeDecodeError, RecursionError, struct.error) as e:
        raise CheckpointCorruptError(f"{fpath}: bad safetensors header: "
                                     f"{type(e).__name__}: {str(e)[:200]}") from None
    except OSError as e:
        raise CheckpointCorruptError(f"{fpath}: cannot read the shard: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointCorruptError(f"{fpath}: bad safetensors header: not a JSON object")
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
    return size


def _by_file(m: Manifest) -> Dict[str, List[Dict[str, Any]]]:
    out: Dict[str, List[Dict[str, Any]]] = {}
    for r in m.rows:
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
def load_checkpoint(store, path: str, *, progress: Optional[bool] = None) -> None:
    """Replace the states of ``store`` with the checkpoint at ``path``, verifying every
    checksum while streaming. On any error the store is left empty (never half-loaded) and
    the exception names the file and tensor."""
    _check_store(store)
    store._check_open()
    try:
        m = read_manifest(path)
        groups = _by_file(m)
        for name, rows in groups.items():
            _check_shard_header(m, name, rows)
    except BaseException:
        store.clear()
        raise
    store.clear()
    try:
        store.create_many([(r["state_key"], r["spec"].shape, r["spec"].dtype, None) for r in m.rows])
        bar = _progress(m.nbytes, f"load {os.path.basename(m.root)}", progress)
        try:
            for name, rows in groups.items():
                fpath = _join(m.root, name)
                try:
                    f = m.fs.open(fpath, "rb")
                except OSError as e:
                    raise CheckpointCorruptError(f"{fpath}: cannot read the shard: {e}") from e
                with f:
                    for r in rows:
                        _load_tensor(store, f, fpath, r, bar)
        finally:
            bar.close()
        store.sync()
    except BaseException:
        try:
            store.clear()
        except Exception:
            pass
        raise
    store._loaded_metadata = m.metadata


def _load_tensor(store, f, fpath: str, r: Dict[str, Any], bar) -> None:
    k, spec = r["state_key"], r["spec"]
    h = xxhash.xxh3_64()
    if spec.nbytes:
        f.seek(r["offset"])
        chunks = store._chunks(spec)
        with store.pipeline([[Slice(k, a, b)] for a, b in chunks], mode="w") as pipe:
            for (t,) in pipe:
                if t.device.type == "cpu" and t.is_contiguous():
                    view = memoryview(t.view(-1).view(torch.uint8).numpy())
                    _read_exact(f, view, fpath, r["key"])
                    h.update(view)
                else:
                    tmp = torch.empty(t.numel(), dtype=t.dtype)
                    view = memoryview(tmp.view(torch.uint8).numpy())
                    _read_exact(f, view, fpath, r["key"])
                    h.update(view)
                    t.copy_(tmp.view(t.shape))
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
    buf = bytearray(min(16 * 1024 * 1024, max((r["nbytes"] for r in m.rows), default=0)))
    mv = memoryview(buf)
    for name, rows in _by_file(m).items():
        fpath = _join(m.root, name)
        try:
            _check_shard_header(m, name, rows)
            f = m.fs.open(fpath, "rb")
        except CheckpointError as e:
            problems.append(str(e))
            continue
        except OSError as e:
            problems.append(f"{fpath}: cannot read the shard: {e}")
            continue
        with f:
            for r in rows:
                h = xxhash.xxh3_64()
                f.seek(r["offset"])
                left = r["nbytes"]
                try:
                    while left:
                        n = min(left, len(buf))
                        _read_exact(f, mv[:n], fpath, r["key"])
                        h.update(mv[:n])
                        left -= n
                        bar.update(n)
                except CheckpointError as e:
                    problems.append(str(e))
                    continue
                if h.hexdigest() != r["checksum"]:
                    problems.append(f"{fpath}: checksum mismatch in tensor {r['key']!r}")
    bar.close()
    return problems
