"""Checkpoint throughput and memory: save and load GB/s and peak RSS growth of ``--gib`` GiB of
optimizer states from each store, against ``torch.save(opt.state_dict())`` / ``torch.load``
and a plain O_DIRECT write probe of the same bytes, in one run.

    .venv/bin/python benchmarks/checkpoint.py --gib 1 --rounds 3 --dir /path/on/the/disk

Cases run interleaved (round 1: every case, round 2: every case, ...) and the table gives
medians, so a slow moment of a shared disk hits every case alike. Every save ends durable
(fsync); before each load the checkpoint's pages are dropped from the page cache
(``posix_fadvise(DONTNEED)``, no root needed), so loads read the disk. Peak RSS growth is
VmHWM after ``/proc/self/clear_refs`` minus RSS before the call. Each case runs in its own
child process (``fork``), so one case's memory never counts against another.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch

import statestore as ss
from _common import peak_growth, reset_peak

KINDS = ["device-cpu", "pinned", "file"] + (["nvme", "nvme-copy"] if hasattr(ss, "NVMeStore")
                                             else [])
N_TENSORS = 16


def _drop_cache(path: str) -> None:
    for root, _, files in os.walk(path):
        for n in files:
            fd = os.open(os.path.join(root, n), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _make_store(kind: str, d: str):
    if kind == "device-cpu":
        return ss.DeviceStore("cpu")
    if kind == "pinned":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return ss.PinnedCPUStore()
    if kind == "file":
        return ss.FileStore(os.path.join(d, "filestore"))
    return ss.NVMeStore(os.path.join(d, "nvme"))


def _fill(store, nbytes: int) -> None:
    per = nbytes // N_TENSORS // 4
    store.create_many([(f"p{i}/exp_avg", (per,), torch.float32, None) for i in range(N_TENSORS)])
    src = torch.randn(per, generator=torch.Generator().manual_seed(0))
    for k in store.keys():
        store.put(k, src)
    store.sync()


def _rw_pass(store) -> float:
    """Seconds of one optimizer-step-like pass: read, modify and write back every state
    through the store's pipeline, then sync."""
    units = []
    for k in store.keys():
        spec = store.spec(k)
        step = max(1, store.unit_bytes // spec.itemsize)
        units += [[ss.Slice(k, a, min(a + step, spec.numel))] for a in range(0, spec.numel, step)]
    t = time.perf_counter()
    with store.pipeline(units, mode="rw") as pipe:
        for (x,) in pipe:
            x.add_(1.0)
    store.sync()
    return time.perf_counter() - t


def case_store(kind: str, d: str, nbytes: int) -> dict:
    link = kind != "nvme-copy"
    kind = "nvme" if kind == "nvme-copy" else kind
    store = _make_store(kind, d)
    _fill(store, nbytes)
    if kind == "file":
        _drop_cache(os.path.join(d, "filestore"))
    extra = {}
    if kind == "nvme":
        extra["pass_before_s"] = _rw_pass(store)
    ck = os.path.join(d, "ckpt")
    base = reset_peak()
    t = time.perf_counter()
    store.save_checkpoint(ck, progress=False, link=link)
    save_s = time.perf_counter() - t
    save_rss = peak_growth(base)
    if kind == "nvme":
        # The step after a save: with linked shards its writes go to new files.
        extra["pass_after_s"] = _rw_pass(store)
    store.close()
    _drop_cache(ck)
    store = _make_store(kind, os.path.join(d, "b"))
    base = reset_peak()
    t = time.perf_counter()
    store.load_checkpoint(ck, progress=False)
    load_s = time.perf_counter() - t
    load_rss = peak_growth(base)
    store.close()
    return {"save_s": save_s, "load_s": load_s, "save_rss": save_rss, "load_rss": load_rss,
            **extra}


def case_torch(kind: str, d: str, nbytes: int) -> dict:
    """torch.save(opt.state_dict()) of the same bytes (an AdamW-shaped state dict)."""
    per = nbytes // N_TENSORS // 4
    src = torch.randn(per, generator=torch.Generator().manual_seed(0))
    sd = {"state": {i // 2: {} for i in range(N_TENSORS)}, "param_groups": [{"lr": 1e-3}]}
    for i in range(N_TENSORS):
        sd["state"][i // 2]["exp_avg" if i % 2 == 0 else "exp_avg_sq"] = src.clone()
    path = os.path.join(d, "torch.pt")
    base = reset_peak()
    t = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(sd, f)
        f.flush()
        os.fsync(f.fileno())
    save_s = time.perf_counter() - t
    save_rss = peak_growth(base)
    del sd
    _drop_cache(d)
    base = reset_peak()
    t = time.perf_counter()
    sd = torch.load(path)
    load_s = time.perf_counter() - t
    load_rss = peak_growth(base)
    return {"save_s": save_s, "load_s": load_s, "save_rss": save_rss, "load_rss": load_rss}


def case_odirect(kind: str, d: str, nbytes: int) -> dict:
    """A plain O_DIRECT write of ``nbytes`` in 8 MiB requests, then fsync: the disk's
    sequential write bandwidth as a single writer sees it (fio's plain write job)."""
    block = 8 << 20
    buf = mmap.mmap(-1, block)
    buf.write(os.urandom(1 << 20) * 8)
    path = os.path.join(d, "probe.bin")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    t = time.perf_counter()
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, buf)
        os.fsync(fd)
    finally:
        os.close(fd)
    save_s = time.perf_counter() - t
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    t = time.perf_counter()
    try:
        while os.readv(fd, [buf]) > 0:
            pass
    finally:
        os.close(fd)
    load_s = time.perf_counter() - t
    return {"save_s": save_s, "load_s": load_s, "save_rss": 0, "load_rss": 0}


CASES = {**{f"statestore {k}": (case_store, k) for k in KINDS},
         "torch.save / torch.load": (case_torch, None),
         "O_DIRECT probe": (case_odirect, None)}


def _run_forked(fn, kind, d, nbytes) -> dict:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            res = fn(kind, d, nbytes)
        except BaseException as e:
            res = {"error": repr(e)}
        os.write(w, json.dumps(res).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while True:
        chunk = os.read(r, 65536)
        if not chunk:
            break
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(data)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="GiB of states (default 1)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--dir", default=None, help="directory on the disk under test (default: tmp)")
    p.add_argument("--only", nargs="*", default=None, help="case names (substrings) to run")
    p.add_argument("--json", default=None, help="also write the raw results here")
    args = p.parse_args(argv)
    import fsspec
    import statestore.checkpoint  # noqa: F401  one-time imports are not throughput
    fsspec.filesystem("file")
    nbytes = int(args.gib * 1024 ** 3) // (N_TENSORS * 4096) * (N_TENSORS * 4096)
    top = tempfile.mkdtemp(prefix="statestore-bench-", dir=args.dir)
    cases = {k: v for k, v in CASES.items()
             if not args.only or any(s in k for s in args.only)}
    results = {k: [] for k in cases}
    try:
        for rnd in range(args.rounds):
            for name, (fn, kind) in cases.items():
                d = os.path.join(top, f"{rnd}-{len(results[name])}-{name.split()[-1]}")
                os.makedirs(d)
                res = _run_forked(fn, kind, d, nbytes)
                shutil.rmtree(d, ignore_errors=True)
                if "error" in res:
                    print(f"{name}: {res['error']}", file=sys.stderr)
                    continue
                results[name].append(res)
                print(f"round {rnd + 1} {name}: save {nbytes / res['save_s'] / 1e9:.2f} GB/s, "
                      f"load {nbytes / res['load_s'] / 1e9:.2f} GB/s", file=sys.stderr)
    finally:
        shutil.rmtree(top, ignore_errors=True)
    gb = nbytes / 1e9
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in results.items() if rs}
    probe = med.get("O_DIRECT probe")
    tsave = med.get("torch.save / torch.load")
    print(f"\n{nbytes / 1024 ** 3:.2f} GiB of states, {args.rounds} interleaved rounds, medians; "
          f"RSS = peak RSS growth during the call")
    hdr = f"{'case':<26} {'save GB/s':>9} {'load GB/s':>9} {'save RSS':>9} {'load RSS':>9} " \
          f"{'save/probe-w':>12} {'save/floor':>10} {'load/floor':>10} {'save/torch':>10} " \
          f"{'load/torch':>10}"
    print(hdr)
    print("-" * len(hdr))
    for n, m in med.items():
        save, load = gb / m["save_s"], gb / m["load_s"]
        # The disk's floor: the probe's write (save) or read (load) of the same bytes. An
        # NVMe store's states are on the same disk, so a copying save also reads them (floor =
        # probe read + write), a linked save only reads them (floor = probe read), and a load
        # into it also writes them (floor = probe read + write).
        if probe:
            pw = f"{probe['save_s'] / m['save_s'] * 100:.0f}%"
            if "nvme-copy" in n:
                fs = probe["save_s"] + probe["load_s"]
            elif "nvme" in n:
                fs = probe["load_s"]
            else:
                fs = probe["save_s"]
            fl = probe["load_s"] + (probe["save_s"] if "nvme" in n else 0.0)
            vs, vl = f"{fs / m['save_s'] * 100:.0f}%", f"{fl / m['load_s'] * 100:.0f}%"
        else:
            pw = vs = vl = "-"
        ts = f"{tsave['save_s'] / m['save_s']:.1f}x" if tsave else "-"
        tl = f"{tsave['load_s'] / m['load_s']:.1f}x" if tsave else "-"
        print(f"{n:<26} {save:>9.2f} {load:>9.2f} {m['save_rss'] / 2 ** 20:>6.0f} MiB "
              f"{m['load_rss'] / 2 ** 20:>5.0f} MiB {pw:>12} {vs:>10} {vl:>10} {ts:>10} {tl:>10}")
    print("save/probe-w: save speed as a share of the O_DIRECT probe's write. save/floor, "
          "load/floor: as a share of the disk's floor for that case (nvme: its own files are "
          "on the same disk: a copying save reads and writes, a linked save at most reads to "
          "checksum, a load reads and writes)")
    steps = [(m["pass_before_s"], m["pass_after_s"], n) for n, m in med.items()
             if "pass_after_s" in m]
    for before, after, n in steps:
        print(f"{n}: read-modify-write pass over all states before the save {before:.2f} s, "
              f"after it {after:.2f} s ({after / before:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"nbytes": nbytes, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
