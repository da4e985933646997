"""Checksums (the checkpoint's xxh3-64) of NVMeStore states: computed as they are written by
puts and checkpoint loads, so that a linked save need not read those states back to hash
them (:class:`WriteDigests`), and checked as they are read from files a checkpoint shares
(:class:`FrozenReads`) (docs/nvme.md)."""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, Iterable, Optional, Sequence, Tuple

import xxhash

from .._types import Slice, StateKey
from ..errors import CheckpointCorruptError

__all__ = ["WriteDigests", "FrozenReads"]


class _Digest:
    """An xxh3-64 in progress over one state written in order; ``ok`` turns False if a
    chunk could not be hashed, and the digest is then never recorded."""
    __slots__ = ("h", "ok")

    def __init__(self):
        self.h = xxhash.xxh3_64()
        self.ok = True


class WriteDigests:
    """Digests of states written from their first to their last element in order (as every
    put and checkpoint load does) since their last other write. Any other write order, and
    any optimizer pass, forgets a state's digest (a save then reads the state to hash it).
    The hashing runs on one worker thread, in submission order; thread-safe."""

    def __init__(self):
        self._digests: Dict[StateKey, str] = {}
        self._hashing: Dict[StateKey, Tuple[_Digest, int]] = {}   # next element expected
        self._finishing: Dict[StateKey, _Digest] = {}      # last chunk submitted, digest due
        self._lock = threading.Lock()
        self._pool: Optional[ThreadPoolExecutor] = None

    def written(self, s: Slice, numel: int, data: memoryview) -> Optional[Future]:
        """The bytes ``data`` of slice ``s`` of a state of ``numel`` elements are being
        written: hash them on the worker thread (the caller goes on meanwhile).

        Returns:
            A future that completes once the worker has read ``data`` (the buffer must not be
            reused before), or None when ``s`` does not continue the state's in-order write
            (the digest is then forgotten).
        """
        k = s.key
        with self._lock:
            self._digests.pop(k, None)
            self._finishing.pop(k, None)
            if s.start == 0:
                self._hashing.pop(k, None)
                d = _Digest()
            else:
                prev = self._hashing.pop(k, None)
                if prev is None or prev[1] != s.start:
                    return None
                d = prev[0]
            final = s.stop == numel
            if final:
                self._finishing[k] = d
            else:
                self._hashing[k] = (d, s.stop)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ss-hash")
        return self._pool.submit(self._hash_chunk, k, d, data, final)

    def _hash_chunk(self, k: StateKey, d: _Digest, view: memoryview, final: bool) -> None:
        try:
            if d.ok:
                d.h.update(view)
        except BaseException:
            d.ok = False
        if final:
            with self._lock:
                if self._finishing.get(k) is d:
                    del self._finishing[k]
                    if d.ok:
                        self._digests[k] = d.h.hexdigest()

    def record(self, k: StateKey, digest: str) -> None:
        """``k`` was written whole, and hashed by the caller: its digest is ``digest``."""
        with self._lock:
            self._hashing.pop(k, None)
            self._finishing.pop(k, None)
            self._digests[k] = digest

    def forget(self, k: StateKey) -> None:
        """``k`` was written otherwise (or removed): its digest is no longer known."""
        with self._lock:
            self._digests.pop(k, None)
            self._hashing.pop(k, None)
            self._finishing.pop(k, None)

    def forget_many(self, keys: Sequence[StateKey]) -> None:
        """:meth:`forget` of ``keys`` (an optimizer's pass over a unit: while no digest of
        them is known, one C-level test each map, not a call a state)."""
        with self._lock:
            for d in (self._digests, self._hashing, self._finishing):
                if d and not d.keys().isdisjoint(keys):
                    for k in keys:
                        d.pop(k, None)

    def known(self, keys: Iterable[StateKey]) -> Dict[StateKey, str]:
        """The digests known of ``keys`` (complete once every write was waited for)."""
        with self._lock:
            return {k: self._digests[k] for k in keys if k in self._digests}

    def close(self) -> None:
        """Wait for the worker, then forget everything."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        with self._lock:
            self._digests.clear()
            self._hashing.clear()
            self._finishing.clear()


class _CheckedRead:
    """A read's future whose bytes are hashed when its outcome is taken (``result()``): the
    pipeline takes the outcomes of a state's slices in order, before it hands them out, so
    the hash runs in order and before anyone changes the bytes."""
    __slots__ = ("_fut", "_check")

    def __init__(self, fut, check: Callable[[], None]):
        self._fut, self._check = fut, check

    def done(self) -> bool:
        return self._fut.done()

    def result(self, timeout: Optional[float] = None):
        n = self._fut.result(timeout)
        check, self._check = self._check, None
        if check is not None:
            check()
        return n

    def exception(self, timeout: Optional[float] = None):
        try:
            self.result(timeout)
        except BaseException as e:      # noqa: BLE001 - a future's exception() returns it
            return e
        return None


class FrozenReads:
    """Checks the states an NVMeStore reads from a *frozen* file (a checkpoint shares it by
    hard link) against the checksums recorded when it froze: the checkpoint's own file can be
    altered in place through its name, and the store would otherwise train on the altered
    bytes (and save their updates with checksums that match). Every read of a state from its
    frozen file, from its first element to its last in order (as pipelines read), is hashed
    as the pipeline takes it; a mismatch raises :class:`CheckpointCorruptError` before the
    last slice is handed out. A read that does not continue the state's run (out of order)
    and copies out of a frozen file (``CopyOnWrite.materialize``) verify the whole state first
    (``whole(sf, key)``). Reads of files that are not frozen cost nothing.

    Args:
        span: ``span(key)`` gives ``(data offset, nbytes)`` of a state in its files.
        read: ``read(sf, offset, n)`` reads ``n`` bytes (at most ``CHUNK``, 4096-aligned) of
            ``sf`` synchronously and returns them (a uint8 tensor).
    """

    CHUNK = 1 << 20

    def __init__(self, span: Callable[[StateKey], Tuple[int, int]],
                 read: Callable[[Any, int, int], Any]):
        self._span, self._read = span, read
        self._runs: Dict[StateKey, Tuple[Any, int, Any]] = {}     # key -> (file, next, hash)
        self._submitted: Dict[StateKey, int] = {}                 # key -> next element read

    def read(self, sf, s: Slice, numel: int, view: memoryview, fut):
        """``fut`` reads slice ``s`` of a state of ``numel`` elements from ``sf`` into
        ``view``: returned as is, or wrapped to verify the state when ``sf`` is frozen with
        the state's checksum recorded."""
        k = s.key
        want = sf.hashes.get(k) if sf.frozen else None
        if want is None or s.stop <= s.start:
            return fut
        if s.start != 0 and self._submitted.get(k) != s.start:
            self.verify(sf, k)              # not the next slice of a run: the whole state now
            return fut
        self._submitted[k] = s.stop

        def check() -> None:
            run = self._runs.pop(k, None)
            if s.start == 0:
                run = (sf, 0, xxhash.xxh3_64())
            elif run is None or run[0] is not sf or run[1] != s.start:
                return                      # its run was verified whole at submission
            run[2].update(view)
            if s.stop < numel:
                self._runs[k] = (sf, s.stop, run[2])
            elif run[2].hexdigest() != want:
                raise _mismatch(sf.path, k)
        return _CheckedRead(fut, check)

    def verify(self, sf, k: StateKey) -> None:
        """Verify the whole state ``k`` in the frozen file ``sf`` (when its checksum is
        recorded). Raises :class:`CheckpointCorruptError` on a mismatch."""
        want = sf.hashes.get(k) if sf.frozen else None
        if want is None:
            return
        start, nbytes = self._span(k)
        end, h = start + nbytes, xxhash.xxh3_64()
        pos = start // 4096 * 4096          # a small state starts inside its block
        while pos < end:
            n = min(self.CHUNK, -(-(end - pos) // 4096) * 4096)
            lo = max(start - pos, 0)
            h.update(self._read(sf, pos, n)[lo:min(n, end - pos)].numpy())
            pos += n
        if h.hexdigest() != want:
            raise _mismatch(sf.path, k)

    def check(self, sf, k: StateKey, data) -> None:
        """``data`` holds the whole state ``k`` as read from ``sf``: raise
        :class:`CheckpointCorruptError` when ``sf`` is frozen with another checksum of it."""
        want = sf.hashes.get(k) if sf.frozen else None
        if want is not None and xxhash.xxh3_64(data).hexdigest() != want:
            raise _mismatch(sf.path, k)

    @staticmethod
    def extent(fut, checks, buf, check_one):
        """``fut`` (an extent read into ``buf``) wrapped to run ``check_one(sf, slice, first
        block, buf)`` for each of ``checks`` when its outcome is taken."""
        return _CheckedRead(fut, lambda: [check_one(sf, s, b0, buf) for sf, s, b0 in checks])

    def forget(self, k: StateKey) -> None:
        self._runs.pop(k, None)
        self._submitted.pop(k, None)


def _mismatch(path: str, k: StateKey) -> CheckpointCorruptError:
    """The error of a mismatch; ``.tensor`` names the state (a linked load names the
    checkpoint's shard instead of the store's link to it)."""
    err = CheckpointCorruptError(
        f"{path}: checksum mismatch in tensor {str(k)!r}: the store reads this state from a "
        f"file it shares with a checkpoint (a hard link), and that file was altered or damaged "
        f"since the checkpoint was saved or loaded (edited in place through the checkpoint's "
        f"name?); the store's value of the state is lost: load an intact checkpoint")
    err.tensor = str(k)
    return err
