"""Checks of whole checkpoint files beyond their listed tensors (``docs/errors.md``,
"Untrusted checkpoint bytes"; ``docs/checkpoint-format.md``, "What verify checks").

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

import os
import stat
from typing import Any, Dict, List, Tuple

from ._safetensors_layout import PAD_PREFIX
from ._types import dtype_from_name
from .errors import CheckpointCorruptError

__all__ = ["MAX_MANIFEST_BYTES", "check_local_file", "check_layout", "pad_ranges",
           "check_zeros"]

#: Largest manifest read (bytes): about two million tensors' rows. A larger
#: ``manifest.parquet`` is refused before a byte of it is read.
MAX_MANIFEST_BYTES = 256 << 20
_ZERO_CHUNK = 1 << 20


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
        if not isinstance(h, dict):
            raise CheckpointCorruptError(f"{fpath}: bad safetensors header: entry {name!r} is "
                                         f"not an object")
        offs, shape, dt = h.get("data_offsets"), h.get("shape"), h.get("dtype")
        if not isinstance(offs, list) or len(offs) != 2 or not all(_is_int(x) for x in offs) \
                or not 0 <= offs[0] <= offs[1]:
            raise CheckpointCorruptError(f"{fpath}: tensor {name!r}: bad data_offsets "
                                         f"{str(offs)[:100]}")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise CheckpointCorruptError(f"{fpath}: tensor {name!r}: bad shape {str(shape)[:100]}")
        try:
            itemsize = dtype_from_name(dt).itemsize
        except (ValueError, TypeError, KeyError):
            raise CheckpointCorruptError(f"{fpath}: tensor {name!r}: unknown dtype "
                                         f"{str(dt)[:40]!r}") from None
        n = itemsize
        for d in shape:
            n *= d
        if n != offs[1] - offs[0]:
            raise CheckpointCorruptError(f"{fpath}: tensor {name!r}: data_offsets span "
                                         f"{offs[1] - offs[0]} bytes, shape and dtype give {n}")
        spans.append((offs[0], offs[1], name))
    spans.sort()
    pos, prev = 0, None
    for a, b, name in spans:
        if a != pos:
            what = "a hole" if a > pos else "an overlap"
            raise CheckpointCorruptError(
                f"{fpath}: bad safetensors layout: tensor {name!r} starts at data byte {a}, "
                f"{'tensor ' + repr(prev) if prev else 'the data start'} ends at {pos} ({what})")
        pos, prev = b, name
    end = data_start + pos
    if size != end:
        how = "truncated" if size < end else "extended"
        raise CheckpointCorruptError(f"{fpath}: {how}: the file has {size} bytes, its header "
                                     f"describes {end}")


def pad_ranges(header: Dict[str, Any], data_start: int) -> List[Tuple[int, int]]:
    """``(absolute offset, bytes)`` of the shard's pad tensors, in file order."""
    out = [(data_start + h["data_offsets"][0], h["data_offsets"][1] - h["data_offsets"][0])
           for name, h in header.items() if name.startswith(PAD_PREFIX) and isinstance(h, dict)]
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
