"""TensorNVMe (issue 19): built by ``make setup``, and a store on it that is correct.

* TensorNVMe's own behaviour, shown on its binding: the facts the adapter is built around
  (keyed bytes; a read frees its key; a rewrite leaks; "wait for reads" waits for writes);
* the adapter (``statestore.io.TensorNVMeEngine``) contains them: reads are verified and
  non-destructive, rewrites do not grow the file, short or failed transfers are detected
  (never handed out), we ``fdatasync`` and drop the page cache, ENOSPC is named, partial
  views transfer exactly their bytes, its libaio backend never gets more requests than it
  can hold;
* the store (``TensorNVMeStore``, a store of its own; ``nvme_store(dir, engine="tensornvme")``
  the factory that picks it): NVMeStore refuses keyed engines and ``engine="tensornvme"``; training with the page cache dropped between steps matches torch and a
  DeviceStore run bit for bit; checkpoints copy (never link) and resume across engines bit for
  bit; the issue's failing sequence (3 steps, save, 2 steps) works; faults fail loudly and the
  previous checkpoint resumes exactly; a killed process's file is reclaimed.

The conformance, optimizer, prefetch, update_in_backward and bad-input suites run on it through
its line in ``helpers.stores.BACKENDS``; the engine-fault suite through ``test_faults.ENGINE_STORES``.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import statestore as ss
from statestore.checkpoint import verify_checkpoint
from statestore.io import IOEngine, probe_engine
from statestore.optim import HybridAdam

from helpers import paths  # noqa: E402
from helpers import faults as F  # noqa: E402
from helpers.stores import BACKEND_NAMES  # noqa: E402

HAVE = probe_engine("tensornvme") is None
needs = pytest.mark.skipif(not HAVE, reason=f"tensornvme: {probe_engine('tensornvme')}")
BLOCK = 1 << 16


def _backends():
    if not HAVE:
        return []
    from tensornvme._C import get_backends
    return sorted(get_backends())


def _engine(tmp_path, **kw):
    return ss.io.TensorNVMeEngine(str(tmp_path / "states-x-tensornvme"), **kw)


def _bytes(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed),
                         dtype=torch.uint8)


def _resident_pages(path: str) -> int:
    """Pages of ``path`` in the page cache: ``mincore`` over a read-only shared mapping
    (mapping faults nothing in)."""
    if not os.path.exists(path):
        return 0
    size = os.path.getsize(path)
    if size == 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        try:
            vec = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            return sum(v & 1 for v in vec)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------ set-up
def test_tensornvme_is_installed_where_required():
    """``make test`` (so CI) sets STATESTORE_REQUIRE_TENSORNVME=1 after ``make setup`` built
    TensorNVMe: there its absence fails, and its store is a line of helpers.stores.BACKENDS."""
    if os.environ.get("STATESTORE_REQUIRE_TENSORNVME") != "1":
        pytest.skip("STATESTORE_REQUIRE_TENSORNVME is not set (`make test` sets it)")
    assert HAVE, probe_engine("tensornvme")
    assert "tensornvme" in BACKEND_NAMES
    assert "tensornvme" in ss.io.available_engines()


SCRIPT = os.path.join(paths.ROOT, "scripts",
                      "install_tensornvme.sh")


def test_install_script_fails_with_the_reason(tmp_path):
    r = subprocess.run(["bash", SCRIPT, str(tmp_path / "no-python")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and "FAILED: no python at" in r.stderr, r.stderr
    fake = tmp_path / "python"      # a python whose every command fails: pip cannot install
    fake.write_text("#!/bin/sh\necho 'no module named pip' >&2\nexit 1\n")
    fake.chmod(0o755)
    r = subprocess.run(["bash", SCRIPT, str(fake)], capture_output=True, text=True, timeout=60)
    # (without liburing-dev the reason is that instead; either way the set-up stops)
    assert r.returncode == 1 and "FAILED" in r.stderr, r.stderr
    assert "no module named pip" in r.stderr or "liburing" in r.stderr, r.stderr


@needs
def test_install_script_skips_when_installed():
    r = subprocess.run(["bash", SCRIPT, sys.executable], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "building" not in r.stderr, r.stderr


# ------------------------------------------------------------------ TensorNVMe's own defects
@needs
def test_binding_facts_the_adapter_is_built_around(tmp_path):
    """On TensorNVMe's binding itself: a read frees its key (a second read fails), a rewrite
    of a key allocates new space and leaks the old, and ``sync_read_events`` does not wait
    for reads (it is bound to the write-events function): the read's completion runs only in
    ``synchronize()``."""
    from tensornvme._C import Offloader
    path = str(tmp_path / "raw")
    off = Offloader(path, 8, "uring" if "uring" in _backends() else "aio")
    src, dst = _bytes(BLOCK, 1), torch.zeros(BLOCK, dtype=torch.uint8)
    off.async_write(src, "k", None)
    off.synchronize()
    done = []
    off.async_read(dst, "k", lambda: done.append(1))
    off.sync_read_events()
    assert done == []               # "wait for reads" returned with the read not reaped
    off.synchronize()
    assert done == [1] and torch.equal(dst, src)
    with pytest.raises(RuntimeError, match="not found"):
        off.async_read(dst, "k", None)
    for _ in range(4):              # rewrites without reads: each takes new space
        off.async_write(src, "k", None)
        off.synchronize()
    assert os.path.getsize(path) == 4 * BLOCK
    del off
    assert not os.path.exists(path)     # its destructor removes its file


# ------------------------------------------------------------------------------ the adapter
@needs
@pytest.mark.parametrize("backend", _backends())
def test_reads_are_verified_and_non_destructive_rewrites_do_not_grow(tmp_path, backend):
    eng = _engine(tmp_path, backend=backend)
    try:
        vals = {f"k{i}": _bytes(BLOCK, i) for i in range(3)}
        for k, v in vals.items():
            eng.write(k, v).result(timeout=60)
        out = torch.empty(BLOCK, dtype=torch.uint8)
        for _ in range(3):
            for k, v in vals.items():
                out.zero_()
                assert eng.read(k, out).result(timeout=60) == BLOCK
                assert torch.equal(out, v)
        for i in range(20):
            for k in vals:
                vals[k] = _bytes(BLOCK, 100 + i)
                eng.write(k, vals[k]).result(timeout=60)
        for k, v in vals.items():
            eng.read(k, out).result(timeout=60)
            assert torch.equal(out, v)
        # live bytes plus at most one block being replaced (the old one is freed first)
        assert os.path.getsize(eng.path) <= 4 * BLOCK
        st = eng.stats()
        assert st["freed"] == 60 and st["checksum_errors"] == 0 and st["keys"] == 3
        eng.discard("k0").result(timeout=60)
        assert "k0" not in eng
        with pytest.raises(ss.StateStoreIOError, match="no such key") as ei:
            eng.read("k0", out).result(timeout=60)
        assert ei.value.errno == errno.ENOENT and eng.path in str(ei.value)
        with pytest.raises(ss.StateStoreIOError, match="holds 65536 bytes"):
            eng.read("k1", out[:4096]).result(timeout=60)
    finally:
        eng.close()
    assert not os.path.exists(eng.path)


@needs
def test_views_transfer_exactly_their_bytes(tmp_path):
    """TensorNVMe transfers a tensor's whole *storage*: the adapter hands it tensors whose
    storage is the view, so the bytes around a view in a larger buffer are never written
    to disk nor overwritten by a read."""
    with _engine(tmp_path) as eng:
        big = _bytes(3 * BLOCK, 7)
        eng.write("mid", big[BLOCK:2 * BLOCK]).result(timeout=60)
        assert os.path.getsize(eng.path) == BLOCK
        canary = torch.full((3 * BLOCK,), 0xA5, dtype=torch.uint8)
        eng.read("mid", canary[BLOCK:2 * BLOCK]).result(timeout=60)
        assert torch.equal(canary[BLOCK:2 * BLOCK], big[BLOCK:2 * BLOCK])
        assert bool((canary[:BLOCK] == 0xA5).all()) and bool((canary[2 * BLOCK:] == 0xA5).all())


@needs
def test_short_read_is_detected_never_handed_out(tmp_path):
    """TensorNVMe does not check read results: a read that comes back short (simulated below
    it: half the bytes never arrive) is caught by the checksum and raises EIO naming the
    block and the file; the block is then gone (TensorNVMe freed it), and says so."""
    with _engine(tmp_path) as eng:
        v = _bytes(BLOCK, 3)
        eng.write("k", v).result(timeout=60)
        eng._inject_fault_for_testing(op="read", kind="short")
        out = torch.empty(BLOCK, dtype=torch.uint8)
        with pytest.raises(ss.StateStoreIOError, match="xxh3") as ei:
            eng.read("k", out).result(timeout=60)
        assert ei.value.errno == errno.EIO and "'k'" in str(ei.value) and eng.path in str(ei.value)
        assert eng.stats()["checksum_errors"] == 1
        with pytest.raises(ss.StateStoreIOError, match="no such key"):
            eng.read("k", out).result(timeout=60)


@needs
def test_short_write_is_detected_at_the_next_read(tmp_path):
    with _engine(tmp_path) as eng:
        eng._inject_fault_for_testing(op="write", kind="short")
        eng.write("k", _bytes(BLOCK, 4)).result(timeout=60)      # TensorNVMe reports nothing
        with pytest.raises(ss.StateStoreIOError, match="xxh3"):
            eng.read("k", torch.empty(BLOCK, dtype=torch.uint8)).result(timeout=60)


@needs
def test_refused_request_keeps_the_bytes(tmp_path):
    with _engine(tmp_path) as eng:
        v = _bytes(BLOCK, 5)
        eng.write("k", v).result(timeout=60)
        eng._inject_fault_for_testing(op="any", count=2, err=errno.EIO)
        out = torch.empty(BLOCK, dtype=torch.uint8)
        with pytest.raises(ss.StateStoreIOError, match="Input/output error"):
            eng.read("k", out).result(timeout=60)
        with pytest.raises(ss.StateStoreIOError, match="Input/output error"):
            eng.write("k", _bytes(BLOCK, 6)).result(timeout=60)
        eng.read("k", out).result(timeout=60)
        assert torch.equal(out, v)


@needs
def test_enospc_is_named_and_the_old_bytes_stay(tmp_path, monkeypatch):
    """Buffered writes that run out of space fail unreported inside TensorNVMe: the adapter
    checks the free space first and names ENOSPC and the file."""
    with _engine(tmp_path) as eng:
        v = _bytes(BLOCK, 8)
        eng.write("k", v).result(timeout=60)
        real = os.fstatvfs

        class Full:
            def __init__(self, st):
                self.f_frsize, self.f_bavail = st.f_frsize, 1

        monkeypatch.setattr(os, "fstatvfs", lambda fd: Full(real(fd)))
        with pytest.raises(ss.StateStoreIOError) as ei:
            eng.write("k", _bytes(BLOCK, 9)).result(timeout=60)
        assert ei.value.errno == errno.ENOSPC and eng.path in str(ei.value)
        monkeypatch.undo()
        out = torch.empty(BLOCK, dtype=torch.uint8)
        eng.read("k", out).result(timeout=60)
        assert torch.equal(out, v)


@needs
def test_flush_fsyncs_and_drops_the_page_cache(tmp_path, monkeypatch):
    """TensorNVMe neither fsyncs nor uses O_DIRECT: its writes sit in the page cache. flush()
    runs fdatasync on the adapter's own descriptor of the file and drops its pages."""
    calls = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (calls.append(fd), real(fd))[1])
    with _engine(tmp_path) as eng:
        for i in range(8):
            eng.write(f"k{i}", _bytes(BLOCK, i)).result(timeout=60)
        assert _resident_pages(eng.path) > 0        # buffered: the page cache holds them
        eng.flush().result(timeout=60)
        assert calls == [eng.fileno()] and eng.stats()["fsyncs"] == 1
        assert _resident_pages(eng.path) == 0


