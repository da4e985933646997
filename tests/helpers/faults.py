"""Helpers of ``tests/reliability/test_faults.py``: a deterministic training set-up, exact comparison with
an uninterrupted reference run, leak accounting, and the child jobs that need a process of
their own (file-size limits, a private size-limited tmpfs, a read-only mount, ``kill -9``).

Child jobs run in processes forked by a zygote (the design of ``helpers/ckpt.py``: torch is
imported once; each job is a fresh process). A job writes its observations as JSON to
``out``; the test asserts on them, so a failing check shows what was observed. A job that
raises exits with status 1 and its traceback in its log; one killed by a signal (SIGBUS from
a mapped file, say) shows as a negative status.
"""
from __future__ import annotations

import ctypes
import gc
import json
import os
import resource
import signal
import sys
import threading
import time
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch

import statestore as ss
from statestore.checkpoint import read_manifest, verify_checkpoint
from statestore.optim import CPUAdam

from helpers import registry  # noqa: E402
from helpers import ckpt as H  # noqa: E402

#: A small NVMe budget: a step is cut into many pipeline units, so faults land mid-step.
NVME_BUDGET = 64 << 10

# ------------------------------------------------------------------------------ stores
#: the lines of the backend registry that keep their states in files (``disk``)
STORE_KINDS = registry.names(cuda=False, disk=True)


def make_store(kind: str, directory: str, engine: Optional[str] = None,
               budget: int = NVME_BUDGET) -> ss.StateStore:
    """A fresh store of ``kind`` (a line of the backend registry, ``tests/registry.py``)
    with its files in ``directory``; on lines that run on I/O engines, a RAM budget of
    ``budget`` bytes and ``engine`` (None: the store's choice)."""
    engines = registry.BY_NAME[kind].engines
    options: Dict[str, Any] = {"budget_bytes": budget} if engines else {}
    if engine is not None and engines == registry.EVERY_ENGINE:
        options["engine"] = engine
    return registry.make(kind, directory, **options)


def engine_of(store) -> Any:
    """The I/O engine of an NVMeStore, or of a TieredStore's disk tier."""
    if isinstance(store, ss.TieredStore):
        return next(t for t in store.tiers if isinstance(t, ss.NVMeStore)).engine
    return store.engine


def files_of(store) -> List[str]:
    """The state files of a file-backed store (a TieredStore's disk tiers included)."""
    if isinstance(store, ss.TieredStore):
        return [f for t in store.tiers if hasattr(t, "files") for f in t.files()]
    return store.files()


# ------------------------------------------------------------------------------ training
#: name -> (shape, dtype): fp32 and bf16 parameters (bf16 ones keep an fp32 master).
PARAMS = {"w0": ((48, 96), torch.float32), "b0": ((96,), torch.float32),
          "w1": ((96, 48), torch.bfloat16), "big": ((30000,), torch.float32)}


def make_params(seed: int = 0) -> List[Tuple[str, torch.nn.Parameter]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.nn.Parameter(torch.randn(shape, generator=g).to(dt)))
            for n, (shape, dt) in PARAMS.items()]


def make_opt(named, store) -> CPUAdam:
    """Two groups, named parameters, amsgrad in the first."""
    return CPUAdam([{"params": named[:2], "lr": 1e-2, "weight_decay": 0.05, "amsgrad": True},
                    {"params": named[2:], "lr": 3e-3}], lr=1e-3, state_store=store)


def set_grads(named, step: int) -> None:
    for i, (_, p) in enumerate(named):
        g = torch.Generator().manual_seed(1000 * step + i)
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def train(opt, named, start: int, n: int) -> None:
    """Steps ``start`` .. ``start + n - 1`` (after them, ``start + n`` steps are done)."""
    for step in range(start, start + n):
        set_grads(named, step)
        opt.step()
        opt.zero_grad()


