"""The checkpoint format's schema and records (``docs/checkpoint-format.md``).

:data:`SCHEMA` is the manifest's Arrow schema; a :class:`ManifestRow` is one validated row
(one tensor), a :class:`Manifest` a whole validated manifest. Readers build rows with
:meth:`ManifestRow.parse`, which refuses anything the format does not allow; writers build
them with :meth:`ManifestRow.of` and turn them into columns with :func:`columns`.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import pyarrow as pa

from .._types import StateKey, StateSpec, dtype_from_name, dtype_name
from .._version import __version__
from ..errors import CheckpointCorruptError
from .parquet_guard import MAX_NDIM

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "MANIFEST", "CHECKSUM", "SCHEMA", "COLUMNS",
           "STRING_COLUMNS", "ManifestRow", "Manifest", "columns", "statestore_version"]

FORMAT_NAME = "statestore-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.parquet"
CHECKSUM = "xxh3_64"

#: The manifest's columns, in order.
SCHEMA = pa.schema([
    ("key", pa.string()), ("param", pa.string()), ("state", pa.string()),
    ("file", pa.string()), ("offset", pa.int64()), ("nbytes", pa.int64()),
    ("shape", pa.list_(pa.int64())), ("dtype", pa.string()), ("checksum", pa.string()),
])
COLUMNS: Tuple[str, ...] = tuple(SCHEMA.names)

#: Manifest columns read dictionary-encoded: a string repeated on every row is then held
#: once, whatever the number of rows.
STRING_COLUMNS = ("key", "param", "state", "file", "dtype", "checksum")


def statestore_version() -> str:
    """The running statestore's version (written into every manifest)."""
    return __version__


@dataclass(frozen=True, eq=True)
class ManifestRow(Mapping):
    """One tensor of a checkpoint: a manifest row, validated.

    The nine manifest columns (:data:`COLUMNS`) are fields; ``spec`` (shape and dtype) and
    ``state_key`` are derived from them. A row also reads as a read-only mapping of those
    eleven names (``row["file"]``, ``row.items()``), as the manifest rows did before they
    were records.
    """
    key: str
    param: str
    state: str
    file: str
    offset: int
    nbytes: int
    shape: Tuple[int, ...]
    dtype: str
    checksum: str
    spec: StateSpec
    state_key: StateKey

    # ---- mapping view
    def __getitem__(self, name: str) -> Any:
        if name not in _FIELD_NAMES:
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self) -> Iterator[str]:
        return iter(_FIELD_NAMES)

    def __len__(self) -> int:
        return len(_FIELD_NAMES)

    # ---- construction
    @classmethod
    def of(cls, key: StateKey, spec: StateSpec, file: str, offset: int,
           checksum: str) -> "ManifestRow":
        """The row a save writes for state ``key`` of ``spec`` stored at ``offset`` of
        ``file`` with xxh3-64 ``checksum`` (hex)."""
        return cls(str(key), key.param, key.state, file, offset, spec.nbytes, tuple(spec.shape),
                   dtype_name(spec.dtype), checksum, spec, key)

    @classmethod
    def parse(cls, values: Sequence[Any], where: str, seen: Optional[set] = None) -> "ManifestRow":
        """The row of the column ``values`` (in :data:`COLUMNS` order) read from a manifest.

        Args:
            values: one value per manifest column, as decoded.
            where: how to name the row in messages (manifest path and tensor key).
            seen: keys of the rows parsed before (updated): a key met twice is refused.

        Returns:
            The validated row.

        Raises:
            CheckpointCorruptError: a field is null, the key or dtype cannot be parsed, the
                key disagrees with the param/state columns, the shape has more than
                ``MAX_NDIM`` dimensions or a negative one, the offset is negative, ``nbytes``
                disagrees with shape and dtype, the file name is not a plain name, or the
                key is in ``seen``.
        """
        r = dict(zip(COLUMNS, values))
        if any(r[c] is None for c in COLUMNS) or any(d is None for d in r["shape"]):
            raise CheckpointCorruptError(f"{where}: null field")
        if seen is not None:
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
        return cls(r["key"], r["param"], r["state"], name, r["offset"], r["nbytes"],
                   tuple(r["shape"]), r["dtype"], r["checksum"], spec, k)


_FIELD_NAMES: Tuple[str, ...] = tuple(f.name for f in fields(ManifestRow))


def columns(rows: Sequence[ManifestRow]) -> Dict[str, list]:
    """``rows`` as manifest columns (:data:`COLUMNS` to lists of values), as written."""
    out: Dict[str, list] = {n: [getattr(r, n) for r in rows] for n in COLUMNS}
    out["shape"] = [list(s) for s in out["shape"]]
    return out


@dataclass(frozen=True)
class Manifest:
    """A parsed, validated manifest (:func:`statestore.checkpoint.read_manifest`).

    Attributes:
        fs: the fsspec filesystem of the checkpoint.
        root: the checkpoint directory on ``fs``.
        rows: one :class:`ManifestRow` per tensor, in the manifest's order.
        metadata: the optimizer metadata (a dict; ``{}`` when none was saved).
        info: format fields: ``format``, ``format_version``, ``statestore_version``,
            ``save_id``, ``checksum``.
    """
    fs: Any
    root: str
    rows: List[ManifestRow]
    metadata: dict
    info: dict

    @property
    def files(self) -> List[str]:
        """The shard files the rows name, sorted."""
        return sorted({r.file for r in self.rows})

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data the checkpoint holds."""
        return sum(r.nbytes for r in self.rows)
