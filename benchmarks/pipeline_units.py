"""Pipeline unit size against the ring: how fast an NVMeStore moves one large state through
its read / compute / write pipeline (mode "rw", as an optimizer step does) for several RAM
budgets and unit sizes.

A unit's ring space is held from the moment its read is submitted until its write-behind
completes, so a ring of a few large units might leave the disk idle while one unit's write
finishes, and small units might keep it busier. On the development host they did not
(benchmarks/RESULTS.md), so ``StateStore.unit_bytes`` stays a quarter of the budget. Two fp32
states of ``--mib`` MiB each (an ``exp_avg``/``exp_avg_sq`` pair,
GPT-2's tied embedding is 147 MiB each) are visited in units of
``unit`` bytes, both states' slices per unit; each configuration is run ``--rounds`` times,
interleaved with the others (the disk here is noisy), and the table gives the median.

    .venv/bin/python benchmarks/pipeline_units.py --dir /nvme/tmp
    .venv/bin/python benchmarks/pipeline_units.py --budgets 64M,256M --units 4M,16M,64M
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

import statestore as ss
from statestore import Slice, StateKey


def _size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * mult)


def one_pass(store: ss.StateStore, units) -> float:
    t0 = time.perf_counter()
    with store.pipeline(units, mode="rw") as pipe:
        for tensors in pipe:
            for t in tensors:
                t.mul_(1.0)             # touch every element, as the Adam kernel does
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="directory on the disk under test")
    ap.add_argument("--mib", type=int, default=147, help="size of each of the two states")
    ap.add_argument("--budgets", default="64M,256M")
    ap.add_argument("--units", default="4M,16M,64M")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    n = args.mib << 18                                  # fp32 elements
    budgets = [_size(b) for b in args.budgets.split(",")]
    unit_sizes = [_size(u) for u in args.units.split(",")]
    results = {}
    with tempfile.TemporaryDirectory(prefix="pipeline-units-", dir=args.dir) as d:
        stores = {}
        for b in budgets:
            st = ss.NVMeStore(f"{d}/b{b}", budget_bytes=b)
            keys = [StateKey("w", "exp_avg"), StateKey("w", "exp_avg_sq")]
            for k in keys:
                st.create(k, (n,), torch.float32, torch.zeros(n))
            st.sync()
            stores[b] = (st, keys)
        for rnd in range(args.rounds):
            for b in budgets:
                st, keys = stores[b]
                for u in unit_sizes:
                    if 4 * u > b:       # fewer than four units in the ring: no overlap left
                        continue
                    step = max(1024, (u // 8) // 1024 * 1024)     # two fp32 slices per unit
                    units = [[Slice(k, a, min(a + step, n)) for k in keys]
                             for a in range(0, n, step)]
                    results.setdefault((b, u), []).append(one_pass(st, units))
            print(f"# round {rnd + 1}/{args.rounds} done", flush=True)
        for st, _ in stores.values():
            st.close()
    moved = 2 * n * 4
    print(f"\n## One rw pass over 2 x {args.mib} MiB fp32 states, NVMeStore, median of "
          f"{args.rounds} interleaved rounds")
    print("| budget | unit | units in ring | pass (s) | GB/s each way | vs a quarter-budget unit |")
    print("|---|---|---|---|---|---|")
    for b in budgets:
        quarter = results.get((b, b // 4))
        base = statistics.median(quarter) if quarter else None
        for u in unit_sizes:
            if (b, u) not in results:
                continue
            t = statistics.median(results[(b, u)])
            ratio = f"{base / t:.2f}x" if base else "-"
            print(f"| {b >> 20} MiB | {u >> 20} MiB | {b // u} | {t:.3f} | "
                  f"{moved / t / 1e9:.2f} | {ratio} |")


if __name__ == "__main__":
    main()
