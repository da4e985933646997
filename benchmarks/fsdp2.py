"""FSDP2 + HybridAdam with states on NVMe against FSDP2 + torch.optim.AdamW in RAM (gloo, CPU).

A GPT-like model (``--layers`` blocks of width ``--width``, vocabulary ``--vocab``: about 106M
fp32 parameters by default) is ``fully_shard``ed over ``--ranks`` processes on this host;
each rank trains on ``--tokens`` tokens a step. Configurations, each in fresh processes
(``torch.multiprocessing`` spawn), interleaved ``--rounds`` times:

* ``torch``: ``torch.optim.AdamW(foreach=False)`` (torch's default for DTensor parameters
  on CPU: its per-tensor loop), states in RAM, glibc's malloc as it starts;
* ``torch+mallopt``: the same with glibc's mmap threshold fixed at 1 MiB, as a statestore
  optimizer over a disk store sets it (``statestore/_malloc.py``): the baseline with the
  same allocator as the ``nvme`` configurations (glibc's default lets freed heap blocks
  keep each rank up to ~1 GiB over its working set, differently in every run);
* ``nvme``: ``HybridAdam`` over an ``NVMeStore`` per rank (``--budget`` MiB of RAM);
* ``nvme+ib``: the same with ``update_in_backward=True, release_grads=True`` (each shard
  updated after its reduce-scatter, the disk working during backward).

Reported per configuration: the median step (forward, backward, optimizer step) over
``--steps`` after one warm-up step, as the slowest rank sees it; its ratio to ``torch``; the
CPU seconds a rank spends in a step (user + system, all its threads; median, the larger rank:
steadier than the wall time on a shared host);
per-rank peak RSS (VmHWM, the whole process) and optimizer state bytes; for ``nvme`` the
store's ring (``store.stats()["buffer_bytes"]``: the pipeline's host buffers, the RAM it
holds between steps), the disk's floor (the states' bytes read and written per step at the
probed O_DIRECT bandwidth, both ranks on one disk) and the step's ratio to it; "saved" is
the RSS a configuration saves per rank against a torch baseline, as a share of that rank's
states (the issue's target: 90%).

    .venv/bin/python benchmarks/fsdp2.py                     # 106M params, 2 ranks
    .venv/bin/python benchmarks/fsdp2.py --layers 2 --vocab 4000 --steps 2 --rounds 1
    .venv/bin/python benchmarks/fsdp2.py --ranks 4 --mesh 2x2   # HSDP on a 2-D mesh

``--mesh RxS`` shards over a 2-D mesh (HSDP: R replicas of S-way sharding, R*S ranks); a rank
then holds 1/S of the states.
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
sys.path.insert(0, os.path.dirname(HERE))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(a: dict):
    import torch
    import torch.nn.functional as F

    class Block(torch.nn.Module):
        def __init__(self, d):
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
            self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
            self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
            self.heads = max(1, d // 64)

        def forward(self, x):                       # x: (batch, tokens, d)
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads) \
                .permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(a["vocab"], a["width"])
            self.blocks = torch.nn.ModuleList(Block(a["width"]) for _ in range(a["layers"]))
            self.ln = torch.nn.LayerNorm(a["width"])
            self.head = torch.nn.Linear(a["width"], a["vocab"], bias=False)

        def forward(self, ids):
            x = self.embed(ids)
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln(x))

    torch.manual_seed(0)
    return GPT()


def _worker(rank: int, world: int, port: int, a: dict, config: str, out: str) -> None:
    import warnings
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import statestore as ss
    from statestore.optim import HybridAdam
    from _common import proc_status

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = None
    if a.get("mesh"):
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", tuple(int(x) for x in a["mesh"].split("x")),
                                mesh_dim_names=("replicate", "shard"))
    model = _model(a)
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    store = None
    if config == "torch+mallopt":
        from statestore._malloc import fix_mmap_threshold
        fix_mmap_threshold()
    if config.startswith("torch"):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, foreach=False)
    else:
        store = ss.NVMeStore(os.path.join(a["dir"], f"{config}-rank{rank}"),
                             budget_bytes=a["budget"] << 20)
        ib = config == "nvme+ib"
        opt = HybridAdam(model.named_parameters(), lr=1e-4, weight_decay=0.01, state_store=store,
                         update_in_backward=ib, release_grads=ib)
    gen = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, a["vocab"], (1, a["tokens"] + 1), generator=gen)
    times, cpu = [], []
    for i in range(a["steps"] + 1):
        dist.barrier()
        t = time.perf_counter()
        ru = resource.getrusage(resource.RUSAGE_SELF)
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.view(-1, a["vocab"]), ids[0, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        if store is not None:
            store.sync()                        # the step's writes are on disk
        ru2 = resource.getrusage(resource.RUSAGE_SELF)
        dist.barrier()
        if i:
            times.append(time.perf_counter() - t)
            cpu.append(ru2.ru_utime + ru2.ru_stime - ru.ru_utime - ru.ru_stime)
    if store is None:
        state_bytes = sum(v.to_local().numel() * v.to_local().element_size()
                          for st in opt.state.values() for v in st.values()
                          if isinstance(v, torch.Tensor) and v.dim() > 0)
    else:
        state_bytes = store.stats()["nbytes"]
    n_local = sum(p.to_local().numel() for p in model.parameters())
    res = {"step_s": statistics.median(times), "cpu_s": statistics.median(cpu), "rss_peak": proc_status("VmHWM"),
           "state_bytes": state_bytes, "local_params": n_local,
           "ring": store.stats()["buffer_bytes"] if store is not None else 0}
    with open(os.path.join(out, f"{config}-rank{rank}.json"), "w") as f:
        json.dump(res, f)
    if store is not None:
        store.close()
    dist.barrier()
    dist.destroy_process_group()


def run(config: str, a: dict) -> list:
    import torch.multiprocessing as mp
    out = tempfile.mkdtemp(prefix="fsdp2-bench-")
    try:
        mp.spawn(_worker, args=(a["ranks"], _port(), a, config, out), nprocs=a["ranks"],
                 join=True)
        return [json.load(open(os.path.join(out, f"{config}-rank{r}.json")))
                for r in range(a["ranks"])]
    finally:
        shutil.rmtree(out, ignore_errors=True)
        for r in range(a["ranks"]):
            shutil.rmtree(os.path.join(a["dir"], f"{config}-rank{r}"), ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per rank per step")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved repetitions")
    ap.add_argument("--budget", type=int, default=32, help="NVMeStore RAM budget, MiB/rank")
    ap.add_argument("--configs", default="torch,torch+mallopt,nvme,nvme+ib")
    ap.add_argument("--dir", default=None, help="directory for the stores (a local disk)")
    ap.add_argument("--mesh", default=None, help="RxS: HSDP over a 2-D mesh (R*S = --ranks)")
    ns = ap.parse_args()
    if ns.mesh and len(ns.mesh.split("x")) == 2 and \
            int(ns.mesh.split("x")[0]) * int(ns.mesh.split("x")[1]) != ns.ranks:
        ap.error(f"--mesh {ns.mesh} does not have --ranks {ns.ranks} ranks")
    from _common import probe_disk
    directory = ns.dir or tempfile.mkdtemp(prefix="fsdp2-bench-", dir=os.getcwd())
    a = dict(vars(ns), dir=directory)
    n = sum(p.numel() for p in _model(a).parameters())
    configs = ns.configs.split(",")
    print(f"# {n / 1e6:.1f}M fp32 params ({ns.layers} layers x {ns.width}, vocab {ns.vocab}), "
          f"{ns.ranks} ranks (gloo, this host{', mesh ' + ns.mesh if ns.mesh else ''}), "
          f"{ns.tokens} tokens/rank/step, "
          f"{os.cpu_count()} cores, steps={ns.steps}, rounds={ns.rounds}, NVMe budget "
          f"{ns.budget} MiB/rank")
    results = {c: [] for c in configs}
    try:
        wbw, rbw = probe_disk(directory, 512 << 20)
        for _ in range(ns.rounds):
            for c in configs:
                results[c].append(run(c, a))
    finally:
        if ns.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    print(f"# disk probe (O_DIRECT, 512 MiB): write {wbw:.2f} GB/s, read {rbw:.2f} GB/s")
    base = statistics.median(max(r["step_s"] for r in res) for res in results.get("torch", []))\
        if "torch" in results else None
    print("| config | step s | vs torch | CPU s/step | disk floor s | vs floor | peak RSS MiB/rank | "
          "state MiB/rank | ring MiB/rank | saved vs torch | saved vs torch+mallopt |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")

    def rss_of(c):
        return [statistics.median(res[r]["rss_peak"] for res in results[c])
                for r in range(ns.ranks)]

    def saved(c, base_c):
        # the RSS saved per rank against ``base_c``, as a share of that rank's states
        if c.startswith("torch") or base_c not in results:
            return "-"
        tstates = [results[base_c][0][r]["state_bytes"] for r in range(ns.ranks)]
        return "/".join(f"{(t - o) / s:.0%}" for t, o, s in zip(rss_of(base_c), rss_of(c),
                                                               tstates))

    for c in configs:
        step = statistics.median(max(r["step_s"] for r in res) for res in results[c])
        states = [results[c][0][r]["state_bytes"] for r in range(ns.ranks)]
        rings = [results[c][0][r]["ring"] for r in range(ns.ranks)]
        floor = None
        if not c.startswith("torch"):
            moved = sum(states)                 # every state read and written once a step
            floor = moved / (rbw * 1e9) + moved / (wbw * 1e9)
        cpu = statistics.median(max(r["cpu_s"] for r in res) for res in results[c])
        print(f"| {c} | {step:.3f} | {f'{step / base:.2f}x' if base else '-'} | {cpu:.2f} | "
              f"{'-' if floor is None else f'{floor:.3f}'} | "
              f"{'-' if floor is None else f'{step / floor:.2f}x'} | "
              f"{'/'.join(f'{x / 2**20:.0f}' for x in rss_of(c))} | "
              f"{'/'.join(f'{x / 2**20:.0f}' for x in states)} | "
              f"{'/'.join(f'{x / 2**20:.0f}' for x in rings)} | "
              f"{saved(c, 'torch')} | {saved(c, 'torch+mallopt')} |")


if __name__ == "__main__":
    main()
