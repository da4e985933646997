"""Directory set-up shared by the file-backed backends (FileStore, NVMeStore)."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import weakref
from typing import Optional, Tuple

from ..errors import StateStoreIOError, StateStoreValueError

__all__ = ["prepare_dir"]


def _remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def prepare_dir(owner, dir, name: str, prefix: str, check_writable: bool = False
                ) -> Tuple[str, Optional[str], Optional[weakref.finalize]]:
    """Validate and create ``dir`` for the store ``owner`` (``name`` in messages).

    ``dir=None`` makes a temporary directory removed when ``owner`` is collected and at
    interpreter exit. Returns ``(dir, temporary dir or None, its finalizer or None)``.
    """
    if dir is None:
        tmp = tempfile.mkdtemp(prefix=prefix)
        fin = weakref.finalize(owner, _remove_tree, tmp)
        atexit.register(fin)
        return tmp, tmp, fin
    if not isinstance(dir, (str, os.PathLike)):
        raise StateStoreValueError(f"{name}: dir must be a path or None, got {dir!r}")
    dir = os.fspath(dir)
    if os.path.exists(dir) and not os.path.isdir(dir):
        raise StateStoreValueError(f"{name}: dir {dir!r} exists and is not a directory")
    try:
        os.makedirs(dir, exist_ok=True)
    except OSError as e:
        raise StateStoreIOError(e.errno, f"{name}: cannot create directory {dir!r}: "
                                f"{e.strerror}", dir) from e
    if check_writable and not os.access(dir, os.W_OK | os.X_OK):
        raise StateStoreIOError(f"{name}: directory {dir!r} is not writable")
    return dir, None, None
