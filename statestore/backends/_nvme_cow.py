"""NVMeStore's copy-on-write: a state file a checkpoint links is *frozen* (never written
again); writes of its states go to its *successor*, a new file of the same layout, reserved
before a pipeline hands out its first unit; a state moves there once every element of it was
written, and a frozen file no other name links any more is *thawed* (docs/nvme.md,
"Checkpoints link the files")."""
from __future__ import annotations

import os
from typing import List

from .._types import Slice, StateKey
from ..errors import StateStoreIOError
from ..io import IOFile
from ._nvme_files import ALIGN, COPY_CHUNK, StateFile, add_range, round_up, still_named
from ._space import check_space

__all__ = ["CopyOnWrite"]


class CopyOnWrite:
    """NVMeStore's part that keeps frozen files unchanged (see the module docstring). Uses
    the store's ``_files``, ``_where``, ``_cow``, ``_specs``, ``_engine``, ``_new_file``,
    ``_drop_file``, ``_leave`` and ``_read_sync``."""

    def pipeline(self, units, mode: str = "rw", wait: bool = True):
        # A pipeline that writes reserves what copy-on-write needs before it hands out the
        # first unit: a step then completes or changes nothing, even on a full disk.
        self._check_open()
        if mode != "r":
            self._reserve_successors()
        return super().pipeline(units, mode=mode, wait=wait)

    def _reserve_successors(self) -> None:
        """Give every frozen file that still holds states its successor now (reserved in
        full), so that no write of a step or a put creates a file half-way through. A frozen
        file no checkpoint links any more (its save failed, or the checkpoint was removed:
        only the store's own name is left) is thawed instead: written in place, as before the
        save."""
        need = []
        for sf in list(self._files.values()):
            if not sf.frozen or sf.successor is not None or not sf.keys:
                continue
            try:
                alone = os.fstat(sf.file.fd).st_nlink == 1 and still_named(sf)
            except OSError:
                alone = False
            if alone and not sf.mapped and self._writable(sf):
                sf.frozen = False
                sf.hashes = {}          # bytes of a thawed file change again
            else:
                need.append(sf)
        if not need:
            return
        check_space(f"NVMeStore: copy-on-write of {need[0].path}"
                    f"{f' and {len(need) - 1} more file(s)' if len(need) > 1 else ''}, linked "
                    f"by a checkpoint (new files for the states' next writes)", self.dir,
                    sum(sf.size for sf in need))
        made: List[StateFile] = []
        try:
            for sf in need:
                sf.successor = self._new_file(sf.header, sf.size)
                sf.successor.blocks = sf.blocks
                made.append(sf)
        except BaseException:
            for sf in made:
                succ, sf.successor = sf.successor, None
                self._drop_file(succ, unlink=True)
            raise

    def _writable(self, sf: StateFile) -> bool:
        """Reopen a read-only file for writing (a linked load's shard whose checkpoint is
        gone); False where that fails (the file then stays frozen: copy-on-write)."""
        if not sf.readonly:
            return True
        try:
            f = IOFile(sf.path, direct=self._direct)
        except StateStoreIOError:
            return False
        sf.old_file, sf.file, sf.readonly = sf.file, f, False
        return True

    def _successor(self, sf: StateFile) -> StateFile:
        if sf.successor is None:
            sf.successor = self._new_file(sf.header, sf.size)
            sf.successor.blocks = sf.blocks
        return sf.successor

    def _move(self, k: StateKey) -> None:
        """Every element of ``k`` is now in its frozen file's successor."""
        self._move_to(k, self._where[k][0].successor)

    def _move_to(self, k: StateKey, new: StateFile) -> None:
        """The current value of ``k`` is now in ``new`` (its file's successor)."""
        old, base = self._where[k]
        if old is new:
            return
        self._cow.pop(k, None)
        self._where[k] = (new, base)
        new.keys.add(k)
        self._leave(old, k)

    def _write_into_successor(self, s: Slice) -> StateFile:
        """The file a write of ``s`` goes to while its state's file is frozen."""
        old, _ = self._where[s.key]
        new = self._successor(old)
        ranges = self._cow.setdefault(s.key, [])
        add_range(ranges, s.start, s.stop)
        if ranges == [[0, self._specs[s.key].numel]]:
            self._move(s.key)
        return new

    def _materialize(self, k: StateKey) -> None:
        """Copy the elements of ``k`` still only in its frozen file into the successor and
        move ``k`` there (synchronous, through a small bounce buffer)."""
        old, base = self._where[k]
        if not old.frozen:
            return
        if self._small(self._specs[k].nbytes):
            self._materialize_block(old, base // ALIGN)        # with its whole block
            return
        new = self._successor(old)
        spec = self._specs[k]
        self.in_flight.wait_for(k)
        ranges = self._cow.get(k, [])
        gaps, pos = [], 0
        for a, b in ranges + [[spec.numel, spec.numel]]:
            if a > pos:
                gaps.append((pos, a))
            pos = max(pos, b)
        if gaps:
            self._frozen_reads.verify(old, k)       # its bytes there are the checkpoint's
            self._check_present(new)
            new.dirty = True
        for a, b in gaps:
            lo = base + a * spec.itemsize            # aligned: gaps start at unit starts
            hi = round_up(base + b * spec.itemsize)  # in this state's blocks (layout aligns)
            while lo < hi:
                n = min(COPY_CHUNK, hi - lo)
                self._engine.write(new.file, self._read_sync(old, lo, n), lo, n).result()
                lo += n
        self._move(k)

    def _materialize_file(self, sf: StateFile) -> None:
        for k in sorted(sf.keys, key=lambda k: self._where[k][1]):
            if self._where[k][0] is not sf:
                continue        # moved with its block
            if self._small(self._specs[k].nbytes):
                self._materialize_block(sf, self._where[k][1] // ALIGN)
            else:
                self._materialize(k)

