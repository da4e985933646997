"""One zygote per test process for every module that runs child jobs (``helpers.ckpt``' and
``helpers.faults``' jobs: the ``helpers.faults`` zygote runs both), instead of one per module:
a zygote's start (torch, statestore, pyarrow imported, a first optimizer built) costs seconds
of a core, and the checkpoint, fault and reliability modules each started their own in every
test process that ran one of their tests.

Tests take it through the ``zygote`` fixture of ``tests/conftest.py``.
"""
from __future__ import annotations

import atexit
from typing import Iterator, List

from helpers import faults as F

_SHARED: List[F.Zygote] = []


def _close() -> None:
    while _SHARED:
        _SHARED.pop().close()


atexit.register(_close)


def lend() -> Iterator[F.Zygote]:
    """The process's zygote (started on first use, or again if it died) for one test; after
    the test, dropped if the test left a child unwaited (the zygote's next answer would be
    that child's exit status)."""
    if not _SHARED or _SHARED[0].proc.poll() is not None:
        _close()
        _SHARED.append(F.Zygote())
    z = _SHARED[0]
    yield z
    if z.outstanding:
        _close()
