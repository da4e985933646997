"""Real faults (issue 7, part 1): statestore keeps working, or fails loudly and loses nothing.

Each fault is produced for real, not mocked: a file-size limit (``RLIMIT_FSIZE``) and a full
filesystem (a private size-limited tmpfs) during a step and during a save; EIO and short reads
and writes from inside the I/O engine (its test-only injection hook, applied where the engine
handles real completions); a state file removed or truncated under a live store; a read-only
checkpoint directory; ``kill -9`` in the middle of an NVMe-offloaded ``step()`` followed by a
resume from the last checkpoint. After each, the tests check that

* the error is a :class:`statestore.StateStoreError` (``StateStoreIOError`` for I/O) whose
  message names the file and the cause;
* the previous checkpoint is untouched, verifies and loads; training resumed from it gives
  bit-identical parameters and states to an uninterrupted run;
* no statestore thread is left, no file descriptor leaks, no temporary file is left behind.

Faults that could take the test process down (file-size limits, mounts, SIGBUS if a mapped
file were truncated, ``kill -9``) run in child processes forked by a zygote
(``helpers/faults.py``), which report what they observed. No pass/fail depends on timing.
"""
from __future__ import annotations

import errno
import os
import re
import signal
import sys
import time

import pytest
import torch

import statestore as ss
from statestore.checkpoint import verify_checkpoint
from statestore.io import available_engines

from helpers import paths  # noqa: E402
from helpers import registry  # noqa: E402
from helpers import faults as F  # noqa: E402

ENGINES = [e for e in available_engines() if e in ("io_uring", "libaio", "threads")]
if not ENGINES:  # pragma: no cover - the native engines are not built
    ENGINES = ["pythreads"]
#: disk stores whose I/O goes through an engine (TensorNVMe's adapter has the same test-only
#: injection hook: an "error" is refused before it reaches TensorNVMe, so the block keeps
#: its bytes, as a failed request leaves a disk's)
ENGINE_STORES = registry.engine_lines(ENGINES)


@pytest.fixture(scope="module", autouse=True)
def _warm(tmp_path_factory):
    """Start what lives for the whole process (torch's and Arrow's thread pools, the engine
    probes) before any test counts threads and descriptors."""
    F.warm_up(str(tmp_path_factory.mktemp("warm")))
    available_engines()


def _assert_io_error(err, *, errnos, names):
    """``err`` (an exception, or a child's description of one) is a StateStoreIOError with
    one of ``errnos`` whose message names every string in ``names``."""
    if isinstance(err, BaseException):
        err = F.describe(err)
    assert err is not None, "no error was raised"
    assert "StateStoreError" in err["mro"], err
    assert "StateStoreIOError" in err["mro"], err
    assert err["errno"] in errnos, err
    for n in names:
        assert n in err["message"], (n, err["message"])


def _cause(code: int) -> str:
    return os.strerror(code)


def _close(store):
    try:
        store.close()
    except ss.StateStoreError:
        pass


# ------------------------------------------------------------------------ engine faults: EIO
@pytest.mark.parametrize("kind,engine", ENGINE_STORES)
def test_write_eio_in_step_is_loud_and_sticky(kind, engine, tmp_path):
    """A background write fails with EIO during a step: the error surfaces at the next call
    (naming the file), and every later step and save refuses rather than going on with the lost
    update; the previous checkpoint is intact and resuming from it is exact."""
    sdir, ck = str(tmp_path / "s"), str(tmp_path / "ck")
    leaks = F.Leaks()
    store = F.make_store(kind, sdir, engine)
    named, opt = F.trained(store, 3)
    F.save(store, named, ck, 3)
    hashes = F.file_hashes(ck)
    # what Leaks checks is there to see (TensorNVMe's adapter has no native thread of ours)
    assert (F.native_threads() or kind == "tensornvme") and F.store_threads()
    F.engine_of(store)._inject_fault_for_testing(op="write", skip=3, count=1, err=errno.EIO)
    with pytest.raises(ss.StateStoreError) as ei:
        F.train(opt, named, 3, 2)
        store.sync()
    _assert_io_error(ei.value, errnos={errno.EIO}, names=["states-", _cause(errno.EIO)])
    assert any(f in str(ei.value) for f in F.files_of(store))
    # The lost update is never silently trained on or checkpointed.
    for _ in range(2):
        F.set_grads(named, 5)
        with pytest.raises(ss.StateStoreError):
            opt.step()
    with pytest.raises(ss.StateStoreError):
        store.save_checkpoint(ck, progress=False)
    assert F.file_hashes(ck) == hashes and verify_checkpoint(ck, progress=False) == []
    _close(store)
    assert F.store_threads() == leaks.threads      # closing despite the error leaves none
    store = F.make_store(kind, str(tmp_path / "s2"), engine)
    named, opt, step = F.resume(store, ck)
    F.train(opt, named, step, 6 - step)
    assert F.differences(F.snapshot(named, store), F.reference(6)) == []
    store.close()
    assert leaks.problems() == []
    assert F.temporaries(ck) == [] and os.listdir(sdir) == [] and os.listdir(tmp_path / "s2") == []


