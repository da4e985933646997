"""Sharding optimizer states over a ``torch.distributed`` process group.

Parameters are assigned whole to ranks by :func:`partition`: a deterministic greedy balance
by element count that depends only on the parameters' sizes (in optimizer order) and the
world size. The optimizer, the distributed checkpoint save and the resharding load all call
it, so a rank knows which states it owns from the checkpoint's manifest alone, before any
optimizer exists, at any world size.
"""
from __future__ import annotations

import heapq
import os
import socket
import time
from typing import Dict, List, Optional, Sequence, Tuple

from .errors import RankLostError, StateStoreError, StateStoreValueError

__all__ = ["partition", "group_info", "resolve_load_group", "owners_from_metadata"]


def partition(numels: Sequence[int], world_size: int) -> List[int]:
    """Owner rank of each parameter: largest first, each to the least loaded rank (ties to
    the lower rank). Deterministic; balanced to within the largest parameter."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise StateStoreValueError(f"world_size must be a positive int, got {world_size!r}")
    try:
        numels = list(numels)
    except TypeError:
        raise StateStoreValueError(f"numels must be a sequence of element counts, got "
                                   f"{numels!r}"[:200]) from None
    for i, n in enumerate(numels):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise StateStoreValueError(f"numels[{i}] must be a non-negative int, got {n!r}")
    owners = [0] * len(numels)
    heap = [(0, r) for r in range(world_size)]
    order = sorted(range(len(numels)), key=lambda i: (-int(numels[i]), i))
    for i in order:
        load, r = heapq.heappop(heap)
        owners[i] = r
        heapq.heappush(heap, (load + int(numels[i]), r))
    return owners


def group_info(process_group):
    """``(rank, world_size)`` in ``process_group``; a clear error when torch.distributed is
    not initialized."""
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise StateStoreError("process_group given but torch.distributed is not initialized "
                              "(call torch.distributed.init_process_group first)")
    return dist.get_rank(process_group), dist.get_world_size(process_group)


# ---------------------------------------------------------------------------------- groups
def resolve_load_group(process_group):
    """The group a checkpoint load shards over: ``"auto"`` is the default group when
    torch.distributed is initialized with more than one rank, else None (load everything)."""
    if process_group is None:
        return None
    if isinstance(process_group, str):
        if process_group != "auto":
            raise StateStoreValueError(f"process_group must be a ProcessGroup, None or "
                                       f"'auto', got {process_group!r}")
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        return dist.group.WORLD
    group_info(process_group)
    return process_group


def owners_from_metadata(metadata: dict, numel_of_rows: Dict[str, int],
                         world_size: int) -> Dict[str, int]:
    """Owner rank of each parameter of a checkpoint at ``world_size``, computed exactly as a
    sharded optimizer over the same parameters computes it (:func:`partition` over the
    parameters' element counts in optimizer order). The order and sizes come from the
    optimizer metadata's ``params`` table; parameters missing from it (a checkpoint saved
    without an optimizer) follow in manifest order with the size of their states,
    ``numel_of_rows`` (parameter name -> element count, in manifest order)."""
    order: List[str] = []
    numels: List[int] = []
    table = metadata.get("params") if isinstance(metadata, dict) else None
    seen = set()
    if isinstance(table, dict):
        for name, info in table.items():
            shape = info.get("shape") if isinstance(info, dict) else None
            if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
                continue
            n = 1
            for d in shape:
                n *= d
            order.append(str(name))
            numels.append(n)
            seen.add(str(name))
    for name in numel_of_rows:
        if name not in seen:
            order.append(name)
            numels.append(numel_of_rows.get(name, 0))
            seen.add(name)
    return dict(zip(order, partition(numels, world_size)))


#: how long a rank waits for a lost peer's process to be seen gone (the kernel closes a
#: killed process's sockets, which is what gloo reports, just before the process exits)
_EXIT_WAIT_S = 2.0


def _start_time(pid: int) -> Optional[str]:
    """The start time of process ``pid`` (``/proc/<pid>/stat``), None when it is gone or
    a zombie, "" where ``/proc`` cannot tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None if os.path.isdir("/proc/self") else ""
    except OSError:
        return ""
    return None if fields[0] in ("Z", "X", "x") else fields[19]


def identity() -> Tuple[str, int, Optional[str]]:
    """This process as its peers can check it is alive: host, pid and start time."""
    return socket.gethostname(), os.getpid(), _start_time(os.getpid())


class Collective:
    """The few object collectives a sharded checkpoint save or load needs, over one group.

    A collective that fails because a rank was lost (gloo's or NCCL's error when a peer's
    connection closes) raises :class:`~statestore.errors.RankLostError` naming the lost rank
    where it can be told: a rank on this host whose process exited (each rank's host, pid
    and start time are recorded by :meth:`all_gather_with_identity`), or the only other
    rank of a group of two.
    """

    def __init__(self, process_group, what: str = "collective"):
        import torch.distributed as dist
        self.dist = dist
        self.group = process_group
        self.what = what
        self.rank, self.world = group_info(process_group)
        #: each rank's (host, pid, start time), once exchanged
        self.peers: Optional[List[Tuple[str, int, Optional[str]]]] = None
        #: ranks whose process was seen exited (on this host) after a collective failed
        self.exited: List[int] = []

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank."""
        box = [obj]
        self._guard(lambda: self.dist.broadcast_object_list(box, group=self.group,
                                                            group_src=0))
        return box[0]

    def all_gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order, on every rank."""
        out = [None] * self.world
        self._guard(lambda: self.dist.all_gather_object(out, obj, group=self.group))
        return out

    def all_gather_with_identity(self, obj) -> list:
        """:meth:`all_gather` of ``obj``, recording every rank's identity on the way."""
        got = self.all_gather((identity(), obj))
        self.peers = [g[0] for g in got]
        return [g[1] for g in got]

    def _guard(self, call) -> None:
        try:
            call()
        except RankLostError:
            raise
        except RuntimeError as e:       # gloo / NCCL: a peer's connection closed or timed out
            raise self.lost(e) from e

    def lost(self, cause: BaseException) -> RankLostError:
        """The error of a collective that failed with ``cause``: which rank was lost."""
        ranks = self.lost_ranks()
        if ranks:
            who = ", ".join(str(r) for r in ranks)
            head = f"rank {who} of the group was lost" if len(ranks) == 1 else \
                f"ranks {who} of the group were lost"
            how = "its process exited; " if ranks == self.exited else ""
        else:
            head, how = "a rank of the group was lost", "none on this host exited; "
        seen = " ".join(str(cause).split())
        seen = seen if len(seen) <= 160 else seen[:160] + "..."
        return RankLostError(f"{self.what}: {head} ({how}rank {self.rank} saw: {seen})", ranks)

    def lost_ranks(self) -> List[int]:
        """The other ranks known gone: on this host, those whose process exited (waiting a
        little for it; recorded in :attr:`exited`); else, in a group of two, the other rank
        (its connection broke; it may still run)."""
        others = [r for r in range(self.world) if r != self.rank]
        if self.peers is not None:
            host = socket.gethostname()
            mine = [(r, self.peers[r]) for r in others if self.peers[r][0] == host
                    and self.peers[r][2]]
            deadline = time.monotonic() + _EXIT_WAIT_S
            while mine:
                gone = [r for r, (_, pid, start) in mine
                        if _start_time(pid) not in (start, "")]
                if gone:
                    self.exited = gone
                    return gone
                if time.monotonic() > deadline:
                    break
                time.sleep(0.02)
        return others if len(others) == 1 else []
