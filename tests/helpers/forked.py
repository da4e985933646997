"""Python code run in a new process forked from the forkserver that ``helpers.ranks`` uses
(it imported torch and dynamo once): seconds faster than ``subprocess.run([sys.executable,
"-c", code, ...])`` for a test that needs a process of its own (one that never saw the test's
stores, one that may abort or be killed), not a cold interpreter. A test about what an
interpreter does at start-up or exit (its module table, atexit, malloc's settings) still
starts ``sys.executable``.

The child runs ``code`` as ``__main__`` with ``sys.argv = ["-c", *args]``, stdout and stderr
to files; its exit status is ``SystemExit``'s code, 1 for an uncaught exception (traceback on
stderr), ``-N`` when signal N killed it (as ``subprocess``). It has the test process's
``sys.path`` and working directory, and the forkserver's environment (the test process's
when the server started).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import traceback

import torch.multiprocessing as mp

from helpers.ranks import PRELOAD


def run_as_main(fn) -> int:
    """Call ``fn()`` and return the exit status an interpreter running it as its script
    would have: 0, ``SystemExit``'s code (a message code printed to stderr: 1), or 1 with
    the traceback on stderr."""
    try:
        fn()
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1


def exit_flushed(code: int):
    """In a child: flush stdout and stderr and end the process with ``code`` at once
    (``os._exit``: nothing of the parent's, atexit handlers or finalizers, runs again), even
    if flushing fails."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def redirect_output(out: str, err: str) -> None:
    """In a child: its stdout and stderr (file descriptors 1 and 2) into the files ``out``
    and ``err``."""
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)


def _main(code: str, argv, out: str, err: str) -> None:
    redirect_output(out, err)
    sys.argv = list(argv)
    rc = 1
    try:
        rc = run_as_main(lambda: exec(compile(code, "<forked>", "exec"), {"__name__": "__main__"}))
    finally:
        exit_flushed(rc)


def _read(path: str) -> str:
    """A child's output file ("" if it died before opening it)."""
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


class Child:
    """A process forked from the forkserver, running ``target(*args, out, err)`` (``out``,
    ``err``: the files its stdout and stderr go to); :meth:`result` waits for it. ``cmd``
    names it in the result (as ``subprocess``'s ``args``); ``session``: the child starts a
    session of its own, and a timeout kills the session (what the child started too)."""

    def __init__(self, target, args, cmd, *, session: bool = False) -> None:
        self.args, self._session = cmd, session
        self._dir = tempfile.mkdtemp(prefix="statestore-forked-")
        self._out, self._err = os.path.join(self._dir, "out"), os.path.join(self._dir, "err")
        mp.set_forkserver_preload(PRELOAD)
        self.proc = mp.get_context("forkserver").Process(
            target=target, args=(*args, self._out, self._err))
        self.proc.start()

    def result(self, timeout: float = 300.0) -> subprocess.CompletedProcess:
        """Wait at most ``timeout`` seconds (then kill it and raise
        ``subprocess.TimeoutExpired`` with what it printed)."""
        try:
            self.proc.join(timeout)
            timed_out = self.proc.is_alive()
            if timed_out:
                self._kill()
                self.proc.join()
            out, err = _read(self._out), _read(self._err)
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)
        if timed_out:
            raise subprocess.TimeoutExpired(self.args, timeout, output=out, stderr=err)
        return subprocess.CompletedProcess(self.args, self.proc.exitcode, out, err)

    def _kill(self) -> None:
        if self._session:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
                return
            except ProcessLookupError:
                pass
        self.proc.kill()


def start(code: str, *args) -> Child:
    """Start ``code`` with ``args`` in a new forked process."""
    argv = ["-c", *map(str, args)]
    return Child(_main, (code, argv), argv)


def run(code: str, *args, timeout: float = 300.0) -> subprocess.CompletedProcess:
    """Run ``code`` with ``args`` in a new forked process and wait for it (as
    ``subprocess.run(..., capture_output=True, text=True, timeout=timeout)``)."""
    return start(code, *args).result(timeout)