@pytest.mark.parametrize("kind,engine", ENGINE_STORES)
def test_read_eio_mid_step_stops_the_optimizer(kind, engine, tmp_path, monkeypatch):
    """A read fails with EIO after the step already updated some parameters: the step raises
    naming the file; the optimizer then refuses to step or checkpoint (its parameters hold two
    steps); the previous checkpoint resumes exactly."""
    import statestore.optim._units as adam_mod      # where the optimizer calls the kernel
    monkeypatch.setenv("STATESTORE_STEP_PLAN", "0")     # (the planned step: test_step_plan.py)
    sdir, ck = str(tmp_path / "s"), str(tmp_path / "ck")
    leaks = F.Leaks()
    store = F.make_store(kind, sdir, engine)
    named, opt = F.trained(store, 3)
    F.save(store, named, ck, 3)
    eng = F.engine_of(store)
    kernel = adam_mod.adam_step
    units = [0]

    def kernel_then_fault(*a, **kw):        # arm the fault once the step changed something
        units[0] += 1
        if units[0] == 1:
            eng._inject_fault_for_testing(op="read", count=1, err=errno.EIO)
        return kernel(*a, **kw)

    monkeypatch.setattr(adam_mod, "adam_step", kernel_then_fault)
    F.set_grads(named, 3)
    with pytest.raises(ss.StateStoreIOError) as ei:
        opt.step()
    monkeypatch.undo()
    _assert_io_error(ei.value, errnos={errno.EIO}, names=["states-", _cause(errno.EIO)])
    with pytest.raises(ss.StateStoreError, match="failed part-way"):
        opt.step()
    with pytest.raises(ss.StateStoreError, match="failed part-way"):
        store.save_checkpoint(ck, progress=False)
    assert verify_checkpoint(ck, progress=False) == [] and F.temporaries(ck) == []
    # Roll back in the same process and store: load the checkpoint, build a new optimizer.
    named, opt, step = F.resume(store, ck)
    F.train(opt, named, step, 5 - step)
    assert F.differences(F.snapshot(named, store), F.reference(5)) == []
    store.close()
    assert leaks.problems() == []
    assert os.listdir(sdir) == []


@pytest.mark.parametrize("kind,engine", ENGINE_STORES)
def test_read_eio_before_any_update_is_retryable(kind, engine, tmp_path):
    """A read that fails before the step changed anything leaves the optimizer as it was:
    the step raises naming the file, the same step retried succeeds, and the run is exact."""
    # The step has one unit per param group. Every read of the step fails, so the first
    # unit's reads fail too and nothing is updated, whichever block completes first (a
    # single fault could hit the second unit's read after the first unit was updated: a
    # failure part-way).
    leaks = F.Leaks()
    store = F.make_store(kind, str(tmp_path / "s"), engine, budget=64 << 20)
    named, opt = F.trained(store, 2)
    before = F.snapshot(named, store)
    # The last step's prefetch may have read the next step's states already (then the fault
    # would hit the prefetch that step 3 starts, and surface at step 4): drop it first.
    store.cancel_prefetch()
    F.engine_of(store)._inject_fault_for_testing(op="read", count=1 << 20, err=errno.EIO)
    F.set_grads(named, 2)
    with pytest.raises(ss.StateStoreIOError) as ei:
        opt.step()
    F.engine_of(store)._clear_faults_for_testing()
    _assert_io_error(ei.value, errnos={errno.EIO}, names=["states-", _cause(errno.EIO)])
    assert F.differences(F.snapshot(named, store), before) == []
    opt.step()                                   # the same step again
    opt.zero_grad()
    F.train(opt, named, 3, 2)
    assert F.differences(F.snapshot(named, store), F.reference(5)) == []
    store.close()
    assert leaks.problems() == []


