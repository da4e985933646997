"""Workers of the collective save and load fault tests (``tests/reliability/test_collective.py``):
module-level functions run by ``helpers.ranks`` (or :func:`run_ranks_to_the_end`) in gloo
ranks on 127.0.0.1. Each writes what it saw into files under ``out`` for the test to check."""
from __future__ import annotations

import os
import signal
import time

import torch.distributed as dist
import torch.multiprocessing as mp

import statestore as ss
from statestore.optim import CPUAdam

from helpers.dist_worker import _done, _exit_without_finalizing, _init, make_model, make_store, train
from helpers.ranks import PRELOAD, free_port


def run_ranks_to_the_end(fn, world: int, *args, timeout: float = 60.0):
    """Run ``fn(rank, world, port, *args)`` in ``world`` processes and wait for every one
    (``helpers.ranks.run_ranks`` ends the others as soon as one dies: here a rank is killed on
    purpose and the survivors must finish), at most ``timeout`` seconds in all (then they are
    killed and ``TimeoutError`` is raised). Returns each rank's exit code (``-9``: SIGKILL)."""
    mp.set_forkserver_preload(PRELOAD)
    ctx = mp.start_processes(fn, args=(world, free_port()) + args, nprocs=world, join=False,
                             start_method="forkserver")
    deadline = time.monotonic() + timeout
    try:
        for p in ctx.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        if any(p.is_alive() for p in ctx.processes):
            raise TimeoutError(f"{fn.__name__}: ranks still running after {timeout} s")
        return [p.exitcode for p in ctx.processes]
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def _write(out: str, name: str, text: str) -> None:
    with open(os.path.join(out, name), "w") as f:
        f.write(text)


def _outcome(call) -> str:
    try:
        call()
        return "ok"
    except Exception as e:         # noqa: BLE001 - the test checks its type and message
        return f"{type(e).__module__}.{type(e).__name__}: {e}"


@_exit_without_finalizing
def save_to_local_disks(rank: int, world: int, port: int, out: str) -> None:
    """Each rank saves collectively to ``ckpt`` relative to a directory of its own
    (``out/node<rank>``): one path name, each rank's own disk, as nodes with local disks.
    Rank 0's directory holds a good checkpoint at that path first."""
    _init(rank, world, port)
    try:
        node = os.path.join(out, f"node{rank}")
        os.makedirs(node, exist_ok=True)
        os.chdir(node)
        model = make_model()
        store = make_store("nvme", os.path.join(out, f"store{rank}"))
        opt = CPUAdam(model.named_parameters(), lr=1e-2, state_store=store,
                      process_group=dist.group.WORLD)
        train(model, opt, 0, 2, rank, world)
        if rank == 0:
            with ss.DeviceStore("cpu") as good:
                good.create(("w", "exp_avg"), (3,))
                good.save_checkpoint("ckpt", process_group=None, progress=False)
        dist.barrier()
        _write(out, f"save{rank}.txt",
               _outcome(lambda: store.save_checkpoint("ckpt", progress=False)))
        store.close()
        _done()
    finally:
        dist.destroy_process_group()
