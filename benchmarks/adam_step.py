"""CPU Adam step throughput: statestore's kernel beside torch's AdamW (fused, foreach),
DeepSpeedCPUAdam and ColossalAI's CPUAdam, with the memory-bandwidth roofline measured in the
same run.

    .venv/bin/python benchmarks/adam_step.py                 # full table (a few minutes)
    .venv/bin/python benchmarks/adam_step.py --quick         # 16M only, fewer repetitions
    .venv/bin/python benchmarks/adam_step.py --peers-python benchmarks/.venv-peers/bin/python

Peers: DeepSpeed, ColossalAI and bitsandbytes (its 8-bit AdamW, CPU path) are not
dependencies of statestore. Where they are not
importable here, and a peers interpreter exists (``--peers-python``, default
``benchmarks/.venv-peers/bin/python`` when present), the script runs itself again under that
interpreter with the repository on ``sys.path``, so that every contestant runs in ONE process,
interleaved, on the same buffers. That interpreter must import the same torch (e.g. a venv
with a ``.pth`` file pointing at ``.venv``'s site-packages, then
``DS_BUILD_OPS=0 pip install deepspeed==0.19.8 py-cpuinfo psutil bitsandbytes==0.50.2``). Peers
that cannot be imported are listed with the reason.

Method: per configuration (size, layout, threads, grad dtype) the buffers are allocated once;
each contestant is warmed up, then the contestants are timed in rotating order, one step at a
time, ``--reps`` rounds; medians are reported, with ratios against the best peer and against
the roofline. Roofline: a kernel with the memory traffic of an fp32 Adam step (read p, g, m, v,
write p, m, v: 28 bytes a parameter) and no arithmetic, from the same extension and threads.
Timing is informative only; nothing here is a test.

Clock (``--clock``): ``wall`` (default) times each step by the wall clock. ``cpu`` takes the
process's CPU time over the step divided by the threads: on a host shared with other work,
where the wall clock also counts the time the threads wait for a core, it is the step's time
on cores of its own (the threads' memory bandwidth is still shared with whatever runs beside
them; the thread pool's spinning at the end of a parallel region is counted).

Compressed moments (``--moments bf16,int8``, default): statestore's kernel over bf16 and int8
moments runs in the same rotation; a second table gives, per moment dtype, params/s, the bytes
an update moves per parameter, the roofline at those bytes (the probe's GB/s divided by them)
and the ratio to fp32 moments.

Compute ceiling (``--cache-resident``): the update on data that stays in the L2 cache, one
thread, statestore's fp32 and compressed-moment kernels against torch's fused AdamW kernel,
interleaved. Each contestant
steps one tensor of ``--cr-sizes`` elements (default 1024 and 16384: 16 KiB and 256 KiB of
p, g, m, v) many times; the per-parameter cost is the slope between the two sizes, which
removes the per-call overhead (Python, dispatch, checks). Far below the memory roofline's time
per parameter means the kernel has compute to spare where memory is the limit.

    .venv/bin/python benchmarks/adam_step.py --cache-resident

Stages (``--stages``): each building block of the compressed-moment SIMD body (decode, update,
block maximum, encode, random bits) timed alone, then the whole kernels, cache-resident, per
instruction set the processor has and per thread count of ``--threads`` (T threads at once,
each on arrays of its own) (``benchmarks/moment_stages.cpp``, compiled with ``$CXX``).
Statestore's moment states are laid out as the resident stores lay out their slabs
(``slab_states``).

Overlap (``--overlap``): how much of a step's memory traffic one core, and T cores, hide behind
arithmetic: the fp32 update plus K hashes a vector of independent integer work, cache-resident
and in RAM (``--overlap-ram-m`` millions of elements a thread), rows in turn. The compressed
moments trade memory traffic for arithmetic; they gain only as far as the two overlap.

    .venv/bin/python benchmarks/adam_step.py --overlap --threads 1,2
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PEERS = os.path.join(REPO, "benchmarks", ".venv-peers", "bin", "python")
M = 1 << 20


def _maybe_reexec(args) -> None:
    """Runs this script under the peers interpreter when DeepSpeed is missing here."""
    if args.no_peers or os.environ.get("STATESTORE_BENCH_CHILD"):
        return
    try:
        import deepspeed  # noqa: F401
        return
    except Exception:  # noqa: BLE001
        pass
    peers = args.peers_python or (DEFAULT_PEERS if os.path.exists(DEFAULT_PEERS) else None)
    if not peers:
        return
    import subprocess
    import torch
    probe = subprocess.run([peers, "-c", "import torch; print(torch.__version__)"],
                           capture_output=True, text=True)
    if probe.returncode != 0 or probe.stdout.strip() != torch.__version__:
        print(f"note: peers interpreter {peers} not used (its torch: "
              f"{probe.stdout.strip() or probe.stderr.strip()[-200:]}, ours: {torch.__version__})")
        return
    env = dict(os.environ, STATESTORE_BENCH_CHILD="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    print(f"note: running under the peers interpreter {peers}", flush=True)
    os.execve(peers, [peers, os.path.abspath(__file__)] + sys.argv[1:], env)


class Contestant:
    name = "?"
    peer = True

    def __init__(self, params, grads, gdtype, masters=None):
        self.params, self.grads, self.gdtype = params, grads, gdtype
        self.masters = masters      # fp32 masters of low-precision params (statestore only)

    def step(self):
        raise NotImplementedError


def slab_states(params, dtypes):
    """(exp_avg, exp_avg_sq) of each parameter, zeros of ``dtypes``, in one buffer laid out as
    the resident stores lay out their slabs (``statestore.backends._slab.slab_layout``): the
    layout users get from ``DeviceStore("cpu")`` or ``PinnedCPUStore``. Separate allocations
    of 2^k bytes land 2^k + 4 KiB apart, a layout that costs the compressed-moment step up to
    1.5x at 1 thread (benchmarks/RESULTS.md, "the slabs' stagger")."""
    import torch
    from statestore.backends._slab import slab_layout
    shapes = [(p.shape, d) for p in params for d in dtypes]
    sizes = [p.numel() * torch.empty((), dtype=d).element_size() for p in params for d in dtypes]
    offs, total = slab_layout(sizes)
    buf = torch.zeros(max(total, 1), dtype=torch.uint8)
    views = [buf[o:o + nb].view(d).view(shape) for (shape, d), o, nb in zip(shapes, offs, sizes)]
    return views[0::2], views[1::2]


class Ours(Contestant):
    name = "statestore"
    peer = False

    def __init__(self, params, grads, gdtype, masters=None):
        import torch
        from statestore.kernels import adam_step
        super().__init__(params, grads, gdtype, masters)
        self.m, self.v = slab_states(params, (torch.float32, torch.float32))
        self.n = 0
        self._step = adam_step

    def step(self):
        self.n += 1
        from statestore.kernels import AdamHyper, AdamTensors
        self._step(AdamTensors(self.params, self.grads, self.m, self.v,
                               [self.n] * len(self.params), None, self.masters),
                   AdamHyper(lr=1e-3, weight_decay=0.01))


class OursMoments(Contestant):
    """statestore's kernel with compressed moments (moment_dtype bf16 / int8)."""
    peer = False
    kind = "bf16"

    def __init__(self, params, grads, gdtype, masters=None):
        import torch
        from statestore.kernels import _quant as Q
        from statestore.kernels._moments import adam_step_moments
        super().__init__(params, grads, gdtype, masters)
        cm, cv = (torch.bfloat16, torch.bfloat16) if self.kind == "bf16" else (torch.int8, torch.uint8)
        self.m, self.v = slab_states(params, (cm, cv))
        self.ms = [torch.zeros(Q.nblocks(p.numel())) for p in params] if self.kind == "int8" else None
        self.vs = [torch.zeros(Q.nblocks(p.numel())) for p in params] if self.kind == "int8" else None
        self.rounding = "stochastic" if self.kind == "bf16" else "nearest"
        self.n = 0
        self._step = adam_step_moments

    def step(self):
        self.n += 1
        k = len(self.params)
        from statestore.kernels import AdamHyper, AdamTensors, MomentCodes
        self._step(AdamTensors(self.params, self.grads, self.m, self.v, [self.n] * k, None,
                               self.masters), AdamHyper(lr=1e-3, weight_decay=0.01),
                   MomentCodes(self.kind, self.rounding, [(self.n, ~self.n)] * k, [0] * k,
                               self.ms, self.vs))


