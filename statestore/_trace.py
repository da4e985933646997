"""Spans of the read / compute / write pipeline for ``torch.profiler`` (and so Perfetto / the
Chrome trace viewer / TensorBoard): ``record_function`` ranges named ``statestore::...``.

Free when no profiler runs: each call reads one module attribute of torch
(``torch.autograd.profiler._is_profiler_enabled``, torch's own fast Python-side flag, set for
every thread while a profiler is active) and returns a shared no-op. docs/profiling.md lists
the spans and how to record a trace.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.autograd import profiler as _torch_profiler

__all__ = ["SPANS", "tracing", "span", "begin", "end"]

#: every span statestore records, and what it covers
SPANS = {
    "statestore::read_submit": "reads of one unit submitted (read-ahead), caller's thread",
    "statestore::read_wait": "the caller waits for one unit's reads before it is handed out",
    "statestore::compute": "one unit in the caller's hands: handed out until handed back",
    "statestore::write_submit": "the unit handed back: its write-back submitted",
    "statestore::write_wait": "the caller waits for write-backs (ring full, sync)",
    "statestore::io_complete": "a native I/O engine's thread completes finished requests",
    "statestore::io_read": "one read on the pure-Python engine's threads (extension not built)",
    "statestore::io_write": "one write on the pure-Python engine's threads",
    "statestore::adam_plan": "a planned step's native call: every tensor of every group of a "
                             "resident store (inside a compute span)",
}


if hasattr(_torch_profiler, "_is_profiler_enabled"):
    def tracing() -> bool:
        """Whether a profiler is recording (any thread)."""
        return _torch_profiler._is_profiler_enabled
else:  # pragma: no cover - a torch without the flag: its C++ check (this thread only)
    tracing = torch.autograd._profiler_enabled


class _NoSpan:
    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


_NO_SPAN = _NoSpan()


def span(name: str):
    """A ``with`` block recorded as ``name`` while a profiler runs; a shared no-op otherwise."""
    if not tracing():
        return _NO_SPAN
    return torch.profiler.record_function(name)


def begin(name: str) -> Optional[torch.profiler.record_function]:
    """Open a span that :func:`end` closes later (across calls); None when not profiling."""
    if not tracing():
        return None
    rf = torch.profiler.record_function(name)
    rf.__enter__()
    return rf


def end(handle: Optional[torch.profiler.record_function]) -> None:
    """Close a span opened by :func:`begin` (None: nothing to close)."""
    if handle is not None:
        handle.__exit__(None, None, None)
