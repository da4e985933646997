"""Layout of safetensors files written piecewise (by offset) rather than from tensors in RAM.

``safetensors.torch.save_file`` needs every tensor in memory at once; stores and checkpoints
stream states through a bounded budget, so they write the header themselves and then the
data at known offsets. The file format (spec: github.com/huggingface/safetensors) is an 8-byte
little-endian header length, a JSON header ``{name: {dtype, shape, data_offsets}}`` (offsets
relative to the data start, contiguous, no holes) padded with spaces, then the data.

``align`` pads the header so that data starts at a multiple of ``align`` bytes and, where
``pad_tensors`` is set, inserts ``__pad__/<n>`` U8 tensors so each tensor also starts at a
multiple of ``align`` (direct I/O needs it), or of ``align_for(nbytes)`` when given (a
multiple of ``align``: larger tensors may ask for coarser alignment). Stock ``safe_open``
reads such files; pad tensors are visible to it and ignored by statestore.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ._types import dtype_name

__all__ = ["Entry", "Layout", "layout", "PAD_PREFIX"]

PAD_PREFIX = "__pad__/"


@dataclass(frozen=True)
class Entry:
    """One tensor of a layout: its name, dtype, shape and absolute byte offset in the file."""

    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Layout:
    header: bytes                 # the 8-byte length and the padded JSON header
    entries: Dict[str, Entry]     # by name, in file order (pads excluded)
    file_size: int


def layout(tensors: Sequence[Tuple[str, torch.dtype, Sequence[int]]], align: int = 64,
           pad_tensors: bool = False, metadata: Optional[Dict[str, str]] = None,
           align_for: Optional[Callable[[int], int]] = None,
           stagger: Optional[Tuple[int, int]] = None,
           pack: Optional[Tuple[int, int]] = None) -> Layout:
    """Compute the header and tensor offsets of a safetensors file for ``tensors``
    (``(name, dtype, shape)``, written in this order). With ``pad_tensors``, each tensor of
    ``nbytes`` starts at a multiple of ``align_for(nbytes)`` (default: ``align``); with
    ``stagger=(gap, min_bytes)`` too, a tensor of at least ``min_bytes`` other than the first
    starts ``gap`` bytes (a multiple of the alignment) further on. With ``pack=(block,
    small_align)``, a tensor of 1 to ``block - 1`` bytes is *packed*: it starts at a multiple
    of ``small_align``, never crosses a multiple of ``block`` (file offsets), and shares no
    block with a tensor that is not packed (the first packed tensor after another starts a
    new block)."""
    header: Dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    rel: List[Tuple[str, torch.dtype, Tuple[int, ...], int, int]] = []
    pos = 0
    npad = 0
    # First pass with offsets relative to the data start; alignment of pads depends on the
    # data start too, which depends on the header length: iterate until stable.
    data_start_guess = 0
    for _ in range(4):
        header_body: Dict[str, object] = dict(header)
        rel = []
        pos = 0
        npad = 0
        packed_before = False
        for name, dtype, shape in tensors:
            shape_t = tuple(int(d) for d in shape)
            n = 1
            for d in shape_t:
                n *= d
            nbytes = n * dtype.itemsize
            a = align_for(nbytes) if align_for is not None else align
            packed = pack is not None and 0 < nbytes < pack[0]
            if packed:
                block = pack[0]
                a = pack[1] if packed_before else block
                at = data_start_guess + pos
                at += (-at) % a
                if at // block != (at + nbytes - 1) // block:
                    a = block               # would cross a block: the next one
            packed_before = packed
            if pad_tensors and a > 1:
                gap = (-(data_start_guess + pos)) % a
                if stagger is not None and pos and nbytes >= stagger[1]:
                    gap += stagger[0]
                if gap:
                    pname = f"{PAD_PREFIX}{npad}"
                    header_body[pname] = {"dtype": "U8", "shape": [gap],
                                          "data_offsets": [pos, pos + gap]}
                    npad += 1
                    pos += gap
            header_body[name] = {"dtype": dtype_name(dtype), "shape": list(shape_t),
                                 "data_offsets": [pos, pos + nbytes]}
            rel.append((name, dtype, shape_t, pos, nbytes))
            pos += nbytes
        raw = json.dumps(header_body, separators=(",", ":")).encode()
        data_start = 8 + len(raw)
        data_start += (-data_start) % max(align, 8)
        if data_start == data_start_guess or not pad_tensors:
            break
        data_start_guess = data_start
    raw = raw + b" " * (data_start - 8 - len(raw))
    head = struct.pack("<Q", len(raw)) + raw
    entries = {name: Entry(name, dtype, shape, data_start + off, nbytes)
               for name, dtype, shape, off, nbytes in rel}
    return Layout(head, entries, data_start + pos)
