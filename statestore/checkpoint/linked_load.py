"""Loading a checkpoint by linking its shards instead of copying them.

Where a store can take a shard file as its own (the operation ``StateStore.load_checkpoint``
hands the load, backed by ``store.links.adopt``: an
:class:`~statestore.NVMeStore` on the checkpoint's filesystem, for shards whose tensors are
laid out for direct I/O, as those of a linked save are), :func:`link_shards` hard-links it
into the store, frozen: the store never writes it (writes of its states go to a new file,
copy-on-write, as after a linked save), so the checkpoint stays immutable and a resume of
tens of GB costs no disk and no copy. Once the checkpoint is removed, the store's link is the
file's only name and the store writes into it in place (it is reopened for writing). The
checksums are still verified: every linked state is read once through the store's pipeline
(direct I/O, the store's RAM budget) and hashed (:func:`verify_linked`). Other shards, and
other stores or filesystems, are copied as before.
"""
from __future__ import annotations

import json
import struct
from typing import Dict, List

import xxhash

from .._safetensors_layout import PAD_PREFIX
from ..errors import CheckpointCorruptError
from .filesystem import is_local, join
from .format import Manifest, ManifestRow
from .stream import read_states

__all__ = ["link_shards", "verify_linked"]


def _tensor_names(fpath: str) -> List[str]:
    with open(fpath, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return [k for k in header if k != "__metadata__" and not k.startswith(PAD_PREFIX)]


def link_shards(store, adopt, m: Manifest,
                groups: Dict[str, List[ManifestRow]]) -> Dict[str, List[ManifestRow]]:
    """The shards of ``groups`` (rows by file, headers already checked) that ``store`` took
    by hard link (``adopt(path, rows, names)``, the store's operation handed to the load),
    with their rows."""
    if store.resident or not is_local(m.fs):
        return {}
    linked = {}
    for name, rs in groups.items():
        fpath = join(m.root, name)
        try:
            names = _tensor_names(fpath)
        except (OSError, ValueError, struct.error, RecursionError):
            continue                    # copied (and its problem reported) by the caller
        rows = [(r.state_key, r.spec, r.offset, r.checksum) for r in rs]
        if adopt(fpath, rows, names):
            linked[name] = rs
    return linked


def verify_linked(store, m: Manifest, linked: Dict[str, List[ManifestRow]], bar) -> None:
    """Check the checksum of every state taken by link, reading it through the store."""
    for name, rs in linked.items():
        by_key = {r.state_key: r for r in rs}
        hashes = {k: xxhash.xxh3_64() for k in by_key}
        try:
            for k, chunk in read_states(store, list(by_key)):
                hashes[k].update(chunk)
                bar.update(len(chunk))
        except CheckpointCorruptError as e:
            # The store checks what it reads from a file a checkpoint shares (the file it
            # adopted): name the checkpoint's shard, as the check below does.
            raise CheckpointCorruptError(f"{join(m.root, name)}: checksum mismatch in tensor "
                                         f"{getattr(e, 'tensor', '?')!r} (the file was "
                                         f"altered or damaged)") from e
        for k, r in by_key.items():
            if hashes[k].hexdigest() != r.checksum:
                raise CheckpointCorruptError(f"{join(m.root, name)}: checksum mismatch in tensor "
                                             f"{r.key!r} (the file was altered or damaged)")
