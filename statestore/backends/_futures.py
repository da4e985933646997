"""Futures shared by the disk-backed backends (NVMeStore, TensorNVMeStore)."""
from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Callable, Sequence

__all__ = ["completed", "when_all"]


def completed(value: int) -> Future:
    """A future already completed with ``value``."""
    f: Future = Future()
    f.set_result(value)
    return f


def when_all(futs: Sequence[Future], finish: Callable[[Future], None]) -> Future:
    """A new future that ``finish(it)`` completes once every one of ``futs`` (not empty) has
    completed; ``finish`` runs once, in the thread of the last of them to complete."""
    out: Future = Future()
    left = [len(futs)]
    lock = threading.Lock()

    def one_done(_):
        with lock:
            left[0] -= 1
            if left[0]:
                return
        finish(out)

    for f in futs:
        f.add_done_callback(one_done)
    return out
