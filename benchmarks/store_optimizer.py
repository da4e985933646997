"""StoreOptimizer on an NVMeStore against the same torch optimizer in RAM: step time and peak
RSS, side by side in one run, for SGD with momentum, Adafactor and Muon over ~100M fp32
parameters.

The parameters are 24 matrices of 16 x 262144 (100.7M) with fixed gradients (the optimizer
step alone is timed). Muon's Newton-Schulz iteration runs torch's bf16 ``addmm``, which on an
AVX2 CPU without bf16 arithmetic takes seconds for one such matrix: ``--muon-count`` gives
Muon's runs fewer of them when a run must finish in minutes (the table says how many
parameters each row has); SGD and Adafactor do not depend on it (``--shape`` changes the
shape). Each (optimizer, place) runs in its own process, so its peak RSS is its own: torch's
class in RAM (its defaults: the single-tensor update on CPU), then
``StoreOptimizer(cls, ..., state_store=NVMeStore(dir, budget_bytes=--budget))``. Reported:
the median step (back to back, the disk store's last write-behind included), the ratio to RAM,
peak RSS (VmHWM), what the disk store saves, the states' bytes, and the bytes read and written
per step with the disk's floor for them (a plain O_DIRECT probe of the same directory).

    .venv/bin/python benchmarks/store_optimizer.py                 # all three, ~100M each
    .venv/bin/python benchmarks/store_optimizer.py --muon-count 4  # Muon over 16.8M of them
    .venv/bin/python benchmarks/store_optimizer.py --optimizers sgd,adafactor --steps 5
    .venv/bin/python benchmarks/store_optimizer.py --quick         # a smoke run

``--per-tensor`` measures instead the host cost a tensor of ``StoreOptimizer(cls, ...)`` on
``DeviceStore("cpu")`` against ``cls(..., foreach=False)`` (the update it computes bit for
bit) and ``cls(..., foreach=True)``, on many small fp32 parameters (50 of 256 elements, 1,000
of 256, 10,000 of 64 by default; ``--sizes``), one thread. The three run interleaved in one
process, step after step, over parameters of the same values and fixed gradients; each
figure is the median of ``--rounds`` steps, in microseconds a tensor, with the load average
(1 minute) before and after it: on a shared machine a figure taken under load is noisy.
The run checks that StoreOptimizer's parameters equal ``foreach=False``'s bit for bit.

    .venv/bin/python benchmarks/store_optimizer.py --per-tensor
    .venv/bin/python benchmarks/store_optimizer.py --per-tensor --classes adamw,sgd --rounds 30
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
#: name -> (torch.optim class name, kwargs)
OPTIMIZERS = {
    "sgd": ("SGD", dict(lr=0.01, momentum=0.9)),
    "adafactor": ("Adafactor", dict(lr=1e-2)),
    "muon": ("Muon", dict(lr=0.02)),
}
LABEL = {"sgd": "SGD (momentum 0.9)", "adafactor": "Adafactor", "muon": "Muon"}
#: --per-tensor's classes: name -> (torch.optim class name, kwargs)
PER_TENSOR = {
    "adamw": ("AdamW", dict(lr=1e-3)),
    "adam": ("Adam", dict(lr=1e-3, weight_decay=0.01, amsgrad=True)),
    "sgd": ("SGD", dict(lr=0.01, momentum=0.9, dampening=0.1)),
    "adagrad": ("Adagrad", dict(lr=0.01)),
    "rmsprop": ("RMSprop", dict(lr=0.01, momentum=0.9, centered=True)),
    "nadam": ("NAdam", dict(lr=1e-3)),
    "rprop": ("Rprop", dict(lr=0.01)),
}


def _size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * mult[s[-1]]) if s[-1] in mult else int(s)


def worker(cfg: dict) -> None:
    """One (optimizer, place): warm-up steps, then ``steps`` timed; prints one JSON line."""
    import torch
    sys.path.insert(0, os.path.dirname(HERE))
    sys.path.insert(0, HERE)
    import statestore as ss
    from _common import proc_status, reset_peak
    from statestore.optim import StoreOptimizer

    torch.set_num_threads(cfg["threads"])
    g = torch.Generator().manual_seed(0)
    rows, cols = cfg["shape"]
    params = []
    for i in range(cfg["count"]):
        p = torch.nn.Parameter(torch.randn(rows, cols, generator=g) * 0.02)
        p.grad = torch.randn(rows, cols, generator=g) * 1e-3
        params.append((f"w{i}", p))
    cls_name, kw = OPTIMIZERS[cfg["optimizer"]]
    cls = getattr(torch.optim, cls_name)
    base = reset_peak(trim=True)            # parameters and gradients in RAM, no state yet
    store = None
    if cfg["place"] == "ram":
        opt = cls([p for _, p in params], **kw)
    else:
        store = ss.NVMeStore(cfg["dir"], budget_bytes=cfg["budget"])
        opt = StoreOptimizer(cls, params, state_store=store, **kw)
    for _ in range(cfg["warmup"]):          # the first creates the states
        opt.step()
    if store is not None:
        store.sync()
    st0 = store.stats() if store is not None else {}
    times = []
    prev = time.perf_counter()
    for i in range(cfg["steps"]):
        opt.step()
        if store is not None and i == cfg["steps"] - 1:
            store.sync()                    # the last step's write-behind counts
        now = time.perf_counter()
        times.append(now - prev)
        prev = now
    peak = proc_status("VmHWM")
    st1 = store.stats() if store is not None else {}
    if store is None:
        state_bytes = sum(t.numel() * t.element_size() for st in opt.state.values()
                          for k, t in st.items() if torch.is_tensor(t) and k != "step")
    else:
        state_bytes = st1["nbytes"]
    out = {"step": statistics.median(times), "steps": times,
           "peak_rss": peak, "base_rss": base, "state_bytes": state_bytes,
           "nparams": sum(p.numel() for _, p in params),
           "read": (st1.get("bytes_read", 0) - st0.get("bytes_read", 0)) / cfg["steps"],
           "written": (st1.get("bytes_written", 0) - st0.get("bytes_written", 0)) / cfg["steps"]}
    if store is not None:
        store.close()
    print("@@JSON " + json.dumps(out), flush=True)


def run(cfg: dict) -> dict:
    res = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(cfg)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"worker {cfg['optimizer']}/{cfg['place']} failed:\n{res.stderr[-3000:]}")
    line = next(x for x in res.stdout.splitlines() if x.startswith("@@JSON "))
    return json.loads(line[len("@@JSON "):])


def per_tensor(classes, sizes, rounds: int, threads: int) -> None:
    """``--per-tensor``: StoreOptimizer on DeviceStore("cpu") against torch's foreach=False
    and foreach=True, interleaved; one table row per (class, count)."""
    import torch
    sys.path.insert(0, os.path.dirname(HERE))
    import statestore as ss
    from statestore.optim import StoreOptimizer
    torch.set_num_threads(threads)
    print(f"torch {torch.__version__}, {threads} thread(s); fp32 parameters, fixed gradients; "
          f"median of {rounds} interleaved steps; us a tensor (load average, 1 min, "
          f"before/after)")
    print()
    print("| class | tensors x elements | StoreOptimizer | foreach=False | foreach=True | "
          "ours / foreach=False | ours / foreach=True | load avg | bits |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in classes:
        cls_name, kw = PER_TENSOR[name]
        cls = getattr(torch.optim, cls_name)
        for count, elems in sizes:
            g = torch.Generator().manual_seed(0)
            init = [torch.randn(elems, generator=g) for _ in range(count)]
            grads = [torch.randn(elems, generator=g) * 1e-2 for _ in range(count)]

            def params():
                ps = [torch.nn.Parameter(t.clone()) for t in init]
                for p, gr in zip(ps, grads):
                    p.grad = gr.clone()
                return ps
            ours_p, single_p, foreach_p = params(), params(), params()
            store = ss.DeviceStore("cpu")
            runs = {
                "ours": StoreOptimizer(cls, [(f"p{i}", p) for i, p in enumerate(ours_p)],
                                       state_store=store, **kw),
                "single": cls(single_p, foreach=False, **kw),
                "foreach": cls(foreach_p, foreach=True, **kw),
            }
            times = {k: [] for k in runs}
            load0 = os.getloadavg()[0]
            for _ in range(2):                  # states created, caches warm
                for opt in runs.values():
                    opt.step()
            for _ in range(rounds):
                for k, opt in runs.items():
                    t = time.perf_counter()
                    opt.step()
                    times[k].append(time.perf_counter() - t)
            load1 = os.getloadavg()[0]
            same = all(torch.equal(a, b) for a, b in zip(ours_p, single_p))
            us = {k: statistics.median(v) / count * 1e6 for k, v in times.items()}
            print(f"| {cls_name} | {count} x {elems} | {us['ours']:.1f} | {us['single']:.1f} | "
                  f"{us['foreach']:.1f} | {us['ours'] / us['single']:.2f}x | "
                  f"{us['ours'] / us['foreach']:.2f}x | {load0:.1f}/{load1:.1f} | "
                  f"{'same' if same else 'DIFFER'} |", flush=True)
            store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--optimizers", default="sgd,adafactor,muon")
    ap.add_argument("--shape", default="16x262144", help="each parameter's shape, ROWSxCOLS")
    ap.add_argument("--count", type=int, default=24, help="how many parameters")
    ap.add_argument("--steps", type=int, default=3, help="timed steps (Muon: --muon-steps)")
    ap.add_argument("--muon-steps", type=int, default=1)
    ap.add_argument("--muon-count", type=int, default=None,
                    help="how many parameters Muon's runs take (default: --count)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--budget", default="64M", help="budget_bytes of the NVMeStore")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--dir", default=None, help="directory on the disk (default: under benchmarks/)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, one step: a smoke run")
    ap.add_argument("--per-tensor", action="store_true",
                    help="host cost a tensor on DeviceStore('cpu') against torch's loops")
    ap.add_argument("--classes", default="adamw,sgd",
                    help=f"--per-tensor's classes, of {sorted(PER_TENSOR)}")
    ap.add_argument("--sizes", default="50x256,1000x256,10000x64",
                    help="--per-tensor's COUNTxELEMENTS list")
    ap.add_argument("--rounds", type=int, default=20, help="--per-tensor's timed steps")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    if args.per_tensor:
        classes = [c.strip() for c in args.classes.split(",") if c.strip()]
        unknown = [c for c in classes if c not in PER_TENSOR]
        if unknown:
            raise SystemExit(f"--classes: unknown {unknown}; choose from {sorted(PER_TENSOR)}")
        sizes = [tuple(int(x) for x in z.lower().split("x")) for z in args.sizes.split(",")]
        per_tensor(classes, sizes, args.rounds,
                   1 if "--threads" not in sys.argv else args.threads)
        return
    if args.quick:
        args.shape, args.count, args.steps, args.muon_steps, args.budget = \
            "8x4096", 4, 1, 1, "1M"
    rows, cols = (int(x) for x in args.shape.lower().split("x"))
    root = tempfile.mkdtemp(prefix="store-optimizer-", dir=args.dir or HERE)
    sys.path.insert(0, HERE)
    from _common import probe_disk
    try:
        names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
        unknown = [n for n in names if n not in OPTIMIZERS]
        if unknown:
            raise SystemExit(f"--optimizers: unknown {unknown}; choose from {sorted(OPTIMIZERS)}")
        results = {}
        for name in names:
            for place in ("ram", "nvme"):
                d = os.path.join(root, f"{name}-{place}")
                results[name, place] = run(dict(
                    optimizer=name, place=place, shape=[rows, cols],
                    count=args.muon_count or args.count if name == "muon" else args.count,
                    steps=args.muon_steps if name == "muon" else args.steps,
                    warmup=args.warmup, budget=_size(args.budget), threads=args.threads, dir=d))
                shutil.rmtree(d, ignore_errors=True)
                r = results[name, place]
                print(f"{name} in {place}: step {r['step']:.3f} s, peak RSS "
                      f"{r['peak_rss'] / 2**20:.0f} MiB", flush=True)
        nbytes = int(max(64 << 20, max(r["read"] for r in results.values())))
        w_bw, r_bw = probe_disk(root, min(nbytes, 1 << 30) // (64 << 20) * (64 << 20)
                                or 64 << 20)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"fp32 parameters of {rows}x{cols}, fixed gradients, {args.threads} threads; "
          f"NVMeStore budget_bytes={args.budget}; disk probe "
          f"(O_DIRECT, this directory): write {w_bw:.2f} GB/s, read {r_bw:.2f} GB/s")
    print()
    print("| optimizer | parameters | states (torch) | step in RAM (s) | step on NVMe (s) | ratio | peak RSS "
          "RAM (MiB) | peak RSS NVMe (MiB) | RSS saved (MiB) | read + written / step (MiB) | "
          "disk floor (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        ram, nv = results[name, "ram"], results[name, "nvme"]
        floor = nv["read"] / (r_bw * 1e9) + nv["written"] / (w_bw * 1e9)
        print(f"| {LABEL[name]} | {ram['nparams'] / 1e6:.1f}M | "
              f"{ram['state_bytes'] / 2**20:.1f} MiB | {ram['step']:.3f} | "
              f"{nv['step']:.3f} | {nv['step'] / ram['step']:.2f}x | "
              f"{ram['peak_rss'] / 2**20:.0f} | {nv['peak_rss'] / 2**20:.0f} | "
              f"{(ram['peak_rss'] - nv['peak_rss']) / 2**20:.0f} | "
              f"{(nv['read'] + nv['written']) / 2**20:.1f} | {floor:.3f} |")


if __name__ == "__main__":
    main()
