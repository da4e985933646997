"""Deferring Ctrl-C across short sections of bookkeeping.

A signal whose Python handler raises (``KeyboardInterrupt`` from SIGINT, or a handler a
program installed for SIGTERM) is delivered between any two bytecodes of the main thread: in
the middle of the few lines that advance a step count and record how to undo it, or that give
a ring buffer back. Raised there, it leaves the bookkeeping half done: counts advanced with no
undo, buffers no pipeline will ever release (the store then refuses every call for want of
RAM). Inside :class:`deferred_signals` the signal is recorded instead and delivered, to the
handler that was installed, as the section ends: a Ctrl-C lands just after it, never inside.

Sections are kept short (bookkeeping, and waits for I/O of at most a unit of a pipeline), so
a Ctrl-C is delayed by at most that. Only the main thread runs Python signal handlers, so
other threads run the section as it is; signals whose handler is not a Python callable
(``SIG_DFL``: the process dies; ``SIG_IGN``) are left alone. Sections nest (only the outermost
installs handlers).
"""
from __future__ import annotations

import signal
import sys
import threading

import _thread
import _signal      # signal's own functions, without the enum conversions (a deferral is hot)
from typing import Any, Callable, Dict, List, Optional

__all__ = ["deferred_signals", "without_signals"]

#: the signals deferred (where a Python handler is installed for them)
SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM") if hasattr(signal, n))

_MAIN = threading.main_thread().ident
#: how long after a finalizer's section ends its deferred signal is raised again
_LATER_S = 0.002
_ident = threading.get_ident


class _State:
    depth = 0
    saved: Dict[int, Any] = {}
    pending: List[int] = []


def _record(signum: int, frame) -> None:
    _State.pending.append(signum)       # not the frame: it would keep its locals alive


class deferred_signals:
    """``with deferred_signals(): ...``: SIGINT (and SIGTERM where a Python handler is
    installed) arriving inside the block is delivered when it ends (module docstring).

    ``later=True`` (a section run by a finalizer, e.g. a ``weakref.finalize`` callback, where
    Python discards any exception: a KeyboardInterrupt raised there is lost) re-raises the
    signal a moment after the section ends (``_thread.interrupt_main`` from a timer thread,
    2 ms) instead of calling its handler there: the handler runs once the finalizer has
    returned, in the code it interrupted."""

    __slots__ = ("_outer", "_later")

    def __init__(self, later: bool = False) -> None:
        self._later = later

    def __enter__(self) -> "deferred_signals":
        self._outer = False
        if _State.depth and _ident() == _MAIN:
            _State.depth += 1
            return self
        if _ident() != _MAIN:
            return self
        saved: Dict[int, Any] = {}
        try:
            for sig in SIGNALS:
                h = _signal.getsignal(sig)
                if callable(h) and h is not _record:
                    saved[sig] = h
                    _signal.signal(sig, _record)
        except BaseException:
            for sig, h in saved.items():    # a signal while installing: leave as it was
                _signal.signal(sig, h)
            raise
        _State.saved, _State.pending = saved, []
        _State.depth = 1
        self._outer = True
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not _State.depth or _ident() != _MAIN:
            return
        _State.depth -= 1
        if not self._outer:
            return
        saved, pending = _State.saved, _State.pending
        _State.saved, _State.pending = {}, []
        for sig, h in saved.items():
            _signal.signal(sig, h)
        if pending:
            handler: Optional[Callable] = saved.get(pending[0])
            if handler is not None and self._later:
                # raised from here it would be checked for at once, still in the finalizer:
                # a thread raises it again a moment later, in the code the finalizer
                # interrupted
                t = threading.Timer(_LATER_S, _thread.interrupt_main, args=(pending[0],))
                t.daemon = True
                t.start()
            elif handler is not None:       # KeyboardInterrupt (say) raised here, after
                handler(pending[0], sys._getframe(1))


def without_signals(fn: Callable) -> Callable:
    """Decorator: run ``fn`` inside :class:`deferred_signals`."""
    def wrapper(*args, **kwargs):
        with deferred_signals():
            return fn(*args, **kwargs)
    wrapper.__name__ = fn.__name__
    wrapper.__qualname__ = fn.__qualname__
    wrapper.__doc__ = fn.__doc__
    wrapper.__wrapped__ = fn
    return wrapper