class OursBF16(OursMoments):
    name = "statestore bf16 moments"
    kind = "bf16"


class OursInt8(OursMoments):
    name = "statestore int8 moments"
    kind = "int8"


MOMENT_CLASSES = {"bf16": OursBF16, "int8": OursInt8}


def moment_bytes(kind: str, gdtype_bytes: int, bf16_params: bool = False) -> float:
    """Bytes an update moves per parameter: read p, g, m, v; write p, m, v; int8 adds the two
    scales per 256 elements, read and written; bf16 params with fp32 masters: read and write
    the master, write the bf16 param (2 more)."""
    mb = {"fp32": 4, "bf16": 2, "int8": 1}[kind]
    extra = 4 * 4 / 256 if kind == "int8" else 0.0
    return 4 + gdtype_bytes + 2 * mb + 4 + 2 * mb + extra + (2 if bf16_params else 0)


def _upcast_into(bufs, grads):
    """The grads as fp32, as a peer that takes fp32 grads only needs them: low-precision grads
    are copied into preallocated fp32 buffers (timed; no allocation in the loop)."""
    import torch
    if bufs is None:
        bufs = [None if g.dtype == torch.float32 else torch.empty(g.shape, dtype=torch.float32)
                for g in grads]
    out = []
    for b, g in zip(bufs, grads):
        if b is None:
            out.append(g)
        else:
            b.copy_(g)
            out.append(b)
    return bufs, out