@needs
def test_page_cache_share_of_the_file_is_bounded(tmp_path):
    """Between flushes the adapter writes back and drops the file every ``cache_bytes``
    written, so the page cache never holds much more of it than that."""
    with _engine(tmp_path, cache_bytes=4 * BLOCK) as eng:
        most = 0
        for i in range(32):
            eng.write(f"k{i}", _bytes(BLOCK, i)).result(timeout=60)
            most = max(most, _resident_pages(eng.path))
        assert os.path.getsize(eng.path) == 32 * BLOCK
        assert most * mmap.PAGESIZE <= 5 * BLOCK and eng.stats()["cache_drops"] >= 7
        out = torch.empty(BLOCK, dtype=torch.uint8)
        for i in range(32):
            eng.read(f"k{i}", out).result(timeout=60)
            assert torch.equal(out, _bytes(BLOCK, i))


@needs
@pytest.mark.skipif("aio" not in _backends(), reason="tensornvme built without libaio")
def test_aio_backend_never_gets_more_requests_than_its_queue(tmp_path):
    """Its libaio backend ignores io_submit failures: a request past ``n_entries`` would
    never complete and synchronize() would wait forever. The adapter keeps at most
    ``queue_depth`` in flight, so 64 requests queued at once on a depth of 2 all finish."""
    with _engine(tmp_path, backend="aio", queue_depth=2) as eng:
        vals = [_bytes(4096, i) for i in range(64)]
        futs = [eng.write(f"k{i}", v) for i, v in enumerate(vals)]
        assert [f.result(timeout=120) for f in futs] == [4096] * 64
        outs = [torch.empty(4096, dtype=torch.uint8) for _ in vals]
        futs = [eng.read(f"k{i}", o) for i, o in enumerate(outs)]
        assert [f.result(timeout=120) for f in futs] == [4096] * 64
        assert all(torch.equal(a, b) for a, b in zip(vals, outs))


