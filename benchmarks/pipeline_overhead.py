"""Overhead of the read / compute / write pipeline on an in-memory store.

Three ways to run the same Adam step over the same tensors:

* ``direct``   : :func:`statestore.kernels.adam_step` on tensors held in Python lists;
* ``pipeline`` : the states live in a store; one ``store.pipeline(units, "rw")`` pass hands
  out views (no copy on resident stores) and ``adam_step`` runs on each unit;
* ``CPUAdam``  : the whole ``CPUAdam.step()`` (gradient checks, unit planning, pipeline,
  kernel) over ``nn.Parameter`` s with ``.grad`` set.

Each is timed as the median of ``--steps`` steps after ``--warmup`` steps; the table gives
milliseconds per step and the ratio to ``direct``.

    .venv/bin/python benchmarks/pipeline_overhead.py [--steps 30] [--store device|pinned|file]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings

import torch

import statestore as ss
from statestore import Slice, StateKey
from statestore.kernels import AdamHyper, AdamTensors, adam_step, kernels_info
from statestore.optim import CPUAdam

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw_mode=True)
CASES = [("1 x 16M", 1, 16 * 1024 * 1024), ("100 x 64K", 100, 64 * 1024),
         ("1000 x 4K", 1000, 4 * 1024)]


def make_store(kind: str, tmp: str) -> ss.StateStore:
    if kind == "device":
        return ss.DeviceStore("cpu")
    if kind == "pinned":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return ss.PinnedCPUStore()
    if kind == "file":
        return ss.FileStore(tmp)
    raise SystemExit(f"unknown store {kind!r}")


def median_ms(fn, steps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def bench_case(count: int, numel: int, kind: str, steps: int, warmup: int, tmp: str):
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(numel, generator=gen) for _ in range(count)]
    grads = [torch.randn(numel, generator=gen) * 1e-2 for _ in range(count)]
    m = [torch.zeros(numel) for _ in range(count)]
    v = [torch.zeros(numel) for _ in range(count)]
    t = [0]

    def direct():
        t[0] += 1
        adam_step(AdamTensors(params, grads, m, v, [t[0]] * count), AdamHyper(**HP))

    store = make_store(kind, tmp)
    keys = [(StateKey(str(i), "exp_avg"), StateKey(str(i), "exp_avg_sq")) for i in range(count)]
    store.create_many([(k, (numel,), torch.float32, None) for pair in keys for k in pair])
    units = [[Slice(ka, 0, numel) for ka in pair] for pair in keys]
    # one unit per call, as plan_units does for resident stores (unit_bytes None): all at once
    all_units = [[s for u in units for s in u]]
    s_steps = [0]

    def via_pipeline():
        s_steps[0] += 1
        with store.pipeline(all_units, mode="rw", wait=False) as pipe:
            for tensors in pipe:
                adam_step(AdamTensors(params, grads, tensors[0::2], tensors[1::2],
                                      [s_steps[0]] * count), AdamHyper(**HP))

    store2 = make_store(kind, tmp)
    nps = [torch.nn.Parameter(p.clone()) for p in params]
    for p, g in zip(nps, grads):
        p.grad = g
    opt = CPUAdam(nps, lr=HP["lr"], weight_decay=HP["weight_decay"], state_store=store2)

    res = {"direct": median_ms(direct, steps, warmup),
           "pipeline": median_ms(via_pipeline, steps, warmup),
           "CPUAdam": median_ms(opt.step, steps, warmup)}
    store.close()
    store2.close()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--store", default="device", choices=["device", "pinned", "file"])
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    info = kernels_info()
    print(f"# store={args.store} kernel={info['cpu']}/{info['simd']} threads={info['threads']} "
          f"torch={torch.__version__} median of {args.steps} steps")
    hdr = f"{'case':<12}{'direct ms':>11}{'pipeline ms':>13}{'ratio':>7}{'CPUAdam ms':>12}{'ratio':>7}"
    print(hdr)
    print("-" * len(hdr))
    with tempfile.TemporaryDirectory(prefix="statestore-bench-") as tmp:
        for name, count, numel in CASES:
            r = bench_case(count, numel, args.store, args.steps, args.warmup, tmp)
            d = r["direct"]
            print(f"{name:<12}{d:>11.3f}{r['pipeline']:>13.3f}{r['pipeline'] / d:>7.2f}"
                  f"{r['CPUAdam']:>12.3f}{r['CPUAdam'] / d:>7.2f}")


if __name__ == "__main__":
    main()
