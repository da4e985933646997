"""Checks of a checkpoint's shard files against its manifest (:func:`check_shard_header`),
and of whole files beyond their listed tensors (``docs/errors.md``,
"Untrusted checkpoint bytes"; ``docs/checkpoint-io.md``, "Loading: verification").

Tensor checksums cover the bytes a load copies. The rest of a shard decides whether stock
tools can still read it, and a damaged rest is a damaged file: so both ``verify`` and load
also check, for every shard,

* **the header**: a JSON object whose entries are ``{dtype, shape, data_offsets}`` with a
  known dtype and ``shape x item size`` bytes, and whose ``__metadata__`` (if any) maps
  strings to strings;
* **the layout**: the entries' data tile the data section exactly, from its start, with no
  hole and no overlap, and the file ends exactly where the last one does (a shard truncated
  into its last pad, or extended by a block, is refused: stock ``safe_open`` refuses it too);
* **the pads**: every ``__pad__/<n>`` tensor (linked shards) reads as zeros.

Tensors a shard holds but the manifest does not list (states a store deleted before a linked
save) are never loaded; their bytes are checked for their place in the layout only.

And before any file of a local checkpoint is opened, :func:`check_local_file` refuses what is
not a regular file (a FIFO would block the reader forever, ``/dev/zero`` would never end) and
symlinks that lead out of the checkpoint directory.
"""
from __future__ import annotations

import json
import os
import stat
import struct
from typing import Any, Dict, Iterable, List, NamedTuple, Sequence, Tuple

from .._safetensors_layout import PAD_PREFIX
from .._types import dtype_from_name
from ..errors import CheckpointCorruptError, CheckpointError
from .filesystem import is_local, join
from .format import Manifest, ManifestRow
from .parquet_guard import MAX_NDIM
from .metadata import clip, is_int

__all__ = ["MAX_MANIFEST_BYTES", "MAX_HEADER", "MAX_UNLISTED_EMPTY", "max_header_entries",
           "check_shard_header", "by_file",
           "check_local_file", "check_layout", "pad_ranges", "check_zeros"]

#: Largest manifest read (bytes): about two million tensors' rows. A larger
#: ``manifest.parquet`` is refused before a byte of it is read.
MAX_MANIFEST_BYTES = 256 << 20
#: Largest safetensors header read (bytes).
MAX_HEADER = 100 * 1024 * 1024
#: Header entries a shard may hold beyond what its manifest rows and data bytes account for
#: (:func:`max_header_entries`): zero-size states a store deleted before a linked save.
MAX_UNLISTED_EMPTY = 1 << 16
_ZERO_CHUNK = 1 << 20


def max_header_entries(listed: int, data_bytes: int) -> int:
    """Most entries the header of a real shard holding ``listed`` manifest rows and
    ``data_bytes`` of data can have: a copied shard holds its listed tensors alone; a linked
    one (a store's file) also the states deleted before the save, each taking at least 64
    bytes of data (NVMeStore packs small states at 64 bytes) unless empty (at most
    :data:`MAX_UNLISTED_EMPTY`), and one ``__pad__/<n>`` before any of them. So a header is
    refused before it is decoded when it claims more (decoding costs some hundred bytes of
    memory an entry: a 99 MiB header of 1.7 million empty entries took 28 s and 1 GiB)."""
    return 2 * (listed + MAX_UNLISTED_EMPTY + data_bytes // 64) + 16


def check_local_file(root: str, fpath: str, what: str) -> os.stat_result:
    """``fpath`` (in the local checkpoint directory ``root``) must be a regular file, reached
    directly or through symlinks that stay inside ``root``. Returns its ``stat``. Raises
    :class:`FileNotFoundError` when it does not exist, else :class:`CheckpointCorruptError`."""
    st = os.lstat(fpath)            # FileNotFoundError: the caller's "missing" message
    if stat.S_ISLNK(st.st_mode):
        real = os.path.realpath(fpath)
        base = os.path.realpath(root)
        if os.path.commonpath([real, base]) != base:
            raise CheckpointCorruptError(f"{fpath}: {what} is a symlink to {real}, outside the "
                                         f"checkpoint directory; refused")
        st = os.stat(fpath)
    if not stat.S_ISREG(st.st_mode):
        kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode)
                or stat.S_ISBLK(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode)
                else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a file")
        raise CheckpointCorruptError(f"{fpath}: {what} is {kind}, not a regular file; refused")
    return st


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class HeaderEntry(NamedTuple):
    """A header entry of the usual form (``dtype`` a str, ``shape`` a list of ints,
    ``data_offsets`` two ints; nothing else), as decoded: a small record instead of a dict of
    lists (about 600 bytes of objects an entry become about 200: a header of millions of
    entries is what a real shard of millions of small states holds). Entries of any other
    form stay dicts, for :func:`check_layout` to name what is wrong with them."""

    dtype: str
    shape: Tuple[int, ...]
    start: int
    end: int


