"""How an NVMeStore's files become checkpoint shards without copying (a linked save hard-
links them, frozen: copy-on-write from then on) and how a checkpoint's shards become its
files (a linked load adopts them): docs/nvme.md, "Checkpoints link the files".

:class:`NVMeLinks` is the store's ``links`` (:class:`~statestore._links.FileLinks`): it decides
which files may be linked and which shards adopted, and reaches the store only through what
the store hands it at construction: its directory, its file table (``files``: path ->
:class:`StateFile`; ``where``: key -> (file, data offset), read here), its write checksums,
its ``in_flight`` and ``spec``, and two operations of the store, ``settle`` (make every file
hold the current value of its states) and ``take`` (register an adopted file)."""
from __future__ import annotations

import bisect
import os
import struct
from typing import Callable, Dict, List, Sequence, Tuple

from .._links import FileLinks
from .._types import LinkableFile, StateKey, StateSpec
from ._nvme_files import ALIGN, StateFile, still_named
from ._space import check_space, reclaimable_bytes

__all__ = ["NVMeLinks"]


class NVMeLinks(FileLinks):
    """An NVMeStore's files as checkpoint shards.

    Args:
        dir: the store's directory.
        files: the store's files by path (read: which files hold which states).
        where: each state's file and data offset (read).
        digests: the store's ``WriteDigests`` (checksums known from puts and loads).
        in_flight: the store's ``InFlightWrites`` (states whose last write failed).
        spec: the store's ``spec(key)``.
        settle: makes every file hold the current value of each state it has (checks the
            files, lets unused successors go, moves partly rewritten frozen files' states to
            their successors, flushes); raises as a read of a damaged file would.
        take: ``take(path, size, header, rows)`` registers the shard at ``path`` (already
            checked here) as a frozen, read-only file of the store; False when it cannot.
    """

    def __init__(self, dir: str, files: Dict[str, StateFile],
                 where: Dict[StateKey, Tuple[StateFile, int]], digests, in_flight,
                 spec: Callable[[StateKey], StateSpec], settle: Callable[[], None],
                 take: Callable[[str, int, bytes, Sequence], bool]):
        self.dir, self.files, self.where, self.digests = dir, files, where, digests
        self.in_flight, self.spec, self.settle, self.take = in_flight, spec, settle, take

    def linkable(self, keys: Sequence[StateKey], root: str, shard_bytes: int) -> List[LinkableFile]:
        try:
            if os.stat(root).st_dev != os.stat(self.dir).st_dev:
                return []           # another filesystem: no hard links
        except OSError:
            return []
        # Every file linked must hold the current value of every state it has; a file
        # truncated (or removed, reported once) under the store raises here, as reading its
        # states for a copy would: a link must never make a damaged file a shard.
        self.settle()
        wanted = set(keys)
        out = []
        linked = []
        for sf in self.files.values():
            if not sf.keys or not sf.keys <= wanted or not still_named(sf):
                continue
            if len(sf.keys) > 1 and sum(self.spec(k).nbytes for k in sf.keys) > shard_bytes:
                continue
            linked.append(sf)
        # After this save, the next write of each linked file's states goes to a new file of
        # the same size (copy-on-write): refuse the save now, before anything is linked,
        # when the filesystem will not have that room once the save removed what it replaces.
        cow = sum(sf.size for sf in self.files.values()
                  if sf.keys and sf.successor is None and (sf.frozen or sf in linked))
        if linked:
            check_space(f"NVMeStore: a checkpoint in {root} linking {linked[0].path}"
                        f"{f' and {len(linked) - 1} more file(s)' if len(linked) > 1 else ''} "
                        f"(the store's next writes then copy them)", self.dir, cow,
                        extra_free=reclaimable_bytes(root))
        for sf in linked:
            rows = sorted(((k, self.where[k][1]) for k in sf.keys), key=lambda r: r[1])
            hashes = dict(sf.hashes)
            hashes.update((k, h) for k, h in self.digests.known(sf.keys).items()
                          if not self.in_flight.is_damaged(k))
            out.append(LinkableFile(rows, hashes, _link_file(sf, hashes)))
        return out

    def adopt(self, path: str, rows: Sequence[Tuple[StateKey, StateSpec, int, str]],
              names: Sequence[str]) -> bool:
        """Take the checkpoint shard ``path`` as a state file by hard link instead of copying
        it, frozen from the start (the store never writes it: its states' writes go to a new
        file, copy-on-write, as after a linked save) and opened read-only. Possible where the
        shard is on this store's filesystem, its size and every tensor's data offset are
        multiples of 4096 (direct I/O; shards a linked save took from an NVMeStore are) and
        it holds exactly ``rows`` (``names``: its tensors, pads excluded). ``rows``:
        ``(key, spec, data offset, checksum)``; the caller verifies the checksums."""
        try:
            st = os.stat(path)
            if st.st_dev != os.stat(self.dir).st_dev:
                return False            # another filesystem: copied
        except OSError:
            return False
        if st.st_size % ALIGN or not _blocks_ok(rows) \
                or sorted(names) != sorted(str(k) for k, _, _, _ in rows):
            return False
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = f.read(n)
        except (OSError, struct.error):
            return False
        header = struct.pack("<Q", n) + header
        if len(header) != 8 + n or any(off < len(header) for _, _, off, _ in rows):
            return False
        return self.take(path, st.st_size, header, rows)


def _link_file(sf: StateFile, hashes: Dict[StateKey, str]):
    def link(dst: str, mapped: bool = False) -> None:
        sf.frozen = True        # first: from here on the store never writes this file
        if mapped:
            sf.mapped = True
        os.link(sf.path, dst)
        sf.hashes = hashes      # frozen bytes: these (and those the save adds) stay valid
    return link


def _blocks_ok(rows) -> bool:
    """The file's states are laid out as the store lays its own out: a state of 4096 bytes
    or more (or none) at a multiple of 4096; a smaller one inside one 4096-byte block, which
    holds no byte of a larger state (docs/nvme.md, "Small states")."""
    big, small = [], []
    for _, spec, off, _ in rows:
        if 0 < spec.nbytes < ALIGN:
            if off // ALIGN != (off + spec.nbytes - 1) // ALIGN:
                return False
            small.append(off // ALIGN)
        elif off % ALIGN:
            return False
        elif spec.nbytes:
            big.append((off // ALIGN, -(-(off + spec.nbytes) // ALIGN)))
    big.sort()
    starts = [a for a, _ in big]
    for b in small:
        i = bisect.bisect_right(starts, b) - 1
        if i >= 0 and big[i][0] <= b < big[i][1]:
            return False
    return True
