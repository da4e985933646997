"""``FileStore``: states in mmap'd safetensors files; the OS page cache does the I/O."""
from __future__ import annotations

import os
import uuid
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from .._safetensors_layout import layout
from .._types import StateKey, StateSpec
from ..errors import StateStoreIOError
from ._dirs import prepare_dir
from ._slab import SlabStore

__all__ = ["FileStore"]


class FileStore(SlabStore):
    """States in memory-mapped safetensors files under ``dir``.

    Each batch of states created together is one file ``states-<store id>-<n>.safetensors``,
    valid for stock ``safetensors.safe_open`` at any time (its header is written first; data
    is mapped ``MAP_SHARED``). :meth:`sync` (called by checkpoints and ``close``) flushes
    the mappings with ``fsync``. The store's files are removed on ``close()`` unless
    ``keep_files=True``; ``dir=None`` uses a temporary directory removed on close and at
    interpreter exit.
    """

    def __init__(self, dir: Optional[str] = None, *, keep_files: bool = False, **kwargs):
        super().__init__(**kwargs)
        dir, self._tmp, self._finalizer = prepare_dir(self, dir, "FileStore", "statestore-file-",
                                                      check_writable=True)
        self.dir = dir
        self.keep_files = keep_files
        self._id = uuid.uuid4().hex[:8]
        self._nfiles = 0
        self._files: Dict[str, int] = {}       # path -> size

    def _new_slab(self, entries: Sequence[Tuple[StateKey, StateSpec]]):
        lay = layout([(str(k), spec.dtype, spec.shape) for k, spec in entries], align=64,
                     pad_tensors=True, metadata={"format": "statestore-filestore"})
        path = os.path.join(self.dir, f"states-{self._id}-{self._nfiles:05d}.safetensors")
        self._nfiles += 1
        try:
            with open(path, "wb") as f:
                f.write(lay.header)
                f.truncate(lay.file_size)        # sparse zeros for the data
            buf = torch.from_file(path, shared=True, size=max(lay.file_size, 1), dtype=torch.uint8)
        except OSError as e:
            raise StateStoreIOError(e.errno, f"FileStore: cannot create {path}: {e.strerror}") from e
        except RuntimeError as e:
            raise StateStoreIOError(f"FileStore: cannot map {path}: {e}") from e
        self._files[path] = lay.file_size
        offsets = {k: lay.entries[str(k)].offset for k, _ in entries}
        return buf, path, offsets

    def _release_slab(self, buffer: torch.Tensor, handle: Any) -> None:
        self._files.pop(handle, None)
        if not self.keep_files:
            try:
                os.unlink(handle)
            except FileNotFoundError:
                pass

    def _flush(self) -> None:
        for path in list(self._files):
            try:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as e:
                raise StateStoreIOError(e.errno, f"FileStore: fsync of {path} failed: {e.strerror}") from e

    def _close(self) -> None:
        super()._close()
        if self._finalizer is not None:
            self._finalizer()

    def files(self):
        """Paths of the store's safetensors files."""
        return list(self._files)

    def _backend_stats(self) -> Dict[str, Any]:
        return {"dir": self.dir, "files": len(self._files),
                "disk_bytes": sum(self._files.values())}
