"""Host time of an optimizer step over many small tensors: what a GPU step waits for before its
one kernel launch, and what a CPU step spends outside the kernel.

HybridAdam over ``DeviceStore("cpu")`` (tensors small enough that the kernel is a few percent of
the step) against ``torch.optim.AdamW(foreach=True)`` on the same parameters, and HybridAdam with
its unit plan made anew every step (``STATESTORE_PLAN_MEMO=0``, the behaviour before the plan
was reused). Contestants run interleaved, ``--rounds`` times ``--steps`` steps; medians of the
per-step microseconds are printed, one row per tensor count.

    python benchmarks/host_overhead.py                       # 50, 200 and 1000 tensors
    python benchmarks/host_overhead.py --tensors 50 --rounds 5
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
from torch import nn  # noqa: E402


def _params(k: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ps = [nn.Parameter(torch.randn(n, generator=g)) for _ in range(k)]
    for p in ps:
        p.grad = torch.randn(n, generator=g) * 1e-2
    return ps


def measure(k: int, n: int, rounds: int, steps: int):
    import statestore as ss
    from statestore.optim import HybridAdam

    ours = HybridAdam(_params(k, n, 0), lr=1e-3, weight_decay=0.01,
                      state_store=ss.DeviceStore("cpu"))
    theirs = torch.optim.AdamW(_params(k, n, 0), lr=1e-3, weight_decay=0.01, foreach=True)

    def run(opt, memo="1"):
        def go():
            os.environ["STATESTORE_PLAN_MEMO"] = memo
            t0 = time.perf_counter()
            for _ in range(steps):
                opt.step()
            return (time.perf_counter() - t0) / steps * 1e6
        return go

    contest = {"ours": run(ours), "replan": run(ours, "0"), "torch": run(theirs)}
    for fn in contest.values():
        fn()
    times = {name: [] for name in contest}
    try:
        for _ in range(rounds):
            for name, fn in contest.items():
                times[name].append(fn())
    finally:
        os.environ.pop("STATESTORE_PLAN_MEMO", None)
        ours.close()
    return {name: statistics.median(v) for name, v in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensors", default="50,200,1000", help="tensor counts")
    ap.add_argument("--numel", type=int, default=256, help="elements a tensor")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=20, help="steps a round")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the kernels' too)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    counts = [int(x) for x in args.tensors.split(",") if x]
    print(f"command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    print(f"load average: {os.getloadavg()[0]:.1f}; {args.threads} thread(s); "
          f"{args.numel} fp32 elements a tensor\n")
    print("| tensors | HybridAdam (us/step) | planned every step (us/step) | torch AdamW foreach "
          "(us/step) | HybridAdam us a tensor | replan / ours | torch / ours |")
    print("|---|---|---|---|---|---|---|")
    for k in counts:
        t = measure(k, args.numel, args.rounds, args.steps)
        print(f"| {k} | {t['ours']:.0f} | {t['replan']:.0f} | {t['torch']:.0f} | "
              f"{t['ours'] / k:.1f} | {t['replan'] / t['ours']:.2f}x | "
              f"{t['torch'] / t['ours']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
