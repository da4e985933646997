"""Parquet files damaged on purpose: the manifest's bytes as an attacker would write them
(``tests/reliability/test_bad_input.py``, ``test_fuzz.py``)."""
from __future__ import annotations

import io

import pyarrow.parquet as pq


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        x, n = n & 0x7F, n >> 7
        out.append(x | (0x80 if n else 0))
        if not n:
            return bytes(out)


def page_bomb(raw: bytes, claimed: int = 2 ** 31 - 1) -> bytes:
    """``raw`` (a Parquet file) with its first column chunk's first page header claiming
    ``claimed`` uncompressed bytes: pyarrow allocates that much before decompressing."""
    md = pq.ParquetFile(io.BytesIO(raw)).metadata
    col = md.row_group(0).column(0)
    off = col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset
    assert raw[off] == 0x15                       # field 1 (type), i32
    i = off + 1
    while raw[i] & 0x80:
        i += 1
    i += 1
    assert raw[i] == 0x15                         # field 2 (uncompressed_page_size), i32
    j = i + 1
    while raw[j] & 0x80:
        j += 1
    return raw[:i + 1] + varint(claimed << 1) + raw[j + 1:]
