"""Where a checkpoint lives: local directories and fsspec URLs, atomic commits, clean-up.

Every checkpoint file is written under a temporary name and committed by :func:`commit`
(flush, ``fsync`` on local filesystems, close, rename, the rename recorded with signals
deferred); a committed directory entry is made
durable with :func:`fsync_dir`, and a local checkpoint directory that :func:`prepare_root`
creates, in its parent. Local files are written by :class:`statestore.io.DirectWriter`
(``O_DIRECT``), others through fsspec.
"""
from __future__ import annotations

import os
import threading
from typing import Callable, List, Optional, Tuple

import fsspec
from tqdm.auto import tqdm

from .._signals import deferred_signals
from ..errors import StateStoreIOError, StateStoreValueError
from ..io.direct_writer import DirectWriter

__all__ = ["resolve", "is_local", "join", "exists", "fsync_dir", "commit", "close_quietly",
           "open_for_write", "prepare_root", "remove", "progress"]


def resolve(path: str) -> Tuple["fsspec.AbstractFileSystem", str]:
    """The filesystem and root of the checkpoint ``path``.

    Args:
        path: a local directory or any fsspec URL (``str`` or ``os.PathLike``).

    Returns:
        ``(fs, root)``: the fsspec filesystem and the path on it, without a trailing slash.

    Raises:
        StateStoreValueError: ``path`` is not a path, or fsspec cannot resolve it.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise StateStoreValueError(f"checkpoint path must be a str or os.PathLike, got {path!r}")
    path = os.fspath(path)
    try:
        fs, root = fsspec.core.url_to_fs(path)
    except (ImportError, ValueError) as e:
        raise StateStoreValueError(f"checkpoint path {path!r}: {e}") from e
    return fs, root.rstrip("/") or root


def is_local(fs) -> bool:
    """True when ``fs`` is the local filesystem (``os`` calls work on its paths)."""
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def join(root: str, name: str) -> str:
    """The path of file ``name`` in the checkpoint directory ``root`` (any filesystem)."""
    return f"{root}/{name}"


def exists(fs, path: str) -> bool:
    """Whether ``path`` exists. Local paths: ``os.path.exists`` (fsspec's local ``exists``
    swallows every exception, a Ctrl-C included, and answers False: a checkpoint then
    looked missing to a load that was only interrupted)."""
    if is_local(fs):
        return os.path.exists(path)
    return fs.exists(path)


def fsync_dir(fs, root: str) -> None:
    """Make the entries of the local directory ``root`` durable (a no-op elsewhere)."""
    if is_local(fs):
        _fsync_path(root)


def commit(fs, f, tmp: str, final: str, then: Optional[Callable[[], None]] = None) -> None:
    """Flush, fsync (local files), close and rename ``tmp`` to ``final``; ``then()`` records
    the rename (who must remove what on failure). The rename and ``then()`` run with signals
    deferred: a Ctrl-C lands before both or after both, never between (a manifest renamed
    into place whose save then removed its shards as if it had failed)."""
    f.flush()
    if is_local(fs):
        os.fsync(f.fileno())
    f.close()
    with deferred_signals():
        fs.mv(tmp, final)
        if then is not None:
            then()


def close_quietly(f) -> None:
    """Close ``f`` after a failure without masking the exception being raised."""
    try:
        f.close()
    except Exception:
        pass


def open_for_write(fs, path: str):
    """A new file at ``path`` opened for sequential writing: a :class:`DirectWriter` on local
    filesystems, fsspec's file elsewhere."""
    if is_local(fs):
        return DirectWriter(path)
    return fs.open(path, "wb")


def prepare_root(path: str):
    """Resolve ``path`` and create its directory.

    Returns:
        ``(fs, root)`` as :func:`resolve`.

    Raises:
        StateStoreValueError: ``path`` exists and is not a directory.
        StateStoreIOError: the directory cannot be created.
    """
    fs, root = resolve(path)
    if exists(fs, root) and not fs.isdir(root):
        raise StateStoreValueError(f"checkpoint path {path!r} exists and is not a directory")
    try:
        if is_local(fs):
            _makedirs_durable(root)
        else:
            fs.makedirs(root, exist_ok=True)
    except OSError as e:
        raise StateStoreIOError(e.errno, f"cannot create checkpoint directory {path!r}: {e}") from e
    return fs, root


def _makedirs_durable(root: str) -> None:
    """Create the local directory ``root`` and its missing parents, each made durable in its
    parent (``fsync`` of the parent after the ``mkdir``): after a power loss a committed
    manifest is never in a directory whose own entry was lost."""
    missing = []
    d = os.path.abspath(root)
    while not os.path.isdir(d):
        missing.append(d)
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    for d in reversed(missing):
        try:
            os.mkdir(d)
        except FileExistsError:
            if not os.path.isdir(d):
                raise
            continue            # created meanwhile by another process: its creator syncs it
        _fsync_path(os.path.dirname(d))


def _fsync_path(d: str) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(fs, paths: List[str]) -> None:
    """Remove ``paths``, ignoring failures (clean-up after an error)."""
    for p in paths:
        try:
            fs.rm(p)
        except Exception:
            pass


class _Bar(tqdm):
    """tqdm with a lock of this process only. tqdm's default lock includes a multiprocessing
    semaphore that forked processes share: one killed (``kill -9``) while it held it, in the
    middle of creating a bar, left it held forever, and every sibling's next save or load then
    hung creating its own bar (seen in ``benchmarks/soak.py``)."""


_Bar.set_lock(threading.RLock())


def progress(total: int, desc: str, enabled: Optional[bool], unit: str = "B", iterable=None):
    """A progress bar of ``total`` bytes (or ``unit``s; over ``iterable`` when given):
    ``enabled=True`` at once, ``None`` only for work over a second, ``False`` never."""
    return _Bar(iterable, total=total, desc=desc, unit=unit, unit_scale=True,
                delay=0.0 if enabled is True else 1.0, disable=(enabled is False), leave=False)
