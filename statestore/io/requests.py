"""What every I/O engine's requests are made of: the operation codes (:class:`Op`) and the
future a submitted request completes (:class:`IOFuture`)."""
from __future__ import annotations

import enum
from concurrent.futures import Future

__all__ = ["Op", "IOFuture"]


class Op(enum.IntEnum):
    """A request's operation; the values are the native queue's codes (``statestore._C_io``)."""
    READ = 0
    WRITE = 1


class IOFuture(Future):
    """A ``concurrent.futures.Future`` for one request. Submitted I/O cannot be cancelled:
    :meth:`cancel` returns ``False``."""

    def cancel(self) -> bool:  # noqa: D401 - Future API
        return False
