"""Disk write/read bandwidth: statestore's engines and NVMeStore against the peers.

Contestants, all on the same directory and interleaved (each repetition runs every contestant
once, in turn; tables report medians):

* ``ss:<engine>``: one request of the whole size through statestore.io (io_uring, libaio,
  threads) on an O_DIRECT file from a page-locked buffer, then ``fdatasync``;
* ``NVMeStore pipeline``: the store's own I/O as an optimizer step drives it, 64 MiB states
  within the default 256 MiB budget: writes through ``pipeline(mode="w")`` (the ring's bytes go
  to the disk as they are: zeros and random bytes wrote at the same speed here) then ``sync``,
  cold reads through ``pipeline(mode="r")``; no copy either way, like the probe and the peers,
  which write and read buffers they hold. This row is the store in the paired table;
* ``TensorNVMe store pipeline``: ``nvme_store(dir, engine="tensornvme")`` (a TensorNVMeStore)
  driven the same way: its writes end with its ``sync`` (fdatasync of TensorNVMe's file, page
  cache dropped); its reads are cold and each read block is written back under its key (the
  adapter's non-destructive read, docs/nvme.md "TensorNVMe"), into the page cache;
* ``NVMeStore put / get``: the user API on the same states: ``put`` copies a tensor into the
  ring (then ``sync``), ``get`` copies into a new tensor. The copy runs while the disk
  transfers the previous chunk and, on this virtual disk, slows it (a 256 MiB write from a
  page-locked buffer: 60 ms alone, 78 ms beside a memory copy);
* ``probe``: plain O_DIRECT ``pwrite``/``pread``, one thread, 4 KiB-aligned buffer;
* ``fio``: Debian's fio, sequential direct io_uring: 1 MiB blocks at iodepth 8 and 32, 8 MiB at 32;
* ``torch.save``/``torch.load`` and ``safetensors`` ``save_file``/``load_file`` (+ fsync);
* ``deepspeed-aio`` and ``tensornvme`` (DiskOffloader, write + fsync / cold read), when they
  import in ``benchmarks/.venv-peers`` (see ``docs/nvme.md``); run in a worker process there.
  Without that environment, TensorNVMe's DiskOffloader runs in this process when it imports
  here (``make setup`` builds it).

Each repetition runs the contestants in a new random order (seeded, so runs are repeatable),
so that none always runs first or after the same neighbour (figures here shift with what ran
just before). Every write ends with
fsync/fdatasync; every read is cold: the file's pages are dropped with
``posix_fadvise(DONTNEED)`` first. GB/s = 1e9 bytes per second.

Which files a contestant writes: with ``--files fresh`` (the default) every contestant writes
new files in every repetition: its previous files are deleted and new ones created and
preallocated with ``posix_fallocate`` before the clock starts (NVMeStore: a new store, whose
``create_many`` preallocates and whose ring is allocated by an untimed read of the new files;
fio lays out its own file), so where the filesystem places each
one's data is drawn anew every time and averages out over the repetitions. On this virtual
disk the place moved a probe's write speed by 40% between a file left by an earlier run and a
fresh one (docs/nvme.md), more than any contestant's own work. With ``--files reuse`` a
first, unrecorded repetition lays out each contestant's file and every later write overwrites
it, as a store does every step. torch.save, safetensors and TensorNVMe create their file anew
each time in both modes, as their APIs do.

A second table pairs ``NVMeStore pipeline`` with the best yardstick (probe, fio, DeepSpeed, TensorNVMe) of
each repetition: the median of the per-repetition ratios, their range, and how many
repetitions the store was at or above the best. The disk's slow swings move a whole
repetition together and cancel in the ratio; the medians of the first table do not pair.

    .venv/bin/python benchmarks/nvme_io.py                       # 64 MiB .. 2 GiB, 3 reps
    .venv/bin/python benchmarks/nvme_io.py --sizes 256M --reps 5 --sweep
    .venv/bin/python benchmarks/nvme_io.py --sizes 256M,1G --reps 6 --no-peers \
        --store-sweep 128x1,64x4,32x8,16x16            # the store's queue depth x block size
    .venv/bin/python benchmarks/nvme_io.py --sizes 1G --only 'NVMeStore|deepspeed|probe'
    .venv/bin/python benchmarks/nvme_io.py --sizes 1G --reps 5 --no-peers --only '^$' \
        --offset-sweep 0,4,16,64,1024                    # unaligned data on this disk
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS_PY = os.path.join(HERE, ".venv-peers", "bin", "python")


def _parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)


def _fmt_size(n: int) -> str:
    return f"{n >> 30} GiB" if n >= 1 << 30 else f"{n >> 20} MiB"


def _drop(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rm(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.unlink(path)


# ============================================================================ peers worker
def peer_worker() -> None:
    """Runs in the peers venv: one JSON command per stdin line, one JSON answer per line."""
    import torch

    ds = tn = None
    handles = {}
    bufs = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            kind = cmd["peer"]
            if kind == "probe":
                out = {}
                try:
                    from deepspeed.ops.op_builder import AsyncIOBuilder
                    ds = AsyncIOBuilder().load(verbose=False)
                    out["deepspeed"] = None
                except Exception as e:  # noqa: BLE001
                    out["deepspeed"] = f"{type(e).__name__}: {e}"[:200]
                try:
                    import tensornvme  # noqa: F401
                    from tensornvme import DiskOffloader
                    tn = DiskOffloader
                    out["tensornvme"] = None
                except Exception as e:  # noqa: BLE001
                    out["tensornvme"] = f"{type(e).__name__}: {e}"[:200]
                print("@@JSON " + json.dumps(out), flush=True)
                continue
            size, path, op = cmd["size"], cmd["path"], cmd["op"]
            if kind == "deepspeed":
                key = (cmd["bs"], cmd["qd"], cmd.get("par", 1))
                if key not in handles:
                    handles[key] = ds.aio_handle(cmd["bs"], cmd["qd"], False, True, cmd.get("par", 1))
                h = handles[key]
                bkey = ("ds", size, cmd["pinned"])
                if bkey not in bufs:
                    for (k0, _s0, pin0), old in list(bufs.items()):
                        if k0 == "ds" and pin0:
                            h.free_cpu_locked_tensor(old)   # locked memory is not freed by GC
                    bufs.clear()
                    if cmd["pinned"]:
                        bufs[bkey] = h.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
                    else:
                        bufs[bkey] = torch.empty(size, dtype=torch.uint8)
                    bufs[bkey].random_(0, 255)
                buf = bufs[bkey]
                if op == "write":
                    t0 = time.perf_counter()
                    h.sync_pwrite(buf, path)
                    _fsync(path)
                    dt = time.perf_counter() - t0
                else:
                    _drop(path)
                    t0 = time.perf_counter()
                    h.sync_pread(buf, path)
                    dt = time.perf_counter() - t0
            elif kind == "tensornvme":
                d = path
                os.makedirs(d, exist_ok=True)
                if op == "write":
                    for f in os.listdir(d):
                        os.unlink(os.path.join(d, f))
                    off = tn(d, n_entries=cmd["qd"], backend="uring")
                    handles["tn"] = off
                    t = torch.empty(size // 4, dtype=torch.float32).uniform_()
                    bufs["tn"] = t
                    t0 = time.perf_counter()
                    off.async_write(t)
                    off.synchronize()
                    (fname,) = os.listdir(d)
                    _fsync(os.path.join(d, fname))
                    dt = time.perf_counter() - t0
                else:
                    off, t = handles["tn"], bufs["tn"]
                    (fname,) = os.listdir(d)
                    _drop(os.path.join(d, fname))
                    t0 = time.perf_counter()
                    off.async_read(t)
                    off.synchronize()
                    dt = time.perf_counter() - t0
                    del handles["tn"], bufs["tn"], off
            else:
                raise ValueError(f"unknown peer {kind}")
            print("@@JSON " + json.dumps({"gbps": size / dt / 1e9}), flush=True)
        except Exception as e:  # noqa: BLE001
            print("@@JSON " + json.dumps({"error": f"{type(e).__name__}: {e}"[:300]}), flush=True)


class Peers:
    def __init__(self) -> None:
        self.proc = None
        self.status = {"deepspeed": "benchmarks/.venv-peers is absent (see docs/nvme.md)",
                       "tensornvme": "benchmarks/.venv-peers is absent (see docs/nvme.md)"}
        if os.path.exists(PEERS_PY):
            self.proc = subprocess.Popen([PEERS_PY, os.path.abspath(__file__), "--peer-worker"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True)
            self.status = self.ask({"peer": "probe"})

    def ask(self, cmd: dict) -> dict:
        if self.proc.poll() is not None:       # the worker died (e.g. out of memory): restart
            self.__init__()
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        while True:   # the peers print their own chatter on stdout; answers are marked
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("peers worker died")
            if line.startswith("@@JSON "):
                return json.loads(line[7:])

    def close(self) -> None:
        if self.proc is not None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()


# ============================================================================ our contestants
# The issue's yardsticks: the peers' engines, fio and the plain O_DIRECT probe (not statestore's
# own engine rows, nor torch.save / safetensors, whose buffered reads ride the page cache).
YARDSTICKS = ("probe", "fio", "deepspeed", "tensornvme")


def print_paired(paired, store_name, results) -> None:
    """NVMeStore against the best yardstick, two ways. (1) Medians: the store's median over
    the best yardstick median (the issue's criterion). (2) Paired: per repetition the ratio
    store / best of that repetition, then the median of those ratios; pairing within a
    repetition (all of whose contestants ran within a minute or two) cancels the disk's slower
    swings, which move every contestant of a repetition together. The paired figure is biased
    low: the best of k noisy yardsticks is the maximum of k draws, so a store exactly as fast
    as each of them is at or above it in only ~1/(k+1) of the repetitions."""
    rows = []
    for size, reps in paired.items():
        cells = []
        for i in (0, 1):
            meds = {n: statistics.median(v[i]) for (n, s), v in results.items()
                    if s == size and v[i] and n.startswith(YARDSTICKS)}
            ours = results.get((store_name, size), ([], []))[i]
            if meds and ours:
                best = max(meds, key=meds.get)
                cells.append(f"{statistics.median(ours) / meds[best]:.2f}x ({best.split(' (')[0]})")
            else:
                cells.append("-")
            ratios = []
            for rep in reps:
                others = [v[i] for n, v in rep.items() if n.startswith(YARDSTICKS)]
                if store_name in rep and others:
                    ratios.append(rep[store_name][i] / max(others))
            cells.append(f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}, "
                         f"{sum(r >= 1 for r in ratios)}/{len(ratios)} >= 1)" if ratios else "-")
        wm, wp, rm, rp = cells
        rows.append(f"| {_fmt_size(size)} | {wm} | {rm} | {wp} | {rp} |")
    if rows:
        print(f"\n## {store_name} / best of {', '.join(YARDSTICKS)}: store median / best median "
              "(which), and paired: per repetition store / best of that repetition (median of the "
              "ratios, range, repetitions at or above 1; biased low, see print_paired)")
        print("| size | write, medians | read, medians | write, paired | read, paired |")
        print("|---|---|---|---|---|")
        print("\n".join(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="64M,256M,1G,2G")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a "
                    "temporary directory under benchmarks/)")
    ap.add_argument("--sweep", action="store_true", help="also sweep queue depth, block size and "
                    "buffer kind at --sweep-size")
    ap.add_argument("--sweep-size", default="256M")
    ap.add_argument("--store-sweep", default=None, metavar="QDxMiB,...",
                    help="also measure NVMeStore at these queue depths x block sizes at each "
                    "size, interleaved with the probe, e.g. 128x1,64x4,32x8,16x16")
    ap.add_argument("--offset-sweep", default=None, metavar="KiB,...",
                    help="also measure the probe with its data at these file offsets (KiB), "
                    "each in its own file, interleaved: how the disk takes unaligned data")
    ap.add_argument("--only", default=None, metavar="REGEX",
                    help="run only the contestants whose name matches (re.search)")
    ap.add_argument("--files", choices=("fresh", "reuse"), default="fresh",
                    help="fresh: every contestant writes new, preallocated files in every "
                    "repetition (placement averages out); reuse: each overwrites its own files")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write every repetition's "
                    "figures, in the order the contestants ran, to PATH")
    ap.add_argument("--peer-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer_worker:
        peer_worker()
        return

    import torch
    from safetensors.torch import load_file, save_file

    sys.path.insert(0, os.path.dirname(HERE))
    import statestore as ss
    from statestore.backends import nvme_store
    from statestore.io import IOFile, alloc_buffer, available_engines, make_engine

    sizes = [_parse_size(s) for s in args.sizes.split(",")]
    peers = Peers() if not args.no_peers else None
    root = tempfile.mkdtemp(prefix="nvme-io-bench-", dir=args.dir or HERE)
    engines = [e for e in available_engines() if e in ("io_uring", "libaio", "threads")]
    fio = shutil.which("fio")
    notes = []
    eng_cache = {}

    def engine(name, qd, bs):
        key = (name, qd, bs)
        if key not in eng_cache:
            eng_cache[key] = make_engine(name, queue_depth=qd, block_size=bs, threads=min(qd, 16))
        return eng_cache[key]

    buf_cache = {}

    def buffer(size, pinned):
        key = (size, pinned)
        if key not in buf_cache:
            buf_cache.clear()
            b = alloc_buffer(size, pinned=pinned)
            b.tensor.random_(0, 255)
            buf_cache[key] = b
        return buf_cache[key]

    fresh = args.files == "fresh"

    def new_file(path, size):
        """In ``--files fresh`` mode: delete ``path`` and create it again, preallocated to
        ``size`` bytes (untimed). In reuse mode: nothing."""
        if fresh:
            _rm(path)
            with IOFile(path, create=True) as f:
                f.allocate(size)

    def ours(name, size, qd=32, bs=1 << 20, pinned=True):
        path = os.path.join(root, f"ss-{name}.bin")
        eng, buf = engine(name, qd, bs), buffer(size, pinned)
        new_file(path, size)
        with IOFile(path, create=True) as f:
            t0 = time.perf_counter()
            eng.write(f, buf, 0).result()
            os.fdatasync(f.fd)
            w = size / (time.perf_counter() - t0) / 1e9
        _drop(path)
        with IOFile(path) as f:
            t0 = time.perf_counter()
            eng.read(f, buf, 0).result()
            r = size / (time.perf_counter() - t0) / 1e9
        return w, r

    stores = {}

    def close_stores():
        for s_ in stores.values():
            s_.close()
        stores.clear()

    def store(size, qd=None, bs=None, keep=False, api="pipeline", engine=None):
        """NVMeStore at its defaults, or with queue_depth ``qd`` and block_size ``bs``, holding
        ``size`` bytes as 64 MiB states. ``api="pipeline"``: the store's own I/O as an
        optimizer step drives it: writes through ``pipeline(mode="w")`` (the bytes written
        are whatever its ring holds, as the probe writes a buffer filled before the clock;
        zeros and random bytes write at the same speed here), reads through
        ``pipeline(mode="r")``, neither copying the data anywhere. ``api="put"``: the user
        API, ``put`` of a tensor (copied into the ring) and ``get`` (copied out into a new
        tensor). Both end writes with ``sync()`` (fdatasync). Stores of other sizes are closed
        first unless ``keep`` (the store sweep keeps one open per configuration). With
        ``--files fresh`` every call makes a new store (new files)."""
        n = max(1, size // (64 << 20))
        per = size // n // 4
        key = (size, qd, bs, api, engine)
        if fresh and key in stores:
            stores.pop(key).close()
        new_store = key not in stores
        if new_store:
            for k_ in [k_ for k_ in stores if not keep and k_[0] != size]:
                stores.pop(k_).close()
            kw = {k: v for k, v in (("queue_depth", qd), ("block_size", bs)) if v is not None}
            sub = f"store-{api}" + ("" if not kw else f"-qd{qd}-bs{bs >> 20}M")
            if engine is not None:
                kw["engine"] = engine
                sub += f"-{engine}"
            stores[key] = nvme_store(os.path.join(root, sub), **kw)
            stores[key].create_many([(f"p{i}/exp_avg", (per,), torch.float32, None) for i in range(n)])
        st = stores[key]

        def drain(units, mode):
            with st.pipeline(units, mode=mode) as pipe:
                for _ in pipe:
                    pass

        names = [f"p{i}/exp_avg" for i in range(n)]
        step = st.unit_bytes // 4
        units = [[ss.Slice(ss.StateKey(f"p{i}", "exp_avg"), a, min(a + step, per))]
                 for i in range(n) for a in range(0, per, step)]
        if new_store:
            # A store allocates its ring (page-locked, on huge pages) at its first transfer:
            # untimed here, as the probe's buffer is (a read of the new, unwritten files).
            drain(units[:1], "r")
        src = torch.rand(per) if api == "put" else None
        t0 = time.perf_counter()
        if api == "put":
            for name in names:
                st.put(name, src)
        else:
            drain(units, "w")
        st.sync()
        w = size / (time.perf_counter() - t0) / 1e9
        for f in st.files():
            _drop(f)
        t0 = time.perf_counter()
        if api == "put":
            for name in names:
                st.get(name)
        else:
            drain(units, "r")
        r = size / (time.perf_counter() - t0) / 1e9
        stats = st.stats()
        if stats.get("huge_page_bytes", stats["pinned_bytes"]) < stats["pinned_bytes"]:
            note = (f"NVMeStore ring at {_fmt_size(size)}: {stats['huge_page_bytes'] >> 20} of "
                    f"{stats['pinned_bytes'] >> 20} MiB on huge pages")
            if note not in notes:
                notes.append(note)
        return w, r

    def probe(size, at=0):
        """``at``: file offset of the data (the offset sweep); the file is the probe's own."""
        path = os.path.join(root, f"probe-{at}.bin" if at else "probe.bin")
        buf = buffer(size, False)
        mv = buf.tensor.numpy()
        new_file(path, at + size)
        chunk = 1 << 30
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
        try:
            t0 = time.perf_counter()
            done = 0
            while done < size:
                done += os.pwrite(fd, mv[done:done + min(chunk, size - done)], at + done)
            os.fdatasync(fd)
            w = size / (time.perf_counter() - t0) / 1e9
        finally:
            os.close(fd)
        _drop(path)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            t0 = time.perf_counter()
            done = 0
            while done < size:
                n = os.preadv(fd, [mv[done:done + min(chunk, size - done)]], at + done)
                if n <= 0:
                    raise OSError("short read in probe")
                done += n
            r = size / (time.perf_counter() - t0) / 1e9
        finally:
            os.close(fd)
        return w, r

    def fio_run(size, depth, bs="1M"):
        path = os.path.join(root, "fio.bin")
        if fresh:
            _rm(path)
        out = {}
        for rw in ("write", "read"):
            cmd = [fio, "--name=ss", f"--filename={path}", f"--rw={rw}", f"--bs={bs}", "--direct=1",
                   "--ioengine=io_uring", f"--iodepth={depth}", f"--size={size}",
                   "--end_fsync=1", "--output-format=json", "--invalidate=1"]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(res.stderr.strip()[:200])
            job = json.loads(res.stdout)["jobs"][0]
            out[rw] = job[rw]["bw_bytes"] / 1e9
            if rw == "write":
                _drop(path)
        return out["write"], out["read"]

    def torch_io(size):
        path = os.path.join(root, "t.pt")
        t = torch.rand(size // 4)
        t0 = time.perf_counter()
        torch.save({"t": t}, path)
        _fsync(path)
        w = size / (time.perf_counter() - t0) / 1e9
        _drop(path)
        t0 = time.perf_counter()
        torch.load(path)
        r = size / (time.perf_counter() - t0) / 1e9
        _rm(path)
        return w, r

    def st_io(size):
        path = os.path.join(root, "t.safetensors")
        t = torch.rand(size // 4)
        t0 = time.perf_counter()
        save_file({"t": t}, path)
        _fsync(path)
        w = size / (time.perf_counter() - t0) / 1e9
        _drop(path)
        t0 = time.perf_counter()
        x = load_file(path)["t"]
        x.sum()  # touch (load_file copies into RAM; the sum is cheap next to the read)
        r = size / (time.perf_counter() - t0) / 1e9
        _rm(path)
        return w, r

    def tensornvme_raw(size, qd=32):
        """TensorNVMe's DiskOffloader in this process (no peers environment): one tensor
        written (+ fsync, which it does not do itself) and read back cold."""
        from tensornvme import DiskOffloader
        d = os.path.join(root, "tn-raw")
        _rm(d)
        os.makedirs(d)
        off = DiskOffloader(d, n_entries=qd, backend="uring")
        t = torch.empty(size // 4, dtype=torch.float32).uniform_()
        t0 = time.perf_counter()
        off.async_write(t)
        off.synchronize()
        (fname,) = os.listdir(d)
        _fsync(os.path.join(d, fname))
        w = size / (time.perf_counter() - t0) / 1e9
        _drop(os.path.join(d, fname))
        t0 = time.perf_counter()
        off.async_read(t)
        off.synchronize()      # its sync_read_events() waits for write events only
        r = size / (time.perf_counter() - t0) / 1e9
        del off, t
        _rm(d)
        return w, r

    def peer(kind, size, **kw):
        path = os.path.join(root, "ds.bin" if kind == "deepspeed" else "tn")
        if kind == "deepspeed":
            new_file(path, size)
        a = peers.ask(dict(peer=kind, op="write", size=size, path=path, **kw))
        b = peers.ask(dict(peer=kind, op="read", size=size, path=path, **kw))
        if "error" in a or "error" in b:
            raise RuntimeError(a.get("error") or b.get("error"))
        return a["gbps"], b["gbps"]

    contestants = []
    for e in engines:
        contestants.append((f"ss:{e} (qd32, 1 MiB, locked)", lambda s, e=e: ours(e, s)))
    params = inspect.signature(ss.NVMeStore).parameters
    dflt = (f"defaults: budget 256 MiB, qd{params['queue_depth'].default} x "
            f"{params['block_size'].default >> 20} MiB")
    contestants.append((f"NVMeStore pipeline ({dflt})", store))
    store_name = contestants[-1][0]
    tn_reason = ss.io.probe_engine("tensornvme")
    if tn_reason is None:
        contestants.append(("TensorNVMe store pipeline (TensorNVMeStore, "
                            "budget 256 MiB, 1 MiB blocks)",
                            lambda s: store(s, engine="tensornvme")))
    else:
        notes.append(f"TensorNVMe store: skipped ({tn_reason})")
    contestants.append((f"NVMeStore put / get, copies in and out ({dflt})",
                        lambda s: store(s, api="put")))
    contestants.append(("probe: O_DIRECT pwrite/pread, 1 thread", probe))
    if fio:
        for depth in (8, 32):
            contestants.append((f"fio io_uring direct 1 MiB iodepth {depth}",
                                lambda s, d=depth: fio_run(s, d)))
        contestants.append(("fio io_uring direct 8 MiB iodepth 32", lambda s: fio_run(s, 32, "8M")))
    else:
        notes.append("fio: not installed (apt-get install fio), skipped")
    contestants.append(("torch.save / torch.load", torch_io))
    contestants.append(("safetensors save_file / load_file", st_io))
    if peers is not None and peers.status.get("deepspeed") is None:
        for qd in (32, 128):
            contestants.append((f"deepspeed aio (qd{qd}, 1 MiB, locked)",
                                lambda s, q=qd: peer("deepspeed", s, bs=1 << 20, qd=q, pinned=True)))
        contestants.append(("deepspeed aio (qd32, 8 MiB, locked)",
                            lambda s: peer("deepspeed", s, bs=8 << 20, qd=32, pinned=True)))
        contestants.append(("deepspeed aio (qd32, 1 MiB, plain)",
                            lambda s: peer("deepspeed", s, bs=1 << 20, qd=32, pinned=False)))
    elif peers is not None:
        notes.append(f"deepspeed aio: skipped ({peers.status.get('deepspeed')})")
    if peers is not None and peers.status.get("tensornvme") is None:
        contestants.append(("tensornvme DiskOffloader (uring)", lambda s: peer("tensornvme", s, qd=32)))
    elif tn_reason is None:
        contestants.append(("tensornvme DiskOffloader (uring), in process", tensornvme_raw))
    elif peers is not None:
        notes.append(f"tensornvme: skipped ({peers.status.get('tensornvme')})")

    if args.only:
        contestants = [c for c in contestants if re.search(args.only, c[0])]

    def rounds(runs, size, per_rep=None):
        """Every contestant of ``runs`` once per repetition, after one unrecorded warm-up
        round; each repetition in its own random order (seeded by size and repetition), so
        none always runs first or after the same neighbour. Returns
        name -> ([write GB/s], [read GB/s]); a contestant that fails is noted. ``per_rep``, a
        list, receives one dict name -> (write, read) per repetition."""
        out = {}
        for rep in range(-1, args.reps):
            order = list(runs)
            random.Random(size * 1000 + rep).shuffle(order)
            this = {}
            for name, fn in order:
                try:
                    w, r = fn(size)
                except Exception as e:  # noqa: BLE001 - one contestant failing is reported
                    notes.append(f"{name} at {_fmt_size(size)}: {type(e).__name__}: {e}")
                    continue
                if rep >= 0:
                    ws, rs = out.setdefault(name, ([], []))
                    ws.append(w)
                    rs.append(r)
                    this[name] = (w, r)
            if rep >= 0 and per_rep is not None:
                per_rep.append(this)
            print(f"# {_fmt_size(size)} rep {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)
        return out

    def med(xs):
        return f"{statistics.median(xs):.2f}" if xs else "-"

    results = {}   # (name, size) -> ([w], [r])
    paired = {}    # size -> [{name: (w, r)} per repetition]
    try:
        for size in sizes:
            paired[size] = []
            for name, wr in rounds(contestants, size, paired[size]).items():
                results[(name, size)] = wr
            close_stores()                  # files of this size: the next size starts fresh
            for f in os.listdir(root):
                _rm(os.path.join(root, f))

        print(f"\n## Disk write / read GB/s (median of {args.reps}, interleaved, {args.files} files), "
              f"dir {root}")
        print("| contestant | " + " | ".join(f"{_fmt_size(s)} write | {_fmt_size(s)} read" for s in sizes) + " |")
        print("|---|" + "---|---|" * len(sizes))
        for name, _ in contestants:
            cells = []
            for s in sizes:
                ws, rs = results.get((name, s), ([], []))
                cells += [med(ws), med(rs)]
            print(f"| {name} | " + " | ".join(cells) + " |")
        print_paired(paired, store_name, results)
        for name, _ in contestants:
            if name.startswith("TensorNVMe store"):
                print_paired(paired, name, results)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({_fmt_size(s): reps for s, reps in paired.items()}, f, indent=1)

        def sweep_table(title, runs, size):
            """Run ``runs`` in interleaved rounds at ``size`` and print their medians."""
            res = rounds(runs, size)
            print(f"\n## {title} at {_fmt_size(size)} "
                  f"(median of {args.reps}, interleaved, shuffled; GB/s)")
            print("| contestant | write | read |")
            print("|---|---|---|")
            for name, _ in runs:
                ws, rs = res.get(name, ([], []))
                print(f"| {name} | {med(ws)} | {med(rs)} |")

        if args.store_sweep:
            cfgs = [tuple(int(x) for x in c.split("x")) for c in args.store_sweep.split(",")]
            runs = [(f"NVMeStore qd{qd} x {mib} MiB",
                     lambda sz, qd=qd, mib=mib: store(sz, qd, mib << 20, keep=True)) for qd, mib in cfgs]
            runs.append(("probe: O_DIRECT pwrite/pread, 1 thread", probe))
            for size in sizes:
                sweep_table("NVMeStore queue depth x block size", runs, size)
                close_stores()

        if args.offset_sweep:
            offs = [int(x) << 10 for x in args.offset_sweep.split(",")]
            runs = [(f"probe, data at {o >> 10} KiB", lambda sz, o=o: probe(sz, o)) for o in offs]
            for size in sizes:
                sweep_table("O_DIRECT probe by file offset of the data", runs, size)

        if args.sweep:
            size = _parse_size(args.sweep_size)
            sweep = []
            for e in engines:
                for qd in (8, 32, 128):
                    for bs in (256 << 10, 1 << 20, 4 << 20):
                        for pinned in (True, False):
                            sweep.append((e, qd, bs, pinned))
            res = {}
            for rep in range(args.reps):
                for cfg in sweep:
                    e, qd, bs, pinned = cfg
                    try:
                        w, r = ours(e, size, qd, bs, pinned)
                    except Exception as ex:  # noqa: BLE001
                        notes.append(f"sweep {cfg}: {ex}")
                        continue
                    res.setdefault(cfg, ([], []))[0].append(w)
                    res[cfg][1].append(r)
                    if peers is not None and peers.status.get("deepspeed") is None and e == engines[0]:
                        try:
                            w, r = peer("deepspeed", size, bs=bs, qd=qd, pinned=pinned)
                            res.setdefault(("deepspeed", qd, bs, pinned), ([], []))[0].append(w)
                            res[("deepspeed", qd, bs, pinned)][1].append(r)
                        except Exception as ex:  # noqa: BLE001
                            notes.append(f"sweep deepspeed {cfg}: {ex}")
            print(f"\n## Sweep at {_fmt_size(size)}: queue depth x block size x buffer kind "
                  f"(median of {args.reps}; GB/s write / read)")
            print("| engine | qd | block | buffer | write | read |")
            print("|---|---|---|---|---|---|")
            for cfg, (ws, rs) in sorted(res.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2], not kv[0][3])):
                e, qd, bs, pinned = cfg
                print(f"| {e} | {qd} | {bs >> 10} KiB | {'locked' if pinned else 'plain'} | "
                      f"{statistics.median(ws):.2f} | {statistics.median(rs):.2f} |")
        b = alloc_buffer(4096)
        print(f"\nbuffers: page-locked kind here = {b.kind!r} {b.note}; engines available: "
              f"{available_engines()}; fio: {fio or 'absent'}")
        for n in notes:
            print(f"note: {n}")
    finally:
        close_stores()
        for e in eng_cache.values():
            e.close()
        if peers is not None:
            peers.close()
        _rm(root)


if __name__ == "__main__":
    main()
