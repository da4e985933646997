"""Reading a checkpoint's manifest: bounded, validated, checksummed.

:func:`read_manifest` refuses, naming the problem, anything that is not a complete manifest
of this format: a missing or foreign directory, a file that is not a regular file or is too
large, Parquet that would cost more than a bounded multiple of its size to decode
(:mod:`.parquet_guard`), another format or version, missing or mistyped columns, bad rows
(:meth:`.format.ManifestRow.parse`), malformed optimizer metadata (:mod:`.metadata`) and a
manifest checksum mismatch (:mod:`.digest`).
"""
from __future__ import annotations

import itertools
import json
import os
from typing import Any, Dict, List, Optional, Tuple

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from .digest import KEY, manifest_digest
from .filesystem import exists, is_local, join, progress as progress_bar, resolve
from .foreign import missing_manifest_message
from .format import (CHECKSUM, COLUMNS, FORMAT_NAME, FORMAT_VERSION, MANIFEST,
                     REGION_COLUMNS, REGION_FORMAT_VERSION, REGION_SCHEMA, SCHEMA,
                     STRING_COLUMNS, Manifest, ManifestRow, statestore_version,
                     tiling_problems)
from .metadata import is_int, optimizer_metadata_problem
from .parquet_guard import ParquetBoundsError, check_parquet_bounds
from .shard_check import MAX_MANIFEST_BYTES, check_local_file

__all__ = ["read_manifest"]


_SLICE = 4096


def _column_values(col: "pa.ChunkedArray") -> list:
    """A column as a Python list, dictionary arrays expanded by reference (one str object per
    distinct value, not per row), lists (shapes, offsets) as one tuple per distinct value,
    decoded a slice at a time (not a list object a row)."""
    out: list = []
    for chunk in col.chunks:
        if pa.types.is_dictionary(chunk.type):
            values = chunk.dictionary.to_pylist()
            out.extend(None if i is None else values[i] for i in chunk.indices.to_pylist())
        elif pa.types.is_list(chunk.type):
            seen: dict = {}
            for a in range(0, len(chunk), _SLICE):
                for v in chunk.slice(a, _SLICE).to_pylist():
                    if v is not None:
                        v = tuple(v)
                        v = seen.setdefault(v, v)
                    out.append(v)
        else:
            out.extend(chunk.to_pylist())
    return out


def _read_manifest_bytes(fs, mpath: str) -> bytes:
    """The manifest's bytes, refusing before reading anything what is not a regular file
    (a FIFO, a device), a symlink out of the checkpoint directory, or a file larger than
    :data:`statestore.checkpoint.shard_check.MAX_MANIFEST_BYTES`."""
    if is_local(fs):
        size = check_local_file(os.path.dirname(mpath), mpath, "the manifest").st_size
    else:
        info = fs.info(mpath)
        if info.get("type", "file") != "file":
            raise CheckpointCorruptError(f"{mpath}: the manifest is not a file")
        size = info.get("size")
    if not is_int(size) or size > MAX_MANIFEST_BYTES:
        raise CheckpointCorruptError(f"{mpath}: the manifest has {size} bytes, more than the "
                                     f"{MAX_MANIFEST_BYTES} read at most; refused")
    with fs.open(mpath, "rb") as f:
        raw = f.read(size)          # what it held when checked, never more
    return raw if isinstance(raw, bytes) else bytes(raw)


def _read_table(fs, mpath: str) -> "pa.Table":
    """Read the manifest's bytes and decode them within the bounds of :mod:`.parquet_guard`."""
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
        table = pq.ParquetFile(pa.BufferReader(raw), read_dictionary=list(STRING_COLUMNS),
                               thrift_string_size_limit=max(len(raw), 1),
                               thrift_container_size_limit=max(len(raw), 1)).read(use_threads=False)
        table.validate(full=True)     # offsets and dictionary indices, before Python reads them
        return table
    except ParquetBoundsError as e:
        raise CheckpointCorruptError(f"{mpath}: unreadable manifest: {e}") from None
    except Exception as e:
        raise CheckpointCorruptError(f"{mpath}: unreadable manifest: {e}") from e


def _column_type_ok(table: "pa.Table", name: str) -> bool:
    schema = REGION_SCHEMA if name in REGION_COLUMNS else SCHEMA
    t, want = table.schema.field(name).type, schema.field(name).type
    if pa.types.is_dictionary(t):
        return want == pa.string() and t.value_type == pa.string()
    return t == want


def _check_digest(mpath: str, names, columns: Dict[str, list], smeta: Dict[str, str]) -> None:
    """The manifest's own checksum (:mod:`statestore.checkpoint.digest`) must match every
    decoded column value and metadata entry: checked last, after the structural checks, so a
    malformed manifest is still named for what is wrong with it."""
    want = smeta.get(KEY)
    if want is None:
        raise CheckpointCorruptError(f"{mpath}: the manifest has no checksum ({KEY} is "
                                     f"missing): damaged, or not written by statestore")
    try:
        got = manifest_digest(names, columns, smeta)
    except (TypeError, ValueError) as e:
        raise CheckpointCorruptError(f"{mpath}: manifest checksum: {e}") from None
    if got != want:
        raise CheckpointCorruptError(f"{mpath}: manifest checksum mismatch (the manifest's rows "
                                     f"or metadata were altered or damaged)")


