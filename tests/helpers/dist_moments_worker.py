"""Worker of tests/distributed/test_moments_distributed.py (module-level, picklable): sharded training
with compressed moments, one collective checkpoint, training on."""
from __future__ import annotations

import os

import torch.distributed as dist

from statestore.optim import CPUAdam

from helpers import dist_worker as W


@W._exit_without_finalizing
def save_sharded(rank: int, world: int, port: int, out: str, md: str, k: int, n: int) -> None:
    W._init(rank, world, port)
    try:
        model = W.make_model()
        store = W.make_store("nvme", os.path.join(out, f"rank{rank}"))
        opt = CPUAdam(model.named_parameters(), lr=1e-2, weight_decay=0.05, state_store=store,
                      process_group=dist.group.WORLD, moment_dtype=md)
        W.train(model, opt, 0, k, rank, world, full=True)
        store.save_checkpoint(os.path.join(out, "ckpt"))
        if rank == 0:
            W._save_params(model, os.path.join(out, f"params{k}.safetensors"))
        W.train(model, opt, k, n, rank, world, full=True)
        if rank == 0:
            W._save_params(model, os.path.join(out, "final.safetensors"))
        with open(os.path.join(out, f"dtypes{rank}.txt"), "w") as f:
            f.write("\n".join(sorted({str(store.spec(k_).dtype) for k_ in store.keys()})))
        store.close()
        W._done()
    finally:
        dist.destroy_process_group()
