"""``FileTable``: an NVMeStore's files and where each state is, the object the store, its
copy-on-write (``_nvme_cow.py``), its packing of small states (``_nvme_packed.py``) and its
links (``_nvme_links.py``) each hold. It creates, registers, retires and removes state files,
keeps a file open while reads of it are in flight, moves a state's record from a frozen file
to its successor, and reads a few bytes of a file synchronously (the bounce copies of
copy-on-write). What is in the files is the store's business: the table never writes a
state's bytes."""
from __future__ import annotations

import errno
import os
import threading
from typing import Dict, List, Optional, Set, Tuple

import torch

from .._types import StateKey
from ..errors import StateStoreIOError
from ..io import IOFile, alloc_buffer
from ._dirs import create_laid_out
from ._nvme_files import COPY_CHUNK, StateFile
from ._space import no_space

__all__ = ["FileTable"]


class FileTable:
    """An NVMeStore's files (module docstring).

    Args:
        dir: the store's directory; files are named ``states-<store_id>-<n>.safetensors``.
        store_id: the store's id in its files' names.
        engine: the store's I/O engine (:meth:`read_sync`).
        direct: ``O_DIRECT`` as the store was given it (None: probe).
        paths: the set of paths the store removes at close or interpreter exit, or None
            when it keeps its files.

    Attributes:
        files: the open files by path.
        where: each state's ``(file, data offset)``; its current value is in that file, or
            for the element ranges in :attr:`cow`, in the file's successor.
        cow: states of a frozen file written in part since: key -> element ranges whose
            current value is in the file's successor (the rest is still in the frozen file).
        version: a number that changes whenever a state gets or loses its place (created,
            removed, loaded, the table closed): the store's ``layout_version``. Moving a
            state to its file's successor keeps its place (same offset and block).
    """

    def __init__(self, dir: str, store_id: str, engine, direct: Optional[bool],
                 paths: Optional[Set[str]]):
        self.dir, self.engine, self.direct = dir, engine, direct
        self._id = store_id
        self._paths = paths
        self._count = 0
        self.files: Dict[str, StateFile] = {}
        self.where: Dict[StateKey, Tuple[StateFile, int]] = {}
        self.cow: Dict[StateKey, List[List[int]]] = {}
        self.version = 0
        self.moves = 0                          # states moved to a successor so far
        self._reads_lock = threading.Lock()     # StateFile.reads: counted across threads
        self._copy_buf = None                   # bounce buffer of read_sync

    def next_path(self) -> str:
        """The path the next file will have (the table counts the files it names)."""
        return os.path.join(self.dir, f"states-{self._id}-{self._count:05d}.safetensors")

    def _name(self) -> str:
        path = self.next_path()
        self._count += 1
        return path

    def _register(self, sf: StateFile) -> StateFile:
        self.files[sf.path] = sf
        if self._paths is not None:
            self._paths.add(sf.path)
        return sf

    def new_file(self, header: bytes, size: int) -> StateFile:
        """Create, reserve (``posix_fallocate``) and open a state file holding ``header``.

        Raises:
            StateStoreIOError: it cannot be created (no space: naming bytes needed and free).
        """
        path = self._name()
        try:
            fd = create_laid_out(path, size, header)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise no_space(f"NVMeStore: cannot create {path}", path, size,
                               code=e.errno) from e
            raise StateStoreIOError(e.errno, f"NVMeStore: cannot create {path} ({size} bytes): "
                                    f"{e.strerror}", path) from e
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError as e:
            os.close(fd)
            try:
                os.unlink(path)
            except OSError:
                pass
            raise StateStoreIOError(e.errno, f"NVMeStore: cannot lay out {path} ({size} bytes): "
                                    f"{e.strerror}", path) from e
        os.close(fd)
        try:
            f = IOFile(path, direct=self.direct)
        except StateStoreIOError:
            os.unlink(path)
            raise
        return self._register(StateFile(path, f, size, header))

    def link_file(self, src: str, size: int, header: bytes) -> Optional[StateFile]:
        """A file of the table hard-linked to ``src`` (a checkpoint's shard): frozen from the
        start, opened read-only; None where the link or the open fails."""
        dst = self._name()
        try:
            os.link(src, dst)
        except OSError:
            return None
        try:
            f = IOFile(dst, readonly=True, direct=self.direct)
        except StateStoreIOError:
            os.unlink(dst)
            return None
        sf = StateFile(dst, f, size, header)
        sf.frozen = sf.readonly = True
        return self._register(sf)

    def successor(self, sf: StateFile) -> StateFile:
        """The frozen ``sf``'s successor (created now when it has none): same layout."""
        if sf.successor is None:
            sf.successor = self.new_file(sf.header, sf.size)
            sf.successor.blocks = sf.blocks
        return sf.successor

    def move_to(self, k: StateKey, new: StateFile) -> None:
        """The current value of ``k`` is now in ``new`` (its file's successor)."""
        old, base = self.where[k]
        if old is new:
            return
        self.cow.pop(k, None)
        self.moves += 1
        self.where[k] = (new, base)
        new.keys.add(k)
        self.leave(old, k)

    def leave(self, sf: StateFile, k: StateKey) -> None:
        """``k``'s current value is no longer in ``sf``: remove the file once none is (and
        its successor, when that never received a whole state)."""
        sf.keys.discard(k)
        sf.hashes.pop(k, None)
        if sf.keys or any(f.successor is sf and f.keys for f in self.files.values()):
            return
        # Closed once no read of it is in flight: a block of small states moves when another
        # unit rewrites it, and a unit reading ahead may still be reading it here.
        self.drop(sf, unlink=True, later=True)
        succ = sf.successor
        if succ is not None and not succ.keys and succ.path in self.files:
            self.drop(succ, unlink=True, later=True)

    def reading(self, sf: StateFile, fut):
        """``fut`` reads ``sf``: ``sf`` stays open until it completes."""
        with self._reads_lock:
            sf.reads += 1
        fut.add_done_callback(lambda _, sf=sf: self._read_done(sf))
        return fut

    def _read_done(self, sf: StateFile) -> None:
        with self._reads_lock:
            sf.reads -= 1
            close = sf.reads == 0 and sf.retired
            sf.retired = sf.retired and not close
        if close:
            _close_file(sf)

    def drop(self, sf: StateFile, unlink: bool, later: bool = False) -> None:
        """Take ``sf`` out of the table and close it (``later``: by its last read in flight);
        ``unlink``: remove it from the directory too."""
        self.files.pop(sf.path, None)
        try:
            with self._reads_lock:
                later = later and sf.reads > 0
                sf.retired = later          # closed by the last read's completion
            if not later:
                _close_file(sf)
        finally:
            if unlink:
                if self._paths is not None:
                    self._paths.discard(sf.path)
                try:
                    os.unlink(sf.path)
                except FileNotFoundError:
                    pass

    def read_sync(self, sf: StateFile, off: int, n: int) -> torch.Tensor:
        """``n`` (<= COPY_CHUNK, aligned) bytes of ``sf`` from ``off``, read now (a buffer
        reused by the next call)."""
        if self._copy_buf is None:
            self._copy_buf = alloc_buffer(COPY_CHUNK, pinned=False)
        buf = self._copy_buf.tensor[:n]
        self.engine.read(sf.file, buf, off, n).result()
        return buf

    def close(self, unlink: bool) -> None:
        """Drop every file (``unlink``: and remove them) and forget every state."""
        for sf in list(self.files.values()):
            self.drop(sf, unlink=unlink)
        self.where.clear()
        self.cow.clear()
        self.version += 1
        self._copy_buf = None


def _close_file(sf: StateFile) -> None:
    try:
        sf.file.close()
    finally:
        if sf.old_file is not None:
            sf.old_file.close()