@needs
def test_engine_arguments(tmp_path):
    with pytest.raises(ss.StateStoreValueError, match="queue_depth"):
        _engine(tmp_path, queue_depth=1)
    with pytest.raises(ss.StateStoreValueError, match="backend"):
        _engine(tmp_path, backend="floppy")
    with _engine(tmp_path) as eng:
        with pytest.raises(ss.StateStoreValueError, match="key"):
            eng.write("", torch.zeros(4, dtype=torch.uint8))
        with pytest.raises(ss.StateStoreValueError, match="nbytes"):
            eng.write("k", torch.zeros(4, dtype=torch.uint8), 0)
    with pytest.raises(ss.StateStoreClosedError):
        eng.write("k", torch.zeros(4, dtype=torch.uint8))


# ------------------------------------------------------------------------------ the store
class _KeyedEngine(IOEngine):
    name = "keyed"
    writes_in_place = False

    def _submit(self, *a):      # pragma: no cover - never reached
        raise AssertionError

    def _close(self):
        pass


@needs
def test_nvme_store_refuses_engines_that_do_not_write_in_place(tmp_path):
    with pytest.raises(ss.StateStoreValueError, match="does not write in place"):
        ss.NVMeStore(str(tmp_path / "a"), engine=_KeyedEngine())
    with _engine(tmp_path) as eng, \
            pytest.raises(ss.StateStoreValueError, match="does not write in place"):
        ss.NVMeStore(str(tmp_path / "b"), engine=eng)


