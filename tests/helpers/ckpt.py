"""Helpers of the checkpoint and CLI tests: deterministic training set-ups, and a *zygote*
process that forks fresh child processes to run them.

Why a zygote: ``import torch`` takes seconds, and the checkpoint tests need many new
processes (resume in a process that never saw the saving store; ``kill -9`` at random
moments of a save, many times). The zygote (``python -m helpers.ckpt --zygote``) imports
torch and statestore once, never computes (so no thread pool exists when it forks), and
forks one child per request. Each child is a new process: it shares nothing with the test
process but the imported modules; its stdout/stderr go to a log file. The test process
talks to the zygote over pipes, one JSON line per message::

    -> {"fn": name, "kwargs": {...}, "log": path}
    <- {"pid": child pid}            (at once: the test may kill -9 it)
    <- {"rc": exit status}           (when the child ends; -9 when killed)
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import traceback
from typing import Any, Dict, List, Optional, Tuple

import torch

import statestore as ss
from statestore.optim import CPUAdam

from helpers import paths, registry

# ------------------------------------------------------------------------------ stores
#: every line of the backend registry that needs no CUDA (``tests/registry.py``)
STORE_KINDS: List[str] = registry.names(cuda=False)


def make_store(kind: str, directory: str, **kwargs) -> ss.StateStore:
    """A fresh store of ``kind`` (a line of the backend registry) keeping its files (if any)
    under ``directory``, with the store's default budget unless ``budget_bytes`` is given."""
    kwargs.setdefault("budget_bytes", ss.DEFAULT_BUDGET_BYTES)
    return registry.make(kind, os.path.join(directory, kind), **kwargs)


# ------------------------------------------------------------------------------ training
#: Training configurations of the exactness tests. ``mixed``: fp32 and bf16 parameters
#: (bf16 ones keep an fp32 master in the store), named, two groups, amsgrad.
#: ``bf16``: bf16 parameters only, unnamed (integer keys), one group, no amsgrad.
CONFIGS: Dict[str, Dict[str, Any]] = {
    "mixed": {"dtypes": ["float32", "bfloat16", "float32", "bfloat16"], "named": True,
              "groups": 2, "amsgrad": True},
    "bf16": {"dtypes": ["bfloat16"] * 4, "named": False, "groups": 1, "amsgrad": False},
    "fp32": {"dtypes": ["float32"] * 4, "named": False, "groups": 2, "amsgrad": False},
}
SHAPES = [(33, 17), (1000,), (7,), (2 ** 12 + 3,)]