def trained(store, steps: int):
    """The set-up most fault tests start from: fresh parameters (:func:`make_params`) and
    their optimizer (:func:`make_opt`) on ``store``, trained ``steps`` steps. Returns
    ``(named, opt)``."""
    named = make_params()
    opt = make_opt(named, store)
    train(opt, named, 0, steps)
    return named, opt


def snapshot(named, store) -> Dict[str, torch.Tensor]:
    """Parameters (``param:<name>``) and every state (``state:<key>``), copied."""
    out = {f"param:{n}": p.detach().clone() for n, p in named}
    for k in store.keys():
        out[f"state:{k}"] = store.get(k).clone()
    return out


def states_of_checkpoint(ck: str) -> Dict[str, torch.Tensor]:
    with ss.DeviceStore("cpu") as s:
        s.load_checkpoint(ck, progress=False)
        return {f"state:{k}": s.get(k).clone() for k in s.keys()}


_REF: Dict[int, Dict[str, torch.Tensor]] = {}


def reference(steps: int) -> Dict[str, torch.Tensor]:
    """Parameters and states after ``steps`` uninterrupted steps (DeviceStore)."""
    if steps not in _REF:
        named = make_params()
        with ss.DeviceStore("cpu") as s:
            opt = make_opt(named, s)
            train(opt, named, 0, steps)
            _REF[steps] = snapshot(named, s)
    return _REF[steps]


def differences(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor],
                only: Optional[str] = None) -> List[str]:
    """Names whose tensors differ in any bit (or are missing on either side)."""
    keys = [k for k in want if only is None or k.startswith(only)]
    out = [f"{k}: missing" for k in keys if k not in got]
    out += [f"{k}: unexpected" for k in got if (only is None or k.startswith(only))
            and k not in want]
    for k in keys:
        if k in got and (got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])):
            out.append(f"{k}: differs")
    return out


def weights_path(ck: str, step: int) -> str:
    return f"{ck}.weights-{step}.safetensors"


