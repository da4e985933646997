"""Workers of the collective save and load fault tests (``tests/reliability/test_collective.py``):
module-level functions run by ``helpers.ranks.run_ranks`` (or ``run_ranks_to_the_end``) in gloo
ranks on 127.0.0.1. Each writes what it saw into files under ``out`` for the test to check."""
from __future__ import annotations

import os
import signal

import torch.distributed as dist

import statestore as ss
from statestore.optim import CPUAdam

from helpers.dist_worker import _done, _exit_without_finalizing, _init, make_model, make_store, train


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


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(case: str) -> None:
    """Make this rank SIGKILL itself at the point of a collective save that ``case`` names."""
    from statestore import distributed
    from statestore.checkpoint import collective, writer
    if case == "rank1-writing-shards":          # after its first shard's rename
        real_commit = writer.commit

        def commit_then_die(*a, **kw):
            real_commit(*a, **kw)
            _die()
        writer.commit = commit_then_die
    elif case == "rank1-after-gather":          # its rows sent, before the outcome
        real_gather = distributed.Collective.all_gather
        calls = []

        def gather_then_die(self, obj):
            got = real_gather(self, obj)
            calls.append(1)
            if len(calls) == 2:
                _die()
            return got
        distributed.Collective.all_gather = gather_then_die
    elif case in ("rank0-before-commit", "rank0-after-commit"):
        real_manifest = collective.write_manifest

        def manifest_and_die(*a, **kw):
            if case == "rank0-after-commit":
                real_manifest(*a, **kw)
            _die()
        collective.write_manifest = manifest_and_die
    else:
        raise ValueError(case)


def killed_in_collective_save(rank: int, world: int, port: int, out: str, case: str) -> None:
    """Save a good checkpoint collectively, step once more, then save again to the same path
    while one rank SIGKILLs itself where ``case`` says; the survivor writes what its save
    returned or raised (``second<rank>.txt``) and exits at once (its group has lost a rank)."""
    _init(rank, world, port)
    model = make_model()
    store = make_store("nvme", os.path.join(out, f"store{rank}"))
    opt = CPUAdam(model.named_parameters(), lr=1e-2, state_store=store,
                  process_group=dist.group.WORLD)
    train(model, opt, 0, 2, rank, world)
    ck = os.path.join(out, "ckpt")
    store.save_checkpoint(ck, shard_bytes=512, progress=False)
    dist.barrier()
    train(model, opt, 2, 3, rank, world)
    if rank == (1 if case.startswith("rank1") else 0):
        _arm(case)
    _write(out, f"second{rank}.txt",
           _outcome(lambda: store.save_checkpoint(ck, shard_bytes=512, progress=False)))
    from helpers.forked import exit_flushed
    exit_flushed(0)


@_exit_without_finalizing
def load_damaged(rank: int, world: int, port: int, out: str) -> None:
    """Every rank loads (collectively, the default under an initialized group) a checkpoint
    saved by one process, in which a shard only rank 1 reads is damaged: ``ck_header``
    (the shard truncated: refused before any tensor is read) and ``ck_data`` (a byte of a
    tensor flipped: found while streaming); then the intact ``ck_good``. Each rank writes
    each outcome and what its store then holds."""
    import json
    _init(rank, world, port)
    try:
        seen = {}
        with ss.DeviceStore("cpu") as store:
            store.create(("kept", "x"), (4,))
            for name in ("ck_header", "ck_data", "ck_good"):
                seen[name] = _outcome(lambda: store.load_checkpoint(
                    os.path.join(out, name), progress=False))
                seen[f"{name}_store"] = [len(store), store.load_error is not None]
        _write(out, f"loads{rank}.json", json.dumps(seen))
        _done()
    finally:
        dist.destroy_process_group()
