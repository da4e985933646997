"""The checkpoint format's schema and records (``docs/checkpoint-format.md``).

:data:`SCHEMA` is the manifest's Arrow schema; a :class:`ManifestRow` is one validated row
(one tensor), a :class:`Manifest` a whole validated manifest. Readers build rows with
:meth:`ManifestRow.parse`, which refuses anything the format does not allow; writers build
them with :meth:`ManifestRow.of` and turn them into columns with :func:`columns`.

Version 2 (:data:`REGION_FORMAT_VERSION`) adds the columns of :data:`REGION_SCHEMA`: a row may
hold a region of a larger tensor (one rank's shard of an FSDP2 parameter's state), and a key
then has one row per region. A manifest whose rows are all whole tensors is written as
version 1, as before.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Iterator, List, NoReturn, Optional, Sequence, Tuple

import pyarrow as pa

from .._regions import Region
from .._types import StateKey, StateSpec, dtype_from_name, dtype_name
from .._version import __version__
from ..errors import CheckpointCorruptError
from .metadata import clip
from .parquet_guard import MAX_NDIM

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "REGION_FORMAT_VERSION", "MANIFEST", "CHECKSUM",
           "SCHEMA", "COLUMNS", "REGION_SCHEMA", "REGION_COLUMNS", "STRING_COLUMNS",
           "ManifestRow", "Manifest", "clip", "columns", "tiling_problems", "statestore_version"]

FORMAT_NAME = "statestore-checkpoint"
#: the version of a manifest whose rows are all whole tensors
FORMAT_VERSION = 1
#: the version of a manifest with rows that hold regions (:data:`REGION_SCHEMA`)
REGION_FORMAT_VERSION = 2
MANIFEST = "manifest.parquet"
CHECKSUM = "xxh3_64"

#: The manifest's columns, in order.
SCHEMA = pa.schema([
    ("key", pa.string()), ("param", pa.string()), ("state", pa.string()),
    ("file", pa.string()), ("offset", pa.int64()), ("nbytes", pa.int64()),
    ("shape", pa.list_(pa.int64())), ("dtype", pa.string()), ("checksum", pa.string()),
])
COLUMNS: Tuple[str, ...] = tuple(SCHEMA.names)

#: The columns a version-2 manifest adds: the row's tensor is the region ``[offsets, offsets +
#: shape)`` of a tensor of ``global_shape`` (a whole tensor: ``global_shape`` = ``shape``,
#: ``offsets`` all zero).
REGION_SCHEMA = pa.schema([("global_shape", pa.list_(pa.int64())),
                           ("offsets", pa.list_(pa.int64()))])
REGION_COLUMNS: Tuple[str, ...] = tuple(REGION_SCHEMA.names)

#: Manifest columns read dictionary-encoded: a string repeated on every row is then held
#: once, whatever the number of rows.
STRING_COLUMNS = ("key", "param", "state", "file", "dtype", "checksum")


def statestore_version() -> str:
    """The running statestore's version (written into every manifest)."""
    return __version__


