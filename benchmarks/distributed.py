"""Sharded optimizer over torch.distributed (gloo, CPU): step time and per-rank RSS.

GPT-2-small-shaped fp32 parameters (``--scale`` shrinks them), CPUAdam, the same fixed
gradients on every rank. For 1 and 2 ranks (``--worlds``), states in RAM (``DeviceStore``)
and on disk (``NVMeStore``, one directory per rank), each configuration in fresh processes
(``torch.multiprocessing.spawn``). One rank runs without a process group (plain CPUAdam); two
ranks shard the states (all-reduce of gradients, owners update, broadcast of parameters).

Reported per configuration (medians over ``--steps`` after one warm-up step): step time, and
its parts as rank 0 sees them (gradient all-reduce, Adam update of its shard, parameter
broadcast); states held per rank; peak RSS per rank; a collective ``save_checkpoint`` time.
Ratios are against the one-rank step of the same store.

    .venv/bin/python benchmarks/distributed.py                 # 124M params
    .venv/bin/python benchmarks/distributed.py --scale 0.25 --steps 3
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, args: dict, out: str) -> None:
    import warnings
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist
    import statestore as ss
    from statestore.optim import CPUAdam
    from offload_step import gpt2_shapes

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    group = None
    if world > 1:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        group = dist.group.WORLD
    gen = torch.Generator().manual_seed(0)
    params = []
    for name, shape in gpt2_shapes(args["scale"]):
        p = torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.02)
        p.grad = torch.randn(shape, generator=gen) * 1e-3
        params.append((name, p))
    if args["store"] == "nvme":
        store = ss.NVMeStore(os.path.join(args["dir"], f"w{world}-rank{rank}"))
    else:
        store = ss.DeviceStore("cpu")
    opt = CPUAdam(params, lr=1e-4, state_store=store, process_group=group)

    parts = {"allreduce": [], "update": [], "broadcast": []}
    if group is not None:                       # time the three phases of a sharded step
        real = {n: getattr(opt, n) for n in ("_allreduce_grads", "_step_store",
                                             "_broadcast_params")}

        def timed(label, fn):
            def run(*a, **k):
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    parts[label].append(time.perf_counter() - t)
            return run
        opt._allreduce_grads = timed("allreduce", real["_allreduce_grads"])
        opt._step_store = timed("update", real["_step_store"])
        opt._broadcast_params = timed("broadcast", real["_broadcast_params"])

    grads = [p.grad.clone() for _, p in params]
    times = []
    for i in range(args["steps"] + 1):
        for (_, p), g in zip(params, grads):         # the all-reduce averages in place
            p.grad.copy_(g)
        if group is not None:
            dist.barrier()
        t = time.perf_counter()
        opt.step()
        store.sync()
        if group is not None:
            dist.barrier()
        if i:
            times.append(time.perf_counter() - t)
        for v in parts.values():
            if i == 0 and v:
                v.clear()
    ckpt = os.path.join(args["dir"], f"ckpt-{args['store']}-w{world}")
    if group is not None:
        dist.barrier()
    t = time.perf_counter()
    store.save_checkpoint(ckpt, progress=False)
    save_s = time.perf_counter() - t
    result = {
        "step_s": statistics.median(times),
        "parts": {k: statistics.median(v) for k, v in parts.items() if v},
        "state_bytes": store.stats()["nbytes"],
        "rss_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "save_s": save_s,
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    store.close()
    if group is not None:
        dist.destroy_process_group()


def run_config(world: int, store: str, scale: float, steps: int, directory: str) -> list:
    import torch.multiprocessing as mp
    out = tempfile.mkdtemp(prefix="dist-bench-")
    try:
        args = {"scale": scale, "steps": steps, "store": store, "dir": directory}
        mp.spawn(_worker, args=(world, _port(), args, out), nprocs=world, join=True)
        return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="GPT-2 shapes scale (1 = 124M)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--stores", default="ram,nvme")
    ap.add_argument("--dir", default=None, help="directory for NVMe stores and checkpoints")
    a = ap.parse_args()
    from offload_step import gpt2_shapes
    n = 0
    for _, shape in gpt2_shapes(a.scale):
        k = 1
        for d in shape:
            k *= d
        n += k
    directory = a.dir or tempfile.mkdtemp(prefix="dist-bench-", dir=os.getcwd())
    print(f"# {n / 1e6:.1f}M fp32 params, Adam states {8 * n / 2**20:.0f} MiB, gloo on "
          f"localhost, {os.cpu_count()} cores, steps={a.steps}")
    rows = []
    try:
        for store in a.stores.split(","):
            base = None
            for world in (int(w) for w in a.worlds.split(",")):
                res = run_config(world, store, a.scale, a.steps, directory)
                step = max(r["step_s"] for r in res)
                base = base or step
                p = res[0]["parts"]
                rows.append((store, world, step, step / base,
                             p.get("allreduce"), p.get("update"), p.get("broadcast"),
                             [r["state_bytes"] / 2**20 for r in res],
                             [r["rss_peak"] / 2**20 for r in res],
                             max(r["save_s"] for r in res)))
    finally:
        if a.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    f = lambda x: "-" if x is None else f"{x * 1e3:.0f}"
    print(f"{'store':6} {'ranks':>5} {'step ms':>8} {'vs 1':>5} {'allred':>7} {'update':>7} "
          f"{'bcast':>6} {'states MiB/rank':>16} {'peak RSS MiB/rank':>18} {'save ms':>8}")
    for s, w, st, ratio, ar, up, bc, sb, rss, sv in rows:
        print(f"{s:6} {w:>5} {st * 1e3:>8.0f} {ratio:>5.2f} {f(ar):>7} {f(up):>7} {f(bc):>6} "
              f"{'/'.join(f'{x:.0f}' for x in sb):>16} {'/'.join(f'{x:.0f}' for x in rss):>18} "
              f"{sv * 1e3:>8.0f}")


if __name__ == "__main__":
    main()