@needs
def test_engine_name_builds_a_tensornvme_store(tmp_path):
    """TensorNVMeStore is its own store: NVMeStore(engine="tensornvme") refuses, naming it
    (an NVMeStore call never returns another class); nvme_store, make_store and the tiered
    store's factory build it."""
    from statestore.backends import make_store, nvme_store
    with pytest.raises(ss.StateStoreValueError, match=r"TensorNVMeStore\(dir\)"):
        ss.NVMeStore(str(tmp_path / "n"), engine="tensornvme", budget_bytes=1 << 20)
    assert not os.path.exists(tmp_path / "n") or not os.listdir(tmp_path / "n")
    with ss.TensorNVMeStore(str(tmp_path / "t0"), budget_bytes=1 << 20) as s:
        s.create("w/exp_avg", (10,), torch.float32, torch.ones(10))
        assert torch.equal(s.get("w/exp_avg"), torch.ones(10))
    with nvme_store(str(tmp_path / "s"), engine="tensornvme", budget_bytes=1 << 20) as s:
        assert isinstance(s, ss.TensorNVMeStore) and not isinstance(s, ss.NVMeStore)
        assert s.block_bytes == 256 << 10 and s.stats()["engine"] == "tensornvme"
        assert s.files() == [s.engine.path] and not os.path.exists(s.engine.path)
        s.create("w/exp_avg", (1000,), torch.float32, torch.ones(1000))
        s.sync()
        assert os.path.exists(s.engine.path)
        s.delete("w/exp_avg")
        assert not os.path.exists(s.engine.path)    # no states: no file
    with make_store("tensornvme", str(tmp_path / "m"), budget_bytes=1 << 20) as s:
        assert type(s) is ss.TensorNVMeStore
    with pytest.raises(ss.StateStoreValueError, match="O_DIRECT"):
        nvme_store(str(tmp_path / "d"), engine="tensornvme", direct=True)
    with pytest.raises(ss.StateStoreValueError, match="keep_files"):
        nvme_store(str(tmp_path / "k"), engine="tensornvme", keep_files=True)
    with ss.TieredStore.from_fraction(0.5, str(tmp_path / "t"), engine="tensornvme") as t:
        assert any(isinstance(x, ss.TensorNVMeStore) for x in t.tiers)