def save(store, named, ck: str, step: int, link: bool = True) -> None:
    """The model weights (atomically: temporary name, fsync, rename) then the optimizer
    checkpoint; the checkpoint's step counts name the weights file that goes with it."""
    from safetensors.torch import save_file
    w = weights_path(ck, step)
    save_file({n: p.detach().contiguous() for n, p in named}, w + ".tmp")
    fd = os.open(w + ".tmp", os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    os.replace(w + ".tmp", w)
    store.save_checkpoint(ck, progress=False, link=link)


def checkpoint_step(ck: str) -> int:
    return max(read_manifest(ck).metadata["steps"].values())


def resume(store, ck: str):
    """Load the weights and the checkpoint ``ck`` into ``store``; returns ``(named, opt,
    step)`` ready to train from ``step``."""
    from safetensors.torch import load_file
    step = checkpoint_step(ck)
    named = make_params(seed=99)                  # the weights file decides the values
    w = load_file(weights_path(ck, step))
    with torch.no_grad():
        for n, p in named:
            p.copy_(w[n])
    store.load_checkpoint(ck, progress=False)
    return named, make_opt(named, store), step


def warm_up(directory: str) -> None:
    """Start what lives as long as the process (torch's and Arrow's thread pools) before
    anyone counts threads: one reference run and a checkpoint save, load and verify."""
    import tempfile
    reference(8)
    with tempfile.TemporaryDirectory(dir=directory) as d, ss.DeviceStore("cpu") as s:
        s.create("w/exp_avg", (10,))
        s.save_checkpoint(os.path.join(d, "ck"), progress=False)
        s.load_checkpoint(os.path.join(d, "ck"), progress=False)
        verify_checkpoint(os.path.join(d, "ck"), progress=False)


# ------------------------------------------------------------------------------ leaks
def _fds() -> Dict[str, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass                            # the descriptor that listed the directory
    return out


def _listing(d: str) -> List[str]:
    if not os.path.isdir(d):
        return []
    return sorted(os.path.relpath(os.path.join(r, f), d)
                  for r, _, fs in os.walk(d) for f in fs)


def store_threads() -> List[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("statestore"))


def _tasks() -> int:
    return len(os.listdir("/proc/self/task"))


def native_threads() -> List[str]:
    """The native threads of statestore's I/O engines (``ss-io-reaper``, ``ss-io-worker``,
    named by ``csrc/io``), from ``/proc/self/task/*/comm``. Other native threads (torch's and
    Arrow's pools) grow lazily and live as long as the process: not ours to count."""
    out = []
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue                        # ended meanwhile
        if name.startswith("ss-"):
            out.append(name)
    return sorted(out)


class Leaks:
    """What a fault must not leave behind: file descriptors, statestore threads (Python ones
    and the engines' native ones, by name), files in ``dirs`` (temporaries included). Record
    with the constructor, compare with :meth:`problems`. Stores an earlier test dropped
    without ``close()`` are collected first: their files and threads would otherwise go
    whenever the garbage collector next runs, during the test, and read as a difference."""

    def __init__(self, *dirs: str):
        gc.collect()
        self.dirs = [str(d) for d in dirs]
        self.fds = _fds()
        self.native = native_threads()
        self.threads = store_threads()
        self.listings = {d: _listing(d) for d in self.dirs}

    def problems(self) -> List[str]:
        out = []
        fds = _fds()
        if len(fds) != len(self.fds):
            new = {k: v for k, v in fds.items() if self.fds.get(k) != v}
            out.append(f"file descriptors: {len(self.fds)} before, {len(fds)} after "
                       f"(new: {sorted(new.values())})")
        th = store_threads()
        if th != self.threads:
            out.append(f"statestore threads: {self.threads} before, {th} after")
        native = native_threads()           # joined by close(): gone already, no waiting
        if native != self.native:
            out.append(f"native statestore threads: {self.native} before, {native} after")
        for d, before in self.listings.items():
            after = _listing(d)
            if after != before:
                out.append(f"{d}: {before} before, {after} after")
        return out


def state_files(d: str) -> List[str]:
    """Store files in ``d`` (not the lock file an open store holds there)."""
    return sorted(n for n in os.listdir(d) if n.startswith("states-")) if os.path.isdir(d) else []


def temporaries(d: str) -> List[str]:
    """Names a save uses while it runs (``.shard-*.tmp``, ``.manifest.parquet.*.tmp``)."""
    return [n for n in _listing(d) if n.endswith(".tmp") or os.path.basename(n).startswith(".")]


def describe(e: BaseException) -> Dict[str, Any]:
    return {"type": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__],
            "errno": getattr(e, "errno", None), "message": str(e)}


def file_hashes(d: str) -> Dict[str, str]:
    return H.file_hashes(d)


# ------------------------------------------------------------------------------ namespaces
_libc = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWNS = 0x00020000
_MS_RDONLY, _MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18


def _call(what: str, rc: int) -> Optional[str]:
    if rc != 0:
        e = ctypes.get_errno()
        return f"{what}: {os.strerror(e)}"
    return None


def private_mounts() -> Optional[str]:
    """Enter a mount namespace of our own (mounts made next are seen by this process only,
    and vanish with it). ``None`` when done, else why not. Needs a single-threaded process."""
    if _tasks() != 1:
        return f"unshare needs a single-threaded process, this one has {_tasks()} threads"
    return (_call("unshare(CLONE_NEWNS)", _libc.unshare(_CLONE_NEWNS))
            or _call("mount --make-rprivate /",
                     _libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None)))


def mount_tmpfs(path: str, nbytes: int) -> Optional[str]:
    os.makedirs(path, exist_ok=True)
    return _call(f"mount -t tmpfs -o size={nbytes}",
                 _libc.mount(b"tmpfs", path.encode(), b"tmpfs", 0, f"size={nbytes}".encode()))


