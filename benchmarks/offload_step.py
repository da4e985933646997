"""Optimizer step time and peak RSS with states in RAM, fully on disk, and half on disk (and
fully on disk through TensorNVMe, ``TensorNVMeStore(dir)``, when it is installed).

A GPT-2-small-shaped set of fp32 parameters (124M, built here from the model's shapes; no
transformers needed), CPUAdam, fixed gradients. Each configuration runs in its own process (so
its peak RSS is its own), the configurations interleaved over ``--rounds``; a plain O_DIRECT
pwrite/pread probe on the same directory, interleaved too, gives the disk's bandwidth.

Reported per configuration (medians): step time (steps back to back, the last one's
write-behind included), peak RSS, page-cache growth, bytes read and written per step, the
I/O floor ``bytes_read / probe_read_bw + bytes_written / probe_write_bw``, step / floor, and the
overlap efficiency ``max(io_floor, compute) / step`` (compute = the in-RAM step).

    .venv/bin/python benchmarks/offload_step.py            # 124M params, 2 rounds, 4 steps
    .venv/bin/python benchmarks/offload_step.py --scale 0.25 --rounds 1

Compressed moments: ``--moments fp32,bf16,int8 --param-dtype bf16`` runs the disk store once
per ``moment_dtype`` (bf16 parameters keep fp32 masters in the store) and adds a table of each
step against the fp32-moment step on the same disk.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * mult[s[-1]]) if s[-1] in mult else int(s)


def gpt2_shapes(scale: float = 1.0):
    """GPT-2 small (124M) parameter shapes; ``scale`` < 1 shrinks the vocabulary and layers."""
    d, vocab, ctx, layers = 768, 50257, 1024, 12
    if scale < 1.0:
        layers = max(1, int(round(12 * scale)))
        vocab = max(1000, int(vocab * scale))
    shapes = [("wte", (vocab, d)), ("wpe", (ctx, d))]
    for i in range(layers):
        shapes += [(f"h{i}.ln_1.w", (d,)), (f"h{i}.ln_1.b", (d,)),
                   (f"h{i}.attn.c_attn.w", (d, 3 * d)), (f"h{i}.attn.c_attn.b", (3 * d,)),
                   (f"h{i}.attn.c_proj.w", (d, d)), (f"h{i}.attn.c_proj.b", (d,)),
                   (f"h{i}.ln_2.w", (d,)), (f"h{i}.ln_2.b", (d,)),
                   (f"h{i}.mlp.c_fc.w", (d, 4 * d)), (f"h{i}.mlp.c_fc.b", (4 * d,)),
                   (f"h{i}.mlp.c_proj.w", (4 * d, d)), (f"h{i}.mlp.c_proj.b", (d,))]
    shapes += [("ln_f.w", (d,)), ("ln_f.b", (d,))]
    return shapes


def _cached_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024
    return 0


def _peak_rss() -> int:
    """VmHWM: this process's peak RSS (reset at exec, unlike ru_maxrss, which a child
    inherits from the parent that forked it)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(cfg: dict) -> None:
    import torch

    sys.path.insert(0, os.path.dirname(HERE))
    import statestore as ss
    from statestore.backends import nvme_store
    from statestore.optim import CPUAdam

    torch.set_num_threads(cfg["threads"])
    shapes = gpt2_shapes(cfg["scale"])
    g = torch.Generator().manual_seed(0)
    pdt = getattr(torch, cfg.get("pdtype", "float32"))
    params = [(n, torch.nn.Parameter((torch.randn(s, generator=g) * 0.02).to(pdt)))
              for n, s in shapes]
    for _, p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(pdt)
    md = dict(moment_dtype=cfg.get("moments", "fp32"))
    frac = cfg["fraction"]
    store = None
    if frac is None:
        opt = CPUAdam(params, lr=1e-4, **md)
    else:
        kw = {"budget_bytes": cfg["budget"]} if cfg.get("budget") else {}
        if cfg.get("engine"):
            kw["engine"] = cfg["engine"]
        store = (ss.TieredStore.from_fraction(frac, cfg["dir"], **kw) if frac < 1.0
                 else nvme_store(cfg["dir"], **kw))
        opt = CPUAdam(params, lr=1e-4, state_store=store, **md)
    opt.step()                     # creates the states (first write)
    if store is not None:
        store.sync()
    cached0 = _cached_bytes()
    st0 = store.stats() if store is not None else {}
    times, returns = [], []
    t_prev = time.perf_counter()
    for _ in range(cfg["steps"]):
        t0 = time.perf_counter()
        opt.step()
        returns.append(time.perf_counter() - t0)
        if store is not None and _ == cfg["steps"] - 1:
            store.sync()           # the last step's write-behind counts
        t1 = time.perf_counter()
        times.append(t1 - t_prev)
        t_prev = t1
    st1 = store.stats() if store is not None else {}
    nparams = sum(p.numel() for _, p in params)
    out = {
        "step": statistics.median(times),
        "step_returns": statistics.median(returns),
        "maxrss": _peak_rss(),
        "cache_growth": _cached_bytes() - cached0,
        "read_per_step": (st1.get("bytes_read", 0) - st0.get("bytes_read", 0)) / cfg["steps"],
        "written_per_step": (st1.get("bytes_written", 0) - st0.get("bytes_written", 0)) / cfg["steps"],
        "nparams": nparams,
        "state_bytes": 8 * nparams,
        "store_nbytes": store.stats()["nbytes"] if store is not None else None,
    }
    if store is not None:
        s = store.stats()
        out["engine"] = s.get("engine") or next((t["stats"].get("engine") for t in s.get("tiers", [])
                                                 if t["stats"].get("engine")), None)
        store.close()
    print("@@JSON " + json.dumps(out), flush=True)


