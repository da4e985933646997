"""Host time of an optimizer step over many small tensors, per tensor: what a GPU step waits
for before its launches, and what a CPU step spends outside the kernel; and the time of a
checkpoint save and load per tensor.

Step table, one per (store, torch threads): ``HybridAdam`` (its compiled step plan, the
default), ``HybridAdam`` made the general way (``STATESTORE_STEP_PLAN=0``: the per-unit path,
what every step did before plans), ``StoreOptimizer(torch.optim.AdamW)``, and torch's
``AdamW`` in RAM in its three forms (``fused=True``, ``foreach=True``, ``foreach=False``), on
the same parameters and gradients. Stores: ``DeviceStore("cpu")`` and ``NVMeStore`` (a
temporary directory); torch's optimizers keep their states in RAM whatever the row's store.
Contestants run interleaved, ``--rounds`` times ``--steps`` steps each (default: about 20,000
tensor updates a round, at least 2 steps); the figures are the medians, in microseconds per
tensor per step, with ratios: ours over torch fused (issue 44's target: 1.0x or less), the
general way over torch fused (before plans), and StoreOptimizer over torch's loop
(``foreach=False``; target 1.2x) and over ``foreach=True``.

Checkpoint table, one per store (``--ckpt``): ``store.save_checkpoint`` / ``load_checkpoint``
of the HybridAdam states against ``torch.save`` / ``torch.load`` of torch AdamW's
``state_dict()`` and ``torch.distributed.checkpoint`` ``save`` / ``load`` of it (one
process), microseconds per tensor (parameter), medians of ``--ckpt-rounds``.

Figures taken while other work runs on the machine are noisy: the load average is printed.

    python benchmarks/host_overhead.py                     # 50, 1000, 10000 tensors; 1, 2 threads
    python benchmarks/host_overhead.py --tensors 1000 --threads 1 --stores device --no-ckpt
    python benchmarks/host_overhead.py --quick             # a smoke run (tests/system)
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
from torch import nn  # noqa: E402

STEP_COLUMNS = ("ours", "general", "store_opt", "fused", "foreach", "single")
STEP_HEAD = ("HybridAdam", "HybridAdam general", "StoreOptimizer(AdamW)", "torch fused",
             "torch foreach", "torch single")


def _params(k: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ps = [nn.Parameter(torch.randn(n, generator=g)) for _ in range(k)]
    for p in ps:
        p.grad = torch.randn(n, generator=g) * 1e-2
    return ps


def _store(kind: str, root: str):
    import statestore as ss
    if kind == "device":
        return ss.DeviceStore("cpu")
    return ss.NVMeStore(tempfile.mkdtemp(dir=root, prefix="nvme-"))


def _steps_of(k: int, steps) -> int:
    return steps if steps else max(2, min(20, 20000 // k))


def measure_steps(kind: str, k: int, n: int, rounds: int, steps: int, root: str):
    """Median microseconds per tensor per step of each contestant (interleaved rounds)."""
    from statestore.optim import HybridAdam, StoreOptimizer
    kw = dict(lr=1e-3, weight_decay=0.01)
    stores = [_store(kind, root) for _ in range(3)]
    opts = {
        "ours": (HybridAdam(_params(k, n, 0), state_store=stores[0], **kw), "1"),
        "general": (HybridAdam(_params(k, n, 0), state_store=stores[1], **kw), "0"),
        "store_opt": (StoreOptimizer(torch.optim.AdamW, _params(k, n, 0), state_store=stores[2],
                                     **kw), "1"),
        "fused": (torch.optim.AdamW(_params(k, n, 0), fused=True, **kw), "1"),
        "foreach": (torch.optim.AdamW(_params(k, n, 0), foreach=True, **kw), "1"),
        "single": (torch.optim.AdamW(_params(k, n, 0), foreach=False, **kw), "1"),
    }

    def timed(opt, plan):
        os.environ["STATESTORE_STEP_PLAN"] = plan
        t0 = time.perf_counter()
        for _ in range(steps):
            opt.step()
        if hasattr(opt, "state_store"):
            opt.state_store.sync()          # a disk store's last write-behind included
        return (time.perf_counter() - t0) / steps / k * 1e6

    times = {name: [] for name in opts}
    try:
        for name, (opt, plan) in opts.items():      # warm up: states created, plans made
            timed(opt, plan)
        for _ in range(rounds):
            for name, (opt, plan) in opts.items():
                times[name].append(timed(opt, plan))
    finally:
        os.environ.pop("STATESTORE_STEP_PLAN", None)
        for s in stores:
            s.close()
    return {name: statistics.median(v) for name, v in times.items()}


def measure_checkpoints(kind: str, k: int, n: int, rounds: int, root: str):
    """Median microseconds per tensor of our save/load and torch's (torch.save, DCP)."""
    import torch.distributed.checkpoint as dcp
    from statestore.optim import HybridAdam
    kw = dict(lr=1e-3, weight_decay=0.01)
    store = _store(kind, root)
    ours = HybridAdam(_params(k, n, 0), state_store=store, **kw)
    theirs = torch.optim.AdamW(_params(k, n, 0), foreach=False, **kw)
    ours.step()
    theirs.step()
    out = {x: [] for x in ("save", "load", "torch_save", "torch_load", "dcp_save", "dcp_load")}

    def clock(fn):
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) / k * 1e6

    try:
        for r in range(rounds):
            d = tempfile.mkdtemp(dir=root, prefix="ck-")
            ck, pt = os.path.join(d, "ours"), os.path.join(d, "torch.pt")
            dc = os.path.join(d, "dcp")
            out["save"].append(clock(lambda: store.save_checkpoint(ck, progress=False)))
            out["torch_save"].append(clock(lambda: torch.save(theirs.state_dict(), pt)))
            with warnings.catch_warnings():         # one process, no process group
                warnings.simplefilter("ignore")
                out["dcp_save"].append(clock(lambda: dcp.save({"optim": theirs.state_dict()},
                                                              checkpoint_id=dc)))
                out["load"].append(clock(lambda: store.load_checkpoint(ck, progress=False)))
                out["torch_load"].append(clock(lambda: theirs.load_state_dict(
                    torch.load(pt, weights_only=True))))
                sd = {"optim": theirs.state_dict()}
                out["dcp_load"].append(clock(lambda: (dcp.load(sd, checkpoint_id=dc),
                                                      theirs.load_state_dict(sd["optim"]))))
            shutil.rmtree(d, ignore_errors=True)
    finally:
        store.close()
    return {x: statistics.median(v) for x, v in out.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensors", default="50,1000,10000", help="tensor counts")
    ap.add_argument("--numel", type=int, default=256, help="fp32 elements a tensor")
    ap.add_argument("--threads", default="1,2", help="torch threads (the kernels' too)")
    ap.add_argument("--stores", default="device,nvme", help="device and/or nvme")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=0, help="steps a round (0: by tensor count)")
    ap.add_argument("--ckpt-rounds", type=int, default=3)
    ap.add_argument("--no-ckpt", action="store_true", help="skip the checkpoint table")
    ap.add_argument("--dir", default=None, help="where NVMe stores and checkpoints go")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 3 and 7 tensors")
    args = ap.parse_args(argv)
    if args.quick:
        args.tensors, args.threads, args.rounds, args.steps, args.ckpt_rounds = "3,7", "1", 1, 2, 1
    counts = [int(x) for x in args.tensors.split(",") if x]
    threads = [int(x) for x in args.threads.split(",") if x]
    kinds = [x for x in args.stores.split(",") if x]
    root = tempfile.mkdtemp(dir=args.dir, prefix="host-overhead-")
    print(f"command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    print(f"load average at start: {os.getloadavg()[0]:.1f}; {args.numel} fp32 elements a "
          f"tensor; microseconds per tensor (median of {args.rounds} rounds)\n")
    try:
        for kind in kinds:
            for th in threads:
                torch.set_num_threads(th)
                print(f"### steps: {kind} store, {th} thread(s)\n")
                print("| tensors | " + " | ".join(STEP_HEAD) + " | ours / fused | general / "
                      "fused | StoreOptimizer / single | StoreOptimizer / foreach |")
                print("|---" * (len(STEP_HEAD) + 5) + "|")
                for k in counts:
                    t = measure_steps(kind, k, args.numel, args.rounds,
                                      _steps_of(k, args.steps), root)
                    cells = " | ".join(f"{t[c]:.2f}" for c in STEP_COLUMNS)
                    print(f"| {k} | {cells} | {t['ours'] / t['fused']:.2f}x | "
                          f"{t['general'] / t['fused']:.2f}x | "
                          f"{t['store_opt'] / t['single']:.2f}x | "
                          f"{t['store_opt'] / t['foreach']:.2f}x |", flush=True)
                print()
            if args.no_ckpt:
                continue
            torch.set_num_threads(threads[0])
            print(f"### checkpoints: {kind} store, {threads[0]} thread(s)\n")
            print("| tensors | save | torch.save | DCP save | load | torch.load | DCP load | "
                  "save / torch.save | load / torch.load |")
            print("|---" * 9 + "|")
            for k in counts:
                c = measure_checkpoints(kind, k, args.numel, args.ckpt_rounds, root)
                print(f"| {k} | {c['save']:.1f} | {c['torch_save']:.1f} | {c['dcp_save']:.1f} | "
                      f"{c['load']:.1f} | {c['torch_load']:.1f} | {c['dcp_load']:.1f} | "
                      f"{c['save'] / c['torch_save']:.2f}x | {c['load'] / c['torch_load']:.2f}x |",
                      flush=True)
            print()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