def make_params(cfg: Dict[str, Any], seed: int = 0) -> List[Tuple[str, torch.nn.Parameter]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (shape, dt) in enumerate(zip(SHAPES, cfg["dtypes"])):
        t = torch.randn(shape, generator=g).to(getattr(torch, dt))
        out.append((f"layer{i}.weight", torch.nn.Parameter(t)))
    return out


def param_groups(cfg: Dict[str, Any], named: List[Tuple[str, torch.nn.Parameter]]):
    items = named if cfg["named"] else [p for _, p in named]
    if cfg["groups"] == 1:
        return items
    half = len(items) // 2
    return [{"params": items[:half], "lr": 1e-2, "weight_decay": 0.05},
            {"params": items[half:], "lr": 3e-3}]


def make_opt(cfg: Dict[str, Any], named, store) -> CPUAdam:
    return CPUAdam(param_groups(cfg, named), lr=1e-3, amsgrad=cfg["amsgrad"], state_store=store)


def set_grads(params, step: int) -> None:
    """Deterministic gradients for ``step`` (same in every process)."""
    for i, p in enumerate(params):
        g = torch.Generator().manual_seed(1000 * step + i)
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def train(opt, params, start: int, n: int) -> None:
    for step in range(start, start + n):
        set_grads(params, step)
        opt.step()
        opt.zero_grad()


def save_weights(named, path: str) -> None:
    from safetensors.torch import save_file
    save_file({n: p.detach().contiguous() for n, p in named}, path)


def load_weights(named, path: str) -> None:
    from safetensors.torch import load_file
    w = load_file(path)
    with torch.no_grad():
        for n, p in named:
            p.copy_(w[n])


def file_hashes(directory: str) -> Dict[str, str]:
    out = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


# ------------------------------------------------------------------------------ child jobs
def job_resume(cfg: str, kind: str, store_dir: str, ckpt: str, weights: str, start: int,
               n: int, out: str) -> None:
    """New process: load ``ckpt`` into a fresh store of ``kind``, rebuild the optimizer
    over the saved weights, train ``n`` more steps and save the weights to ``out``."""
    c = CONFIGS[cfg]
    named = make_params(c, seed=123)           # other values: the weights file decides
    load_weights(named, weights)
    with make_store(kind, store_dir) as store:
        store.load_checkpoint(ckpt)
        opt = make_opt(c, named, store)
        train(opt, [p for _, p in named], start, n)
        save_weights(named, out)


def _fill(store, value: float) -> None:
    for k in store.keys():
        store.put(k, torch.full(store.spec(k).shape, value, dtype=store.spec(k).dtype))


def job_save_loop(kind: str, store_dir: str, base: str, new: str, ready: str,
                  shard_bytes: int) -> None:
    """Saves forever (until killed): each round fills every state with the round number
    ``v`` (metadata ``{"round": v}``), then saves to ``new`` and re-saves to ``base``.
    ``ready`` is created once ``base`` holds a complete checkpoint."""
    torch.set_num_threads(1)
    with make_store(kind, store_dir) as store:
        store.create_many([(f"p{i}/exp_avg", (257 * 1024 + 3 * i,), torch.float32, None)
                           for i in range(8)])
        v = 0
        while True:
            v += 1
            _fill(store, float(v))
            meta = {"round": v}
            store.save_checkpoint(base if v == 1 else new, shard_bytes=shard_bytes,
                                  progress=False, metadata=meta)
            if v == 1:
                open(ready, "w").close()
                continue
            store.save_checkpoint(base, shard_bytes=shard_bytes, progress=False, metadata=meta)


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")           # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def job_bounded(kind: str, store_dir: str, ckpt: str, nbytes: int, out: str) -> None:
    """Peak RSS growth of saving and of loading ``nbytes`` of states of a ``kind`` store.

    Writes ``{"save_kib", "load_kib", "field"}`` to ``out``: VmHWM growth (peak RSS; for
    the mmap'd FileStore, RssAnon growth sampled by a thread, since its file-backed pages are
    the states themselves and the kernel may evict them)."""
    import threading
    torch.set_num_threads(1)
    n_tensors = 12
    per = nbytes // n_tensors // 4
    store = make_store(kind, store_dir)
    store.create_many([(f"p{i}/exp_avg", (per,), torch.float32, None) for i in range(n_tensors)])
    first = store.keys()[0]                     # some nonzero data (the rest: zeros)
    store.put(first, torch.arange(per, dtype=torch.float32))
    store.sync()
    anon = kind == "file"
    field = "RssAnon" if anon else "VmHWM"
    peak = [0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_kib("RssAnon"))
            time.sleep(0.002)

    results = {"field": field}
    for phase in ("save", "load"):
        import gc
        gc.collect()
        if anon:
            base = _rss_kib("RssAnon")
            peak[0] = base
            stop.clear()
            th = threading.Thread(target=sample, daemon=True)
            th.start()
        else:
            if not _reset_peak():
                raise RuntimeError("cannot reset VmHWM (/proc/self/clear_refs)")
            base = _rss_kib("VmRSS")
        t0 = time.perf_counter()
        if phase == "save":
            store.save_checkpoint(ckpt, progress=False)
        else:
            store.load_checkpoint(ckpt, progress=False)
        if anon:
            stop.set()
            th.join()
            results[f"{phase}_kib"] = peak[0] - base
        else:
            results[f"{phase}_kib"] = _rss_kib("VmHWM") - base
        results[f"{phase}_s"] = time.perf_counter() - t0
    results["nbytes"] = store.stats()["nbytes"]
    if not torch.equal(store.get(first)[:1000], torch.arange(1000, dtype=torch.float32)):
        raise AssertionError("the loaded states differ from the saved ones")
    store.close()
    with open(out, "w") as f:
        json.dump(results, f)


JOBS = {"resume": job_resume, "save_loop": job_save_loop, "bounded": job_bounded}


# ------------------------------------------------------------------------------ zygote
def _prewarm() -> None:
    """Pay the one-time costs (lazy imports: ``torch.optim`` pulls in ``torch._dynamo``;
    the kernel extension; safetensors, pyarrow) once in the zygote, not in every child.
    Nothing here starts a thread pool."""
    import pyarrow.parquet  # noqa: F401
    import safetensors.torch  # noqa: F401
    from statestore.kernels import kernels_info
    kernels_info()
    with ss.DeviceStore("cpu") as s:
        CPUAdam([torch.nn.Parameter(torch.zeros(2))], state_store=s)


def _zygote() -> None:
    _prewarm()
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:                     # child: a new process with the imports done
            rc = 1
            try:
                fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                random.seed()
                JOBS[req["fn"]](**req["kwargs"])
                rc = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(rc)
        proto.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        proto.write(json.dumps({"rc": rc}) + "\n")


class Zygote:
    """The test side of the zygote (see the module docstring)."""

    #: children started and not waited for (a test that failed between start and wait
    #: leaves one: its exit status would be read as the next test's answer)
    outstanding = 0

    def __init__(self, module: str = "helpers.ckpt"):
        """``python -m MODULE --zygote``: this module's jobs, or those of a module that adds
        its own (``helpers.faults``)."""
        env = paths.env(OMP_NUM_THREADS="1", ARROW_DEFAULT_MEMORY_POOL="system")
        self.proc = subprocess.Popen([sys.executable, "-m", module, "--zygote"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1, env=env)

    def _recv(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the zygote process died")
        return json.loads(line)

    def start(self, fn: str, log: str, **kwargs) -> int:
        """Fork a child running ``fn(**kwargs)``; returns its pid."""
        self.proc.stdin.write(json.dumps({"fn": fn, "kwargs": kwargs, "log": str(log)}) + "\n")
        self.outstanding += 1
        return self._recv()["pid"]

    def wait(self) -> int:
        rc = self._recv()["rc"]
        self.outstanding -= 1
        return rc

    def run(self, fn: str, log: str, **kwargs) -> None:
        """Run ``fn(**kwargs)`` in a new process; raise with its log when it fails."""
        self.start(fn, log, **kwargs)
        rc = self.wait()
        if rc != 0:
            with open(log) as f:
                raise AssertionError(f"child {fn} failed (rc={rc}):\n{f.read()}")

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except Exception:
            self.proc.kill()
            self.proc.wait()


if __name__ == "__main__":
    if sys.argv[1:] == ["--zygote"]:
        _zygote()
    else:
        print(__doc__)
        sys.exit(2)
