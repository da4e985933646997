"""How an NVMeStore's files become checkpoint shards without copying (a linked save hard-
links them, frozen: copy-on-write from then on) and how a checkpoint's shards become its
files (a linked load adopts them): docs/nvme.md, "Checkpoints link the files"."""
from __future__ import annotations

import bisect
import os
import struct
from typing import Dict, List, Sequence, Tuple

from .._types import LinkableFile, StateKey, StateSpec
from ..errors import StateStoreIOError
from ..io import IOFile
from ._nvme_files import ALIGN, StateFile, still_named
from ._space import check_space, reclaimable_bytes

__all__ = ["CheckpointLinks"]


class CheckpointLinks:
    """NVMeStore's part that implements the checkpoint-link hooks of
    :class:`~statestore.StateStore` (``_linkable``, ``_adopt``) on its file tables."""

    def _linkable(self, keys: Sequence[StateKey], root: str, shard_bytes: int) -> List[LinkableFile]:
        try:
            if os.stat(root).st_dev != os.stat(self.dir).st_dev:
                return []           # another filesystem: no hard links
        except OSError:
            return []
        # A file truncated (or removed, reported once) under the store raises here, as reading
        # its states for a copy would: a link must never make a damaged file a shard.
        self._check_files()
        # A successor reserved but never written (no state of its frozen file was written
        # since): let it go, the frozen file is still current and can be linked again.
        for sf in [f for f in self._files.values() if f.frozen and f.successor is not None]:
            succ = sf.successor
            if not succ.keys and not any(k in self._cow for k in sf.keys) \
                    and succ.path in self._files:
                sf.successor = None
                self._drop_file(succ, unlink=True)
        # A frozen file whose states were partly rewritten: move the rest to its successor,
        # so every file linked holds the current value of every state it has.
        for sf in [f for f in self._files.values() if f.frozen and f.successor is not None]:
            self._materialize_file(sf)
        self._flush()
        wanted = set(keys)
        out = []
        linked = []
        for sf in self._files.values():
            if not sf.keys or not sf.keys <= wanted or not still_named(sf):
                continue
            if len(sf.keys) > 1 and sum(self._specs[k].nbytes for k in sf.keys) > shard_bytes:
                continue
            linked.append(sf)
        # After this save, the next write of each linked file's states goes to a new file of
        # the same size (copy-on-write): refuse the save now, before anything is linked,
        # when the filesystem will not have that room once the save removed what it replaces.
        cow = sum(sf.size for sf in self._files.values()
                  if sf.keys and sf.successor is None and (sf.frozen or sf in linked))
        if linked:
            check_space(f"NVMeStore: a checkpoint in {root} linking {linked[0].path}"
                        f"{f' and {len(linked) - 1} more file(s)' if len(linked) > 1 else ''} "
                        f"(the store's next writes then copy them)", self.dir, cow,
                        extra_free=reclaimable_bytes(root))
        for sf in linked:
            rows = sorted(((k, self._where[k][1]) for k in sf.keys), key=lambda r: r[1])
            hashes = dict(sf.hashes)
            hashes.update((k, h) for k, h in self._digests.known(sf.keys).items()
                          if not self.in_flight.is_damaged(k))
            out.append(LinkableFile(rows, hashes, self._link_file(sf, hashes)))
        return out

    def _link_file(self, sf: StateFile, hashes: Dict[StateKey, str]):
        def link(dst: str, mapped: bool = False) -> None:
            sf.frozen = True        # first: from here on the store never writes this file
            if mapped:
                sf.mapped = True
            os.link(sf.path, dst)
            sf.hashes = hashes      # frozen bytes: these (and those the save adds) stay valid
        return link

    def _adopt(self, path: str, rows: Sequence[Tuple[StateKey, StateSpec, int, str]],
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
        dst = os.path.join(self.dir, f"states-{self._id}-{self._nfiles:05d}.safetensors")
        self._nfiles += 1
        try:
            os.link(path, dst)
        except OSError:
            return False
        try:
            f = IOFile(dst, readonly=True, direct=self._direct)
        except StateStoreIOError:
            os.unlink(dst)
            return False
        sf = StateFile(dst, f, st.st_size, header)
        sf.frozen = sf.readonly = True
        self._files[dst] = sf
        if not self.keep_files:
            self._paths.add(dst)
        for k, _, off, checksum in rows:
            self._where[k] = (sf, off)
            sf.keys.add(k)
            sf.hashes[k] = checksum     # verified by the caller, else the load clears us
        self._index_blocks(sf, [(k, spec) for k, spec, _, _ in rows])
        return True


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
