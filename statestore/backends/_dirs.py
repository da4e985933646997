"""Directory set-up shared by the file-backed backends (FileStore, NVMeStore, TensorNVMeStore).

**Files of stores that never closed.** A store that dies without ``close()`` (``kill -9``, a
crash, an out-of-memory kill) leaves its state files behind: as large as the optimizer states,
and nothing would ever remove them, so a job that restarts after each crash fills its disk.
Each open store therefore holds a lock file ``<dir>/.statestore-<store id>.lock`` (an
exclusive ``flock``, released by the kernel when the process dies, whatever the cause), and
every new store first reclaims what dead ones left in its directory: the files
``states-<id>-*.safetensors`` (a TensorNVMeStore's: ``states-<id>-tensornvme``) of every lock
file nobody holds, then the lock file (a
``RuntimeWarning`` says what was removed). Temporary directories (``dir=None``) of dead
stores are removed likewise. Never touched: files of live stores (their lock is held), and
anything without a lock file: files of ``keep_files=True`` stores (which take no lock),
other programs' files, stores of older versions.
"""
from __future__ import annotations

import atexit
import errno
import fcntl
import glob
import os
import re
import shutil
import tempfile
import warnings
import weakref
from typing import Optional, Tuple

from ..errors import StateStoreIOError, StateStoreValueError

__all__ = ["prepare_dir", "StoreLock", "reclaim_stale", "create_laid_out"]

_LOCK = re.compile(r"^\.statestore-([0-9a-f]+)\.lock(\.[0-9]+\.tmp)?$")


def _remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


class StoreLock:
    """``<directory>/.statestore-<store_id>.lock``, exclusively ``flock``\\ ed while the store
    is open; :meth:`release` (at ``close()``) removes it. The file appears already locked (it
    is locked under a temporary name, then renamed), so no other store can mistake it for a
    dead one's."""

    def __init__(self, directory: str, store_id: str):
        self.path = os.path.join(directory, f".statestore-{store_id}.lock")
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                         0o644)
        except OSError as e:
            raise StateStoreIOError(e.errno, f"cannot create the lock file {tmp}: {e.strerror}",
                                    tmp) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.rename(tmp, self.path)
        except OSError as e:
            os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise StateStoreIOError(e.errno, f"cannot create the lock file {self.path}: "
                                    f"{e.strerror}", self.path) from e
        self.fd = fd

    def __del__(self) -> None:
        # The store was dropped without close(): let go of the lock (its file stays, so a
        # later store reclaims what was left), not of the descriptor number.
        if getattr(self, "fd", -1) >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1

    def release(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            finally:
                os.close(fd)


def _dead_lock(path: str):
    """An open descriptor of lock file ``path``, exclusively locked by us, when its store is
    dead; else None."""
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # Still the file at that name? (Another store may have reclaimed it meanwhile.)
        if os.fstat(fd).st_ino == os.stat(path).st_ino:
            return fd
    except OSError:         # locked by a live store (EWOULDBLOCK), or gone
        pass
    os.close(fd)
    return None


def reclaim_stale(directory: str) -> Tuple[int, int]:
    """Remove the state files and lock files of stores that died without closing in
    ``directory`` (see the module docstring). Returns ``(files, bytes)`` removed."""
    nfiles = nbytes = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0, 0
    for name in names:
        m = _LOCK.match(name)
        if not m:
            continue
        path = os.path.join(directory, name)
        fd = _dead_lock(path)
        if fd is None:
            continue
        try:
            if not m.group(2):      # a complete lock file: its store's files go
                for f in (glob.glob(os.path.join(directory, f"states-{m.group(1)}-*.safetensors"))
                          + glob.glob(os.path.join(directory, f"states-{m.group(1)}-tensornvme"))):
                    try:
                        size = os.stat(f).st_size
                        os.unlink(f)
                    except OSError:
                        continue
                    nfiles += 1
                    nbytes += size
            os.unlink(path)
        except OSError:
            pass
        finally:
            os.close(fd)
    return nfiles, nbytes


def _reclaim_temporary_dirs(parent: str, prefix: str, mine: str) -> Tuple[int, int]:
    """Remove ``parent/<prefix>*`` directories (``dir=None`` stores) whose store is dead: each
    holds exactly one lock file, and nobody holds it."""
    nfiles = nbytes = 0
    for d in glob.glob(os.path.join(parent, prefix + "*")):
        if d == mine or not os.path.isdir(d):
            continue
        try:
            locks = [n for n in os.listdir(d) if _LOCK.match(n) and n.endswith(".lock")]
        except OSError:
            continue
        if len(locks) != 1:
            continue
        fd = _dead_lock(os.path.join(d, locks[0]))
        if fd is None:
            continue
        try:
            for r, _, fs in os.walk(d):
                for f in fs:
                    try:
                        nbytes += os.stat(os.path.join(r, f)).st_size
                    except OSError:
                        pass
                    nfiles += 1
            shutil.rmtree(d, ignore_errors=True)
        finally:
            os.close(fd)
    return nfiles, nbytes


def _warn_reclaimed(where: str, nfiles: int, nbytes: int) -> None:
    if nfiles:
        warnings.warn(f"statestore: removed {nfiles} file(s), {nbytes / 2**20:.1f} MiB, left in "
                      f"{where} by a store that was never closed (a killed or crashed process)",
                      RuntimeWarning, stacklevel=4)


def prepare_dir(owner, dir, name: str, prefix: str, check_writable: bool = False
                ) -> Tuple[str, Optional[str], Optional[weakref.finalize]]:
    """Validate and create ``dir`` for the store ``owner`` (``name`` in messages), and reclaim
    what stores that never closed left there.

    ``dir=None`` makes a temporary directory removed when ``owner`` is collected and at
    interpreter exit. Returns ``(dir, temporary dir or None, its finalizer or None)``.
    """
    if dir is None:
        tmp = tempfile.mkdtemp(prefix=prefix)
        fin = weakref.finalize(owner, _remove_tree, tmp)
        atexit.register(fin)
        _warn_reclaimed(f"{tempfile.gettempdir()}/{prefix}*",
                        *_reclaim_temporary_dirs(os.path.dirname(tmp), prefix, tmp))
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
        raise StateStoreIOError(errno.EACCES, f"{name}: directory {dir!r} is not writable", dir)
    _warn_reclaimed(dir, *reclaim_stale(dir))
    return dir, None, None


def create_laid_out(path: str, size: int, header: bytes) -> int:
    """Create the state file ``path`` (it must not exist) of ``size`` bytes with every byte
    reserved (sparse zeros where the filesystem cannot reserve) and the safetensors
    ``header`` at its start; returns the open descriptor. On failure nothing is left behind
    and the ``OSError`` is raised."""
    from ..io.files import reserve_space
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        if not reserve_space(fd, 0, size):
            os.ftruncate(fd, size)
        n = os.pwrite(fd, header, 0)
        if n != len(header):
            raise OSError(errno.EIO, f"short write of the header ({n} of {len(header)} bytes)")
    except OSError:
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass
        raise
    return fd
