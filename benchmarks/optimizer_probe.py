"""The quick probe a user runs: ``CPUAdam.step()`` against ``torch.optim.AdamW(fused=True)`` on
one large fp32 parameter, the two stepped alternately.

``benchmarks/adam_step.py`` times the kernel alone; this times the whole optimizer step (the
store, the pipeline over a resident store, the kernel call), the way a user compares the two
optimizers. Each round starts a fresh process pair of optimizers and reports the medians of
``--steps`` interleaved steps; the table gives every round and the median of the rounds'
ratios (speed: torch's time / ours, above 1 is faster than torch).

    python benchmarks/optimizer_probe.py --size-m 64 --threads 2 --rounds 9
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def one_round(n: int, steps: int, weight_decay: float):
    """Median seconds per step of (CPUAdam, torch fused AdamW) over ``steps`` alternated steps."""
    import torch
    from statestore.optim import CPUAdam
    g = torch.randn(n) * 1e-3
    ours = torch.nn.Parameter(torch.randn(n))
    theirs = torch.nn.Parameter(ours.detach().clone())
    ours.grad, theirs.grad = g, g.clone()
    a = CPUAdam([ours], lr=1e-3, weight_decay=weight_decay)
    b = torch.optim.AdamW([theirs], lr=1e-3, weight_decay=weight_decay, fused=True)
    for opt in (a, b, a, b):        # warm up: states created, pages touched
        opt.step()
    ta, tb = [], []
    for _ in range(steps):
        t = time.perf_counter()
        a.step()
        ta.append(time.perf_counter() - t)
        t = time.perf_counter()
        b.step()
        tb.append(time.perf_counter() - t)
    return statistics.median(ta), statistics.median(tb)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-m", type=float, default=64, help="parameters, in millions (2**20)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=15, help="interleaved steps per round")
    ap.add_argument("--weight-decay", type=float, default=0.01)
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    n = int(args.size_m * (1 << 20))
    gbytes = 28 * n / 1e9          # bytes an fp32 AdamW step moves: p, g, m, v read; p, m, v written
    print(f"torch {torch.__version__}; {n:,} fp32 parameters in one tensor, "
          f"weight_decay {args.weight_decay}, {args.threads} threads")
    print()
    print("| round | CPUAdam.step (ms) | torch fused (ms) | ours GB/s | torch GB/s | speed vs torch |")
    print("|---|---|---|---|---|---|")
    ratios = []
    for r in range(args.rounds):
        ta, tb = one_round(n, args.steps, args.weight_decay)
        ratios.append(tb / ta)
        print(f"| {r + 1} | {ta * 1e3:.1f} | {tb * 1e3:.1f} | {gbytes / ta:.1f} | "
              f"{gbytes / tb:.1f} | {tb / ta:.3f}x |")
    print()
    print(f"speed vs torch fused AdamW: median {statistics.median(ratios):.3f}x, "
          f"range {min(ratios):.3f}-{max(ratios):.3f}x over {len(ratios)} rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
