"""Worker of the multi-process tests: run by ``torch.multiprocessing.spawn`` from
tests/test_distributed.py (module-level functions, so they can be pickled)."""
from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import statestore as ss
from statestore.optim import CPUAdam

FEATURES = (8, 16, 12, 4)


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(FEATURES[:-1], FEATURES[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def batch(step: int, n: int = 12):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(n, FEATURES[0], generator=g)
    return x, torch.cos(x[:, :FEATURES[-1]])


def train(model, opt, first, last, rank=0, world=1):
    for step in range(first, last):
        x, y = batch(step)
        per = x.shape[0] // world
        xs, ys = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        loss = torch.nn.functional.mse_loss(model(xs), ys)
        opt.zero_grad()
        loss.backward()
        opt.step()


def make_store(kind: str, directory: str):
    if kind == "nvme" and hasattr(ss, "NVMeStore"):
        return ss.NVMeStore(directory)
    if kind in ("file", "nvme"):
        return ss.FileStore(directory)
    return ss.DeviceStore("cpu")


def _init(rank: int, world: int, port: int) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def sharded_train(rank: int, world: int, port: int, out: str, kind: str, steps: int) -> None:
    """Train with states sharded over the group; rank 0 saves the final parameters."""
    _init(rank, world, port)
    try:
        model = make_model()
        store = make_store(kind, os.path.join(out, f"rank{rank}"))
        opt = CPUAdam(model.named_parameters(), lr=1e-2, weight_decay=0.05, state_store=store,
                      process_group=dist.group.WORLD)
        train(model, opt, 0, steps, rank, world)
        owned = sorted({k.param for k in store.keys()})
        with open(os.path.join(out, f"owned{rank}.txt"), "w") as f:
            f.write("\n".join(owned))
        if rank == 0:
            save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                      os.path.join(out, "params.safetensors"))
        store.close()
    finally:
        dist.destroy_process_group()
