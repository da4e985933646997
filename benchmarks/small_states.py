"""Many small parameters (MoE experts, norms, biases) on an NVMeStore: step, save, load,
peak RSS and checkpoint bytes, against the same on a DeviceStore (docs/nvme.md, "Small
states").

    .venv/bin/python benchmarks/small_states.py --params 20000 --elements 16 --dir /tmp/x
    .venv/bin/python benchmarks/small_states.py --params 20000 --sizes 16,16,64,512,1024,4096

``--sizes`` cycles parameter sizes (a mixture-of-experts-like mix of norms, biases, routers
and small experts: states under and over 4 KiB in one store) instead of ``--elements``.

One process per run (the peak RSS is the process's): it builds ``--params`` parameters of
``--elements`` fp32 elements, ``CPUAdam`` over the store, makes one step (the states are
created), then times a second step (``step()`` + ``sync()``), a linked ``save_checkpoint``,
and a ``load_checkpoint`` into a new store of the same kind, and prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import statestore as ss  # noqa: E402
from statestore.optim import CPUAdam  # noqa: E402


def _store(kind: str, path: str):
    return ss.NVMeStore(path) if kind == "nvme" else ss.DeviceStore("cpu")


def run(params: int, sizes, kind: str, root: str) -> dict:
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    torch.manual_seed(0)
    named = [(f"experts.{i}.w", torch.nn.Parameter(torch.randn(sizes[i % len(sizes)])))
             for i in range(params)]
    store = _store(kind, os.path.join(root, "store"))
    opt = CPUAdam(named, lr=1e-3, state_store=store)
    for _, p in named:
        p.grad = torch.randn(p.shape)
    out = {"params": params, "elements": sizes[0] if len(sizes) == 1 else list(sizes),
           "store": kind}
    t = time.perf_counter()
    opt.step()
    store.sync()
    out["first_step_s"] = time.perf_counter() - t
    t = time.perf_counter()
    opt.step()
    store.sync()
    out["step_s"] = time.perf_counter() - t
    ck = os.path.join(root, "ck")
    t = time.perf_counter()
    store.save_checkpoint(ck, progress=False)
    out["save_s"] = time.perf_counter() - t
    out["checkpoint_bytes"] = sum(os.path.getsize(os.path.join(ck, f)) for f in os.listdir(ck))
    out["state_bytes"] = store.stats()["nbytes"]
    other = _store(kind, os.path.join(root, "other"))
    t = time.perf_counter()
    other.load_checkpoint(ck, progress=False)
    out["load_s"] = time.perf_counter() - t
    other.close()
    store.close()
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=20000)
    ap.add_argument("--elements", type=int, default=16)
    ap.add_argument("--sizes", default=None,
                    help="comma-separated element counts cycled over the parameters")
    ap.add_argument("--store", choices=["nvme", "device"], default="nvme")
    ap.add_argument("--dir", default="/tmp/statestore-small-states")
    a = ap.parse_args()
    try:
        sizes = [int(x) for x in a.sizes.split(",")] if a.sizes else [a.elements]
    except ValueError:
        ap.error(f"--sizes takes comma-separated integers, got {a.sizes!r}")
    if min(sizes) <= 0 or a.params <= 0:
        ap.error("--params, --elements and --sizes take positive counts")
    print(json.dumps(run(a.params, sizes, a.store, a.dir)))


if __name__ == "__main__":
    main()
