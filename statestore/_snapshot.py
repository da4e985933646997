"""Every state of a store as CPU tensors without holding them in RAM: what
``state_dict()`` returns for disk stores.

Resident stores hand out views of their live states (as torch's optimizers return their own
state tensors). For a disk store, the states' files are snapshotted the way a linked checkpoint
takes them (``store.links.linkable``): each file is frozen (the store never writes it
again: later writes of its states go to a new file, copy-on-write) and memory-mapped
privately, so the returned tensors are the values at the time of the call, cost no RAM until
read (their pages are the kernel's page cache, evictable) and no disk beyond the files the
store would otherwise have overwritten. States in files that cannot be taken whole (shared
with states of other keys, or on a filesystem without hard links) are streamed, a chunk at a
time through the store's RAM budget, into a temporary file of only their size, mapped the same
way. Nothing is ever materialized as a whole.

Disk: while the returned tensors live, the snapshotted files stay on disk (unlinked) next to
the ones the store writes after it: up to twice the states' bytes, as after a linked
checkpoint.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Dict, List, Optional, Sequence

import torch

from ._types import StateKey

__all__ = ["export_states", "unlinked_buffer"]

_NO_SHARD_LIMIT = 1 << 62


def _disk_dir(store) -> Optional[str]:
    """A directory on the filesystem of the store's files (None: the store has none)."""
    d = getattr(store, "dir", None)
    if isinstance(d, str) and os.path.isdir(d):
        return d
    for t in getattr(store, "tiers", ()) or ():
        d = _disk_dir(t)
        if d is not None:
            return d
    return None


def _map(path: str, size: int) -> torch.Tensor:
    """``path``'s bytes, mapped privately (writes to the tensor never reach the file)."""
    return torch.from_file(path, shared=False, size=max(size, 1), dtype=torch.uint8)


def _linked(store, keys: Sequence[StateKey], out: Dict[StateKey, torch.Tensor]) -> None:
    """Map the store's files that hold only states of ``keys`` (frozen by the link)."""
    root = _disk_dir(store)
    if root is None:
        return
    tmp = tempfile.mkdtemp(prefix=".state_dict-", dir=root)
    try:
        for i, lf in enumerate(store.links.linkable(list(keys), tmp, _NO_SHARD_LIMIT)):
            dst = os.path.join(tmp, f"{i:05d}.safetensors")
            try:
                lf.link(dst, mapped=True)   # frozen for good: the mapping reads its pages
            except (OSError, TypeError):
                continue            # copied by the caller
            try:
                flat = _map(dst, os.path.getsize(dst))
            finally:
                os.unlink(dst)      # the mapping keeps the file's data
            for k, off in lf.rows:
                spec = store.spec(k)
                out[k] = flat[off:off + spec.nbytes].view(spec.dtype).view(spec.shape)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def unlinked_buffer(nbytes: int, directory: str, prefix: str) -> torch.Tensor:
    """``nbytes`` (at least 1) of zero bytes, a shared mapping of a sparse temporary file made
    in ``directory`` (its name starting with ``prefix``) and unlinked at once: no RAM until
    written, the kernel loads and evicts its pages, the disk is freed with the last reference."""
    fd, path = tempfile.mkstemp(prefix=prefix, dir=directory)
    try:
        os.ftruncate(fd, max(nbytes, 1))
        return torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)
    finally:
        os.close(fd)
        os.unlink(path)


def _copied(store, keys: List[StateKey]) -> Dict[StateKey, torch.Tensor]:
    """Stream ``keys`` into an unlinked temporary file of their size and map it."""
    out: Dict[StateKey, torch.Tensor] = {}
    offsets, pos = {}, 0
    for k in keys:
        offsets[k] = pos
        pos += store.spec(k).nbytes
        pos += (-pos) % 64
    directory = _disk_dir(store) or tempfile.gettempdir()
    flat = unlinked_buffer(pos, directory, ".state_dict-")
    dst = {}
    for k in keys:
        spec = store.spec(k)
        dst[k] = flat[offsets[k]:offsets[k] + spec.nbytes].view(spec.dtype).view(-1)
    with store.stream(keys, "r") as chunks:     # reads ahead across states
        for s, t in chunks:
            piece = dst[s.key][s.start:s.stop]
            piece.copy_(t)
            _drop_pages(piece)      # RSS stays at a chunk, not the states
    for k in keys:
        out[k] = dst[k].view(store.spec(k).shape)
    return out


def _drop_pages(piece: torch.Tensor) -> None:
    """Unmap the pages of a piece of a shared file mapping just written: their data stays in
    the file (the kernel keeps dirty pages of shared mappings), and without it every state
    copied would count in the process's RSS."""
    try:
        import ctypes
        import mmap
        page = mmap.PAGESIZE
        start = piece.data_ptr() // page * page
        end = -(-(piece.data_ptr() + piece.numel() * piece.element_size()) // page) * page
        if end > start:
            ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start),
                                      4)       # MADV_DONTNEED
    except Exception:
        pass


def export_states(store, keys: Sequence[StateKey]) -> Dict[StateKey, torch.Tensor]:
    """Values of ``keys`` as CPU tensors (resident stores: live views) without holding every
    state in RAM; see the module docstring."""
    if store.resident:
        return {k: store.get(k) for k in keys}
    store.sync()
    out: Dict[StateKey, torch.Tensor] = {}
    if not keys:
        return out
    _linked(store, keys, out)
    rest = [k for k in keys if k not in out]
    if rest:
        out.update(_copied(store, rest))
    return {k: out[k] for k in keys}