# ------------------------------------------------------------------- engine faults: short I/O
@pytest.mark.parametrize("engine", ENGINES)
def test_short_reads_and_writes_are_transparent(engine, tmp_path):
    """Reads and writes that come back short (half a block) are completed by the engine:
    training, save and load are bit-identical to an uninterrupted run."""
    if engine == "pythreads":
        pytest.skip("the pure-Python engine has no injection hook")
    store = F.make_store("nvme", str(tmp_path / "s"), engine)
    eng = F.engine_of(store)
    named = F.make_params()
    opt = F.make_opt(named, store)
    for step in range(4):
        eng._inject_fault_for_testing(op="any", count=40, kind="short")
        F.train(opt, named, step, 1)
    eng._inject_fault_for_testing(op="read", count=40, kind="short")
    store.save_checkpoint(str(tmp_path / "ck"), progress=False)
    store.sync()
    assert eng.stats()["retries"] > 0 and eng.stats()["errors"] == 0
    assert F.differences(F.snapshot(named, store), F.reference(4)) == []
    eng._inject_fault_for_testing(op="write", count=40, kind="short")
    store.load_checkpoint(str(tmp_path / "ck"), progress=False)
    assert F.differences(F.snapshot(named, store), F.reference(4), "state:") == []
    store.close()


# ----------------------------------------------------------------- engine faults: save, load
@pytest.mark.parametrize("kind,engine", ENGINE_STORES)
def test_read_eio_during_save_keeps_previous_checkpoint(kind, engine, tmp_path):
    """Re-saving to the same path (copying) fails (EIO reading the store): the error names the file,
    the previous checkpoint is byte-for-byte intact and verifies, nothing temporary is left,
    and the store and optimizer keep working (the next save is exact)."""
    sdir, ck = str(tmp_path / "s"), str(tmp_path / "ck")
    store = F.make_store(kind, sdir, engine)
    named, opt = F.trained(store, 3)
    store.save_checkpoint(ck, progress=False)
    hashes = F.file_hashes(ck)
    F.train(opt, named, 3, 1)
    store.sync()
    leaks = F.Leaks(ck, sdir)
    # A linked save reads nothing here (the store hashed the states as the step wrote them,
    # tests/checkpoint/test_checkpoint_link.py): copy, so that the save reads the store. The next
    # step's prefetch is dropped first, so that the armed fault hits the save's reads.
    store.cancel_prefetch()
    F.engine_of(store)._inject_fault_for_testing(op="read", skip=2, count=1, err=errno.EIO)
    with pytest.raises(ss.StateStoreIOError) as ei:
        store.save_checkpoint(ck, progress=False, link=False)
    _assert_io_error(ei.value, errnos={errno.EIO}, names=["states-", _cause(errno.EIO)])
    assert leaks.problems() == []
    assert F.file_hashes(ck) == hashes and verify_checkpoint(ck, progress=False) == []
    F.train(opt, named, 4, 1)
    store.save_checkpoint(ck, progress=False)
    assert verify_checkpoint(ck, progress=False) == [] and F.temporaries(ck) == []
    assert F.differences(F.states_of_checkpoint(ck), F.reference(5), "state:") == []
    store.close()


