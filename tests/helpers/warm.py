"""Run a script as ``python SCRIPT ARGS`` would, in a process forked from a warm one.

A test that runs a benchmark or an example end to end starts a new interpreter, whose
``import torch`` (and ``torch._dynamo``, which building an optimizer imports) takes seconds
before the script does anything. :func:`run_script` forks the script's process instead
from torch's forkserver: the one ``helpers.ranks`` and ``helpers.forked`` use (torch and
dynamo imported once, ``helpers.ranks.PRELOAD``), started by the first of them in this test
process. The server never computes, so no thread pool exists when it forks. The child is a
new process: its own session (a timeout kills what the script started too), ``sys.argv``,
``sys.path`` (the script's folder, then ``PYTHONPATH``: the statestore under test),
working directory, environment, stdin from ``/dev/null``, stdout and stderr into files; it
runs the script as ``__main__`` (``runpy``), then exits as an interpreter does (non-daemon
threads joined, ``atexit`` handlers run) with the script's exit status. What differs from a
new interpreter: the preloaded modules are already imported, so a variable of the
environment one of them reads at import time is the server's (pass ``env`` only for what is
read later), and processes the script starts itself (``sys.executable``) are new
interpreters as before. Tests that need a cold interpreter (what an import pulls in, an
import's own cost) keep ``subprocess``; Python code that needs only a process of its own
(no script, the test's directory) runs from ``helpers.forked``.
"""
from __future__ import annotations

import atexit
import os
import subprocess
import sys
from typing import Dict, Iterable, Optional

from helpers.forked import Child, exit_flushed, redirect_output, run_as_main


def _child(req: dict, out: str, err: str) -> None:
    """In the forked child: become the script's process and run it; never returns."""
    code = 1
    try:
        os.setsid()
        fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(fd, 0)
        os.close(fd)
        redirect_output(out, err)
        sys.stdin = open(0, closefd=False)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        script = req["script"]
        sys.argv = [script] + list(req["argv"])
        # as `python SCRIPT` with this environment: the script's folder, then PYTHONPATH
        # (the statestore under test first), then the rest (never "": the cwd moved)
        front = [os.path.dirname(script)] + [x for x in req["env"].get("PYTHONPATH", "")
                                             .split(os.pathsep) if x]
        sys.path[:] = front + [x for x in sys.path[1:] if x and x not in front]
        import runpy
        code = run_as_main(lambda: runpy.run_path(script, run_name="__main__"))
        import threading
        threading._shutdown()           # what the interpreter's exit does, in its order
        atexit._run_exitfuncs()
    finally:
        exit_flushed(code)


def run_script(script: str, args: Iterable = (), *, timeout: float = 600.0,
               cwd: Optional[str] = None,
               env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, script, *args], capture_output=True, text=True,
    timeout=timeout, cwd=cwd, env=paths.env(**env))``, the script run in a process forked
    from torch's forkserver. A run past ``timeout`` has its session killed and raises
    ``subprocess.TimeoutExpired``."""
    from helpers import paths
    script, args = os.path.abspath(script), [str(a) for a in args]
    req = dict(script=script, argv=args, cwd=cwd or os.getcwd(), env=paths.env(**(env or {})))
    return Child(_child, (req,), [sys.executable, script, *args], session=True).result(timeout)
