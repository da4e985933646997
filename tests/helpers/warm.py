"""Run a script as ``python SCRIPT ARGS`` would, in a process forked from a warm one.

A test that runs a benchmark or an example end to end starts a new interpreter, whose
``import torch`` (and ``torch._dynamo``, which building an optimizer imports, and
``transformers`` for the HF scripts) takes seconds before the script does anything.
:func:`run_script` forks the script's process instead from torch's forkserver (the one
``helpers.ranks`` and ``helpers.forked`` use: torch and dynamo imported once, started by
the first of them in this test process) or, with ``warm=HF``, from a *zygote* (``python -m
helpers.warm --zygote MODULE...``, started once per test process and set of modules, with
:func:`helpers.paths.env`) that imported those modules. Neither computes, so no thread pool
exists when they fork. The child is a new process: its own session (a timeout kills what
the script started too), ``sys.argv``, ``sys.path`` (the script's folder, then
``PYTHONPATH``: the statestore under test), working directory, environment, stdin from
``/dev/null``, stdout and stderr into files; it runs the script as ``__main__`` (``runpy``),
then exits as an interpreter does (non-daemon threads joined, ``atexit`` handlers run) with
the script's exit status. What differs from a new interpreter: the preloaded modules are
already imported, so a variable of the environment one of them reads at import time is the
server's (pass ``env`` only for what is read later), and processes the script starts itself
(``sys.executable``) are new interpreters as before. Tests that need a cold interpreter
(what an import pulls in, an import's own cost) keep ``subprocess``; Python code that needs
only a process of its own (no script, the test's directory) runs from ``helpers.forked``.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
from typing import Dict, Iterable, Optional, Sequence

#: the modules a zygote for the HF Trainer scripts imports
HF = ("torch", "torch._dynamo", "statestore", "statestore.optim", "transformers",
      "transformers.trainer", "accelerate", "statestore.integrations.transformers")


# ------------------------------------------------------------------------------ zygote side
def _child(req: dict) -> None:
    """In the forked child: become the script's process and run it; never returns."""
    code = 1
    try:
        os.setsid()
        fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(fd, 0)
        os.close(fd)
        for target, path in ((1, req["out"]), (2, req["err"])):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, target)
            os.close(fd)
        sys.stdin = open(0, closefd=False)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        script = os.path.abspath(req["script"])
        sys.argv = [script] + list(req["argv"])
        # as `python SCRIPT` with this environment: the script's folder, then PYTHONPATH
        # (the statestore under test first), then the rest (never "": the cwd moved)
        front = [os.path.dirname(script)] + [x for x in req["env"].get("PYTHONPATH", "")
                                             .split(os.pathsep) if x]
        sys.path[:] = front + [x for x in sys.path[1:] if x and x not in front]
        import runpy
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 1
        import threading
        threading._shutdown()           # what the interpreter's exit does, in its order
        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _zygote(modules: Sequence[str]) -> None:
    import importlib
    for m in modules:
        importlib.import_module(m)
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req)
        out.write(json.dumps({"pid": pid}) + "\n")
        out.flush()
        _, status = os.waitpid(pid, 0)
        out.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        out.flush()


# ------------------------------------------------------------------------------ test side
def _read(path: str) -> str:
    """A child's output file ("" if it died before opening it)."""
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


class _Zygote:
    def __init__(self, modules: Sequence[str]):
        from helpers import paths
        self.proc = subprocess.Popen([sys.executable, "-m", "helpers.warm", "--zygote", *modules],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     bufsize=1, env=paths.env(), cwd=paths.ROOT,
                                     start_new_session=True)
        self.env, self._buf = paths.env(), b""
        if self._line(600.0) != "ready":
            raise RuntimeError(f"the zygote importing {modules} did not start")

    def _line(self, timeout: float) -> Optional[str]:
        """The zygote's next line, or None after ``timeout`` seconds (read unbuffered: a
        buffered reader could hold a second line that ``select`` then never reports)."""
        import time
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            ready, _, _ = select.select([self.proc.stdout], [], [],
                                        max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                raise RuntimeError("the zygote process died")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode().strip()

    def run(self, script: str, args: Sequence[str], timeout: float, cwd: str,
            env: Dict[str, str]) -> subprocess.CompletedProcess:
        import time
        with tempfile.TemporaryDirectory(prefix="warm-") as d:
            out, err = os.path.join(d, "out"), os.path.join(d, "err")
            self.proc.stdin.write(json.dumps(dict(script=script, argv=[str(a) for a in args],
                                                  cwd=cwd, env=env, out=out, err=err)) + "\n")
            self.proc.stdin.flush()
            deadline = time.monotonic() + timeout
            pid = json.loads(self._line(60.0) or "{}").get("pid")
            if pid is None:
                raise RuntimeError("the zygote did not fork")
            line = self._line(deadline - time.monotonic())
            timed_out = line is None
            if timed_out:
                try:
                    os.killpg(pid, 9)
                except ProcessLookupError:
                    pass
                line = self._line(60.0)
            stdout, stderr = _read(out), _read(err)
        cmd = [sys.executable, script, *map(str, args)]
        if timed_out:
            raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess(cmd, json.loads(line)["rc"], stdout, stderr)

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_ZYGOTES: Dict[tuple, _Zygote] = {}


@atexit.register
def _close_all() -> None:
    for z in _ZYGOTES.values():
        z.close()
    _ZYGOTES.clear()


def _forkserver_run(script: str, args: list, timeout: float, cwd: str,
                    env: Dict[str, str]) -> subprocess.CompletedProcess:
    """:func:`_child` forked from torch's forkserver (``helpers.ranks.PRELOAD``)."""
    import signal

    import torch.multiprocessing as mp

    from helpers.ranks import PRELOAD
    cmd = [sys.executable, script, *args]
    with tempfile.TemporaryDirectory(prefix="warm-") as d:
        out, err = os.path.join(d, "out"), os.path.join(d, "err")
        mp.set_forkserver_preload(PRELOAD)
        p = mp.get_context("forkserver").Process(target=_child, args=(dict(
            script=script, argv=args, cwd=cwd, env=env, out=out, err=err),))
        p.start()
        p.join(timeout)
        timed_out = p.is_alive()
        if timed_out:
            try:
                os.killpg(p.pid, signal.SIGKILL)    # its session: what it started too
            except ProcessLookupError:
                p.kill()
            p.join()
        stdout, stderr = _read(out), _read(err)
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(cmd, p.exitcode, stdout, stderr)


def run_script(script: str, args: Iterable = (), *, warm: Optional[Sequence[str]] = None,
               timeout: float = 600.0, cwd: Optional[str] = None,
               env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, script, *args], capture_output=True, text=True,
    timeout=timeout, cwd=cwd, env=paths.env(**env))``, the script run in a process forked
    from torch's forkserver (``helpers.ranks`` and ``helpers.forked`` start it: torch and
    dynamo imported) or, with ``warm``, from a zygote that imported those modules (started
    on first use, kept for this process; ``HF``). A run past ``timeout`` has its session
    killed and raises ``subprocess.TimeoutExpired``."""
    from helpers import paths
    script, args, cwd = os.path.abspath(script), [str(a) for a in args], cwd or os.getcwd()
    if warm is None:
        return _forkserver_run(script, args, timeout, cwd, paths.env(**(env or {})))
    key = tuple(warm)
    z = _ZYGOTES.get(key)
    if z is None or z.proc.poll() is not None:
        z = _ZYGOTES[key] = _Zygote(key)
    return z.run(script, args, timeout, cwd, dict(z.env, **(env or {})))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--zygote"]:
        _zygote(sys.argv[2:])