@pytest.mark.parametrize("kind,engine", ENGINE_STORES)
def test_write_eio_during_load_leaves_store_empty(kind, engine, tmp_path):
    """Loading fails (EIO writing the store): the error names the file, the store is left
    empty (never half-loaded), and loading again succeeds exactly."""
    ck = str(tmp_path / "ck")
    with ss.DeviceStore("cpu") as src:
        named = F.make_params()
        F.train(F.make_opt(named, src), named, 0, 3)
        src.save_checkpoint(ck, progress=False)
    leaks = F.Leaks(tmp_path / "s")
    store = F.make_store(kind, str(tmp_path / "s"), engine)
    F.engine_of(store)._inject_fault_for_testing(op="write", skip=1, count=1, err=errno.EIO)
    with pytest.raises(ss.StateStoreIOError) as ei:
        store.load_checkpoint(ck, progress=False)
    _assert_io_error(ei.value, errnos={errno.EIO}, names=["states-", _cause(errno.EIO)])
    assert len(store) == 0 and store.loaded_metadata is None
    assert F.state_files(str(tmp_path / "s")) == []
    store.load_checkpoint(ck, progress=False)
    assert F.differences(F.snapshot([], store), F.reference(3), "state:") == []
    store.close()
    assert leaks.problems() == []


def test_injection_hook_is_inert_in_production():
    """Nothing in the library arms the hook (only its own definition forwards to the C++
    queue), and a fresh engine transfers without faults or retries."""
    import ast
    root = os.path.dirname(ss.__file__)
    callers = []
    for d, _, files in os.walk(root):
        for name in files:
            path = os.path.join(d, name)
            with open(path, errors="replace") as f:
                text = f.read()
            if name.endswith(".py"):
                tree = ast.parse(text)
                for fn in ast.walk(tree):
                    if isinstance(fn, ast.FunctionDef) and fn.name == "_inject_fault_for_testing":
                        fn.body = []            # the hook's own body forwards the arguments
                for node in ast.walk(tree):
                    if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(
                            node.func, "id", "")) in ("_inject_fault_for_testing", "inject_fault"):
                        callers.append(f"{path}:{node.lineno}")
    csrc = os.path.join(os.path.dirname(root), "csrc")
    for d, _, files in os.walk(csrc):
        for name in files:
            with open(os.path.join(d, name), errors="replace") as f:
                for i, line in enumerate(f, 1):
                    if re.search(r"\binject_fault\s*\(", line) and not line.lstrip().startswith(
                            ("void ", "//")):
                        callers.append(f"{name}:{i}: {line.strip()}")
    assert callers == []
    for name in ENGINES:
        if name == "pythreads":
            continue
        with ss.io.make_engine(name, block_size=4096) as eng, \
                ss.io.IOFile(os.path.join(paths.ROOT, ".inert-probe"),
                             create=True) as f:
            os.unlink(f.path)
            buf = ss.io.alloc_buffer(1 << 16, pinned=False)
            for _ in range(8):
                eng.write(f, buf, 0).result()
                eng.read(f, buf, 0).result()
            st = eng.stats()
            assert st["errors"] == 0 and st["retries"] == 0, st


# ------------------------------------------------------------ files removed under the store
@pytest.mark.parametrize("kind", F.STORE_KINDS)
def test_state_files_removed_under_live_store(kind, tmp_path):
    """``rm`` of the store's files: the next step fails naming a file ("removed") before
    changing anything; the states live on in the open files, so a checkpoint saved then keeps
    them, and training resumed from it is exact."""
    sdir, ck = str(tmp_path / "s"), str(tmp_path / "ck")
    leaks = F.Leaks()
    store = F.make_store(kind, sdir)
    named, opt = F.trained(store, 3)
    before = F.snapshot(named, store)
    files = F.files_of(store)
    for f in files:
        os.unlink(f)
    F.set_grads(named, 3)
    with pytest.raises(ss.StateStoreIOError) as ei:
        opt.step()
    _assert_io_error(ei.value, errnos={errno.ENOENT}, names=["removed"])
    assert any(f in str(ei.value) for f in files)
    assert F.differences(F.snapshot(named, store), before) == []
    opt.step()                                   # reported once; the same step goes on
    opt.zero_grad()
    F.save(store, named, ck, 4)
    assert verify_checkpoint(ck, progress=False) == []
    store.close()
    assert leaks.problems() == [] and os.listdir(sdir) == []
    store = F.make_store(kind, str(tmp_path / "s2"))
    named, opt, step = F.resume(store, ck)
    F.train(opt, named, step, 6 - step)
    assert F.differences(F.snapshot(named, store), F.reference(6)) == []
    store.close()


