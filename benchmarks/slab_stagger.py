"""How far apart a resident store's slab puts a parameter's two moment buffers, and what it
costs the step: ``CPUAdam.step()`` on ``DeviceStore("cpu")``, one parameter, one thread, for
each stagger (the bytes a state of 1 MiB or more starts beyond the previous state's end,
``statestore/backends/_slab.py``'s ``STAGGER``), interleaved over rounds.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/slab_stagger.py --size-m 64 --moments bf16 \\
        --staggers 4096,65536,0,12288 --rounds 2

Prints, per stagger, exp_avg_sq's distance above exp_avg and ns per parameter of a step
(minimum and median of ``--steps`` steps a round, over all rounds).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import statestore as ss
from statestore.backends import _slab
from statestore.optim import CPUAdam


def _rounds(n: int, moments: str, stagger: int, steps: int, p: torch.nn.Parameter):
    _slab.STAGGER = stagger
    store = ss.DeviceStore("cpu")
    try:
        opt = CPUAdam([p], lr=1e-4, state_store=store, moment_dtype=moments)
        opt.step()                                   # creates the states
        st = opt.state[p]
        dist = st["exp_avg_sq"].data_ptr() - st["exp_avg"].data_ptr()
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            opt.step()
            times.append((time.perf_counter() - t) / n * 1e9)
        del st, opt
        return dist, times
    finally:
        store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-m", type=int, default=64, help="parameter size in Mi elements")
    ap.add_argument("--moments", default="bf16", choices=("fp32", "bf16", "int8"))
    ap.add_argument("--staggers", default="4096,65536")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n = args.size_m << 20
    staggers = [int(s) for s in args.staggers.split(",")]
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n) * 1e-3
    default, res, dists = _slab.STAGGER, {s: [] for s in staggers}, {}
    try:
        for _ in range(args.rounds):
            for s in staggers:
                dists[s], times = _rounds(n, args.moments, s, args.steps, p)
                res[s] += times
    finally:
        _slab.STAGGER = default
    print(f"{args.size_m}M parameters, {args.moments} moments, {args.threads} thread(s), "
          f"{args.rounds} rounds x {args.steps} steps (library default stagger {default})")
    print("| stagger | exp_avg_sq - exp_avg | ns/param min | ns/param median |")
    print("|---|---|---|---|")
    for s in staggers:
        print(f"| {s} | {dists[s]:#x} | {min(res[s]):.3f} | {statistics.median(res[s]):.3f} |")


if __name__ == "__main__":
    main()
