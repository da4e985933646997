"""What the pipeline's profiler spans (``statestore::read_wait``, ``compute``, ``write_submit``...;
docs/profiling.md) cost when no profiler runs, and what a step costs while one records.

One ``CPUAdam`` over ``--params`` parameters of ``--numel`` fp32 elements, states on an
``NVMeStore`` with a small RAM budget (many pipeline units: the most spans a step can have) or
a ``DeviceStore("cpu")``. Timed, interleaved step by step so that the machine's load hits all
alike (median ms per step over ``--steps`` rounds):

* ``spans``: the code as shipped (each span checks torch's profiler flag and does nothing);
* ``no spans``: the same code with the span helpers replaced by a bare ``nullcontext``/no-op
  in ``statestore.pipeline`` (the floor: what the spans would cost if they cost nothing);
* ``profiling``: under ``torch.profiler.profile`` (CPU activity), spans recorded.

Also printed: the spans one step records (counted under the profiler) and the cost of one
disabled span (``timeit``).

    .venv/bin/python benchmarks/trace_overhead.py [--store nvme|device] [--steps 30]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
import timeit

import torch

import statestore as ss
import statestore.pipeline as pipeline_mod
from statestore import _trace
from statestore.optim import CPUAdam


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", default="nvme", choices=["nvme", "device"])
    ap.add_argument("--params", type=int, default=64)
    ap.add_argument("--numel", type=int, default=16 * 1024)
    ap.add_argument("--budget-mib", type=float, default=1.0, help="NVMeStore budget_bytes")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    null = contextlib.nullcontext()
    shipped = (pipeline_mod._span, pipeline_mod._begin_span, pipeline_mod._end_span)
    stripped = (lambda name: null, lambda name: None, lambda h: None)

    def use(fns):
        pipeline_mod._span, pipeline_mod._begin_span, pipeline_mod._end_span = fns

    with tempfile.TemporaryDirectory(prefix="statestore-trace-") as tmp:
        store = (ss.NVMeStore(tmp, budget_bytes=int(a.budget_mib * 2**20)) if a.store == "nvme"
                 else ss.DeviceStore("cpu"))
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(a.numel, generator=gen)) for _ in range(a.params)]
        for p in params:
            p.grad = torch.randn(a.numel, generator=gen) * 1e-2
        opt = CPUAdam(params, lr=1e-3, state_store=store)
        for _ in range(3):
            opt.step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            opt.step()
        counts = {}
        for e in prof.events():
            if e.name in _trace.SPANS:
                counts[e.name] = counts.get(e.name, 0) + 1
        times = {"spans": [], "no spans": [], "profiling": []}
        for _ in range(a.steps):
            for mode in ("spans", "no spans", "profiling"):
                use(stripped if mode == "no spans" else shipped)
                ctx = (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                       if mode == "profiling" else null)
                with ctx:
                    t0 = time.perf_counter()
                    opt.step()
                    dt = time.perf_counter() - t0
                times[mode].append(dt)
        use(shipped)
        store.close()
    per_call = min(timeit.repeat(lambda: _trace.span("statestore::compute"), number=100_000,
                                 repeat=5)) / 100_000
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    nspans = sum(counts.values())
    print(f"# store={a.store} params={a.params} x {a.numel} fp32"
          + (f" budget={a.budget_mib} MiB" if a.store == "nvme" else "")
          + f", torch {torch.__version__}, median of {a.steps} interleaved steps")
    print(f"# spans one step records: {nspans} ("
          + ", ".join(f"{k.split('::')[1]} {v}" for k, v in sorted(counts.items())) + ")")
    print(f"# one disabled span: {per_call * 1e9:.0f} ns; x {nspans} spans = "
          f"{per_call * nspans * 1e6:.1f} us a step")
    print(f"{'mode':<12}{'ms/step':>10}{'vs no spans':>13}")
    for mode in ("no spans", "spans", "profiling"):
        print(f"{mode:<12}{med[mode]:>10.3f}{med[mode] / med['no spans']:>13.3f}")


if __name__ == "__main__":
    main()
