"""NVMeStore's state files: the record of one open file (its states, copy-on-write
successor, checksums), where a state's data starts in it, and the element-range helpers of
copy-on-write (docs/nvme.md, "File layout")."""
from __future__ import annotations

import errno
import os
from concurrent.futures import Future
from typing import Dict, List, Optional

from .._types import StateKey
from ..errors import StateStoreIOError
from ..io import IOFile
from ._futures import when_all

__all__ = ["ALIGN", "COPY_CHUNK", "MAX_DATA_ALIGN", "MAX_FILE_DATA", "StateFile", "add_range",
           "after_both", "check_present", "check_size", "covered", "data_alignment", "round_up",
           "still_named", "unlink_all"]

ALIGN = 4096
# Most bytes of states in one file (a larger state gets a file of its own): the default bound
# of a checkpoint shard (checkpoint.DEFAULT_SHARD_BYTES), so a checkpoint can link the files.
MAX_FILE_DATA = 2 << 30
COPY_CHUNK = 1 << 20       # bounce buffer of copy-on-write copies
# Where a state's data starts in its file: a multiple of 4096 (direct I/O), and for larger
# states of up to MAX_DATA_ALIGN, the largest power of two at most 1/32 of its size (<= 3%
# of padding). Disks are faster with data that was written in requests aligned to their
# internal granularity (64 KiB on the development host's virtual disk: data written from 4 KiB
# offsets read back 7-8% slower); see docs/nvme.md, "Alignment of the data".
MAX_DATA_ALIGN = 1 << 20


def data_alignment(nbytes: int) -> int:
    a = ALIGN
    while a < MAX_DATA_ALIGN and a * 2 * 32 <= nbytes:
        a *= 2
    return a


def add_range(ranges: List[List[int]], a: int, b: int) -> None:
    """Merge ``[a, b)`` into the sorted, disjoint ``ranges``."""
    out: List[List[int]] = []
    for r in ranges:
        if r[1] < a or r[0] > b:
            out.append(r)
        else:
            a, b = min(a, r[0]), max(b, r[1])
    out.append([a, b])
    out.sort()
    ranges[:] = out


def covered(ranges: List[List[int]], a: int, b: int) -> int:
    """Elements of ``[a, b)`` inside ``ranges``."""
    return sum(max(0, min(b, r[1]) - max(a, r[0])) for r in ranges)


def round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def unlink_all(paths: set) -> None:
    for p in list(paths):
        try:
            os.unlink(p)
        except OSError:
            pass
    paths.clear()


def after_both(write: Future, other: Optional[Future]) -> Future:
    """A future with ``write``'s outcome that completes once ``other`` has completed too (the
    ring buffer of a write is reused only after its checksum job has read it)."""
    if other is None:
        return write

    def finish(out: Future) -> None:
        err = write.exception()
        if err is not None:
            out.set_exception(err)
        else:
            out.set_result(write.result())

    return when_all([write, other], finish)


class StateFile:
    """One open state file of an NVMeStore."""

    __slots__ = ("path", "file", "size", "header", "keys", "removed_reported", "dirty",
                 "frozen", "successor", "hashes", "mapped", "readonly", "old_file", "blocks",
                 "reads", "retired")

    def __init__(self, path: str, file: IOFile, size: int, header: bytes):
        self.path, self.file, self.size, self.header = path, file, size, header
        self.keys: set = set()          # live states whose current value is in this file
        self.removed_reported = False
        self.dirty = False              # written since the last fsync
        # Frozen: a checkpoint links this file, so the store never writes it again; writes of
        # its states go to ``successor`` (same layout), and a state moves there once every
        # element of it was written (``FileTable.cow``, _nvme_table.py). ``hashes``:
        # checksums of its states' data, valid for as long as they stay here (frozen bytes
        # never change).
        self.frozen = False
        self.successor: Optional["StateFile"] = None
        self.hashes: Dict[StateKey, str] = {}
        # Mapped by a ``state_dict()`` snapshot (statestore/_snapshot.py): never thawed, even
        # once no checkpoint links it, since the snapshot's tensors read its pages.
        self.mapped = False
        # Opened read-only (a checkpoint's shard taken by a linked load); ``old_file``: that
        # descriptor, kept open for reads in flight, once the file was reopened for writing
        # (thawed after the checkpoint was removed).
        self.readonly = False
        self.old_file: Optional[IOFile] = None
        # block index -> the small states packed into that 4 KiB block (_nvme_packed.py);
        # the same dict for a frozen file and its successor (same layout)
        self.blocks: Dict[int, List[StateKey]] = {}
        # reads in flight (FileTable.reading); a file dropped meanwhile is ``retired`` and
        # closed by the last of them
        self.reads = 0
        self.retired = False


def still_named(sf: StateFile) -> bool:
    """``sf.path`` still names the open file (it was not removed or replaced)."""
    try:
        a, b = os.stat(sf.path), os.fstat(sf.file.fd)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def check_present(sf: StateFile) -> None:
    """Raise (once per file) when ``sf`` was removed while the store is open."""
    if sf.removed_reported:
        return
    try:
        nlink = os.fstat(sf.file.fd).st_nlink
    except OSError as e:
        raise StateStoreIOError(e.errno, f"NVMeStore: fstat of {sf.path} failed: {e.strerror}",
                                sf.path) from e
    if nlink == 0:
        sf.removed_reported = True
        raise StateStoreIOError(errno.ENOENT, f"NVMeStore: state file {sf.path} was removed "
                                "while the store was open; its states live on in the open "
                                "file until close(), save a checkpoint to keep them", sf.path)


def check_size(sf: StateFile) -> None:
    """Raise when ``sf`` was truncated under the open store (its states past the end are
    lost)."""
    try:
        size = os.fstat(sf.file.fd).st_size
    except OSError as e:
        raise StateStoreIOError(e.errno, f"NVMeStore: fstat of {sf.path} failed: "
                                f"{e.strerror}", sf.path) from e
    if size < sf.size:
        raise StateStoreIOError(
            errno.EIO, f"NVMeStore: state file {sf.path} was truncated to {size} bytes "
            f"while the store was open (it had {sf.size}); the states past that point "
            "are lost: load a checkpoint", sf.path)