class TorchAdamW(Contestant):
    kind = "fused"

    def __init__(self, params, grads, gdtype, masters=None):
        import torch
        super().__init__(params, grads, gdtype)
        self.tp = [torch.nn.Parameter(p, requires_grad=True) for p in params]
        kw = {"fused": True} if self.kind == "fused" else {"foreach": True}
        self.opt = torch.optim.AdamW(self.tp, lr=1e-3, weight_decay=0.01, **kw)

    def step(self):
        import torch
        # fp32 params need fp32 grads: a low-precision grad is upcast first (timed)
        self.bufs, gs = _upcast_into(getattr(self, "bufs", None), self.grads)
        for p, g in zip(self.tp, gs):
            p.grad = g
        self.opt.step()


class TorchFused(TorchAdamW):
    name = "torch AdamW fused"
    kind = "fused"


class TorchForeach(TorchAdamW):
    name = "torch AdamW foreach"
    kind = "foreach"


class DeepSpeed(Contestant):
    name = "DeepSpeedCPUAdam"

    def __init__(self, params, grads, gdtype, masters=None):
        import torch
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        super().__init__(params, grads, gdtype)
        self.tp = [torch.nn.Parameter(p, requires_grad=True) for p in params]
        self.opt = DeepSpeedCPUAdam(self.tp, lr=1e-3, weight_decay=0.01, adamw_mode=True)

    def step(self):
        import torch
        self.bufs, gs = _upcast_into(getattr(self, "bufs", None), self.grads)
        for p, g in zip(self.tp, gs):
            p.grad = g
        self.opt.step()


class Colossal(Contestant):
    name = "ColossalAI CPUAdam"

    def __init__(self, params, grads, gdtype, masters=None):
        import torch
        from colossalai.nn.optimizer import CPUAdam
        super().__init__(params, grads, gdtype)
        self.tp = [torch.nn.Parameter(p, requires_grad=True) for p in params]
        self.opt = CPUAdam(self.tp, lr=1e-3, weight_decay=0.01, adamw_mode=True)

    def step(self):
        import torch
        self.bufs, gs = _upcast_into(getattr(self, "bufs", None), self.grads)
        for p, g in zip(self.tp, gs):
            p.grad = g
        self.opt.step()


class BnbAdamW8bit(Contestant):
    """bitsandbytes' 8-bit AdamW (blockwise dynamic-map states) on CPU."""
    name = "bitsandbytes AdamW8bit"

    def __init__(self, params, grads, gdtype, masters=None):
        import bitsandbytes as bnb
        import torch
        super().__init__(params, grads, gdtype)
        self.tp = [torch.nn.Parameter(p, requires_grad=True) for p in params]
        self.opt = bnb.optim.AdamW8bit(self.tp, lr=1e-3, weight_decay=0.01)

    def step(self):
        self.bufs, gs = _upcast_into(getattr(self, "bufs", None), self.grads)
        for p, g in zip(self.tp, gs):
            p.grad = g
        self.opt.step()


#: the moments each peer keeps (for the per-moment-dtype table)
PEER_MOMENTS = {"torch AdamW fused": "fp32", "torch AdamW foreach": "fp32",
                "DeepSpeedCPUAdam": "fp32", "ColossalAI CPUAdam": "fp32",
                "bitsandbytes AdamW8bit": "int8"}


