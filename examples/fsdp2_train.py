"""FSDP2 (``fully_shard``) with HybridAdam: each rank's optimizer states on its own store (NVMe
by default), one checkpoint of all ranks that resumes at any world size and mesh.
``torchrun`` below is the one of the environment statestore is installed in
(``.venv/bin/torchrun`` after ``make setup``, or that environment's ``python -m
torch.distributed.run``).

    torchrun --nproc_per_node 2 examples/fsdp2_train.py --dir /tmp/fsdp2 --steps 20
    torchrun --nproc_per_node 3 examples/fsdp2_train.py --dir /tmp/fsdp2 --steps 40 --resume
    torchrun --nproc_per_node 1 examples/fsdp2_train.py --dir /tmp/fsdp2 --steps 60 --resume

On a 2-D mesh (HSDP: ``--mesh 2x2`` replicates over 2 groups of 2 ranks that each shard the
model; on a cluster, the nodes x the GPUs of a node), resumed on another mesh:

    torchrun --nproc_per_node 4 examples/fsdp2_train.py --dir /tmp/hsdp --mesh 2x2 --steps 20
    torchrun --nproc_per_node 2 examples/fsdp2_train.py --dir /tmp/hsdp --steps 40 --resume
    torchrun --nproc_per_node 4 examples/fsdp2_train.py --dir /tmp/hsdp --mesh 4x1 --steps 60 \
        --resume

Two nodes (here two agents on one host; on a cluster the first node's address):

    torchrun --nnodes 2 --nproc_per_node 1 --rdzv_backend c10d \\
        --rdzv_endpoint 127.0.0.1:29400 --rdzv_id run1 examples/fsdp2_train.py --dir /tmp/fsdp2

Each step the ranks take their slice of one global batch, FSDP2 reduce-scatters the gradients,
``clip_grad_norm_`` clips the DTensor gradients, and HybridAdam updates each rank's local shard
with statestore's kernels, its states (moments, fp32 masters) in the rank's store. At the end
(and every ``--save-every`` steps) every rank calls ``store.save_checkpoint`` (one checkpoint:
each rank writes its regions, rank 0 the manifest) and the model goes through
``torch.distributed.checkpoint`` into ``<dir>/model-<step>``. ``--resume`` loads both at
whatever world size this run has.
gloo on CPU; NCCL when CUDA is available. ``--losses FILE``: rank 0 appends ``step loss`` lines.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import statestore as ss
from statestore.optim import HybridAdam

VOCAB, DIM, SEQ, BATCH = 257, 48, 16, 12      # odd sizes: uneven shards at 2 and 3 ranks


class TinyLM(torch.nn.Module):
    """Embedding, two MLP blocks, a head: next-token prediction on synthetic sequences."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(DIM), torch.nn.Linear(DIM, 3 * DIM),
                                torch.nn.GELU(), torch.nn.Linear(3 * DIM, DIM))
            for _ in range(2))
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        h = self.embed(tokens.reshape(-1))      # (tokens, DIM): 2-D all the way through
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def batch(step: int, rank: int, world: int, device) -> torch.Tensor:
    """This rank's rows of step ``step``'s global batch (the same global batch at any world
    size that divides BATCH)."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    tokens = (start + torch.arange(SEQ + 1) * 7) % VOCAB        # learnable: +7 each token
    per = BATCH // world
    return tokens[rank * per:(rank + 1) * per].to(device)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True, help="run directory (stores and checkpoints)")
    ap.add_argument("--steps", type=int, default=20, help="train until this step")
    ap.add_argument("--resume", action="store_true", help="resume from <dir>/ckpt")
    ap.add_argument("--save-every", type=int, default=0, help="also save every N steps")
    ap.add_argument("--store", choices=["nvme", "ram"], default="nvme")
    ap.add_argument("--mesh", help="RxS: HSDP over a 2-D mesh, R replicas of S-way sharding "
                    "(R*S ranks); default: a 1-D mesh of every rank")
    ap.add_argument("--losses", help="rank 0 appends 'step loss' lines to this file")
    a = ap.parse_args(argv)

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if BATCH % world:
        raise SystemExit(f"the global batch of {BATCH} does not split over {world} ranks")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else \
        torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    mesh = None
    if a.mesh:
        shape = tuple(int(x) for x in a.mesh.lower().split("x"))
        if len(shape) != 2 or shape[0] * shape[1] != world:
            raise SystemExit(f"--mesh {a.mesh}: expected RxS with R*S = {world} ranks")
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))

    torch.manual_seed(0)                     # every rank builds the same model
    model = TinyLM().to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)            # DTensors: Shard(0), or (Replicate(), Shard(0))
    ckpt = os.path.join(a.dir, "ckpt")

    def weights(step: int) -> str:                  # the model's DCP checkpoint of a step
        return os.path.join(a.dir, f"model-{step}")
    if a.store == "nvme":
        where = os.path.join(a.dir, f"states-rank{rank}")      # a local disk per rank
        shutil.rmtree(where, ignore_errors=True)
        store = ss.NVMeStore(where)
    else:
        store = ss.PinnedCPUStore() if cuda else ss.DeviceStore("cpu")
    first = 0
    if a.resume:
        store.load_checkpoint(ckpt)          # this rank's shard of every state, at this size
        first = max((store.loaded_metadata or {}).get("steps", {"": 0}).values())
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=weights(first))        # resharded by DCP
        set_model_state_dict(model, state["model"])
    opt = HybridAdam(model.named_parameters(), lr=3e-3, weight_decay=0.01, state_store=store)

    def save(step: int) -> None:
        store.save_checkpoint(ckpt)          # a collective: one checkpoint of every rank
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=weights(step))
        if rank == 0:
            print(f"saved step {step} to {ckpt} ({world} ranks, mesh "
                  f"{a.mesh or world})", flush=True)

    for step in range(first, a.steps):
        tokens = batch(step, rank, world, device)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits, tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)     # on DTensor gradients
        opt.step()                           # each rank's shard, statestore's kernels
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean = mean.item() / world
        if rank == 0:
            if a.losses:
                with open(a.losses, "a") as f:
                    f.write(f"{step + 1} {mean!r}\n")
            if step % 10 == 0 or step + 1 == a.steps:
                print(f"step {step + 1} loss {mean:.5f}", flush=True)
        if a.save_every and (step + 1) % a.save_every == 0 and step + 1 < a.steps:
            save(step + 1)
    save(a.steps)
    if rank == 0:
        print(json.dumps({"world": world, "mesh": a.mesh or str(world), "steps": a.steps,
                          "states_bytes_rank0": store.stats()["nbytes"]}), flush=True)
    store.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