def bind_read_only(path: str) -> Optional[str]:
    p = path.encode()
    return (_call("mount --bind", _libc.mount(p, p, None, _MS_BIND, None))
            or _call("mount -o remount,bind,ro",
                     _libc.mount(None, p, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY, None)))


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(path: str, leave: int) -> None:
    """Make a ballast file ``path`` so that ``leave`` bytes stay free on its filesystem."""
    d = os.path.dirname(path)
    n = free_bytes(d) - leave
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, 0, max(n, 4096))
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------ child jobs
_FSIZE = resource.RLIMIT_FSIZE


def _limit_file_size(nbytes: Optional[int]) -> None:
    """Lower (or, ``None``, lift) the soft limit on file sizes; writes past it fail with
    EFBIG (SIGXFSZ is ignored, as a training job that wants the error must)."""
    _, hard = resource.getrlimit(_FSIZE)
    resource.setrlimit(_FSIZE, (hard if nbytes is None else nbytes, hard))


def _dump(out: str, res: Dict[str, Any]) -> None:
    with open(out + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(out + ".tmp", out)


def job_fsize_step(kind: str, root: str, out: str) -> None:
    """A file-size limit (RLIMIT_FSIZE) during steps.

    Creation: the first step creates the states; under the limit it must fail naming the
    file, change nothing (parameters, step counts) and leave no file; lifted, the same step
    succeeds. Later steps: the limit refuses every write past it, also inside existing files.
    Direct writes (NVMe) then fail: the error surfaces naming the file, later steps and saves
    refuse, and training resumed from the previous checkpoint is exact. Stores written through
    a mapping (FileStore) are not subject to the limit and must simply go on, exactly."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    torch.set_num_threads(1)
    res: Dict[str, Any] = {}
    warm_up(root)
    sdir, ck = os.path.join(root, "store"), os.path.join(root, "ck")
    leaks = Leaks(sdir)
    store = make_store(kind, sdir)
    named = make_params()
    opt = make_opt(named, store)
    before = {n: p.detach().clone() for n, p in named}
    set_grads(named, 0)
    _limit_file_size(16 << 10)
    try:
        opt.step()
        res["create_error"] = None
    except BaseException as e:  # noqa: BLE001 - observed, asserted by the test
        res["create_error"] = describe(e)
    finally:
        _limit_file_size(None)
    res["create_listing"] = state_files(sdir)
    res["params_unchanged"] = all(torch.equal(p, before[n]) for n, p in named)
    res["states_after_error"] = [str(k) for k in store.keys()]
    res["steps_after_error"] = dict(opt._steps)
    opt.step()                                   # the same gradients: step 0 again
    opt.zero_grad()
    train(opt, named, 1, 2)
    # Copied, not linked: the steps below then write inside the store's existing files (after
    # a linked save, the first write reserves new files and fails before changing anything:
    # tests/reliability/test_reliability.py).
    save(store, named, ck, 3, link=False)
    _limit_file_size(16 << 10)
    errors = []
    try:
        train(opt, named, 3, 2)
        store.sync()
        errors.append(None)
    except BaseException as e:  # noqa: BLE001
        errors.append(describe(e))
    if errors[0] is not None:                    # failed loudly: it must stay refused
        for what in ("step", "save"):
            try:
                if what == "step":
                    set_grads(named, 5)
                    opt.step()
                else:
                    store.save_checkpoint(ck, progress=False)
                errors.append(None)
            except BaseException as e:  # noqa: BLE001
                errors.append(describe(e))
    _limit_file_size(None)
    res["step_errors"] = errors
    res["previous_verify"] = verify_checkpoint(ck, progress=False)
    if errors[0] is None:
        train(opt, named, 5, 1)
    else:
        try:
            store.close()
        except ss.StateStoreError:
            pass
        store = make_store(kind, os.path.join(root, "store2"))
        named, opt, step = resume(store, ck)
        train(opt, named, step, 6 - step)
    res["differences"] = differences(snapshot(named, store), reference(6))
    store.close()
    res["problems_at_end"] = leaks.problems()
    _dump(out, res)


def job_fsize_save(kind: str, root: str, out: str) -> None:
    """A save under a file-size limit fails naming the file and cause; the previous
    checkpoint at the same path is untouched; the store keeps working."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    torch.set_num_threads(1)
    res: Dict[str, Any] = {}
    warm_up(root)
    sdir, ck = os.path.join(root, "store"), os.path.join(root, "ck")
    store = make_store(kind, sdir)
    named = make_params()
    opt = make_opt(named, store)
    train(opt, named, 0, 3)
    store.save_checkpoint(ck, progress=False)
    hashes = file_hashes(ck)
    train(opt, named, 3, 2)
    leaks = Leaks(ck, sdir)
    _limit_file_size(64 << 10)
    try:
        # link=False: an NVMeStore's linked save writes no shard data (checked below).
        store.save_checkpoint(ck, progress=False, link=False)
        res["error"] = None
    except BaseException as e:  # noqa: BLE001
        res["error"] = describe(e)
    finally:
        _limit_file_size(None)
    res["problems_after_error"] = leaks.problems()
    if kind == "nvme":
        # Linking the store's files writes only the manifest: it fits under the limit.
        _limit_file_size(64 << 10)
        try:
            store.save_checkpoint(os.path.join(root, "ck-linked"), progress=False)
            res["linked_error"] = None
        except BaseException as e:  # noqa: BLE001
            res["linked_error"] = describe(e)
        finally:
            _limit_file_size(None)
        res["linked_verify"] = verify_checkpoint(os.path.join(root, "ck-linked"), progress=False)
        res["linked_differences"] = differences(
            states_of_checkpoint(os.path.join(root, "ck-linked")), reference(5), "state:")
    res["previous_unchanged"] = file_hashes(ck) == hashes
    res["previous_verify"] = verify_checkpoint(ck, progress=False)
    res["previous_differences"] = differences(states_of_checkpoint(ck), reference(3), "state:")
    train(opt, named, 5, 1)                      # the store keeps working
    store.save_checkpoint(ck, progress=False)
    res["new_verify"] = verify_checkpoint(ck, progress=False)
    res["new_differences"] = differences(states_of_checkpoint(ck), reference(6), "state:")
    res["differences"] = differences(snapshot(named, store), reference(6))
    res["temporaries"] = temporaries(ck)
    store.close()
    _dump(out, res)


def job_disk_full(kind: str, root: str, out: str) -> None:
    """A real full filesystem (a private, size-limited tmpfs): creating states (the first step)
    and saving fail with ENOSPC naming the file (never SIGBUS from a mapped file); after space
    is freed the same step and the save succeed, and the results are exact."""
    torch.set_num_threads(1)
    res: Dict[str, Any] = {}
    why = private_mounts()
    mnt = os.path.join(root, "mnt")
    why = why or mount_tmpfs(mnt, 4 << 20)
    if why:
        _dump(out, {"skip": why})
        return
    warm_up(root)
    sdir, ck, ballast = os.path.join(mnt, "store"), os.path.join(mnt, "ck"), os.path.join(mnt, "ballast")
    store = make_store(kind, sdir)
    named = make_params()
    opt = make_opt(named, store)
    leaks = Leaks(sdir)
    before = {n: p.detach().clone() for n, p in named}
    fill(ballast, 64 << 10)
    set_grads(named, 0)
    try:
        opt.step()
        res["step_error"] = None
    except BaseException as e:  # noqa: BLE001
        res["step_error"] = describe(e)
    res["step_problems"] = leaks.problems()
    res["params_unchanged"] = all(torch.equal(p, before[n]) for n, p in named)
    os.unlink(ballast)
    opt.step()                                   # step 0 again, now with room
    opt.zero_grad()
    train(opt, named, 1, 2)
    store.save_checkpoint(ck, progress=False)
    hashes = file_hashes(ck)
    train(opt, named, 3, 1)
    fill(ballast, 64 << 10)
    leaks = Leaks(ck, sdir)
    try:
        # link=False: an NVMeStore's linked save needs no room for shard data.
        store.save_checkpoint(ck, progress=False, link=False)
        res["save_error"] = None
    except BaseException as e:  # noqa: BLE001
        res["save_error"] = describe(e)
    res["save_problems"] = leaks.problems()
    res["previous_unchanged"] = file_hashes(ck) == hashes
    res["previous_verify"] = verify_checkpoint(ck, progress=False)
    os.unlink(ballast)
    store.save_checkpoint(ck, progress=False)
    res["new_verify"] = verify_checkpoint(ck, progress=False)
    res["new_differences"] = differences(states_of_checkpoint(ck), reference(4), "state:")
    res["differences"] = differences(snapshot(named, store), reference(4))
    store.close()
    _dump(out, res)


def job_read_only(kind: str, root: str, out: str) -> None:
    """Saving into a read-only checkpoint directory fails naming the file and cause, the
    checkpoint there still verifies and loads (from the read-only directory), and the store
    keeps working. As root, permissions do not stop writes: the directory is bind-mounted
    read-only in a private mount namespace instead (EROFS)."""
    torch.set_num_threads(1)
    res: Dict[str, Any] = {}
    root_user = os.geteuid() == 0
    if root_user:
        why = private_mounts()
        if why:
            _dump(out, {"skip": why})
            return
    warm_up(root)
    sdir, ck, ck2 = (os.path.join(root, n) for n in ("store", "ck", "ck2"))
    store = make_store(kind, sdir)
    named = make_params()
    opt = make_opt(named, store)
    train(opt, named, 0, 3)
    store.save_checkpoint(ck, progress=False)
    hashes = file_hashes(ck)
    if root_user:
        why = bind_read_only(ck)
        if why:
            _dump(out, {"skip": why})
            return
    else:
        os.chmod(ck, 0o555)
    res["how"] = "read-only bind mount" if root_user else "chmod 0555"
    train(opt, named, 3, 1)
    leaks = Leaks(ck, sdir)
    try:
        store.save_checkpoint(ck, progress=False)
        res["error"] = None
    except BaseException as e:  # noqa: BLE001
        res["error"] = describe(e)
    res["problems_after_error"] = leaks.problems()
    res["previous_unchanged"] = file_hashes(ck) == hashes
    res["previous_verify"] = verify_checkpoint(ck, progress=False)
    res["previous_differences"] = differences(states_of_checkpoint(ck), reference(3), "state:")
    store.save_checkpoint(ck2, progress=False)   # the store keeps working
    res["new_verify"] = verify_checkpoint(ck2, progress=False)
    res["differences"] = differences(snapshot(named, store), reference(4))
    store.close()
    if not root_user:
        os.chmod(ck, 0o755)
    _dump(out, res)


def job_truncate(kind: str, root: str, out: str) -> None:
    """Truncate the store's files under the live store: every later step and save fails
    naming the file (never SIGBUS), without touching parameters; the previous checkpoint
    loads into the same store (rollback in-process) and training resumes exactly."""
    torch.set_num_threads(1)
    res: Dict[str, Any] = {}
    warm_up(root)
    sdir, ck = os.path.join(root, "store"), os.path.join(root, "ck")
    store = make_store(kind, sdir)
    named = make_params()
    opt = make_opt(named, store)
    train(opt, named, 0, 3)
    save(store, named, ck, 3)
    train(opt, named, 3, 1)
    store.sync()
    for f in files_of(store):
        os.truncate(f, os.path.getsize(f) // 2)
    before = {n: p.detach().clone() for n, p in named}
    errors = []
    for _ in range(2):
        set_grads(named, 4)
        try:
            opt.step()
            errors.append(None)
        except BaseException as e:  # noqa: BLE001
            errors.append(describe(e))
    res["step_errors"] = errors
    res["params_unchanged"] = all(torch.equal(p, before[n]) for n, p in named)
    try:
        store.save_checkpoint(ck, progress=False)
        res["save_error"] = None
    except BaseException as e:  # noqa: BLE001
        res["save_error"] = describe(e)
    res["previous_verify"] = verify_checkpoint(ck, progress=False)
    res["files"] = files_of(store)
    named, opt, step = resume(store, ck)         # roll back, in this process, same store
    res["resumed_at"] = step
    train(opt, named, step, 6 - step)
    res["differences"] = differences(snapshot(named, store), reference(6))
    store.close()
    res["store_dir_after_close"] = sorted(os.listdir(sdir))
    _dump(out, res)


def job_kill_in_step(engine: str, root: str, marker: str) -> None:
    """Train on an NVMeStore, saving after steps 2 and 4; in step 6 (the 7th), after some
    units were written and others not, create ``marker`` and wait to be killed."""
    torch.set_num_threads(1)
    sdir, ck = os.path.join(root, "store"), os.path.join(root, "ck")
    store = ss.NVMeStore(sdir, engine=engine, budget_bytes=NVME_BUDGET)
    named = make_params()
    opt = make_opt(named, store)
    for step in range(6):
        set_grads(named, step)
        opt.step()
        opt.zero_grad()
        if step + 1 in (2, 4):
            save(store, named, ck, step + 1)
    submit = store._submit_write
    calls = [0]

    def submit_then_hang(s, src, **kw):
        calls[0] += 1
        fut = submit(s, src, **kw)
        if calls[0] == 5:                       # mid-step: writes in flight, units unwritten
            open(marker, "w").close()
            while True:
                time.sleep(1)
        return fut

    store._submit_write = submit_then_hang
    set_grads(named, 6)
    opt.step()
    raise AssertionError("step 6 returned: the kill point was never reached")


def job_hold_stores(root: str, marker: str) -> None:
    """Open an NVMeStore in a temporary directory (``dir=None``) and a FileStore under
    ``root``, write their directories to ``marker``, and wait to be killed."""
    t = ss.NVMeStore(budget_bytes=NVME_BUDGET)
    t.create("a/m", (5000,), torch.float32, torch.ones(5000))
    f = ss.FileStore(os.path.join(root, "filestore"))
    f.create("a/m", (5000,), torch.float32, torch.ones(5000))
    t.sync()
    f.sync()
    _dump(marker, {"tmp": t.dir, "file": f.dir})
    while True:
        time.sleep(1)


def _linked(ck: str, sdir: str) -> bool:
    """Whether some shard of ``ck`` is a hard link of a file of the store in ``sdir``."""
    inodes = {os.stat(os.path.join(sdir, n)).st_ino for n in state_files(sdir)}
    return any(os.stat(os.path.join(ck, n)).st_ino in inodes
               for n in os.listdir(ck) if n.startswith("shard-"))


def mount_ext4_loop(path: str, nbytes: int) -> Optional[str]:
    """A fresh ext4 filesystem of ``nbytes`` in a file, loop-mounted at ``path`` (inside a
    private mount namespace: it vanishes with the process). No blocks reserved for root, so
    "full" means full for root too. ``None`` when done, else why not."""
    import subprocess
    img = path + ".img"
    os.makedirs(path, exist_ok=True)
    with open(img, "wb") as f:
        f.truncate(nbytes)
    for cmd in (["mkfs.ext4", "-q", "-F", "-m", "0", img], ["mount", "-o", "loop", img, path]):
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as e:
            return f"{cmd[0]}: {e}"
        if r.returncode != 0:
            return f"{' '.join(cmd[:2])}: {r.stderr.strip()[:200]}"
    return None


def job_disk_full_after_linked_save(kind: str, root: str, out: str, fs: str = "tmpfs") -> None:
    """Issue 18.1 / 20.2 on a real full filesystem (a private tmpfs, or an ext4 loop mount):
    after a linked save, the disk fills; the next step must fail before it changes anything
    (naming bytes needed and free), and succeed once space is freed, exactly. A linked save
    whose copy-on-write would not fit is refused up front, writing nothing; with room again
    it succeeds and training goes on exactly."""
    torch.set_num_threads(1)
    res: Dict[str, Any] = {}
    why = private_mounts()
    mnt = os.path.join(root, "mnt")
    if fs == "ext4":
        why = why or mount_ext4_loop(mnt, 16 << 20)
    else:
        why = why or mount_tmpfs(mnt, 8 << 20)
    if why:
        _dump(out, {"skip": why})
        return
    warm_up(root)
    sdir, ck, ck2 = (os.path.join(mnt, n) for n in ("store", "ck", "ck2"))
    ballast = os.path.join(mnt, "ballast")
    store = make_store(kind, sdir)
    named = make_params()
    opt = make_opt(named, store)
    train(opt, named, 0, 2)
    store.save_checkpoint(ck, progress=False)
    res["linked"] = _linked(ck, sdir)
    fill(ballast, 64 << 10)
    before = {n: p.detach().clone() for n, p in named}
    files_before = state_files(sdir)
    set_grads(named, 2)
    try:
        opt.step()
        res["step_error"] = None
    except BaseException as e:  # noqa: BLE001
        res["step_error"] = describe(e)
    res["params_unchanged"] = all(torch.equal(p, before[n]) for n, p in named)
    res["files_unchanged"] = state_files(sdir) == files_before
    os.unlink(ballast)
    try:
        opt.step()                      # the same step 2, now with room
        opt.zero_grad()
        train(opt, named, 3, 1)
        res["retry_error"] = None
    except BaseException as e:  # noqa: BLE001
        res["retry_error"] = describe(e)
    res["differences"] = differences(snapshot(named, store), reference(4))
    res["ck_verify"] = verify_checkpoint(ck, progress=False)
    res["ck_differences"] = differences(states_of_checkpoint(ck), reference(2), "state:")
    # A linked save into a new path: copy-on-write will need a new file per linked file.
    fill(ballast, 64 << 10)
    try:
        store.save_checkpoint(ck2, progress=False)
        res["save_error"] = None
    except BaseException as e:  # noqa: BLE001
        res["save_error"] = describe(e)
    res["ck2_listing"] = _listing(ck2)
    os.unlink(ballast)
    store.save_checkpoint(ck2, progress=False)
    train(opt, named, 4, 1)
    res["ck2_verify"] = verify_checkpoint(ck2, progress=False)
    res["ck2_differences"] = differences(states_of_checkpoint(ck2), reference(4), "state:")
    res["final_differences"] = differences(snapshot(named, store), reference(5))
    store.close()
    _dump(out, res)


JOBS = {"hold_stores": job_hold_stores, "fsize_step": job_fsize_step, "fsize_save": job_fsize_save,
        "disk_full": job_disk_full, "read_only": job_read_only, "truncate": job_truncate,
        "kill_in_step": job_kill_in_step,
        "disk_full_after_linked_save": job_disk_full_after_linked_save}


class Zygote(H.Zygote):
    """``helpers.ckpt.Zygote`` running this module's jobs."""

    def __init__(self):  # noqa: D107 - same protocol, this script
        super().__init__("helpers.faults")

    def job(self, fn: str, tmp_path, **kwargs) -> Dict[str, Any]:
        """Run job ``fn`` in a new process; returns what it observed."""
        out, log = str(tmp_path / f"{fn}.json"), str(tmp_path / f"{fn}.log")
        self.start(fn, log, out=out, **kwargs)
        rc = self.wait()
        if rc != 0 or not os.path.exists(out):
            with open(log) as f:
                raise AssertionError(f"child job {fn} failed (exit status {rc}"
                                     f"{', killed by ' + signal.Signals(-rc).name if rc < 0 else ''}"
                                     f"):\n{f.read()}")
        with open(out) as f:
            return json.load(f)


if __name__ == "__main__":
    if sys.argv[1:] == ["--zygote"]:
        warnings.simplefilter("ignore", RuntimeWarning)
        H.JOBS.update(JOBS)
        H._zygote()
    else:
        print(__doc__)
        sys.exit(2)