def available_peers():
    """(classes usable, {name: reason skipped})."""
    usable, skipped = [TorchFused, TorchForeach], {}
    import torch
    for cls, mod in ((DeepSpeed, "deepspeed.ops.adam"), (Colossal, "colossalai.nn.optimizer"),
                     (BnbAdamW8bit, "bitsandbytes")):
        try:
            p = torch.nn.Parameter(torch.randn(64))
            p.grad = torch.randn(64)
            c = cls([p.data], [p.grad], torch.float32)
            c.step()
            usable.append(cls)
        except Exception as e:  # noqa: BLE001 - report why, go on
            msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            skipped[cls.name] = f"{type(e).__name__}: {msg[:160]}"
    return usable, skipped


class Roofline(Contestant):
    """The memory roofline, timed in the same rotation as the contestants: read p, g, m, v
    and write p, m, v (28 B/param) with no arithmetic, same threads (_C_adam.bandwidth_probe)."""
    name = "roofline"
    peer = False

    def __init__(self, n, ext):
        import torch
        self.bufs = [torch.rand(n) for _ in range(4)]
        self.ext = ext

    def step(self):
        self.ext.bandwidth_probe(*self.bufs)


def run_config(classes, n, ntensors, gdtype, reps, ext, bf16_params=False, clock="wall"):
    """Median step time of each contestant and of the roofline probe, interleaved. With
    bf16_params the parameters are bf16 with fp32 masters (statestore's contestants only).
    clock "cpu": the process's CPU time per step over the threads (see the module doc)."""
    import torch
    if clock == "cpu":
        thr = torch.get_num_threads()
        now = lambda: time.process_time() / thr  # noqa: E731
    else:
        now = time.perf_counter
    sizes = [n // ntensors] * ntensors
    sizes[-1] += n - sum(sizes)
    params = [torch.randn(s) for s in sizes]
    grads = [(torch.randn(s) * 1e-2).to(gdtype) for s in sizes]
    masters = None
    if bf16_params:
        masters, params = params, [p.to(torch.bfloat16) for p in params]
        classes = [c for c in classes if not c.peer]
    contestants = [cls(params, grads, gdtype, masters) for cls in classes] + [Roofline(n, ext)]
    for c in contestants:  # warm-up: state allocation, first touch
        c.step()
    times = {c.name: [] for c in contestants}
    for r in range(reps):
        k = r % len(contestants)
        for c in contestants[k:] + contestants[:k]:
            t0 = now()
            c.step()
            times[c.name].append(now() - t0)
    del contestants, params, grads
    gc.collect()
    med = {k: statistics.median(v) for k, v in times.items()}
    return med, med.pop(Roofline.name)


def _cpu_mhz():
    """The clock /proc/cpuinfo reports (MHz), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("cpu MHz"):
                    return float(line.split(":", 1)[1])
    except (OSError, ValueError):
        pass
    return None


CR_MOMENTS = [("bf16", "nearest"), ("bf16", "stochastic"), ("int8", "nearest"),
              ("int8", "stochastic")]


def cache_resident(sizes, rounds, calls):
    """Per-parameter time of the update on cache-resident data, one thread: the slope of a
    step's time between two tensor sizes, interleaved: torch's fused AdamW, statestore's fp32
    kernel and its compressed-moment kernels (fp32 params and grads)."""
    import torch
    from statestore.kernels import _quant as Q
    from statestore.kernels import (AdamHyper, AdamTensors, MomentCodes, adam_step,
                                    adam_step_moments, kernels_info)
    lo, hi = sizes
    hyper = AdamHyper(lr=1e-3, weight_decay=0.01)

    def ours(n):
        p, g = torch.randn(n), torch.randn(n) * 1e-3
        m, v = torch.zeros(n), torch.zeros(n)
        return lambda: adam_step(AdamTensors([p], [g], [m], [v], [5]), hyper)

    def moments(kind, rounding):
        def make(n):
            p, g = torch.randn(n), torch.randn(n) * 1e-3
            m, s_m = Q.encode(kind, 0, torch.randn(n) * 1e-3, seed=1, offset=0, rounding="nearest")
            v, s_v = Q.encode(kind, 1, torch.rand(n) * 1e-6, seed=2, offset=0, rounding="nearest")
            sc = ([s_m], [s_v]) if kind == "int8" else (None, None)
            codes = MomentCodes(kind, rounding, [(1, 2)], [0], *sc)
            return lambda: adam_step_moments(AdamTensors([p], [g], [m], [v], [5]), hyper, codes)
        return make

    def torch_fused(n):
        q = torch.nn.Parameter(torch.randn(n))
        q.grad = torch.randn(n) * 1e-3
        opt = torch.optim.AdamW([q], lr=hyper.lr, betas=(hyper.beta1, hyper.beta2),
                                eps=hyper.eps, weight_decay=hyper.weight_decay, fused=True)
        opt.step()
        return opt.step

    makers = [("torch fused AdamW", torch_fused), ("statestore", ours)]
    makers += [(f"statestore {k} moments, {r}", moments(k, r)) for k, r in CR_MOMENTS]
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fns = {(name, n): make(n) for name, make in makers for n in (lo, hi)}
        best = {k: float("inf") for k in fns}
        for f in fns.values():
            for _ in range(20):
                f()
        for _ in range(rounds):          # rotate: every contestant sees the same machine
            for k, f in fns.items():
                t0 = time.perf_counter()
                for _ in range(calls):
                    f()
                best[k] = min(best[k], (time.perf_counter() - t0) / calls)
    finally:
        torch.set_num_threads(old)
    mhz = _cpu_mhz()
    info = kernels_info()
    print(f"torch {torch.__version__}; statestore path {info['simd']} ({info['simd_width']}-bit); "
          f"cpu: {_cpu_name()}; 1 thread; cache-resident AdamW step (fp32 params and grads), "
          f"slope between {lo} and {hi} params")
    print()
    print("| contestant | step at %d (us) | step at %d (us) | ns/param | G params/s | "
          "cycles/16 params | vs torch | vs statestore fp32 |" % (lo, hi))
    print("|---|---|---|---|---|---|---|---|")
    slope = {name: (best[(name, hi)] - best[(name, lo)]) / (hi - lo) for name, _ in makers}
    for name, sl in slope.items():
        cyc = f"{sl * mhz * 1e6 * 16:.1f}" if mhz and sl > 0 else "?"
        rate = f"{1e-9 / sl:.2f}" if sl > 0 else "?"
        ratio = f"{slope['torch fused AdamW'] / sl:.2f}x" if sl > 0 else "?"
        own = f"{sl / slope['statestore']:.2f}x" if slope["statestore"] > 0 else "?"
        print(f"| {name} | {best[(name, lo)] * 1e6:.2f} | {best[(name, hi)] * 1e6:.2f} | "
              f"{sl * 1e9:.3f} | {rate} | {cyc} | {ratio} | {own} |")
    print(f"\nbest of {rounds} rotations of {calls} calls; cycles at the {mhz} MHz "
          "/proc/cpuinfo reports; vs torch: torch's ns/param / ours (above 1: ours is faster); "
          "vs statestore fp32: the time per param against the fp32-moment kernel's.")
    return slope


def _run_stages(n, rounds, opt, threads, seconds, ram_elems=0):
    """Build benchmarks/moment_stages.cpp for each instruction set the processor has (with the
    extension's flags; ``opt``: the -O level, the extension's is 3) and run it with each thread
    count of ``threads``; returns the columns ((isa, threads) pairs) and {row name: {column:
    ns per element}}. ``ram_elems`` > 0: the overlap probe's rows (that many elements a
    thread in RAM) instead of the stages'."""
    import subprocess
    import tempfile
    from statestore.kernels import kernels_info
    info = kernels_info()
    isas = [i for i in ("avx512", "avx2") if i in info["simd_supported"]]
    if not isas:
        sys.exit("--stages: the processor has neither AVX2 nor AVX-512")
    cxx = os.environ.get("CXX", "c++")
    src = os.path.join(REPO, "benchmarks", "moment_stages.cpp")
    cols, rows = [], {}
    with tempfile.TemporaryDirectory() as d:
        for isa in isas:
            exe = os.path.join(d, f"stages_{isa}")
            cmd = [cxx, f"-O{opt}", "-std=c++17", "-ffp-contract=off", "-fno-math-errno",
                   "-I" + os.path.join(REPO, "csrc"), f"-DSTAGES_{isa.upper()}", src, "-o", exe,
                   "-lpthread"]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                sys.exit(f"--stages: {' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
            for t in threads:
                # below -O3 the figures are not the kernels': one call a row and round (a check)
                per_round = 200000 if opt == "3" else n
                out = subprocess.run([exe, str(n), str(rounds), str(t), str(seconds), str(per_round),
                                      str(ram_elems)], capture_output=True, text=True, check=True).stdout
                col = (isa, t)
                cols.append(col)
                for line in out.splitlines():
                    name, _, val = line.partition("\t")
                    if name.startswith(("stage:", "kernel:", "overlap:")):
                        rows.setdefault(name, {})[col] = float(val)
    return cols, rows


def stages(n, rounds, opt="3", threads=(1,), seconds=3.0):
    """Cycles per element of each stage of the compressed-moment SIMD body, cache-resident:
    benchmarks/moment_stages.cpp, compiled here for each instruction set the processor has,
    with the extension's flags (``opt``: the -O level; the extension's is 3), run with each
    thread count of ``threads`` (T threads: each its own arrays, at once; the machine's ns
    per element), the rows in turn for at least ``seconds``."""
    mhz = _cpu_mhz()
    cols, rows = _run_stages(n, rounds, opt, threads, seconds)
    print(f"cpu: {_cpu_name()}; {n} elements a thread, cache-resident; best of {rounds} or "
          f"more rounds (at least {seconds:g} s, rows in turn); ns per element of the machine "
          f"(T threads at once); cycles of one core per element, at the {mhz} MHz "
          f"/proc/cpuinfo reports; built with -O{opt}"
          + ("" if opt == "3" else " (NOT the kernel's -O3: these figures are not its speed)"))
    print()
    head = (["stage (per element)"] + [f"{i} {t} thr ns" for i, t in cols]
            + [f"{i} {t} thr cycles" for i, t in cols])
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name, vals in rows.items():
        ns = [f"{vals[c]:.3f}" if c in vals else "?" for c in cols]
        cy = [f"{vals[c] * c[1] * mhz / 1e3:.2f}" if c in vals and mhz else "?" for c in cols]
        print("| " + " | ".join([name] + ns + cy) + " |")
    print("\nstage: one building block of the SIMD body alone, on fp32 arrays in and out (so "
          "each includes its own loads and stores); kernel: the whole update (fp32 grads).")
    return rows


def overlap(n, ram_elems, rounds, opt="3", threads=(1, 2), seconds=3.0):
    """How much of the memory traffic a core hides behind arithmetic: the fp32 update (with
    the kernel's prefetches) plus K hashes a vector of integer work independent of it, timed
    cache-resident (its arithmetic) and on arrays of ``ram_elems`` elements a thread in RAM,
    rows in turn (benchmarks/moment_stages.cpp's overlap probe). If the core overlapped the
    two, the RAM time would be max(arithmetic, the K = 0 step's RAM time); the last column
    is what it costs above that."""
    cols, rows = _run_stages(n, rounds, opt, threads, seconds, ram_elems=ram_elems)
    print(f"cpu: {_cpu_name()}; fp32 update + K hashes a vector, and the moment kernels: {n} "
          f"elements a thread cache-resident, {ram_elems} in RAM; best of {rounds} or more "
          f"rounds (at least {seconds:g} s, rows in turn); ns per element of the machine (T "
          f"threads at once); built with -O{opt}"
          + ("" if opt == "3" else " (NOT the kernel's -O3: these figures are not its speed)"))
    print()
    print("| ISA | threads | K hashes | cache-resident ns | RAM ns | RAM - cache-resident | "
          "RAM - max(cache-resident, K=0 RAM) |")
    print("|---|---|---|---|---|---|---|")
    ks = sorted({int(name.split()[1]) for name in rows if name.startswith("overlap:")})
    for col in cols:
        ram0 = rows.get("overlap: 0 hashes, RAM", {}).get(col)
        for k in ks:
            c = rows.get(f"overlap: {k} hashes, cache", {}).get(col)
            r = rows.get(f"overlap: {k} hashes, RAM", {}).get(col)
            if c is None or r is None or ram0 is None:
                continue
            print(f"| {col[0]} | {col[1]} | {k} | {c:.3f} | {r:.3f} | {r - c:+.3f} | "
                  f"{r - max(c, ram0):+.3f} |")
    print("\nA core that hid its memory traffic behind its arithmetic would show about 0 in the "
          "last column once K makes the arithmetic the longer of the two; one that did the two "
          "one after the other would show the K = 0 step's memory time there.")
    print()
    print("The kernels on the same arrays (fp32 grads and params): the time their bytes would take "
          "at the fp32 step's rate in RAM, and how far the step is above the larger of that and "
          "its arithmetic (cache-resident).")
    print()
    print("| ISA | threads | moments | cache-resident ns | RAM ns | bytes at fp32's rate ns | "
          "RAM - max(the two) | time / fp32 moments' |")
    print("|---|---|---|---|---|---|---|---|")
    for col in cols:
        f32 = rows.get("kernel: fp32 moments, RAM", {}).get(col)
        for name in [r for r in rows if r.startswith("kernel:") and r.endswith(", cache")]:
            label = name[len("kernel: "):-len(", cache")]
            c = rows[name].get(col)
            r = rows.get(f"kernel: {label}, RAM", {}).get(col)
            if c is None or r is None or f32 is None:
                continue
            mem = f32 * moment_bytes(label.split()[0], 4) / moment_bytes("fp32", 4)
            print(f"| {col[0]} | {col[1]} | {label} | {c:.3f} | {r:.3f} | {mem:.3f} | "
                  f"{r - max(c, mem):+.3f} | {r / f32:.2f} |")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="16,128", help="millions of parameters (M = 2^20)")
    ap.add_argument("--tensors", default="1,100", help="tensor counts per step")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--grads", default="fp32,bf16")
    ap.add_argument("--params", default="fp32",
                    help="param dtypes: fp32 and/or bf16 (bf16 params with fp32 masters: "
                         "statestore's kernels only, in the per-moment table)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="16M only, 5 reps")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall clock, or the process's CPU time over the threads (a loaded "
                         "host: the step on cores of its own)")
    ap.add_argument("--no-foreach", action="store_true", help="skip torch foreach (slow)")
    ap.add_argument("--peers-python", default=None)
    ap.add_argument("--no-peers", action="store_true", help="stay in this interpreter")
    ap.add_argument("--moments", default="bf16,int8",
                    help="compressed moment dtypes to time beside fp32 ('' for none)")
    ap.add_argument("--cache-resident", action="store_true",
                    help="only the compute ceiling: one thread, cache-resident tensors, "
                         "slope between two sizes (ours vs torch fused)")
    ap.add_argument("--cr-sizes", default="1024,16384",
                    help="the two tensor sizes (elements) of --cache-resident")
    ap.add_argument("--cr-calls", type=int, default=2000,
                    help="calls per timing of --cache-resident")
    ap.add_argument("--stages", action="store_true",
                    help="only the cycles per element of each stage of the compressed-moment "
                         "SIMD body (compiles benchmarks/moment_stages.cpp with $CXX)")
    ap.add_argument("--stage-elems", type=int, default=4096,
                    help="elements of --stages' arrays (cache-resident)")
    ap.add_argument("--stage-seconds", type=float, default=3.0,
                    help="--stages: time each thread count's rows in turn for at least this "
                         "long (the host's slow spells last tenths of a second)")
    ap.add_argument("--stages-opt", choices=("0", "1", "2", "3"), default="3",
                    help="optimization level (-O) of --stages' build; below 3 the figures "
                         "are not the kernel's (a quicker build, to check the script runs)")
    ap.add_argument("--overlap", action="store_true",
                    help="how much of the step's memory traffic a core hides behind arithmetic "
                         "(the fp32 update plus independent hashes, cache-resident and in RAM)")
    ap.add_argument("--overlap-ram-m", type=float, default=16,
                    help="--overlap: millions (2^20) of elements a thread in RAM")
    args = ap.parse_args()
    if args.overlap:
        sys.path.insert(0, REPO)
        overlap(max(args.stage_elems, 256), max(int(args.overlap_ram_m * M), 64), max(args.reps, 1),
                opt=args.stages_opt, threads=[int(t) for t in args.threads.split(",")],
                seconds=args.stage_seconds)
        return
    if args.stages:
        sys.path.insert(0, REPO)
        stages(max(args.stage_elems, 256), max(args.reps, 1) * 8, opt=args.stages_opt,
               threads=[int(t) for t in args.threads.split(",")], seconds=args.stage_seconds)
        return
    if args.cache_resident:
        sys.path.insert(0, REPO)
        lo, hi = (int(x) for x in args.cr_sizes.split(","))
        if not 0 < lo < hi:
            sys.exit("--cr-sizes: two sizes, the first smaller")
        cache_resident((lo, hi), max(args.reps, 1), max(args.cr_calls, 1))
        return
    if args.quick:
        args.sizes, args.reps = "16", 5
    _maybe_reexec(args)

    import torch
    sys.path.insert(0, REPO)
    from statestore.kernels import kernels_info
    from statestore.kernels._dispatch import load_extension as _load
    ext = _load()
    if ext is None:
        sys.exit("statestore._C_adam is not built: STATESTORE_EXT=adam python setup.py build_ext --inplace")
    info = kernels_info()
    peers, skipped = available_peers()
    if args.no_foreach:
        peers = [p for p in peers if p is not TorchForeach]
    classes = [Ours] + peers
    mclasses = [MOMENT_CLASSES[k] for k in args.moments.split(",") if k]
    gd = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    print(f"torch {torch.__version__}; statestore path {info['simd']} ({info['simd_width']}-bit); "
          f"cpu: {_cpu_name()}")
    print(f"clock: {args.clock}; load average at start: "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    if "ColossalAI CPUAdam" in skipped:
        print("  (ColossalAI 0.5.0's CPU Adam loader refuses to load without CUDA; measured by hand "
              "on a host of this kind, its speed was DeepSpeed's within noise)")
    names = [c.name for c in classes]
    header = (["params", "tensors", "thr", "grads"] + names +
              ["roofline", "ours/best peer", "ours/roofline"])
    rows = []
    mrows = []
    old_threads = torch.get_num_threads()
    for size in [int(s) for s in args.sizes.split(",")]:
        for nt in [int(s) for s in args.tensors.split(",")]:
            for thr in [int(s) for s in args.threads.split(",")]:
                for g, pd in [(g, pd) for pd in args.params.split(",") for g in args.grads.split(",")]:
                    torch.set_num_threads(thr)
                    bf16p = pd == "bf16"
                    med, roof_t = run_config(classes + mclasses, size * M, nt, gd[g], args.reps,
                                             ext, bf16_params=bf16p, clock=args.clock)
                    n = size * M
                    rate = {k: n / t for k, t in med.items()}
                    roof = n / roof_t
                    if not bf16p:
                        best_peer = max(v for k, v in rate.items() if k != Ours.name
                                        and k in names)
                        row = [f"{size}M", str(nt), str(thr), g]
                        row += [f"{rate[k] / 1e9:.2f} G" for k in names]
                        row += [f"{roof / 1e9:.2f} G ({roof * 28 / 1e9:.0f} GB/s)",
                                f"{rate[Ours.name] / best_peer:.2f}x",
                                f"{100 * rate[Ours.name] / roof:.0f}%"]
                        rows.append(row)
                        print(" | ".join(row), flush=True)
                    roof_bps = roof * 28
                    mlist = [("fp32", Ours.name, "statestore")]
                    mlist += [(c.kind, c.name, "statestore") for c in mclasses]
                    mlist += [(PEER_MOMENTS[c.name], c.name, c.name) for c in classes
                              if c.name in PEER_MOMENTS and c.name in rate]
                    for kind, cname, who in mlist:
                        b = moment_bytes(kind, gd[g].itemsize, bf16p)
                        r = rate[cname]
                        mrows.append([f"{size}M", str(nt), str(thr), g,
                                      "bf16 + fp32 master" if bf16p else "fp32", who, kind,
                                      f"{r / 1e9:.2f} G", f"{b:.2f}",
                                      f"{roof_bps / b / 1e9:.2f} G",
                                      f"{100 * r / (roof_bps / b):.0f}%",
                                      f"{r / rate[Ours.name]:.2f}x"])
                        print(" | ".join(mrows[-1]), flush=True)
    torch.set_num_threads(old_threads)
    print()
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print("\nparams/s, medians of %d interleaved steps; roofline = 28 B/param probe, same run; "
          "peers with bf16 grads include the upcast they need (into preallocated fp32 "
          "buffers)." % args.reps)
    if mclasses:
        mh = ["params", "tensors", "thr", "grads", "param dtype", "optimizer", "moments",
              "params/s", "B/param",
              "roofline at B/param", "of roofline", "vs fp32 moments"]
        print("\n| " + " | ".join(mh) + " |")
        print("|" + "---|" * len(mh))
        for r in mrows:
            print("| " + " | ".join(r) + " |")
        print("\nB/param: bytes an update moves per fp32 parameter (read p, g, m, v; write p, "
              "m, v; int8: plus 2 fp32 scales per 256 elements each way; a peer given bf16 "
              "grads is counted with them, though it reads its fp32 copy too); roofline at "
              "B/param = the probe's bytes/s / B/param; vs fp32 moments: params/s against "
              "statestore's fp32-moment kernel in the same configuration.")


def _cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"


if __name__ == "__main__":
    main()
