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


def _main(code: str, argv, out: str, err: str) -> None:
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.argv = list(argv)
    rc = 1
    try:
        rc = run_as_main(lambda: exec(compile(code, "<forked>", "exec"), {"__name__": "__main__"}))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


class Child:
    """A running child (:func:`start`); :meth:`result` waits for it."""

    def __init__(self, code: str, args) -> None:
        self._dir = tempfile.mkdtemp(prefix="statestore-forked-")
        self.args = ["-c", *map(str, args)]
        self._out, self._err = os.path.join(self._dir, "out"), os.path.join(self._dir, "err")
        mp.set_forkserver_preload(PRELOAD)
        self.proc = mp.get_context("forkserver").Process(
            target=_main, args=(code, self.args, self._out, self._err))
        self.proc.start()

    def result(self, timeout: float = 300.0) -> subprocess.CompletedProcess:
        """Wait at most ``timeout`` seconds (then kill it and raise ``TimeoutError``)."""
        try:
            self.proc.join(timeout)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
                raise TimeoutError(f"forked child {self.args}: still running after {timeout} s")
            out = open(self._out).read() if os.path.exists(self._out) else ""
            err = open(self._err).read() if os.path.exists(self._err) else ""
            return subprocess.CompletedProcess(self.args, self.proc.exitcode, out, err)
        finally:
            for name in (self._out, self._err):
                if os.path.exists(name):
                    os.unlink(name)
            os.rmdir(self._dir)


def start(code: str, *args) -> Child:
    """Start ``code`` with ``args`` in a new forked process."""
    return Child(code, args)


def run(code: str, *args, timeout: float = 300.0) -> subprocess.CompletedProcess:
    """Run ``code`` with ``args`` in a new forked process and wait for it (as
    ``subprocess.run(..., capture_output=True, text=True, timeout=timeout)``)."""
    return start(code, *args).result(timeout)
