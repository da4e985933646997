"""Sharded CPUAdam/HybridAdam under torchrun, with states on a per-rank NVMe store and one
checkpoint for all ranks that resumes at any world size. ``torchrun`` below is the one of the
environment statestore is installed in (``.venv/bin/torchrun`` after ``make setup``, or that
environment's ``python -m torch.distributed.run``).

    torchrun --nproc_per_node 2 examples/distributed_train.py --dir /tmp/run --steps 20
    torchrun --nproc_per_node 3 examples/distributed_train.py --dir /tmp/run --steps 40 --resume

The first run trains 20 steps and saves ``/tmp/run/ckpt``; the second resumes that checkpoint
at 3 ranks (each rank loads only its shard) and trains on to step 40. gloo on CPU; NCCL when
CUDA is available (the model and gradients then live on the GPU, HybridAdam updates them).
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import statestore as ss
from statestore.optim import HybridAdam


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True, help="run directory (stores and checkpoint)")
    ap.add_argument("--steps", type=int, default=20, help="train until this step")
    ap.add_argument("--resume", action="store_true", help="resume from <dir>/ckpt")
    a = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else \
        torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)                     # every rank builds the same model
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 64)).to(device)
    ckpt, weights = os.path.join(a.dir, "ckpt"), os.path.join(a.dir, "model.safetensors")
    store = ss.NVMeStore(os.path.join(a.dir, f"states-rank{rank}"))   # a local disk per rank
    first = 0
    if a.resume:
        model.load_state_dict(load_file(weights, device=str(device)))
        store.load_checkpoint(ckpt)          # this rank's shard only, at this world size
        first = max((store.loaded_metadata or {}).get("steps", {0: 0}).values())
    opt = HybridAdam(model.named_parameters(), lr=1e-3, state_store=store,
                     process_group=dist.group.WORLD)

    for step in range(first, a.steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(32, 64, generator=g).to(device)
        loss = torch.nn.functional.mse_loss(model(x), torch.tanh(x))
        opt.zero_grad()
        loss.backward()
        opt.step()                           # all-reduce grads, update own shard, broadcast
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.5f}", flush=True)

    store.save_checkpoint(ckpt)              # collective: one checkpoint for all ranks
    if rank == 0:
        save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
                  weights)
        print(f"saved {ckpt} at step {a.steps} from {world} ranks; states on rank 0: "
              f"{store.stats()['nbytes'] / 2**20:.2f} MiB", flush=True)
    store.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