def read_manifest(path: str, progress: Optional[bool] = False) -> Manifest:
    """Read and validate the manifest of the checkpoint at ``path`` (``progress``: a bar over
    its tensors: True always, None for reads over a second, False, the default, never).

    Decoding is bounded by the manifest's size (:mod:`statestore.checkpoint.parquet_guard`);
    shard files are not opened (:func:`statestore.checkpoint.shard_check.check_shard_header`
    checks them).

    Args:
        path: the checkpoint directory: a local path or any fsspec URL.

    Returns:
        The :class:`~statestore.checkpoint.format.Manifest`: rows, optimizer metadata and
        format fields.

    Raises:
        StateStoreValueError: ``path`` is not a path, or its protocol is unknown.
        CheckpointNotFoundError: there is no complete checkpoint at ``path`` (the message
            says what is there instead).
        CheckpointCorruptError: the manifest is unreadable, too large, not of this format,
            inconsistent, or fails its checksum (the message names the problem).
        CheckpointError: the manifest is of another format version.
    """
    fs, root = resolve(path)
    mpath = _find_manifest(fs, root, path)
    table = _read_table(fs, mpath)
    smeta = {k.decode(errors="replace"): v.decode(errors="replace")
             for k, v in (table.schema.metadata or {}).items()}
    version, names = _check_schema(mpath, table, smeta)
    metadata = _read_metadata(mpath, smeta)
    try:
        columns = {n: _column_values(table.column(n)) for n in names}
    except Exception as e:
        raise CheckpointCorruptError(f"{mpath}: unreadable manifest: {e}") from e
    rows = _parse_rows(mpath, table.num_rows, names, columns, progress)
    for problem in tiling_problems(rows):
        raise CheckpointCorruptError(f"{mpath}: {problem}")
    _check_digest(mpath, names, columns, smeta)
    info = {"format": FORMAT_NAME, "format_version": int(version),
            "statestore_version": smeta.get("statestore.version"),
            "save_id": smeta.get("statestore.save_id"), "checksum": CHECKSUM}
    return Manifest(fs, root, rows, metadata, info)


def _find_manifest(fs, root: str, path: str) -> str:
    """The manifest's path in the checkpoint directory ``root`` (``path`` as given)."""
    mpath = join(root, MANIFEST)
    try:
        found = exists(fs, mpath)
        if not found and exists(fs, root) and not fs.isdir(root):
            raise CheckpointNotFoundError(f"{path!r} is a file, not a checkpoint directory")
        if not found and exists(fs, root):
            raise CheckpointNotFoundError(missing_manifest_message(fs, root, path, MANIFEST))
    except CheckpointError:
        raise
    except (OSError, ValueError) as e:
        raise CheckpointNotFoundError(f"cannot look for a checkpoint at {path!r}: {e}") from e
    if not found:
        raise CheckpointNotFoundError(f"no checkpoint at {path!r}")
    return mpath


def _check_schema(mpath: str, table, smeta: Dict[str, str]) -> Tuple[str, Tuple[str, ...]]:
    """The manifest's format version and column names, once its format, version, checksum
    and columns (each once, of its type) are this statestore's."""
    if smeta.get("statestore.format") != FORMAT_NAME:
        raise CheckpointCorruptError(f"{mpath}: not a statestore checkpoint manifest")
    version = smeta.get("statestore.format_version")
    if version not in (str(FORMAT_VERSION), str(REGION_FORMAT_VERSION)):
        raise CheckpointError(f"{mpath}: checkpoint format version {version}, this statestore "
                              f"({statestore_version()}) reads versions {FORMAT_VERSION} and "
                              f"{REGION_FORMAT_VERSION}")
    names = COLUMNS + (REGION_COLUMNS if version == str(REGION_FORMAT_VERSION) else ())
    if smeta.get("statestore.checksum") != CHECKSUM:
        raise CheckpointCorruptError(f"{mpath}: unknown checksum "
                                     f"{smeta.get('statestore.checksum')!r}")
    missing = [n for n in names if n not in table.column_names]
    if missing:
        raise CheckpointCorruptError(f"{mpath}: manifest lacks columns {missing}")
    for n in names:
        if table.column_names.count(n) != 1:
            raise CheckpointCorruptError(f"{mpath}: manifest has column {n!r} "
                                         f"{table.column_names.count(n)} times")
        if not _column_type_ok(table, n):
            want = (REGION_SCHEMA if n in REGION_COLUMNS else SCHEMA).field(n).type
            raise CheckpointCorruptError(f"{mpath}: manifest column {n!r} has type "
                                         f"{table.schema.field(n).type}, expected {want}")
    return version, names


def _read_metadata(mpath: str, smeta: Dict[str, str]) -> Any:
    """The optimizer metadata the manifest carries, checked for shape."""
    try:
        metadata = json.loads(smeta.get("statestore.metadata", "{}"))
    except (ValueError, RecursionError) as e:
        raise CheckpointCorruptError(f"{mpath}: optimizer metadata is not valid JSON: "
                                     f"{type(e).__name__}: {str(e)[:200]}") from None
    problem = optimizer_metadata_problem(metadata)
    if problem:
        raise CheckpointCorruptError(f"{mpath}: optimizer metadata: {problem}")
    return metadata


def _parse_rows(mpath: str, num_rows: int, names: Tuple[str, ...], columns: Dict[str, list],
                progress: Optional[bool]) -> List[ManifestRow]:
    """The manifest's rows from its decoded ``columns``, each checked."""
    seen: set = set()
    base = [columns[n] for n in COLUMNS]
    regions = zip(*(columns[n] for n in REGION_COLUMNS)) if len(names) > len(COLUMNS) \
        else itertools.repeat(None)
    cache: dict = {}
    values = progress_bar(num_rows, "manifest", progress, unit="tensor",
                          iterable=zip(zip(*base), regions))
    return [ManifestRow.parse(vals, mpath, seen, reg, cache) for vals, reg in values]