_ENTRY_KEYS = frozenset(("dtype", "shape", "data_offsets"))


def decode_header(raw: Any) -> Any:
    """The JSON of a safetensors header, its entries of the usual form as
    :class:`HeaderEntry` (dtypes and shapes shared between entries)."""
    shared: Dict[Any, Any] = {}

    def obj(pairs):
        if len(pairs) == 3:
            d = dict(pairs)
            if d.keys() == _ENTRY_KEYS:
                dt, shape, offs = d["dtype"], d["shape"], d["data_offsets"]
                if isinstance(dt, str) and isinstance(shape, list) and len(shape) <= MAX_NDIM \
                        and all(_is_int(x) for x in shape) and isinstance(offs, list) \
                        and len(offs) == 2 and _is_int(offs[0]) and _is_int(offs[1]):
                    shape_t = tuple(shape)
                    dt = shared.setdefault(dt, dt)
                    shape_t = shared.setdefault(("shape", shape_t), shape_t)
                    a, b = offs
                    return HeaderEntry(dt, shape_t, a, a if b == a else b)
            return d
        return dict(pairs)

    return json.loads(raw, object_pairs_hook=obj)


def _entry_fields(h: Any) -> Tuple[Any, Any, Any]:
    """``(data_offsets, shape, dtype)`` of a header entry as lists, as JSON has them."""
    if isinstance(h, HeaderEntry):
        return [h.start, h.end], list(h.shape), h.dtype
    return h.get("data_offsets"), h.get("shape"), h.get("dtype")


