"""The manifest's own checksum (``docs/checkpoint-format.md``, "Manifest checksum").

Tensor checksums cover tensor bytes; this one covers everything else that decides what a load
does: every value of the manifest's columns (which tensor, which file, where, what shape and
dtype, which tensor checksum) and every key and value of its schema metadata (format fields,
the optimizer metadata JSON: step counts, hyperparameters, parameter names). It is stored in
the schema metadata under :data:`KEY` as 16 lowercase hex digits of xxh3-64 over a canonical
encoding of those *decoded* values, so

* any change to a byte that alters what a reader decodes (a flipped bit in a data page, in the
  key-value metadata, in the embedded Arrow schema that pyarrow reads it from) changes the
  digest, and the manifest is refused;
* a change that alters nothing decoded (statistics, the writer's name, a re-encoding of the
  same rows with other Parquet settings) is harmless by construction, and accepted.

The canonical encoding is JSON (``ensure_ascii``, no spaces) of
``{"columns": [[name, [values...]], ...], "metadata": [[key, value], ...]}``, columns in the
format's order (a version-2 manifest's two region columns after the nine), metadata sorted by
key, the checksum key itself left out.
"""
from __future__ import annotations

import json
from typing import Iterable, List, Mapping

import xxhash

from .format import COLUMNS, REGION_COLUMNS

__all__ = ["KEY", "manifest_digest", "sealed"]

KEY = "statestore.manifest_checksum"
_CHUNK = 4096


def manifest_digest(names: Iterable[str], columns: Mapping[str, List],
                    metadata: Mapping[str, str]) -> str:
    """xxh3-64 (hex) of the columns ``names`` of ``columns`` and of ``metadata`` (without
    :data:`KEY`)."""
    # The JSON text is hashed as it is encoded, _CHUNK values at a time: the same bytes as
    # json.dumps of the whole payload, without holding them (or the encoder's list of
    # pieces: ~40 bytes a value) for a manifest of millions of rows.
    enc = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    h = xxhash.xxh3_64()

    def update(text: str) -> None:
        h.update(text.encode("ascii"))

    update('{"columns":[')
    for i, n in enumerate(names):
        update(("," if i else "") + "[" + enc.encode(n) + ",[")
        values = columns[n]
        for a in range(0, len(values), _CHUNK):
            update(("," if a else "") + enc.encode(list(values[a:a + _CHUNK]))[1:-1])
        update("]]")
    update('],"metadata":' + enc.encode(sorted([k, v] for k, v in metadata.items()
                                               if k != KEY)) + "}")
    return h.hexdigest()


def sealed(table):
    """``table`` (a manifest as a ``pyarrow.Table``) with its checksum recomputed over its
    current rows and metadata: for tools (and tests) that rewrite a manifest on purpose."""
    meta = {k.decode(errors="replace"): v.decode(errors="replace")
            for k, v in (table.schema.metadata or {}).items()}
    names = [n for n in COLUMNS + REGION_COLUMNS if n in table.column_names]
    columns = {n: table.column(n).to_pylist() for n in names}
    meta[KEY] = manifest_digest(names, columns, meta)
    return table.replace_schema_metadata(meta)