@pytest.mark.parametrize("kind", F.STORE_KINDS)
def test_state_files_truncated_under_live_store(kind, tmp_path, zygote):
    """Truncating the store's files loses states: every later step and save refuses naming
    the file (never SIGBUS from the mapping), parameters stay untouched, the previous
    checkpoint verifies and, loaded into the same store, resumes exactly."""
    r = zygote.job("truncate", tmp_path, kind=kind, root=str(tmp_path))
    assert len(r["step_errors"]) == 2
    for e in r["step_errors"] + [r["save_error"]]:
        _assert_io_error(e, errnos={errno.EIO}, names=["truncated"])
        assert any(f in e["message"] for f in r["files"]), e
    assert r["params_unchanged"]
    assert r["previous_verify"] == []
    assert r["resumed_at"] == 3 and r["differences"] == []
    assert r["store_dir_after_close"] == []


# --------------------------------------------------------------------- file size, disk full
@pytest.mark.parametrize("kind", F.STORE_KINDS)
def test_file_size_limit_during_step(kind, tmp_path, zygote):
    """RLIMIT_FSIZE during steps. When the first step creates the states: EFBIG naming the
    file, nothing changed or left behind, and the same step succeeds once the limit is lifted.
    On later steps, direct writes (NVMe, the tiered store's disk tier) fail: EFBIG naming the
    file, then every step and save refuses, and the resume from the previous checkpoint is
    exact; writes through a mapping (FileStore) are not limited and training goes on exactly."""
    r = zygote.job("fsize_step", tmp_path, kind=kind, root=str(tmp_path))
    _assert_io_error(r["create_error"], errnos={errno.EFBIG},
                     names=["states-", str(tmp_path), _cause(errno.EFBIG)])
    assert r["create_listing"] == []
    assert r["params_unchanged"] and r["states_after_error"] == [] and r["steps_after_error"] == {}
    if kind == "file":
        assert r["step_errors"] == [None]
    else:
        assert len(r["step_errors"]) == 3
        _assert_io_error(r["step_errors"][0], errnos={errno.EFBIG},
                         names=["states-", str(tmp_path), _cause(errno.EFBIG)])
        for e in r["step_errors"][1:]:
            assert e is not None and "StateStoreError" in e["mro"], e
    assert r["previous_verify"] == []
    assert r["differences"] == []
    assert r["problems_at_end"] == []


@pytest.mark.parametrize("kind", F.STORE_KINDS)
def test_file_size_limit_during_save(kind, tmp_path, zygote):
    """RLIMIT_FSIZE during a re-save to the same path (copying, ``link=False``): EFBIG naming
    the shard being written; the previous checkpoint is byte-for-byte intact, verifies and
    holds the step-3 states; no descriptor, thread or temporary file is left; the next save is
    exact. An NVMeStore's linked save writes only the manifest, so it succeeds under the same
    limit, exact."""
    r = zygote.job("fsize_save", tmp_path, kind=kind, root=str(tmp_path))
    _assert_io_error(r["error"], errnos={errno.EFBIG},
                     names=[str(tmp_path / "ck"), ".shard-", _cause(errno.EFBIG)])
    assert r["problems_after_error"] == []
    assert r["previous_unchanged"] and r["previous_verify"] == []
    assert r["previous_differences"] == []
    assert r["new_verify"] == [] and r["new_differences"] == [] and r["differences"] == []
    assert r["temporaries"] == []
    if kind == "nvme":
        assert r["linked_error"] is None
        assert r["linked_verify"] == [] and r["linked_differences"] == []


@pytest.mark.parametrize("kind", F.STORE_KINDS)
def test_disk_full(kind, tmp_path, zygote):
    """A full filesystem (a private 4 MiB tmpfs): creating states fails with ENOSPC naming
    the file, never SIGBUS from a mapped file; saving fails with ENOSPC keeping the previous
    checkpoint; after space is freed the same step and the save succeed exactly."""
    r = zygote.job("disk_full", tmp_path, kind=kind, root=str(tmp_path))
    if "skip" in r:
        pytest.skip(f"no private tmpfs here: {r['skip']}")
    _assert_io_error(r["step_error"], errnos={errno.ENOSPC}, names=["states-", _cause(errno.ENOSPC)])
    assert r["step_problems"] == [] and r["params_unchanged"]
    _assert_io_error(r["save_error"], errnos={errno.ENOSPC}, names=[".shard-", _cause(errno.ENOSPC)])
    assert r["save_problems"] == []
    assert r["previous_unchanged"] and r["previous_verify"] == []
    assert r["new_verify"] == [] and r["new_differences"] == [] and r["differences"] == []