def check_layout(fpath: str, header: Dict[str, Any], data_start: int, size: int) -> None:
    """The safetensors rules over the whole file (see the module docstring)."""
    meta = header.get("__metadata__")
    if meta is not None and (not isinstance(meta, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
        raise CheckpointCorruptError(f"{fpath}: bad safetensors header: __metadata__ must map "
                                     f"strings to strings")
    spans: List[Tuple[int, int, str]] = []
    for name, h in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(h, (dict, HeaderEntry)):
            raise CheckpointCorruptError(f"{fpath}: bad safetensors header: entry {clip(name)} "
                                         f"is not an object")
        offs, shape, dt = _entry_fields(h)
        if not isinstance(offs, list) or len(offs) != 2 or not all(_is_int(x) for x in offs) \
                or not 0 <= offs[0] <= offs[1]:
            raise CheckpointCorruptError(f"{fpath}: tensor {clip(name)}: bad data_offsets "
                                         f"{clip(offs)}")
        if isinstance(shape, list) and len(shape) > MAX_NDIM:
            raise CheckpointCorruptError(f"{fpath}: tensor {clip(name)}: bad shape of "
                                         f"{len(shape)} dimensions (at most {MAX_NDIM})")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise CheckpointCorruptError(f"{fpath}: tensor {clip(name)}: bad shape "
                                         f"{clip(shape)}")
        try:
            itemsize = dtype_from_name(dt).itemsize
        except (ValueError, TypeError, KeyError):
            raise CheckpointCorruptError(f"{fpath}: tensor {clip(name)}: unknown dtype "
                                         f"{clip(dt, 40)}") from None
        n = itemsize
        for d in shape:         # at most MAX_NDIM factors
            n *= d
        if n != offs[1] - offs[0]:
            raise CheckpointCorruptError(f"{fpath}: tensor {clip(name)}: data_offsets span "
                                         f"{offs[1] - offs[0]} bytes, shape and dtype give {n}")
        spans.append((offs[0], offs[1], name))
    spans.sort()
    pos, prev = 0, None
    for a, b, name in spans:
        if a != pos:
            what = "a hole" if a > pos else "an overlap"
            raise CheckpointCorruptError(
                f"{fpath}: bad safetensors layout: tensor {clip(name)} starts at data byte {a}, "
                f"{'tensor ' + clip(prev) if prev else 'the data start'} ends at {pos} ({what})")
        pos, prev = b, name
    end = data_start + pos
    if size != end:
        how = "truncated" if size < end else "extended"
        raise CheckpointCorruptError(f"{fpath}: {how}: the file has {size} bytes, its header "
                                     f"describes {end}")


def pad_ranges(header: Dict[str, Any], data_start: int) -> List[Tuple[int, int]]:
    """``(absolute offset, bytes)`` of the shard's pad tensors, in file order."""
    out = []
    for name, h in header.items():
        if name.startswith(PAD_PREFIX) and isinstance(h, (dict, HeaderEntry)):
            offs = _entry_fields(h)[0]
            out.append((data_start + offs[0], offs[1] - offs[0]))
    return sorted(r for r in out if r[1] > 0)


def check_zeros(f, fpath: str, ranges: List[Tuple[int, int]]) -> None:
    """Every byte of ``ranges`` in the open file ``f`` is zero (read in chunks of at most
    1 MiB)."""
    for off, n in ranges:
        f.seek(off)
        left = n
        while left:
            chunk = f.read(min(left, _ZERO_CHUNK))
            if not chunk:
                raise CheckpointCorruptError(f"{fpath}: truncated in the pad at byte {off}")
            if chunk.count(0) != len(chunk):
                raise CheckpointCorruptError(f"{fpath}: pad bytes at {off}..{off + n} are not "
                                             f"zero (the file was altered or damaged)")
            left -= len(chunk)


def check_shard_header(m: Manifest, name: str, rows: Sequence[ManifestRow]) -> int:
    """Check a shard's safetensors header, and the whole file, against the manifest.

    After it, every listed tensor lies in the shard's data section, inside the file, and no
    two overlap: loading allocates at most the shard's size for them, and reads nothing
    outside it.

    Args:
        m: the checkpoint's manifest.
        name: the shard's file name in the checkpoint directory.
        rows: the manifest rows that name the shard.

    Returns:
        The shard's size in bytes.

    Raises:
        CheckpointCorruptError: the shard is missing, not a regular file, unreadable, or
            disagrees with the manifest or with itself (the message names the problem).
    """
    fpath = join(m.root, name)
    size = _shard_size(m, fpath, [r["key"] for r in rows[:3]])     # named if it is missing
    header, n = _read_header(m, fpath, size, len(rows))
    data_start = 8 + n
    _check_rows(fpath, header, data_start, size, rows)
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


def _shard_size(m: Manifest, fpath: str, keys: List[str]) -> int:
    """The size of the shard at ``fpath``, a regular file with room for a header length."""
    try:
        if is_local(m.fs):     # before opening it: a FIFO would block, /dev/zero never end
            check_local_file(m.root, fpath, "the shard")
        size = m.fs.size(fpath)
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{fpath}: shard missing (tensors {keys[:3]}...)") from None
    except (OSError, ValueError) as e:
        raise CheckpointCorruptError(f"{fpath}: cannot read the shard: {e}") from None
    if not is_int(size) or size < 8:
        raise CheckpointCorruptError(f"{fpath}: truncated (no safetensors header)")
    return size


def _read_header(m: Manifest, fpath: str, size: int, nrows: int) -> Tuple[Dict[str, Any], int]:
    """The shard's decoded safetensors header and its length in bytes, bounded before it is
    decoded by the file's size and the manifest's ``nrows`` tensors in it."""
    try:
        with m.fs.open(fpath, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > min(size - 8, MAX_HEADER):
                raise CheckpointCorruptError(f"{fpath}: header length {n} exceeds the file "
                                             f"({size} bytes)")
            _bound_entries(f, fpath, n, size, nrows)
            f.seek(8)
            text = f.read(n).decode("utf-8")     # (the bytes freed before decoding the JSON)
            header = decode_header(text)
            del text
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
    return header, n


def _bound_entries(f, fpath: str, n: int, size: int, nrows: int) -> None:
    """Refuse a header of ``n`` bytes (read from ``f``, just past its length) that may
    describe more tensors than the shard can hold.

    Every JSON object has a '{' byte (escapes exist only inside strings), so this bounds the
    entries from above before any is decoded (read in chunks: a refused header costs no more
    memory than a chunk)."""
    claimed, left = -1, n
    while left:
        chunk = f.read(min(left, _ZERO_CHUNK))
        if not chunk:
            break
        claimed += chunk.count(b"{")
        left -= len(chunk)
    most = max_header_entries(nrows, size - 8 - n)
    if claimed > most:
        raise CheckpointCorruptError(
            f"{fpath}: the shard header ({n} bytes) describes up to {claimed} tensors; "
            f"a shard of {nrows} listed tensors and {size - 8 - n} data bytes has "
            f"at most {most}; refused before decoding it")


def _check_rows(fpath: str, header: Dict[str, Any], data_start: int, size: int,
                rows: Sequence[ManifestRow]) -> None:
    """Each of the manifest's ``rows`` is in the header as the manifest says, inside the
    file, and overlaps no other."""
    prev_end, prev_key = data_start, None
    for r in sorted(rows, key=lambda r: (r["offset"], r["nbytes"])):
        h = header.get(r["key"])
        if not isinstance(h, (dict, HeaderEntry)) or _entry_fields(h)[0] is None:
            raise CheckpointCorruptError(f"{fpath}: tensor {clip(r['key'])} missing from the shard header")
        offs, shape, dt = _entry_fields(h)
        if not isinstance(offs, list) or len(offs) != 2 or not all(is_int(x) for x in offs) \
                or not 0 <= offs[0] <= offs[1]:
            raise CheckpointCorruptError(f"{fpath}: tensor {clip(r['key'])}: bad data_offsets "
                                         f"{str(offs)[:100]}")
        a, b = offs
        if data_start + a != r["offset"] or b - a != r["nbytes"] or dt != r["dtype"] \
                or not isinstance(shape, list) or shape != list(r["shape"]):
            raise CheckpointCorruptError(f"{fpath}: tensor {clip(r['key'])}: shard header disagrees "
                                         f"with the manifest")
        if r["offset"] + r["nbytes"] > size:
            raise CheckpointCorruptError(f"{fpath}: truncated: tensor {clip(r['key'])} ends at byte "
                                         f"{r['offset'] + r['nbytes']}, file has {size}")
        if r["nbytes"] and r["offset"] < prev_end:
            raise CheckpointCorruptError(f"{fpath}: tensor {clip(r['key'])} overlaps tensor "
                                         f"{clip(prev_key)}")
        if r["nbytes"]:
            prev_end, prev_key = r["offset"] + r["nbytes"], r["key"]


def by_file(rows: Iterable[ManifestRow]) -> Dict[str, List[ManifestRow]]:
    """Manifest ``rows`` grouped by shard file, each group in file order."""
    out: Dict[str, List[ManifestRow]] = {}
    for r in rows:
        out.setdefault(r["file"], []).append(r)
    for rows in out.values():
        rows.sort(key=lambda r: r["offset"])
    return out
