"""Bounds on what decoding an untrusted manifest may cost, checked before pyarrow decodes it.

A Parquet file tells its reader how much to allocate: the footer gives row counts, each page
header gives the page's uncompressed size and value count. pyarrow trusts them: a 4 KiB
manifest whose page header claims ``uncompressed_page_size = 2**31 - 1`` makes it allocate
2 GiB before decompression fails, and a run-length-encoded page can claim billions of values.
:func:`check_parquet_bounds` reads the footer and every page header with the small Thrift
compact-protocol reader below (not with pyarrow's metadata accessors: on a damaged footer,
``RowGroupMetaData.column()`` lets a C++ exception escape and the interpreter aborts), and
refuses a file where

* a row group or the file declares more than ``len(raw) // MIN_ROW_BYTES`` rows (a real
  manifest row takes far more: a unique key, offset and checksum), or more than
  :data:`MAX_ROWS` (each row becomes Python objects of a few hundred bytes: the bound keeps
  reading a manifest within about 1.5 GiB of RAM, whatever its compression);
* a page declares more than ``MAX_EXPANSION`` times its compressed size (plus
  ``EXPANSION_SLACK`` bytes) once decompressed;
* a page or column chunk declares more values than ``rows * MAX_VALUES_PER_ROW`` (the
  ``shape`` column has one value per dimension, at most :data:`MAX_NDIM`);
* a column chunk lies outside the file, refers to another file, or its pages do not hold the
  values its metadata declares.

String columns are then read dictionary-encoded (see ``checkpoint.read_manifest``), so one
long string repeated on every row is held once, not once per row. Decoding therefore costs a
bounded multiple of the file's size; ``tests/reliability/test_fuzz.py`` measures it.
"""
from __future__ import annotations

from typing import Dict, Tuple

from .._types import MAX_NDIM

__all__ = ["check_parquet_bounds", "ParquetBoundsError", "MAX_NDIM", "MAX_ROWS", "MIN_ROW_BYTES",
           "MAX_EXPANSION"]

#: A manifest declaring more rows than ``size // MIN_ROW_BYTES`` is refused (real manifests
#: use about 20 bytes per row).
MIN_ROW_BYTES = 4
#: Most rows (tensors) a manifest may list; saves of more states are refused before writing.
MAX_ROWS = 2_000_000
#: A page may decompress to at most this many times its stored size, plus EXPANSION_SLACK.
MAX_EXPANSION = 64
EXPANSION_SLACK = 64 * 1024
MAX_VALUES_PER_ROW = MAX_NDIM
_MAX_DEPTH = 16            # nesting of Thrift structs / containers in a page header


class ParquetBoundsError(ValueError):
    """The file's declared sizes exceed the bounds; the message says which."""


class _Truncated(ParquetBoundsError):
    pass


def _varint(b: bytes, pos: int, end: int) -> Tuple[int, int]:
    out = shift = 0
    while True:
        if pos >= end:
            raise _Truncated("truncated page header")
        x = b[pos]
        pos += 1
        out |= (x & 0x7F) << shift
        if not x & 0x80:
            return out, pos
        shift += 7
        if shift > 70:
            raise ParquetBoundsError("malformed varint in a page header")


def _zigzag(n: int) -> int:
    return (n >> 1) ^ -(n & 1)


def _value(b: bytes, pos: int, end: int, t: int, depth: int, in_container: bool):
    """One Thrift compact value of type ``t`` at ``pos``: ``(value, new pos)``: ints, bools,
    dicts for structs, lists for lists and sets; None for doubles, strings and maps."""
    if t in (1, 2):                                # bool: in a field header, or one byte
        if in_container:
            if pos >= end:
                raise _Truncated("truncated page header")
            return b[pos] == 1, pos + 1
        return t == 1, pos
    if t == 3:                                     # byte
        if pos >= end:
            raise _Truncated("truncated page header")
        return b[pos], pos + 1
    if t in (4, 5, 6):                             # i16, i32, i64: zigzag varints
        v, pos = _varint(b, pos, end)
        return _zigzag(v), pos
    if t == 7:                                     # double
        if pos + 8 > end:
            raise _Truncated("truncated page header")
        return None, pos + 8
    if t == 8:                                     # binary / string
        n, pos = _varint(b, pos, end)
        if n > end - pos:
            raise _Truncated("truncated page header")
        return None, pos + n
    if depth >= _MAX_DEPTH:
        raise ParquetBoundsError("page header nested too deeply")
    if t in (9, 10):                               # list, set
        if pos >= end:
            raise _Truncated("truncated page header")
        head = b[pos]
        pos += 1
        n, et = head >> 4, head & 0x0F
        if n == 15:
            n, pos = _varint(b, pos, end)
        if n > end - pos:                          # every element takes at least one byte
            raise _Truncated("truncated page header")
        items = []
        for _ in range(n):
            v, pos = _value(b, pos, end, et, depth + 1, True)
            items.append(v)
        return items, pos
    if t == 11:                                    # map
        n, pos = _varint(b, pos, end)
        if n:
            if pos >= end or n > end - pos:
                raise _Truncated("truncated page header")
            kv = b[pos]
            pos += 1
            for _ in range(n):
                _, pos = _value(b, pos, end, kv >> 4, depth + 1, True)
                _, pos = _value(b, pos, end, kv & 0x0F, depth + 1, True)
        return None, pos
    if t == 12:                                    # struct
        return _struct(b, pos, end, depth + 1)
    raise ParquetBoundsError(f"unknown Thrift type {t} in a page header")


