"""Checksums (the checkpoint's xxh3-64) of NVMeStore states computed as they are written by
puts and checkpoint loads, so that a linked save need not read those states back to hash
them (docs/nvme.md)."""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, Iterable, Optional, Tuple

import xxhash

from .._types import Slice, StateKey

__all__ = ["WriteDigests"]


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

    def forget(self, k: StateKey) -> None:
        """``k`` was written otherwise (or removed): its digest is no longer known."""
        with self._lock:
            self._digests.pop(k, None)
            self._hashing.pop(k, None)
            self._finishing.pop(k, None)

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
