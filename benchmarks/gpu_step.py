"""GPU step: HybridAdam on CUDA against torch's fused AdamW, and an offloaded step against its
floors (PCIe, disk, CPU Adam).

Table 1, states on the GPU (``DeviceStore("cuda")``, the fused CUDA kernel): HybridAdam's
``step()`` (its step plan: one launch, docs/kernels.md "Step plans"; and, in the last
columns, the same step made the general way, ``STATESTORE_STEP_PLAN=0``) against
``torch.optim.AdamW(fused=True)`` on the same parameters and gradients, and
the HBM floor: the bytes a step must move (fp32 params: read p, g, m, v, write p, m, v = 28 B a
parameter; bf16/fp16 params with fp32 masters: read g 2, master, m, v 12, write master, m, v 12,
p 2 = 28 B too; torch runs on the fp32 masters with fp32 gradients: 28 B) over the device's
copy bandwidth, measured here with a device-to-device copy. ``--moments bf16,int8`` adds rows
of fp32 parameters with compressed moments (``moment_dtype``), whose floor counts the moments at
their width (bf16: 20 B, int8: 16 B an element); torch's row is still fp32 moments, the step
they replace.

Table 2, CUDA parameters with states in host memory or on NVMe (the staging path,
docs/gpu.md): ``step()`` with the gradients already on the GPU (the copies of a real backward
would overlap it; here they are all inside the step), the same step through synchronous
pageable copies (the path it replaced), and its floors, each measured alone in the same run:

* PCIe: D2H of the gradients (+ the fp32 parameters) and H2D of the updated parameters, pinned
  copies of the same byte counts (copy engines run both ways at once: the floor is the larger);
* CPU Adam: ``statestore.kernels.adam_step`` on host tensors of the same dtypes;
* disk (NVMe only): the store's own pipeline reading and writing every state, no compute.

floor = max(PCIe, CPU Adam, disk): a step that overlapped its parts perfectly.

Table 3, overlap with backward: a stack of bf16 linear layers (``--layers`` x ``--width``^2,
``--tokens`` rows) over a ``PinnedCPUStore``: backward alone, backward + ``step()`` on the offload
path (gradients copied by the hook while backward runs), the same through synchronous copies,
and backward + ``step()`` with states on the GPU (fused kernel), for scale.

Contestants run interleaved, ``--reps`` times; medians are printed. Without CUDA the script
says so and exits 0.

    python benchmarks/gpu_step.py                      # 64M and 256M parameters
    python benchmarks/gpu_step.py --quick              # 32M, 3 reps (make gpu-test)
    python benchmarks/gpu_step.py --dir /nvme/bench    # NVMeStore's directory
    python benchmarks/gpu_step.py --tables 2 --offload-sizes 1G --dtypes bf16   # ~1B offloaded
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

DEV = "cuda"
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * mult[s[-1]]) if s[-1] in mult else int(float(s) * (1 << 20))


def _split(n: int, ntensors: int):
    base = n // ntensors
    return [base + (1 if i < n - base * ntensors else 0) for i in range(ntensors)]


def _sync():
    torch.cuda.synchronize()


def _timed(fn) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


def _interleaved(contestants, reps):
    """``{name: median seconds}``; one warm-up call each, then ``reps`` rounds."""
    for fn in contestants.values():
        fn()
    _sync()
    times = {k: [] for k in contestants}
    for _ in range(reps):
        for k, fn in contestants.items():
            times[k].append(_timed(fn))
    return {k: statistics.median(v) for k, v in times.items()}


def _params(sizes, dtype, device=None):
    device = device or DEV
    ps = [nn.Parameter(torch.randn(s, device=device).to(dtype)) for s in sizes]
    for p in ps:
        p.grad = torch.randn_like(p) * 1e-2
    return ps


def _pinned_empty(nbytes: int):
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f}"


def _gbs(nbytes: int, s: float) -> str:
    return f"{nbytes / s / 1e9:.1f} GB/s"


# ------------------------------------------------------------------ table 1: on the GPU
def _step_bytes(param_dtype: str, moments: str) -> int:
    """Bytes one element's step must move through HBM: p (or master) read + write, g read, m and v
    read + write at the moments' width (int8 adds its block scales, under 1%)."""
    width = {"fp32": 4, "bf16": 2, "int8": 1}[moments]
    if param_dtype == "fp32":
        return 4 + 4 + 4 + 4 * width
    return 2 + 4 + 4 + 2 + 4 * width         # g, master r/w, p written