def probe(directory: str, size: int = 1 << 30):
    """Plain O_DIRECT pwrite / cold pread, one thread: (write GB/s, read GB/s)."""
    import mmap

    buf = mmap.mmap(-1, size)
    buf.write(os.urandom(1 << 20) * (size >> 20))
    path = os.path.join(directory, "probe.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        os.posix_fallocate(fd, 0, size)
        t0 = time.perf_counter()
        done = 0
        mv = memoryview(buf)
        while done < size:
            done += os.pwrite(fd, mv[done:], done)
        os.fdatasync(fd)
        w = size / (time.perf_counter() - t0) / 1e9
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        done = 0
        while done < size:
            n = os.preadv(fd, [mv[done:]], done)
            if n <= 0:
                raise OSError("short read in probe")
            done += n
        r = size / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)
        os.unlink(path)
    return w, r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=1.0, help="shrink the model (1.0 = 124M)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--dir", default=None, help="directory on the disk (default: under benchmarks/)")
    ap.add_argument("--budget", default=None, help="budget_bytes of the disk stores, e.g. 64M "
                    "(default: the stores' default, 256 MiB)")
    ap.add_argument("--moments", default=None, help="moment dtypes, e.g. fp32,bf16,int8: the "
                    "disk store once per moment_dtype (default: fp32 only, and the tiered store)")
    ap.add_argument("--param-dtype", default="fp32", choices=["fp32", "bf16"],
                    help="parameter dtype (bf16: fp32 masters in the store)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    root = tempfile.mkdtemp(prefix="offload-step-", dir=args.dir or HERE)
    # (name, fraction, engine, moment_dtype)
    configs = [("states in RAM", None, None, "fp32"), ("fully on disk (NVMeStore)", 1.0, None, "fp32"),
               ("fraction 0.5 (TieredStore)", 0.5, None, "fp32")]
    sys.path.insert(0, os.path.dirname(HERE))
    from statestore.io import probe_engine
    moments = args.moments.split(",") if args.moments else []
    if moments:
        configs = [("states in RAM", None, None, "fp32")] + [
            ("fully on disk (NVMeStore)" if m == "fp32" else f"NVMeStore, {m} moments", 1.0,
             None, m) for m in moments]
    elif probe_engine("tensornvme") is None:
        configs.append(("fully on disk (TensorNVMe store)", 1.0, "tensornvme", "fp32"))
    pdtype = {"fp32": "float32", "bf16": "bfloat16"}[args.param_dtype]
    res = {name: [] for name, *_ in configs}
    probes = []
    try:
        for rnd in range(args.rounds):
            probes.append(probe(root))
            for name, frac, engine, mdt in configs:
                d = os.path.join(root, f"s{rnd}")
                os.makedirs(d, exist_ok=True)
                cfg = dict(fraction=frac, engine=engine, dir=d, scale=args.scale, steps=args.steps,
                           moments=mdt, pdtype=pdtype,
                           threads=args.threads, budget=_parse_size(args.budget) if args.budget else None)
                p = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker",
                                    json.dumps(cfg)], capture_output=True, text=True)
                lines = [l for l in p.stdout.splitlines() if l.startswith("@@JSON ")]
                if p.returncode != 0 or not lines:
                    print(f"note: {name} failed: {p.stderr.strip()[-500:]}", file=sys.stderr)
                    continue
                res[name].append(json.loads(lines[-1][7:]))
                shutil.rmtree(d, ignore_errors=True)
            print(f"# round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        probes.append(probe(root))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    pw = statistics.median(w for w, _ in probes)
    pr = statistics.median(r for _, r in probes)

    def med(name, key):
        vals = [r[key] for r in res[name] if key in r]
        return statistics.median(vals) if vals else float("nan")

    compute = med("states in RAM", "step")
    any_run = next((r for v in res.values() for r in v), None)
    n = any_run["nparams"] if any_run else 0
    print(f"\n## Optimizer step, {n / 1e6:.1f}M {args.param_dtype} params (GPT-2 small shapes), CPUAdam, "
          f"{args.threads} threads, median of {args.rounds} rounds x {args.steps} steps, "
          f"disk budget {args.budget or 'default (256 MiB)'}")
    print(f"probe (plain O_DIRECT, 1 thread, 1 GiB, same dir): write {pw:.2f} GB/s, read {pr:.2f} GB/s")
    print("| states | step (s) | step() returns (s) | peak RSS (MiB) | page cache grown (MiB) | "
          "read/step (MB) | written/step (MB) | I/O floor (s) | step / floor | overlap eff. |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, *_ in configs:
        if not res[name]:
            print(f"| {name} | failed | | | | | | | | |")
            continue
        step = med(name, "step")
        rd, wr = med(name, "read_per_step"), med(name, "written_per_step")
        floor = rd / (pr * 1e9) + wr / (pw * 1e9)
        ratio = f"{step / floor:.2f}" if floor > 0 else "-"
        eff = max(floor, compute) / step
        print(f"| {name} | {step:.3f} | {med(name, 'step_returns'):.3f} | "
              f"{med(name, 'maxrss') / 2**20:.0f} | {med(name, 'cache_growth') / 2**20:.0f} | "
              f"{rd / 1e6:.0f} | {wr / 1e6:.0f} | {floor:.3f} | {ratio} | {eff:.2f} |")
    if moments and res.get("fully on disk (NVMeStore)"):
        base = med("fully on disk (NVMeStore)", "step")
        print(f"\n### Moment dtypes on the disk store ({args.param_dtype} params)")
        print("| moments | store nbytes (MiB) | step (s) | vs fp32 moments |")
        print("|---|---|---|---|")
        for name, frac, _, mdt in configs:
            if frac is None or not res[name]:
                continue
            print(f"| {mdt} | {med(name, 'store_nbytes') / 2**20:.0f} | {med(name, 'step'):.3f} | "
                  f"{med(name, 'step') / base:.2f}x |")
    if any_run and not moments:
        ram, disk = med("states in RAM", "maxrss"), med("fully on disk (NVMeStore)", "maxrss")
        print(f"\nRSS saved fully on disk: {(ram - disk) / 2**20:.0f} MiB of the states' "
              f"{any_run['state_bytes'] / 2**20:.0f} MiB (8N bytes) = "
              f"{(ram - disk) / any_run['state_bytes'] * 100:.0f}%")


if __name__ == "__main__":
    main()