# ------------------------------------------------------------------- read-only checkpoint dir
@pytest.mark.parametrize("kind", F.STORE_KINDS)
def test_read_only_checkpoint_directory(kind, tmp_path, zygote):
    """Saving into a read-only checkpoint directory fails naming the file and the cause; the
    checkpoint already there verifies and loads from it; the store keeps working."""
    r = zygote.job("read_only", tmp_path, kind=kind, root=str(tmp_path))
    if "skip" in r:
        pytest.skip(f"cannot make a read-only directory here: {r['skip']}")
    code = errno.EROFS if r["how"].startswith("read-only") else errno.EACCES
    _assert_io_error(r["error"], errnos={code}, names=[str(tmp_path / "ck"), _cause(code)])
    assert r["problems_after_error"] == []
    assert r["previous_unchanged"] and r["previous_verify"] == []
    assert r["previous_differences"] == []
    assert r["new_verify"] == [] and r["differences"] == []


# ---------------------------------------------------------------------------- kill -9
@pytest.mark.parametrize("engine", ENGINES)
def test_kill_9_during_nvme_step_then_resume(engine, tmp_path, zygote):
    """``kill -9`` in the middle of an NVMe-offloaded ``step()`` (some units written, writes
    in flight, others not started): the last checkpoint verifies; a new store in the same
    directory reclaims the dead store's files, resumes from the checkpoint and trains on
    bit-identically to a run never interrupted; the resume leaks nothing."""
    root, marker = tmp_path / "run", tmp_path / "in-step"
    ck = str(root / "ck")
    pid = zygote.start("kill_in_step", str(tmp_path / "child.log"), engine=engine,
                       root=str(root), marker=str(marker))
    t0 = time.monotonic()
    while not marker.exists():
        if time.monotonic() - t0 > 120:      # a safety net only: the child hangs by design
            os.kill(pid, signal.SIGKILL)
            zygote.wait()
            pytest.fail((tmp_path / "child.log").read_text() or "child never reached step 6")
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    rc = zygote.wait()
    assert rc == -signal.SIGKILL, (tmp_path / "child.log").read_text()
    assert verify_checkpoint(ck, progress=False) == [] and F.temporaries(ck) == []
    assert F.checkpoint_step(ck) == 4
    # The killed store's files (as large as the states) are still there ...
    sdir = str(root / "store")
    left = F.state_files(sdir)
    assert left and any(n.startswith(".statestore-") for n in os.listdir(sdir))
    leaks = F.Leaks(sdir)
    # ... until a store resumed in the same directory reclaims them.
    with pytest.warns(RuntimeWarning, match="never closed"):
        store = ss.NVMeStore(sdir, engine=engine, budget_bytes=F.NVME_BUDGET)
    assert not set(left) & set(F.state_files(sdir))
    named, opt, step = F.resume(store, ck)
    F.train(opt, named, step, 8 - step)
    assert F.differences(F.snapshot(named, store), F.reference(8)) == []
    store.close()
    assert os.listdir(sdir) == []
    problems = leaks.problems()       # the directory listing differs by design: reclaimed
    assert [p for p in problems if not p.startswith(sdir)] == []


# ------------------------------------------------------------------ rollback in one process
def test_rollback_into_the_same_store_takes_the_checkpoints_step_counts(tmp_path):
    """Load the last checkpoint into the store an optimizer used, build a new optimizer: it
    resumes with the checkpoint's step counts (not the old optimizer's), exactly."""
    ck = str(tmp_path / "ck")
    store = F.make_store("nvme", str(tmp_path / "s"))
    named, opt = F.trained(store, 3)
    F.save(store, named, ck, 3)
    F.train(opt, named, 3, 4)                   # the old optimizer goes on to step 7
    named, opt, step = F.resume(store, ck)
    assert step == 3 and set(opt._steps.values()) == {3}
    F.train(opt, named, 3, 2)
    assert F.differences(F.snapshot(named, store), F.reference(5)) == []
    store.close()


