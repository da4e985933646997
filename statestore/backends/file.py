"""``FileStore``: states in mmap'd safetensors files; the OS page cache does the I/O."""
from __future__ import annotations

import errno
import os
import uuid
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from .._safetensors_layout import layout
from .._types import StateKey, StateSpec
from ..errors import StateStoreIOError
from ._dirs import StoreLock, create_laid_out, prepare_dir
from ._slab import STAGGER, STAGGER_MIN, SlabStore

__all__ = ["FileStore"]


class _SlabFile:
    __slots__ = ("fd", "size", "removed_reported")

    def __init__(self, fd: int, size: int):
        self.fd, self.size = fd, size       # an open descriptor: fsync, fstat (size, links)
        self.removed_reported = False


class FileStore(SlabStore):
    """States in memory-mapped safetensors files under ``dir``.

    Each batch of states created together is one file ``states-<store id>-<n>.safetensors``,
    valid for stock ``safetensors.safe_open`` at any time (its header is written first; data
    is mapped ``MAP_SHARED``). :meth:`sync` (called by checkpoints and ``close``) flushes
    the mappings with ``fsync``. The store's files are removed on ``close()`` unless
    ``keep_files=True``; ``dir=None`` uses a temporary directory removed on close and at
    interpreter exit. Files are reserved in full at creation (a full disk raises
    ``StateStoreIOError`` then, not SIGBUS mid-step); a file removed under the store is
    reported once, a truncated one before every access (``docs/reliability.md``).
    """

    def __init__(self, dir: Optional[str] = None, *, keep_files: bool = False, **kwargs):
        super().__init__(**kwargs)
        dir, self._tmp, self._finalizer = prepare_dir(self, dir, "FileStore", "statestore-file-",
                                                      check_writable=True)
        self.dir = dir
        self.keep_files = keep_files
        self._id = uuid.uuid4().hex[:8]
        # Held while open; if this process dies without close(), a store started later in
        # this directory reclaims the files (_dirs.py).
        self._lock = None if keep_files and self._tmp is None else StoreLock(dir, self._id)
        self._nfiles = 0
        self._files: Dict[str, _SlabFile] = {}

    def _new_slab(self, entries: Sequence[Tuple[StateKey, StateSpec]]):
        lay = layout([(str(k), spec.dtype, spec.shape) for k, spec in entries], align=64,
                     pad_tensors=True, metadata={"format": "statestore-filestore"},
                     stagger=(STAGGER, STAGGER_MIN))
        path = os.path.join(self.dir, f"states-{self._id}-{self._nfiles:05d}.safetensors")
        self._nfiles += 1
        size = max(lay.file_size, 1)
        fd = -1
        try:
            # Every byte reserved now: a sparse file on a full disk would raise SIGBUS at the
            # first store into a page of the mapping, in the middle of a step.
            fd = create_laid_out(path, size, lay.header)
            buf = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        except (OSError, RuntimeError) as e:
            if fd >= 0:
                os.close(fd)
                try:
                    os.unlink(path)
                except OSError:
                    pass
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                from ._space import no_space     # bytes needed and free
                raise no_space(f"FileStore: cannot create {path}", path, size,
                               code=e.errno) from e
            if isinstance(e, OSError):
                raise StateStoreIOError(e.errno, f"FileStore: cannot create {path} ({size} bytes): "
                                        f"{e.strerror}", path) from e
            raise StateStoreIOError(f"FileStore: cannot map {path}: {e}") from e
        self._files[path] = _SlabFile(fd, lay.file_size)
        offsets = {k: lay.entries[str(k)].offset for k, _ in entries}
        return buf, path, offsets

    def _release_slab(self, buffer: torch.Tensor, handle: Any) -> None:
        sf = self._files.pop(handle, None)
        if sf is not None:
            os.close(sf.fd)
        if not self.keep_files:
            try:
                os.unlink(handle)
            except FileNotFoundError:
                pass

    def _check_files(self) -> None:
        # A file truncated under the mapping would raise SIGBUS at the first access past its
        # end: refuse instead, every time (those states are gone). A removed file is reported
        # once: its states live on in the mapping until close(), so a checkpoint keeps them.
        for path, sf in list(self._files.items()):
            size = self._fstat(path, sf).st_size
            if size < sf.size:
                raise StateStoreIOError(
                    errno.EIO, f"FileStore: state file {path} was truncated to {size} bytes "
                    f"while the store was open (it had {sf.size}); the states past that point are "
                    "lost: load a checkpoint", path)
            self._check_present(path, sf)

    @staticmethod
    def _fstat(path: str, sf: _SlabFile) -> os.stat_result:
        try:
            return os.fstat(sf.fd)
        except OSError as e:
            raise StateStoreIOError(e.errno, f"FileStore: fstat of {path} failed: {e.strerror}",
                                    path) from e

    def _check_present(self, path: str, sf: _SlabFile) -> None:
        if not sf.removed_reported and self._fstat(path, sf).st_nlink == 0:
            sf.removed_reported = True
            raise StateStoreIOError(
                errno.ENOENT, f"FileStore: state file {path} was removed while the store was "
                "open; its states live on in the mapping until close(), save a checkpoint to "
                "keep them", path)

    def _flush(self) -> None:
        for path, sf in list(self._files.items()):
            self._check_present(path, sf)
            try:
                os.fsync(sf.fd)
            except OSError as e:
                raise StateStoreIOError(e.errno, f"FileStore: fsync of {path} failed: {e.strerror}",
                                        path) from e

    def _close(self) -> None:
        try:
            super()._close()
        finally:
            if self._lock is not None:
                self._lock.release()
            if self._finalizer is not None:
                self._finalizer()

    def files(self):
        """Paths of the store's safetensors files."""
        return list(self._files)

    def _backend_stats(self) -> Dict[str, Any]:
        return {"dir": self.dir, "files": len(self._files),
                "disk_bytes": sum(sf.size for sf in self._files.values())}
