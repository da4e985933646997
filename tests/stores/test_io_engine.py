"""The I/O engines: every engine that works here, round trips, concurrency and errors."""
from __future__ import annotations

import concurrent.futures
import errno
import os
import tempfile
import warnings

import pytest
import torch

from statestore.errors import StateStoreClosedError, StateStoreIOError, StateStoreValueError
from statestore.io import (
    IOFile,
    PyThreadsEngine,
    alloc_buffer,
    available_engines,
    make_engine,
    probe_engine,
)
from statestore.io import files as io_files
from statestore.io._native import native

NATIVE = [n for n in ("io_uring", "libaio", "threads") if probe_engine(n) is None]
ENGINES = NATIVE + ["pythreads"]


@pytest.fixture
def d():
    with tempfile.TemporaryDirectory(prefix="statestore-test-io-") as t:
        yield t


@pytest.fixture(params=ENGINES)
def engine(request):
    # Small blocks and a shallow queue so that requests split and queue up.
    if request.param == "pythreads":
        eng = PyThreadsEngine(queue_depth=4, block_size=8192, threads=3)
    else:
        eng = make_engine(request.param, queue_depth=4, block_size=8192, threads=3)
    yield eng
    eng.close()


def _rand_bytes(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def test_threads_engine_always_available():
    assert native is not None, "statestore._C_io must be built for the test suite"
    assert "threads" in available_engines()
    with make_engine("auto") as eng:
        assert eng.name in available_engines()


@pytest.mark.parametrize("nbytes,offset", [(4096, 0), (4096 * 7, 4096 * 5),
                                           ((1 << 16) + 4096 * 3, 4096)])
def test_direct_round_trip(engine, d, nbytes, offset):
    src = alloc_buffer(nbytes)
    dst = alloc_buffer(nbytes, pinned=False)
    src.tensor.copy_(_rand_bytes(nbytes, nbytes))
    with IOFile(os.path.join(d, "f"), create=True) as f:
        assert f.direct  # this filesystem supports O_DIRECT
        fut = engine.write(f, src, offset)
        assert isinstance(fut, concurrent.futures.Future)
        assert fut.result(timeout=30) == nbytes
        assert engine.read(f, dst, offset).result(timeout=30) == nbytes
    assert torch.equal(src.tensor, dst.tensor)


@pytest.mark.parametrize("nbytes,offset", [(1, 0), (7, 3), (17, 12345), (4099, 1),
                                           ((1 << 20) + 3, 4097)])
def test_buffered_odd_sizes(engine, d, nbytes, offset):
    src = _rand_bytes(nbytes, offset)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    with IOFile(os.path.join(d, "f"), create=True, direct=False) as f:
        assert not f.direct and f.drop_cache
        engine.write(f, src, offset).result(timeout=30)
        engine.read(f, dst, offset).result(timeout=30)
        assert f.size() == offset + nbytes
    assert torch.equal(src, dst)


def test_partial_nbytes_and_typed_buffers(engine, d):
    x = torch.randn(3000, dtype=torch.float32)
    y = torch.zeros(3000, dtype=torch.float32)
    with IOFile(os.path.join(d, "f"), create=True, direct=False) as f:
        engine.write(f, x, 100, nbytes=4 * 1000).result(timeout=30)
        engine.read(f, y, 100, nbytes=4 * 1000).result(timeout=30)
    assert torch.equal(x[:1000], y[:1000]) and not y[1000:].any()


def test_many_concurrent_requests(engine, d):
    n, size = 96, 4096 * 3
    src = alloc_buffer(n * size)
    src.tensor.copy_(_rand_bytes(n * size, 7))
    dst = alloc_buffer(n * size, pinned=False)
    with IOFile(os.path.join(d, "f"), create=True) as f:
        futs = [engine.write(f, src.tensor[i * size:(i + 1) * size], i * size) for i in range(n)]
        assert [fu.result(timeout=60) for fu in futs] == [size] * n
        # Read back in a scrambled order, all at once.
        order = list(range(n))[::2] + list(range(n))[1::2]
        futs = [engine.read(f, dst.tensor[i * size:(i + 1) * size], i * size) for i in order]
        concurrent.futures.wait(futs, timeout=60)
        assert all(fu.result() == size for fu in futs)
    assert torch.equal(src.tensor, dst.tensor)


def test_short_read_at_eof_names_file(engine, d):
    path = os.path.join(d, "short")
    buf = alloc_buffer(4096 * 4)
    with IOFile(path, create=True) as f:
        engine.write(f, buf, 0, nbytes=4096).result(timeout=30)
        with pytest.raises(StateStoreIOError) as ei:
            engine.read(f, buf, 0).result(timeout=30)
    assert ei.value.errno == errno.ENODATA
    assert path in str(ei.value) and "end of file" in str(ei.value)
    assert isinstance(ei.value, OSError)


def test_bad_fd_names_file(engine, d):
    path = os.path.join(d, "bad")
    buf = alloc_buffer(4096)
    f = IOFile(path, create=True)
    os.close(f.fd)  # behind the IOFile's back: the engine sees EBADF
    try:
        with pytest.raises(StateStoreIOError) as ei:
            engine.read(f, buf, 0).result(timeout=30)
        assert ei.value.errno == errno.EBADF
        assert path in str(ei.value)
    finally:
        f.fd = -1


@pytest.mark.parametrize("name", NATIVE)
@pytest.mark.parametrize("op", ["read", "write"])
def test_injected_eio_names_file(d, name, op):
    path = os.path.join(d, "eio")
    with make_engine(name, queue_depth=4, block_size=8192) as eng, IOFile(path, create=True) as f:
        buf = alloc_buffer(8192 * 5)
        eng.write(f, buf, 0).result(timeout=30)
        eng._inject_fault_for_testing(op=op, skip=2, count=1, kind="error", err=errno.EIO)
        fut = (eng.read if op == "read" else eng.write)(f, buf, 0)
        with pytest.raises(StateStoreIOError) as ei:
            fut.result(timeout=30)
        assert ei.value.errno == errno.EIO and path in str(ei.value)
        assert "at offset" in str(ei.value)  # the failed block (completion order varies)
        # The fault is spent: the engine keeps working.
        assert eng.read(f, buf, 0).result(timeout=30) == 8192 * 5
        assert eng.stats()["errors"] >= 1


@pytest.mark.parametrize("name", NATIVE)
def test_injected_short_transfers_are_retried(d, name):
    src = alloc_buffer(8192 * 6)
    src.tensor.copy_(_rand_bytes(8192 * 6, 3))
    dst = alloc_buffer(8192 * 6)
    with make_engine(name, queue_depth=3, block_size=8192) as eng, \
            IOFile(os.path.join(d, "s"), create=True) as f:
        eng._inject_fault_for_testing(op="any", count=4, kind="short")
        eng.write(f, src, 0).result(timeout=30)
        eng._inject_fault_for_testing(op="read", skip=1, count=3, kind="short")
        eng.read(f, dst, 0).result(timeout=30)
        assert eng.stats()["retries"] >= 7
    assert torch.equal(src.tensor, dst.tensor)


def test_enospc_like_error_on_write(d):
    name = NATIVE[0]
    path = os.path.join(d, "full")
    with make_engine(name) as eng, IOFile(path, create=True) as f:
        eng._inject_fault_for_testing(op="write", count=1, err=errno.ENOSPC)
        with pytest.raises(StateStoreIOError) as ei:
            eng.write(f, alloc_buffer(4096), 0).result(timeout=30)
    assert ei.value.errno == errno.ENOSPC and path in str(ei.value)


def test_fault_injection_arguments_checked():
    with make_engine(NATIVE[0]) as eng:
        with pytest.raises(StateStoreValueError, match="op"):
            eng._inject_fault_for_testing(op="sideways")
        with pytest.raises(StateStoreValueError, match="kind"):
            eng._inject_fault_for_testing(kind="explode")


def test_direct_alignment_checked(d):
    with make_engine(NATIVE[0]) as eng, IOFile(os.path.join(d, "a"), create=True) as f:
        buf = alloc_buffer(8192)
        with pytest.raises(StateStoreValueError, match="offset"):
            eng.write(f, buf, 100)
        with pytest.raises(StateStoreValueError, match="nbytes"):
            eng.write(f, buf, 0, nbytes=100)
        with pytest.raises(StateStoreValueError, match="buffer address"):
            eng.write(f, buf.tensor[1:4097], 0)
        with pytest.raises(StateStoreValueError, match="nbytes"):
            eng.write(f, buf, 0, nbytes=8192 * 2)
        with pytest.raises(StateStoreValueError, match="contiguous"):
            eng.write(f, torch.zeros(8, 8, dtype=torch.uint8).t(), 0)


def test_bad_arguments():
    with pytest.raises(StateStoreValueError, match="engine"):
        make_engine("floppy")
    with pytest.raises(StateStoreValueError, match="queue_depth"):
        make_engine("threads", queue_depth=0)
    with pytest.raises(StateStoreValueError, match="block_size"):
        make_engine("threads", block_size=1000)
    with pytest.raises(StateStoreValueError, match="nbytes"):
        alloc_buffer(0)


def test_closed_engine_and_file(d):
    eng = make_engine(NATIVE[0])
    f = IOFile(os.path.join(d, "c"), create=True)
    buf = alloc_buffer(4096)
    futs = [eng.write(f, buf, i * 4096) for i in range(8)]
    eng.close()  # waits for the pending writes
    assert all(fu.done() and fu.result() == 4096 for fu in futs)
    with pytest.raises(StateStoreClosedError):
        eng.write(f, buf, 0)
    f.close()
    with make_engine(NATIVE[0]) as eng2, pytest.raises(StateStoreIOError, match="closed"):
        eng2.read(f, buf, 0)


def test_buffered_fallback_warns_once(d, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(io_files.os, "open", no_direct)
    monkeypatch.setattr(io_files, "_warned", False)
    with pytest.warns(RuntimeWarning, match="O_DIRECT"):
        f1 = IOFile(os.path.join(d, "a"), create=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f2 = IOFile(os.path.join(d, "b"), create=True)
    assert not f1.direct and f1.drop_cache and not f2.direct
    with make_engine(NATIVE[0]) as eng:
        src = _rand_bytes(5000, 1)
        dst = torch.zeros_like(src)
        eng.write(f1, src, 11).result(timeout=30)
        eng.read(f1, dst, 11).result(timeout=30)
    assert torch.equal(src, dst)
    f1.close()
    f2.close()
    with pytest.raises(StateStoreIOError, match="direct I/O"):
        IOFile(os.path.join(d, "c"), create=True, direct=True)


def test_alloc_buffer_kinds():
    b = alloc_buffer(10000)
    assert b.data_ptr() % 4096 == 0 and b.nbytes == 10000
    assert b.kind in ("cuda-registered", "mlocked", "plain")
    if b.kind == "plain":
        assert b.note  # says why it is not locked
    p = alloc_buffer(4096, pinned=False)
    assert p.kind == "plain" and p.data_ptr() % 4096 == 0
    v = b.view(torch.float32, 100, 4096)
    assert v.data_ptr() == b.data_ptr() + 4096
    with pytest.raises(StateStoreValueError):
        b.view(torch.float32, 10000)


def test_sync_write_and_drop_cache(d):
    with make_engine(NATIVE[0]) as eng, IOFile(os.path.join(d, "s"), create=True) as f:
        buf = alloc_buffer(4096 * 4)
        assert eng.write(f, buf, 0, sync=True).result(timeout=30) == 4096 * 4
        f.drop_cache_now()
        assert f.size() == 4096 * 4


def test_make_engine_refuses_keyed_tensornvme():
    """TensorNVMe cannot serve (file, offset) requests: make_engine says so and points at the
    store and the keyed interface made for it (tests/stores/test_tensornvme.py tests those)."""
    with pytest.raises(StateStoreValueError, match="keyed.*TensorNVMeStore"):
        make_engine("tensornvme")


@pytest.mark.parametrize("nbytes", [1, 4096, (2 << 20) - 1, 2 << 20, (8 << 20) + 4097])
@pytest.mark.parametrize("pinned", [True, False])
def test_alloc_buffer_alignment(nbytes, pinned):
    """Buffers of 2 MiB or more start on a 2 MiB boundary (huge-page backed where THP allows:
    fewer segments per direct-I/O request); smaller ones on a page. Every byte is usable and
    freeing them (many times over) gives the memory back."""
    import statestore.io.buffers as B
    if B.native is None:
        pytest.skip("statestore._C_io not built")
    for _ in range(3):
        b = alloc_buffer(nbytes, pinned=pinned)
        t = b.tensor
        assert t.numel() == nbytes and t.dtype == torch.uint8
        assert t.data_ptr() % ((2 << 20) if nbytes >= (2 << 20) else 4096) == 0
        t.fill_(7)
        assert int(t[0]) == 7 and int(t[-1]) == 7
        del b, t


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "unknown"


def test_huge_bytes_reports_the_buffers_own_mapping():
    """huge_bytes() counts only the buffer's own mapping: a small buffer (not advised) has
    none under THP 'madvise'; a large advised one reports a whole number of 2 MiB pages, at
    most its size (how many the kernel gave depends on free memory)."""
    import statestore.io.buffers as B
    if B.native is None:
        pytest.skip("statestore._C_io not built")
    big = alloc_buffer(16 << 20, pinned=False)
    big.tensor.fill_(1)
    small = alloc_buffer(1 << 20, pinned=False)
    small.tensor.fill_(1)
    h = big.huge_bytes()
    assert 0 <= h <= big.nbytes and h % (2 << 20) == 0
    if _thp_mode() == "madvise":
        assert small.huge_bytes() == 0
    if _thp_mode() == "never":
        assert h == 0
