"""The quick probe a user runs: ``CPUAdam.step()`` against ``torch.optim.AdamW(fused=True)`` on
one large fp32 parameter, the two stepped alternately.

``benchmarks/adam_step.py`` times the kernel alone; this times the whole optimizer step (the
store, the pipeline over a resident store, the kernel call), the way a user compares the two
optimizers. Each round starts a fresh process pair of optimizers and reports the medians of
``--steps`` interleaved steps; the table gives every round and the median of the rounds'
ratios (speed: torch's time / ours, above 1 is faster than torch).

    python benchmarks/optimizer_probe.py --size-m 64 --threads 2 --rounds 9

``--layouts`` times, in the same rotation as ``CPUAdam.step()`` and torch's fused AdamW,
statestore's kernel alone (``statestore.kernels.adam_step``) on torch's parameter and gradient
with exp_avg and exp_avg_sq laid out three ways: torch's own two (separate allocations),
back to back in one buffer (as a store's slab has them: for a power-of-two
size the two sit exactly 2^k bytes apart), and in one buffer with 4 KiB between them. It tells
the kernel's own speed from the speed of the memory layout it is given.

    python benchmarks/optimizer_probe.py --size-m 64 --threads 2 --rounds 9 --layouts
"""
from __future__ import annotations

import argparse
import gc
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


def layouts_round(n: int, steps: int, weight_decay: float):
    """Median seconds per step of each contestant of ``--layouts``, over ``steps`` rotations."""
    import torch
    from statestore.kernels import AdamHyper, AdamTensors, adam_step
    from statestore.optim import CPUAdam
    fns = {}
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n) * 1e-3
    fns["CPUAdam.step"] = CPUAdam([p], lr=1e-3, weight_decay=weight_decay).step
    q = torch.nn.Parameter(torch.randn(n))
    q.grad = torch.randn(n) * 1e-3
    theirs = torch.optim.AdamW([q], lr=1e-3, weight_decay=weight_decay, fused=True)
    fns["torch fused"] = theirs.step

    # The kernel steps torch's parameter and gradient (timing only: the values do not matter),
    # with torch's own exp_avg/exp_avg_sq (separate allocations) or with slab-like buffers;
    # that keeps the process at about 12 bytes a parameter per contestant above torch's.
    theirs.step()
    torch_state = theirs.state[q]

    def kernel(pad):
        if pad is None:
            m, v = torch_state["exp_avg"], torch_state["exp_avg_sq"]
        else:
            buf = torch.zeros(2 * n + pad)
            m, v = buf[:n], buf[n + pad:]
        count = [0]

        def step():
            count[0] += 1
            adam_step(AdamTensors([q.data], [q.grad], [m], [v], [count[0]]),
                      AdamHyper(lr=1e-3, weight_decay=weight_decay))
        return step
    fns["kernel, m v separate"] = kernel(None)
    fns["kernel, m v back to back"] = kernel(0)
    fns["kernel, m v 4 KiB apart"] = kernel(1024)
    items = list(fns.items())
    for _, f in items:              # warm up: states created, pages touched
        f()
        f()
    times = {k: [] for k in fns}
    for r in range(steps):
        k = r % len(items)
        for name, f in items[k:] + items[:k]:
            t = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def layouts_main(args, n: int, gbytes: float) -> int:
    names = None
    ratios = {}
    for r in range(args.rounds):
        med = layouts_round(n, args.steps, args.weight_decay)
        gc.collect()                # the optimizers' reference cycles: free the round's buffers
        if names is None:
            names = list(med)
            print("GB/s of each contestant (28 B a parameter), then its speed against torch's "
                  "fused AdamW in the same round")
            print()
            print("| round | " + " | ".join(names) + " |")
            print("|---|" + "---|" * len(names))
        for k in names:
            ratios.setdefault(k, []).append(med["torch fused"] / med[k])
        print(f"| {r + 1} | " + " | ".join(
            f"{gbytes / med[k]:.1f} ({med['torch fused'] / med[k]:.2f}x)" for k in names) + " |",
            flush=True)
    print()
    for k in names:
        if k != "torch fused":
            v = ratios[k]
            print(f"{k}: median {statistics.median(v):.3f}x of torch fused, "
                  f"range {min(v):.3f}-{max(v):.3f}x over {len(v)} rounds")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-m", type=float, default=64, help="parameters, in millions (2**20)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=15, help="interleaved steps per round")
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--layouts", action="store_true",
                    help="also time the kernel alone on three layouts of exp_avg/exp_avg_sq")
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    n = int(args.size_m * (1 << 20))
    gbytes = 28 * n / 1e9          # bytes an fp32 AdamW step moves: p, g, m, v read; p, m, v written
    print(f"torch {torch.__version__}; {n:,} fp32 parameters in one tensor, "
          f"weight_decay {args.weight_decay}, {args.threads} threads")
    print()
    if args.layouts:
        return layouts_main(args, n, gbytes)
    print("| round | CPUAdam.step (ms) | torch fused (ms) | ours GB/s | torch GB/s | speed vs torch |")
    print("|---|---|---|---|---|---|")
    ratios = []
    for r in range(args.rounds):
        ta, tb = one_round(n, args.steps, args.weight_decay)
        gc.collect()                # the optimizers' reference cycles: free the round's buffers
        ratios.append(tb / ta)
        print(f"| {r + 1} | {ta * 1e3:.1f} | {tb * 1e3:.1f} | {gbytes / ta:.1f} | "
              f"{gbytes / tb:.1f} | {tb / ta:.3f}x |")
    print()
    print(f"speed vs torch fused AdamW: median {statistics.median(ratios):.3f}x, "
          f"range {min(ratios):.3f}-{max(ratios):.3f}x over {len(ratios)} rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