def _struct(b: bytes, pos: int, end: int, depth: int = 0) -> Tuple[Dict[int, object], int]:
    """A Thrift compact struct at ``pos``: ``({field id: value}, new pos)``; nested structs
    are dicts, integers ints, everything else None."""
    fields: Dict[int, object] = {}
    last = 0
    while True:
        if pos >= end:
            raise _Truncated("truncated page header")
        byte = b[pos]
        pos += 1
        t = byte & 0x0F
        if t == 0:
            return fields, pos
        delta = byte >> 4
        if delta:
            fid = last + delta
        else:
            v, pos = _varint(b, pos, end)
            fid = _zigzag(v)
        last = fid
        fields[fid], pos = _value(b, pos, end, t, depth, False)


def _int_field(d: object, fid: int) -> int:
    v = d.get(fid) if isinstance(d, dict) else None
    return v if isinstance(v, int) and not isinstance(v, bool) else -1


def _int(v) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else -1


def _footer(raw: bytes) -> Dict[int, object]:
    """The FileMetaData struct of the Parquet file ``raw``."""
    size = len(raw)
    if size < 12 or raw[:4] != b"PAR1" or raw[-4:] != b"PAR1":
        raise ParquetBoundsError("not a Parquet file (no PAR1 magic)")
    n = int.from_bytes(raw[-8:-4], "little")
    if n > size - 12:
        raise ParquetBoundsError(f"footer of {n} bytes in a file of {size}")
    start = size - 8 - n
    footer, pos = _struct(raw, start, size - 8)
    return footer


def check_parquet_bounds(raw: bytes) -> None:
    """Check the declared sizes of the Parquet file ``raw`` against the bounds of this
    module. Raises :class:`ParquetBoundsError` naming the first violation."""
    size = len(raw)
    max_rows = size // MIN_ROW_BYTES
    fmd = _footer(raw)
    # FileMetaData: 3 num_rows, 4 row_groups; RowGroup: 1 columns, 3 num_rows; ColumnChunk:
    # 1 file_path, 3 meta_data; ColumnMetaData: 5 num_values, 7 total_compressed_size,
    # 9 data_page_offset, 11 dictionary_page_offset.
    num_rows = _int(fmd.get(3))
    if not 0 <= num_rows <= max_rows:
        raise ParquetBoundsError(f"declares {fmd.get(3)} rows in {size} bytes")
    if num_rows > MAX_ROWS:
        raise ParquetBoundsError(f"lists {num_rows} tensors, more than the {MAX_ROWS} a "
                                 f"manifest may list (statestore.checkpoint.MAX_ROWS)")
    groups = fmd.get(4, [])
    if not isinstance(groups, list):
        raise ParquetBoundsError("malformed footer: row groups")
    for g, rg in enumerate(groups):
        if not isinstance(rg, dict) or not isinstance(rg.get(1), list):
            raise ParquetBoundsError(f"malformed footer: row group {g}")
        rows = _int(rg.get(3))
        if not 0 <= rows <= max_rows:
            raise ParquetBoundsError(f"row group {g} declares {rg.get(3)} rows in {size} bytes")
        max_values = max(rows, 1) * MAX_VALUES_PER_ROW
        for c, cc in enumerate(rg[1]):
            where = f"row group {g}, column {c}"
            if not isinstance(cc, dict) or not isinstance(cc.get(3), dict):
                raise ParquetBoundsError(f"{where}: malformed or missing column metadata")
            if 1 in cc:
                raise ParquetBoundsError(f"{where}: data in another file")
            md = cc[3]
            num_values, length = _int(md.get(5)), _int(md.get(7))
            start = _int(md.get(9))
            dict_off = _int(md.get(11))
            if rows == 0 and num_values == 0 and length <= 64:
                continue        # an empty table's row group (a store without states): no pages
            if 0 < dict_off < start:
                start = dict_off
            if start < 4 or length < 0 or start + length > size:
                raise ParquetBoundsError(f"{where}: column chunk [{start}, +{length}) lies "
                                         f"outside the file of {size} bytes")
            if not 0 <= num_values <= max_values:
                raise ParquetBoundsError(f"{where}: declares {md.get(5)} values for "
                                         f"{rows} rows")
            end = start + length
            pos = start
            values = 0
            while pos < end:
                header, pos = _struct(raw, pos, end)
                usize, csize = _int_field(header, 2), _int_field(header, 3)
                if csize < 0 or csize > end - pos:
                    raise ParquetBoundsError(f"{where}: page of {csize} bytes at byte {pos} "
                                             f"overruns its column chunk")
                if usize < 0 or usize > MAX_EXPANSION * csize + EXPANSION_SLACK:
                    raise ParquetBoundsError(f"{where}: page of {csize} bytes claims {usize} "
                                             f"bytes uncompressed")
                for fid in (5, 7, 8):              # data page v1, dictionary page, data page v2
                    if fid in header:
                        nv = _int_field(header[fid], 1)
                        if not 0 <= nv <= max_values:
                            raise ParquetBoundsError(f"{where}: page declares {nv} values for "
                                                     f"{rows} rows")
                        if fid != 7:
                            values += nv
                pos += csize
            if values < num_values:
                raise ParquetBoundsError(f"{where}: pages hold {values} values, the metadata "
                                         f"declares {num_values}")