@needs
def test_issue_sequence_three_steps_checkpoint_two_more(tmp_path):
    """The issue's failing run: 3 steps, a checkpoint, 2 more steps (it failed with "Read
    error, tensor not found"); now bit-identical to an uninterrupted DeviceStore run, and the
    checkpoint equals the 3-step states."""
    ck = str(tmp_path / "ck")
    with ss.TensorNVMeStore(str(tmp_path / "s"), budget_bytes=64 << 10) as store:
        named, opt = F.trained(store, 3)
        store.save_checkpoint(ck, progress=False)
        F.train(opt, named, 3, 2)
        assert F.differences(F.snapshot(named, store), F.reference(5)) == []
    assert verify_checkpoint(ck, progress=False) == []
    assert F.differences(F.states_of_checkpoint(ck), F.reference(3), "state:") == []


def _mlp_params(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    shapes = [(256, 512), (512,), (512, 384), (384,), (7,)]
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


@needs
@pytest.mark.parametrize("backend", _backends())
def test_training_reads_states_from_disk_matches_torch(tmp_path, backend):
    """HybridAdam over a TensorNVMe store with the page cache of its file empty at every step
    (the prefetch cancelled, then ``sync()`` drops the cache; mincore confirms): every state
    is read from the disk in every step, as where ColossalAI's optimizer on TensorNVMe crashed
    4 times out of 4. Parameters and states match torch.optim.AdamW to float32 rounding and a
    DeviceStore run bit for bit."""
    steps = 6
    grads = [[torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * s + i))
              for i, p in enumerate(_mlp_params(0))] for s in range(steps)]
    hp = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)

    def run(store, opt_cls, cold=False):
        params = _mlp_params(0)
        opt = opt_cls(params, **hp, **({"state_store": store} if store is not None else {}))
        for step, gs in enumerate(grads):
            if cold:
                # The next step's prefetch (started at the end of a step) would read before
                # the cache is dropped: drop it, so that every read of the step comes after.
                store.cancel_prefetch()
                store.sync()
                assert _resident_pages(store.engine.path) == 0
                before = store.engine.stats()["bytes_read"]
            for p, g in zip(params, gs):
                p.grad = g.clone()
            opt.step()
            opt.zero_grad()
            if cold and step:       # every state was read back from the disk in this step
                state_bytes = sum(store.spec(k).nbytes for k in store.keys())
                assert store.engine.stats()["bytes_read"] - before >= state_bytes
        return params

    ref = run(None, lambda ps, **kw: torch.optim.AdamW(ps, foreach=False, **kw))
    with ss.DeviceStore("cpu") as dev:
        exact = run(dev, HybridAdam)
        exact_states = {k: dev.get(k).clone() for k in dev.keys()}
    store = ss.TensorNVMeStore(str(tmp_path / "s"), budget_bytes=1 << 20, backend=backend)
    with store:
        got = run(store, HybridAdam, cold=True)
        assert store.stats()["bytes_read"] > 5 * sum(v.numel() * 4 for v in exact_states.values())
        for k, v in exact_states.items():
            assert torch.equal(store.get(k), v), k
        assert store.engine.stats()["checksum_errors"] == 0
    for a, b, c in zip(got, exact, ref):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