@dataclass(frozen=True, eq=True, slots=True)
class ManifestRow(Mapping):
    """One tensor of a checkpoint: a manifest row, validated.

    The nine manifest columns (:data:`COLUMNS`) and the two of :data:`REGION_COLUMNS` are
    attributes (a version-1 row holds a whole tensor: ``global_shape`` is its shape,
    ``offsets`` zeros); ``spec`` (shape and dtype) and ``state_key`` are derived from them,
    and ``key``, ``param`` and ``state`` are read from ``state_key`` (held once). A row also
    reads as a read-only mapping of those thirteen names (``row["file"]``, ``row.items()``),
    as the manifest rows did before they were records.
    """
    state_key: StateKey
    file: str
    offset: int
    nbytes: int
    shape: Tuple[int, ...]
    dtype: str
    checksum: str
    spec: StateSpec
    global_shape: Tuple[int, ...] = ()
    offsets: Tuple[int, ...] = ()

    # ``key``, ``param`` and ``state`` are read from ``state_key``: a row holds its name's
    # strings once (a manifest of millions of rows: about 100 bytes a row less)
    @property
    def key(self) -> str:
        """``"param/state"``, the manifest's ``key`` column."""
        return f"{self.state_key.param}/{self.state_key.state}"

    @property
    def param(self) -> str:
        return self.state_key.param

    @property
    def state(self) -> str:
        return self.state_key.state

    def __post_init__(self) -> None:
        if len(self.global_shape) != len(self.shape):      # built without a region: whole
            object.__setattr__(self, "global_shape", tuple(self.shape))
            object.__setattr__(self, "offsets", (0,) * len(self.shape))

    @property
    def region(self) -> Region:
        """The region of its tensor this row holds."""
        return Region(self.global_shape, self.offsets, self.shape)

    def with_region(self, region: Region) -> "ManifestRow":
        """This row holding ``region`` (of this row's shape) of a larger tensor."""
        return replace(self, global_shape=region.global_shape, offsets=region.offsets)

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
        return cls(key, file, offset, spec.nbytes, tuple(spec.shape), dtype_name(spec.dtype),
                   checksum, spec)

    @classmethod
    def parse(cls, values: Sequence[Any], where: str, seen: Optional[set] = None,
              region: Optional[Sequence[Any]] = None,
              cache: Optional[dict] = None) -> "ManifestRow":
        """The row of the column ``values`` (in :data:`COLUMNS` order) read from a manifest.

        Args:
            values: one value per manifest column, as decoded.
            where: how to name the manifest in messages (its path); the row's key follows,
                shortened (:func:`clip`: a message never repeats a string of any length).
            seen: ``(key, offsets)`` of the rows parsed before (updated): a row met twice
                is refused.
            region: a version-2 manifest's :data:`REGION_COLUMNS` values of the row (None:
                a whole tensor).
            cache: a dict kept across the rows of one manifest: file names already checked
                and one ``StateSpec`` per shape and dtype, shared by the rows (a manifest of
                many tensors of few shapes holds few).

        Returns:
            The validated row.

        Raises:
            CheckpointCorruptError: a field is null, the key or dtype cannot be parsed, the
                key disagrees with the param/state columns, the shape has more than
                ``MAX_NDIM`` dimensions or a negative one, the offset is negative, ``nbytes``
                disagrees with shape and dtype, the file name is not a plain name, the
                region does not fit its global shape, or the row is in ``seen``.
        """
        key, param, state, name, offset, nbytes, shape, dtype, checksum = values
        if cache is None:
            cache = {}

        def bad(problem: str) -> CheckpointCorruptError:
            return CheckpointCorruptError(f"{where}: tensor {clip(key)}: {problem}")

        if None in values or None in shape:
            raise bad("null field")
        if len(shape) > MAX_NDIM:
            raise bad(f"{len(shape)} dimensions (at most {MAX_NDIM})")
        reg = None if region is None else _parse_region(region, shape, bad)
        if seen is not None:        # a whole tensor's row by its key (no tuple a row)
            ident = key if reg is None else (key, reg.offsets)
            if ident in seen:
                raise bad("listed twice")
            seen.add(ident)
        if key != f"{param}/{state}" or not param or not state or "/" in state:
            _refuse_key(key, bad)
        if offset < 0:
            raise bad("negative shape or offset")
        spec = cache.get((dtype, *shape))
        if spec is None:
            spec = cache[(dtype, *shape)] = _parse_spec(shape, dtype, bad)
        if spec.nbytes != nbytes:
            raise bad(f"{nbytes} bytes listed, shape and dtype give {spec.nbytes}")
        if ("file", name) not in cache:
            _check_file_name(name, bad)
            cache["file", name] = True
        if reg is None:
            whole = cache.get(("whole", spec.shape))
            if whole is None:
                whole = cache["whole", spec.shape] = (0,) * len(spec.shape)
            return cls(StateKey(param, state), name, offset, nbytes, spec.shape, dtype,
                       checksum, spec, spec.shape, whole)
        return cls(StateKey(param, state), name, offset, nbytes, spec.shape, dtype, checksum,
                   spec, reg.global_shape, reg.offsets)


# The checks of ManifestRow.parse that run once per region, key problem, spec or file name
# (``bad(problem)`` is the row's error).
def _parse_region(region: Sequence[Any], shape: Sequence[int],
                  bad: Callable[[str], CheckpointCorruptError]) -> Region:
    """The region of a row of ``shape`` from its :data:`REGION_COLUMNS` values."""
    if None in region or any(d is None for v in region for d in v):
        raise bad("null field")
    if len(region[0]) > MAX_NDIM:
        raise bad(f"{len(region[0])} dimensions (at most {MAX_NDIM})")
    reg = Region.of(region[0], region[1], shape)
    problem = reg.problem()
    if problem:
        raise bad(f"bad region: {clip(problem, 200)}")
    return reg


def _refuse_key(key: str, bad: Callable[[str], CheckpointCorruptError]) -> NoReturn:
    """Raise for a key that disagrees with its row's param/state columns."""
    try:
        StateKey.parse(key)
    except ValueError:
        raise bad("not a state key (expected 'param/state')") from None
    raise bad("key disagrees with param/state columns")


def _parse_spec(shape: Sequence[int], dtype: str,
                bad: Callable[[str], CheckpointCorruptError]) -> StateSpec:
    """The spec of a row's ``shape`` and ``dtype`` name."""
    if any(d < 0 for d in shape):
        raise bad("negative shape or offset")
    try:
        return StateSpec(tuple(shape), dtype_from_name(dtype))
    except ValueError as e:
        raise bad(clip(str(e), 200)) from None


def _check_file_name(name: str, bad: Callable[[str], CheckpointCorruptError]) -> None:
    """A row's shard file is a plain name in the checkpoint directory."""
    if "/" in name or "\\" in name or "\0" in name or name in ("", ".", "..") \
            or len(name.encode("utf-8", "surrogatepass")) > 255:
        raise bad(f"bad file name {clip(name)} (a plain name in the checkpoint "
                  f"directory is expected)")


