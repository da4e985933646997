"""Ranks of a gloo group on 127.0.0.1, started for a test: a free port, and
:func:`run_ranks`, which forks them from a server that imported torch once and bounds their
join (a hang fails the test, never stalls it)."""
from __future__ import annotations

import socket
import time

import torch.multiprocessing as mp


#: what the forkserver imports once (``helpers.forked`` forks from the same server): torch,
#: with what FSDP2 and optimizers import on first use (dynamo alone takes seconds)
PRELOAD = ["torch", "torch._dynamo", "torch.distributed.fsdp", "torch.distributed.tensor",
           "torch.distributed.checkpoint"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(fn, world: int, *args, timeout: float = 120.0) -> None:
    """Run ``fn(rank, world, port, *args)`` in ``world`` new processes and wait for all, at
    most ``timeout`` seconds (then they are killed and the test fails)."""
    # forkserver: one server process imports torch once (with what FSDP2 and optimizers
    # import on first use: dynamo alone takes seconds) and forks every rank from it, seconds
    # faster per rank than a fresh interpreter each. Only torch: the server starts before
    # the test's sys.path applies, so statestore would come from wherever the interpreter
    # finds it first (an installed copy), not from this tree.
    mp.set_forkserver_preload(PRELOAD)
    ctx = mp.start_processes(fn, args=(world, free_port()) + args, nprocs=world, join=False,
                             start_method="forkserver")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{fn.__name__}: ranks still running after {timeout} s")
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:     # died, or raised
        raise AssertionError(f"{fn.__name__} at {world} ranks: {e}") from None
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def run_ranks_to_the_end(fn, world: int, *args, timeout: float = 60.0):
    """Run ``fn(rank, world, port, *args)`` in ``world`` processes and wait for every one
    (:func:`run_ranks` ends the others as soon as one dies: here a rank is killed on
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