def test_save_failing_after_its_manifest_is_committed_keeps_its_shards(tmp_path, monkeypatch):
    """A failure after the new manifest is in place (the directory fsync) is reported, but
    never removes the shards that manifest names: the new checkpoint stays valid."""
    from statestore.checkpoint import writer
    ck = str(tmp_path / "ck")
    with ss.DeviceStore("cpu") as store:
        named, opt = F.trained(store, 3)
        store.save_checkpoint(ck, progress=False)
        F.train(opt, named, 3, 1)

        real, calls = writer.fsync_dir, []

        def fsync_fails(fs, root):      # the shards' fsync passes, the manifest's fails
            calls.append(root)
            if len(calls) == 1:
                return real(fs, root)
            raise OSError(errno.EIO, "Input/output error")
        monkeypatch.setattr(writer, "fsync_dir", fsync_fails)
        with pytest.raises(ss.StateStoreIOError, match="Input/output error"):
            store.save_checkpoint(ck, progress=False)
    monkeypatch.undo()
    assert verify_checkpoint(ck, progress=False) == []
    assert F.differences(F.states_of_checkpoint(ck), F.reference(4), "state:") == []

def test_reclaiming_never_touches_live_or_kept_files(tmp_path):
    """Reclaiming files of dead stores spares a live store's files (even in another
    process's hands: its lock is held) and files kept with ``keep_files=True``."""
    d = str(tmp_path / "d")
    live = ss.NVMeStore(d, budget_bytes=F.NVME_BUDGET)
    live.create("a/m", (1000,), torch.float32, torch.ones(1000))
    kept = ss.NVMeStore(d, budget_bytes=F.NVME_BUDGET, keep_files=True)
    kept.create("k/m", (10,))
    kept_files = kept.files()
    kept.close()
    fs = ss.FileStore(d)
    fs.create("f/m", (10,), torch.float32, torch.full((10,), 2.0))
    with ss.NVMeStore(d, budget_bytes=F.NVME_BUDGET) as other:    # reclaims nothing
        other.create("o/m", (10,))
    assert all(os.path.exists(f) for f in live.files() + kept_files + fs.files())
    assert torch.equal(live.get("a/m"), torch.ones(1000))
    assert torch.equal(fs.get("f/m"), torch.full((10,), 2.0))
    live.close()
    fs.close()
    assert sorted(os.listdir(d)) == sorted(os.path.basename(f) for f in kept_files)


def test_killed_stores_files_are_reclaimed(tmp_path, zygote):
    """``kill -9`` of a process holding an NVMeStore in a temporary directory and a FileStore
    in a given one: the next store of each kind removes what the dead one left (with a
    warning), so a job restarted after every crash does not fill its disk."""
    import json
    marker = tmp_path / "dirs.json"
    pid = zygote.start("hold_stores", str(tmp_path / "hold.log"), root=str(tmp_path),
                       marker=str(marker))
    t0 = time.monotonic()
    while not marker.exists():
        if time.monotonic() - t0 > 120:      # a safety net only
            os.kill(pid, signal.SIGKILL)
            zygote.wait()
            pytest.fail((tmp_path / "hold.log").read_text())
        time.sleep(0.01)
    dirs = json.loads(marker.read_text())
    os.kill(pid, signal.SIGKILL)
    assert zygote.wait() == -signal.SIGKILL
    assert F.state_files(dirs["tmp"]) and F.state_files(dirs["file"])
    with pytest.warns(RuntimeWarning, match="never closed"):
        fresh = ss.NVMeStore(budget_bytes=F.NVME_BUDGET)
    assert not os.path.exists(dirs["tmp"])
    fresh.close()
    with pytest.warns(RuntimeWarning, match="never closed"):
        fresh = ss.FileStore(dirs["file"])
    assert F.state_files(dirs["file"]) == []
    fresh.close()
    assert os.listdir(dirs["file"]) == []