#: the names of a row's mapping view, in the manifest's order (the nine columns, the two
#: derived fields, the two region columns)
_FIELD_NAMES: Tuple[str, ...] = ("key", "param", "state", "file", "offset", "nbytes", "shape",
                                 "dtype", "checksum", "spec", "state_key", "global_shape",
                                 "offsets")


def columns(rows: Sequence[ManifestRow]) -> Dict[str, list]:
    """``rows`` as manifest columns (:data:`COLUMNS` to lists of values), as written; with
    :data:`REGION_COLUMNS` too when a row holds a region of a larger tensor."""
    names = COLUMNS + REGION_COLUMNS if any(not r.region.is_whole for r in rows) else COLUMNS
    out: Dict[str, list] = {n: [getattr(r, n) for r in rows] for n in names}
    for n in ("shape",) + REGION_COLUMNS:
        if n in out:
            out[n] = [list(s) for s in out[n]]
    return out


def _grid_problem(rows: Sequence[ManifestRow]) -> Optional[str]:
    """What keeps ``rows`` (regions of one tensor cut along several dimensions) from tiling
    it, or None. The boundaries of the regions along each dimension make a grid; every
    non-empty region must cover whole cells, and every cell must be covered once. A 2-D
    mesh's shards (``Shard`` x ``Shard``, FSDP x TP's strided shards) are such grids, of
    about as many cells as regions; a manifest whose grid would have more than 64 cells per
    region is refused rather than checked."""
    first = rows[0]
    glob = first.global_shape
    live = [r for r in rows if r.spec.numel]
    cuts = [sorted({0, g} | {r.offsets[d] for r in live} | {r.offsets[d] + r.shape[d]
                                                          for r in live})
            for d, g in enumerate(glob)]
    if any(c[-1] > g for c, g in zip(cuts, glob)):
        return "a region ends past the tensor"
    cells = math.prod(len(c) - 1 for c in cuts)
    if cells > 64 * max(1, len(rows)):
        return f"its {len(rows)} regions do not form a grid of boxes"
    index = [{b: i for i, b in enumerate(c)} for c in cuts]
    seen = bytearray(cells)
    steps = [math.prod(len(c) - 1 for c in cuts[d + 1:]) for d in range(len(cuts))]
    for r in live:
        spans = [range(index[d][o], index[d][o + n])
                 for d, (o, n) in enumerate(zip(r.offsets, r.shape))]
        for cell in itertools.product(*spans):
            i = sum(c * s for c, s in zip(cell, steps))
            if seen[i]:
                return f"region {r.region.describe()} overlaps another"
            seen[i] = 1
    if not all(seen) and math.prod(glob):
        return f"its regions leave a gap in {list(glob)}"
    return None


def tiling_problems(rows: Sequence[ManifestRow]) -> Iterator[str]:
    """What is wrong with the regions of ``rows`` (a manifest's rows): the rows of one key
    must be one whole tensor, or regions of one global shape and dtype that together cover
    the tensor exactly (no gap, no overlap): each cut along the same single dimension (a 1-D
    mesh's shards), or boxes of a grid (a 2-D mesh's: :func:`_grid_problem`). Yields one
    message per key at fault (``"tensor 'k': ..."``)."""
    # Only keys with a region row are grouped: a whole tensor's row is listed once (parse's
    # ``seen``), so a key without regions is fine as it is (no list a row for the many).
    cut = {r.key for r in rows if not r.region.is_whole}
    by_key: Dict[str, List[ManifestRow]] = {}
    for r in rows:
        if cut and r.key in cut:
            by_key.setdefault(r.key, []).append(r)
    for key, rs in by_key.items():
        if len(rs) == 1 and rs[0].region.is_whole:
            continue
        first = rs[0]
        if any(r.global_shape != first.global_shape or r.dtype != first.dtype for r in rs):
            yield f"tensor {key!r}: its regions disagree on the global shape or dtype"
            continue
        dims = {r.region.split_dim() for r in rs} - {None}
        if -1 in dims or len(dims) > 1:
            problem = _grid_problem(rs)
            if problem is not None:
                yield f"tensor {key!r}: {problem}"
            continue
        full = [r for r in rs if r.region.is_whole]
        if full or not dims:
            yield (f"tensor {key!r}: {len(rs)} rows, not regions that tile "
                   f"{list(first.global_shape)}")
            continue
        d = dims.pop()
        end = 0
        for r in sorted((r for r in rs if r.spec.numel), key=lambda r: r.offsets[d]):
            if r.offsets[d] != end:
                yield (f"tensor {key!r}: region {r.region.describe()} "
                       f"{'overlaps the one before' if r.offsets[d] < end else 'leaves a gap'}")
                break
            end += r.shape[d]
        else:
            if end != first.global_shape[d]:
                yield (f"tensor {key!r}: its regions cover {end} of the {first.global_shape[d]} "
                       f"entries of dimension {d}")


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