def _general_step(opt) -> None:
    """``opt.step()`` made the general way (``STATESTORE_STEP_PLAN=0``, no step plan)."""
    os.environ["STATESTORE_STEP_PLAN"] = "0"
    try:
        opt.step()
    finally:
        os.environ.pop("STATESTORE_STEP_PLAN", None)


def device_table(n_list, ntensors, dtypes, reps, moments=("fp32",)):
    import statestore as ss
    from statestore.optim import HybridAdam

    buf = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(buf)
    bw_s = _interleaved({"copy": lambda: dst.copy_(buf)}, reps)["copy"]
    hbm = 2 * buf.numel() / bw_s            # bytes read + written per second
    del buf, dst
    rows = []
    for n in n_list:
        sizes = _split(n, ntensors)
        for name, mom in [(d, "fp32") for d in dtypes] + [("fp32", m) for m in moments
                                                         if m != "fp32"]:
            dtype = _DTYPES[name]
            params = _params(sizes, dtype)
            store = ss.DeviceStore(DEV)
            ours = HybridAdam(params, lr=1e-3, weight_decay=0.01, state_store=store,
                              moment_dtype=mom)
            ref = [nn.Parameter(p.detach().float().clone()) for p in params]
            for r, p in zip(ref, params):
                r.grad = p.grad.float()
            theirs = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.01, fused=True)
            # the same optimizer made the general way (STATESTORE_STEP_PLAN=0: a launch per
            # group after Python per tensor, as before step plans), on a copy
            gparams = [nn.Parameter(p.detach().clone()) for p in params]
            for q, p in zip(gparams, params):
                q.grad = p.grad.clone()
            gstore = ss.DeviceStore(DEV)
            general = HybridAdam(gparams, lr=1e-3, weight_decay=0.01, state_store=gstore,
                                 moment_dtype=mom)
            t = _interleaved({"ours": ours.step, "torch": theirs.step,
                              "general": lambda: _general_step(general)}, reps)
            floor = _step_bytes(name, mom) * n / hbm
            rows.append((f"{n / (1 << 20):.0f}M", name, mom, _ms(t["ours"]), _ms(t["torch"]),
                         f"{t['torch'] / t['ours']:.2f}x", _ms(floor),
                         f"{floor / t['ours'] * 100:.0f}%", _ms(t["general"]),
                         f"{t['torch'] / t['general']:.2f}x"))
            store.close()
            gstore.close()
            del params, ref, ours, theirs, gparams, general
            torch.cuda.empty_cache()
    from statestore.kernels import kernels_info
    print(f"\n### HybridAdam on CUDA vs torch.optim.AdamW(fused=True), {ntensors} tensors "
          f"(device copy bandwidth {hbm / 1e9:.0f} GB/s; compressed-moment kernel layout: "
          f"{kernels_info()['cuda_moments']})\n")
    print("| params | param dtype | moments | HybridAdam step (ms) | torch fused AdamW, fp32 "
          "moments (ms) | speed-up (torch / ours) | HBM floor (ms) | floor / ours | HybridAdam "
          "the general way (ms) | torch / general |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


# ------------------------------------------------------------------ table 2: offloaded
def _pcie_floor(n, dtype, reps):
    """(d2h s, h2d s, d2h bytes, h2d bytes) for one offloaded step of ``n`` params."""
    item = torch.empty((), dtype=dtype).element_size()
    d2h_bytes = n * item * (2 if dtype == torch.float32 else 1)   # grads (+ fp32 params)
    h2d_bytes = n * item
    dev = torch.empty(max(d2h_bytes, h2d_bytes), dtype=torch.uint8, device=DEV)
    host = _pinned_empty(dev.numel())
    t = _interleaved({
        "d2h": lambda: host[:d2h_bytes].copy_(dev[:d2h_bytes], non_blocking=True),
        "h2d": lambda: dev[:h2d_bytes].copy_(host[:h2d_bytes], non_blocking=True)}, reps)
    return t["d2h"], t["h2d"], d2h_bytes, h2d_bytes


def _cpu_adam_floor(sizes, dtype, reps):
    from statestore.kernels import AdamHyper, AdamTensors, adam_step
    ps = [torch.randn(s).to(dtype) for s in sizes]
    gs = [torch.randn(s).to(dtype) for s in sizes]
    ms = [torch.zeros(s) for s in sizes]
    vs = [torch.zeros(s) for s in sizes]
    masters = [p.float() for p in ps] if dtype != torch.float32 else None
    count = [0]

    def step():
        count[0] += 1
        adam_step(AdamTensors(ps, gs, ms, vs, [count[0]] * len(ps), None, masters),
                  AdamHyper(lr=1e-3, weight_decay=0.01))
    step()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _disk_floor(store, reps):
    """The store's pipeline over every state, read and written back, no compute."""
    def rw():
        with store.stream(store.keys(), "rw") as chunks:
            for _ in chunks:
                pass
        store.sync()
    rw()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        rw()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def offload_table(n_list, ntensors, dtypes, reps, directory, stores):
    import statestore as ss
    from statestore.optim import HybridAdam

    rows, staged = [], {}
    for n in n_list:
        sizes = _split(n, ntensors)
        for name in dtypes:
            dtype = _DTYPES[name]
            d2h, h2d, d2h_b, h2d_b = _pcie_floor(n, dtype, reps)
            cpu = _cpu_adam_floor(sizes, dtype, reps)
            for kind in stores:
                tmp = None
                if kind == "pinned":
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", RuntimeWarning)
                        store = ss.PinnedCPUStore()
                else:
                    tmp = tempfile.mkdtemp(prefix="gpu_step-", dir=directory)
                    store = ss.NVMeStore(tmp)
                params = _params(sizes, dtype)
                opt = HybridAdam(params, lr=1e-3, weight_decay=0.01, state_store=store)
                opt.step()                      # creates the states
                sync_store = None
                if kind == "pinned":
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", RuntimeWarning)
                        sync_store = ss.PinnedCPUStore()
                    sparams = _params(sizes, dtype)
                    sopt = HybridAdam(sparams, lr=1e-3, weight_decay=0.01, state_store=sync_store)
                    if sopt._staging is not None:
                        sopt._staging.close()
                        sopt._staging = None    # the synchronous pageable copies
                    contest = {"ours": opt.step, "sync": sopt.step}
                else:
                    contest = {"ours": opt.step}
                t = _interleaved(contest, reps)
                disk = _disk_floor(store, reps) if kind == "nvme" else None
                pcie = max(d2h, h2d)
                floor = max(pcie, cpu, disk or 0.0)
                rows.append((f"{n / (1 << 20):.0f}M", name, kind, _ms(t["ours"]),
                             _ms(t["sync"]) if "sync" in t else "-",
                             f"{_ms(d2h)} / {_ms(h2d)} ({_gbs(d2h_b, d2h)} / {_gbs(h2d_b, h2d)})",
                             _ms(cpu), _ms(disk) if disk is not None else "-", _ms(floor),
                             f"{t['ours'] / floor:.2f}x"))
                staged = opt.staging_stats()
                opt.close()
                store.close()
                if sync_store is not None:
                    sync_store.close()
                if tmp:
                    shutil.rmtree(tmp, ignore_errors=True)
                del params, opt
                torch.cuda.empty_cache()
    print(f"\n### Offloaded step: CUDA parameters, states in host memory / NVMe, {ntensors} "
          f"tensors ({torch.get_num_threads()} CPU threads; staging {staged})\n")
    print("| params | param dtype | store | step (ms) | synchronous copies (ms) | "
          "PCIe D2H / H2D (ms) | CPU Adam (ms) | disk (ms) | floor (ms) | step / floor |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


# ------------------------------------------------------------------ table 3: with backward
def backward_table(layers, width, tokens, reps):
    import statestore as ss
    from statestore.optim import HybridAdam

    def make():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)]
                             ).to(DEV, torch.bfloat16)

    x = torch.randn(tokens, width, device=DEV, dtype=torch.bfloat16)
    models, opts, stores = {}, {}, []
    for kind in ("offload", "sync", "gpu"):
        m = make()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            store = ss.DeviceStore(DEV) if kind == "gpu" else ss.PinnedCPUStore()
        stores.append(store)
        opt = HybridAdam(m.parameters(), lr=1e-4, state_store=store)
        if kind == "sync" and opt._staging is not None:
            opt._staging.close()
            opt._staging = None
        models[kind], opts[kind] = m, opt
    plain = make()

    def backward_only():
        plain(x).float().square().mean().backward()
        plain.zero_grad()

    def train(kind):
        def run():
            models[kind](x).float().square().mean().backward()
            opts[kind].step()
            opts[kind].zero_grad()
        return run

    t = _interleaved({"backward": backward_only, "offload": train("offload"),
                      "sync": train("sync"), "gpu": train("gpu")}, reps)
    n = layers * width * width
    print(f"\n### Overlap with backward: {layers} x Linear({width}, {width}) bf16 "
          f"({n / 1e6:.1f}M params), {tokens} rows; states in PinnedCPUStore unless said\n")
    print("| forward + backward (ms) | + step, staging path (ms) | + step, synchronous copies "
          "(ms) | + step, states on the GPU (ms) | step's share, staging path (ms) |")
    print("|---|---|---|---|---|")
    print(f"| {_ms(t['backward'])} | {_ms(t['offload'])} | {_ms(t['sync'])} | {_ms(t['gpu'])} | "
          f"{_ms(t['offload'] - t['backward'])} |")
    for o in opts.values():
        o.close()
    for st in stores:
        st.close()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="64M,256M", help="parameters per step (M = 2^20)")
    ap.add_argument("--tensors", type=int, default=50, help="tensors the parameters are cut in")
    ap.add_argument("--dtypes", default="fp32,bf16", help="parameter dtypes")
    ap.add_argument("--moments", default="fp32,bf16,int8",
                    help="table 1: moment dtypes (bf16/int8 rows use fp32 parameters)")
    ap.add_argument("--offload-sizes", default=None,
                    help="table 2's sizes when not --sizes (e.g. 1G: the ~1B-parameter step)")
    ap.add_argument("--tables", default="1,2,3", help="which tables to measure")
    ap.add_argument("--stores", default="pinned,nvme", help="offloaded stores: pinned,nvme")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--dir", default=None, help="NVMeStore directory (default: a temp dir)")
    ap.add_argument("--layers", type=int, default=8, help="table 3: linear layers")
    ap.add_argument("--width", type=int, default=4096, help="table 3: layer width")
    ap.add_argument("--tokens", type=int, default=8192, help="table 3: rows of the input")
    ap.add_argument("--no-backward", action="store_true", help="leave table 3 out")
    ap.add_argument("--quick", action="store_true", help="32M parameters, 3 reps")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"gpu_step: CUDA is not available (torch {torch.__version__}, CUDA "
              f"{torch.version.cuda}); nothing measured")
        return 0
    if args.quick:
        args.sizes, args.reps, args.layers, args.width = "32M", 3, 4, 2048
    from statestore import kernels_info
    info = kernels_info()
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__} (CUDA "
          f"{torch.version.cuda}); statestore kernels: cuda={info['cuda']}, cpu={info['cpu']} "
          f"({info['simd']}), {info['threads']} threads")
    print(f"command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    n_list = [_parse_size(s) for s in args.sizes.split(",") if s]
    dtypes = [d for d in args.dtypes.split(",") if d]
    for d in dtypes:
        if d not in _DTYPES:
            ap.error(f"--dtypes: unknown dtype {d!r} (fp32, bf16, fp16)")
    moments = [m for m in args.moments.split(",") if m]
    for m in moments:
        if m not in ("fp32", "bf16", "int8"):
            ap.error(f"--moments: unknown moment dtype {m!r} (fp32, bf16, int8)")
    off_list = ([_parse_size(s) for s in args.offload_sizes.split(",") if s]
                if args.offload_sizes else n_list)
    tables = {t.strip() for t in args.tables.split(",") if t.strip()}
    stores = [s for s in args.stores.split(",") if s]
    for s in stores:
        if s not in ("pinned", "nvme"):
            ap.error(f"--stores: unknown store {s!r} (pinned, nvme)")
    torch.manual_seed(0)
    if "1" in tables:
        device_table(n_list, args.tensors, dtypes, args.reps, moments)
    if "2" in tables:
        offload_table(off_list, args.tensors, dtypes, args.reps, args.dir, stores)
    if "3" in tables and not args.no_backward:
        backward_table(args.layers, args.width, args.tokens, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