def _store(kind, d):
    if kind == "tensornvme":
        return ss.TensorNVMeStore(d, budget_bytes=64 << 10)
    if kind == "nvme":
        return ss.NVMeStore(d, budget_bytes=64 << 10)
    return ss.DeviceStore("cpu")


@needs
@pytest.mark.parametrize("src,dst", [("tensornvme", "nvme"), ("tensornvme", "device-cpu"),
                                     ("tensornvme", "tensornvme"), ("nvme", "tensornvme"),
                                     ("device-cpu", "tensornvme")])
def test_checkpoint_resumes_across_engines_bit_for_bit(tmp_path, src, dst):
    """Save after 3 steps on one store, resume on another, 2 more steps: bit-identical to 5
    uninterrupted steps. A TensorNVMe store's checkpoint is a copy: its shards are no hard
    links (nothing of TensorNVMe's file is in it), and it verifies."""
    ck = str(tmp_path / "ck")
    a = _store(src, str(tmp_path / "a"))
    named = F.make_params()
    F.train(F.make_opt(named, a), named, 0, 3)
    F.save(a, named, ck, 3)
    a.close()
    assert verify_checkpoint(ck, progress=False) == []
    if src == "tensornvme":
        shards = [os.path.join(r, f) for r, _, fs in os.walk(ck) for f in fs]
        assert shards and all(os.stat(p).st_nlink == 1 for p in shards)
    b = _store(dst, str(tmp_path / "b"))
    named, opt, step = F.resume(b, ck)
    assert step == 3
    F.train(opt, named, step, 2)
    assert F.differences(F.snapshot(named, b), F.reference(5)) == []
    b.close()


@needs
def test_short_read_in_a_step_fails_loudly_and_the_checkpoint_resumes(tmp_path):
    """A short read inside TensorNVMe during a step (it reports success) is caught: the step
    raises EIO naming TensorNVMe's file and the checksum; the previous checkpoint resumes
    exactly in a new store."""
    ck = str(tmp_path / "ck")
    store = F.make_store("tensornvme", str(tmp_path / "s"))
    named, opt = F.trained(store, 3)
    F.save(store, named, ck, 3)
    store.cancel_prefetch()
    store.engine._inject_fault_for_testing(op="read", kind="short")
    F.set_grads(named, 3)
    with pytest.raises(ss.StateStoreIOError, match="xxh3") as ei:
        opt.step()
    assert ei.value.errno == errno.EIO and "states-" in str(ei.value)
    store.close()
    store = F.make_store("tensornvme", str(tmp_path / "s2"))
    named, opt, step = F.resume(store, ck)
    F.train(opt, named, step, 2)
    assert F.differences(F.snapshot(named, store), F.reference(5)) == []
    store.close()


@needs
def test_killed_process_file_is_reclaimed(tmp_path):
    """``kill -9`` of a process holding a TensorNVMe store leaves its file; the next store in
    that directory removes it (its lock is dead)."""
    d = str(tmp_path / "s")
    code = textwrap.dedent(f"""
        import os, signal, torch, statestore as ss
        s = ss.TensorNVMeStore({d!r}, budget_bytes=1 << 20)
        s.create("w/exp_avg", (100000,), torch.float32, torch.ones(100000))
        s.sync()
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=300)
    assert r.returncode == -9, r.stderr.decode()[-2000:]
    left = [n for n in os.listdir(d) if n.endswith("-tensornvme")]
    assert len(left) == 1
    with pytest.warns(RuntimeWarning, match="never closed"):
        s = ss.TensorNVMeStore(d)
    assert [n for n in os.listdir(d) if n.endswith("-tensornvme")] == []
    s.close()
