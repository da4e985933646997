"""A collective save: every rank of a ``torch.distributed`` group writes the states it holds
into its own shards, rank 0 writes the one manifest once all have finished
(``docs/distributed.md``): :class:`CollectiveSave`, the steps
:class:`~.save.CheckpointWriter` makes over a group. Any rank's failure fails the save on every rank, the previous
checkpoint intact.

States a rank holds as a region (its shard of an FSDP2 parameter, ``SavedStates.regions``) are
written by every rank, each row recording its region; blockwise states of such a parameter
(int8 moments' scales) are rows of a 1-D tensor of all ranks' scales, ordered as the
moment's regions (``docs/checkpoint-format.md``, "Regions")."""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Dict, List, Optional, Set, Tuple

from ..distributed import Collective
from ..errors import CheckpointError, RankLostError
from .filesystem import exists, join, prepare_root, remove
from .._regions import Region
from .format import ManifestRow, tiling_problems
from .manifest import read_manifest
from .region_load import blockwise_states
from .writer import (as_io_error, lock_for_save, metadata_json, remove_stale, save_progress,
                     write_manifest, write_shards)

__all__ = ["CollectiveSave", "merge_metadata", "region_rows"]


def merge_metadata(metas: List[str], rows: List[List[ManifestRow]]) -> str:
    """One optimizer metadata from every rank's: rank 0's, with each parameter's step count
    taken from the rank that saved its states."""
    parsed = [json.loads(m) for m in metas]
    merged = next((m for m in parsed if m), {})
    if not isinstance(merged, dict):
        return json.dumps(merged)
    steps: Dict[str, Any] = {}
    for m in parsed:                       # parameters without states: any rank's count
        if isinstance(m, dict) and isinstance(m.get("steps"), dict):
            for k, v in m["steps"].items():
                steps.setdefault(k, v)
    for m, r in zip(parsed, rows):         # parameters with states: their owner's count
        own = m.get("steps") if isinstance(m, dict) else None
        if isinstance(own, dict):
            for name in {row.param for row in r}:
                if name in own:
                    steps[name] = own[name]
    if steps or "steps" in merged:
        merged = dict(merged, steps=steps)
    return json.dumps(merged)


def region_rows(rows: List[ManifestRow], regions: Dict[str, Region],
                blockwise: Set[str], whole: Set[str] = frozenset()) -> List[ManifestRow]:
    """``rows`` with the region each holds: the states of ``regions``' parameters but the
    ``blockwise`` ones (int8 scales: theirs come from :func:`merge_rows`) and the ``whole``
    keys (states not shaped like the parameter, kept whole by every rank: saved once).

    Raises:
        CheckpointError: a state of a sharded parameter without the shape of its region.
    """
    out = []
    for r in rows:
        reg = regions.get(r.param)
        if reg is not None and r.state not in blockwise and r.key not in whole:
            if r.shape != reg.shape:
                raise CheckpointError(f"state {r.key!r} has shape {list(r.shape)}, but this "
                                      f"rank holds {reg.describe()} of its parameter")
            r = r.with_region(reg)
        out.append(r)
    return out


def merge_rows(gathered: List[List[ManifestRow]],
               regions: List[Dict[str, Region]],
               blockwise: Optional[Set[str]] = None) -> List[ManifestRow]:
    """Every rank's rows (``gathered``, in rank order) as one manifest's: the blockwise rows
    (states named in ``blockwise``; None: every whole row) of parameters held as regions
    become regions of a 1-D tensor, in the order of the ranks' regions of their parameter.

    Raises:
        CheckpointError: the rows do not tile their tensors (ranks disagree on a shape).
    """
    scaled: Dict[str, List[tuple]] = {}
    for rank, rows in enumerate(gathered):
        reg = regions[rank]
        for i, r in enumerate(rows):
            if r.param in reg and r.region.is_whole and (blockwise is None
                                                         or r.state in blockwise):
                scaled.setdefault(r.key, []).append((reg[r.param].offsets, rank, i))
    fixed = [list(rows) for rows in gathered]
    for key, owners in scaled.items():
        total = sum(gathered[rank][i].shape[0] if len(gathered[rank][i].shape) == 1 else -1
                    for _, rank, i in owners)
        start = 0
        for _, rank, i in sorted(owners):
            r = gathered[rank][i]
            if len(r.shape) != 1 or total < 0:
                raise CheckpointError(f"state {key!r} of a sharded parameter has shape "
                                      f"{list(r.shape)} on rank {rank}, neither its region's "
                                      f"nor a 1-D blockwise one")
            fixed[rank][i] = r.with_region(Region((total,), (start,), r.shape))
            start += r.shape[0]
    out = [r for rows in fixed for r in rows]
    for problem in tiling_problems(out):
        raise CheckpointError(f"the ranks' states do not form one checkpoint: {problem}")
    return out


class _Written(list):
    """The files a rank's save created (removed if it fails); ``write_manifest`` clears the
    list as it renames the manifest into place, which sets ``committed`` (a rank that wrote
    no shard has an empty list before the commit too)."""
    committed = False

    def clear(self) -> None:
        super().clear()
        self.committed = True


def _after_lost_rank(comm, lost: RankLostError, fs, path: str, save_id: str, written,
                     error) -> None:
    """A rank was lost after this rank wrote its shards (``written``): decide the save's
    outcome as every surviving rank decides it. Rank 0 commits only after a whole gather, so
    it has not: it removes its shards and raises. Another rank returns when rank 0 renamed
    this save's manifest into place before it was lost (the new checkpoint is whole); when
    rank 0 exited without it, it removes its shards and raises; when rank 0 may still run
    (another host), its shards stay (the manifest may name them; the next save removes them
    otherwise) and it raises.

    Raises:
        RankLostError: the save did not commit (or this rank cannot tell), naming the rank.
    """
    if comm.rank != 0 and 0 in comm.exited and _committed(path, save_id):
        return
    if comm.rank == 0 or 0 in comm.exited:
        remove(fs, written)
        if error is not None:       # this rank's own failure came first
            raise as_io_error(error, path)
        raise RankLostError(f"{lost}; nothing was committed: the previous checkpoint (if any) "
                            f"is intact, and this rank's shards were removed",
                            lost.ranks) from lost
    raise RankLostError(f"{lost}; rank 0 may still commit this save, so this rank's shards "
                        f"stay (the next save to the path removes them if it did not)",
                        lost.ranks) from lost


def _committed(path: str, save_id: str) -> bool:
    """Whether the manifest at ``path`` is the one of save ``save_id``."""
    try:
        return read_manifest(path).info.get("save_id") == save_id
    except Exception:
        return False


def missing_shards(fs, root: str, rows: List[ManifestRow], wait_s: float = 2.0) -> List[str]:
    """The shard files ``rows`` name that are not in ``root`` as rank 0 sees it, looked for
    again for up to ``wait_s`` seconds (a network filesystem may show another node's new
    files a moment late)."""
    missing = list(dict.fromkeys(r.file for r in rows))
    deadline = time.monotonic() + wait_s
    while True:
        missing = [name for name in missing if not exists(fs, join(root, name))]
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(0.1)


def _rank_of(name: str) -> str:
    """The rank that wrote shard ``name`` (``shard-<save id>-r<rank>-<n>.safetensors``)."""
    part = name.split("-r", 1)[1][:5] if "-r" in name else ""
    return str(int(part)) if part.isdigit() else "?"


def not_shared_error(path: str, missing: List[str]) -> CheckpointError:
    """What a collective save says when rank 0 does not see the shards other ranks wrote."""
    ranks = sorted({_rank_of(n) for n in missing}, key=lambda r: (len(r), r))
    return CheckpointError(
        f"checkpoint {path!r} is not shared between ranks: rank 0 does not see "
        f"{len(missing)} shard(s) that rank(s) {', '.join(ranks)} wrote there (e.g. "
        f"{missing[0]!r}), so each rank wrote to its own directory (a local disk). Save to "
        f"a path every rank of the group reaches as one directory (a shared filesystem or "
        f"an fsspec URL); nothing was committed")


class CollectiveSave:
    """A save over ``comm``'s group, in :class:`~.save.CheckpointWriter`'s call order (each
    step's collectives are made by every rank, whatever failed on it before):

    1. :meth:`set_up`: this rank's metadata checked, the directory prepared, rank 0 takes
       the path's save lock (a failure is kept for the next step, not raised);
    2. :meth:`plan`: every rank's save id, keys, regions and early failure gathered (any
       failure fails every rank, nothing written); the keys this rank writes;
    3. :meth:`write_data`: this rank's shards (a failure is kept for the next step);
    4. :meth:`finish`: every rank's rows gathered, rank 0 commits the manifest, the outcome
       broadcast; a failed save removes this rank's uncommitted shards;
    :meth:`close`: always, releases rank 0's lock.
    """

    def __init__(self, comm: Collective, path: str, shard_bytes: int, progress,
                 metadata: Optional[dict], link: bool):
        self.comm, self.path, self.shard_bytes = comm, path, shard_bytes
        self.progress, self.metadata, self.link = progress, metadata, link
        self.error: Optional[BaseException] = None
        self.lock = None
        self.fs = self.root = self.meta_json = self.save_id = None
        self.written = _Written()
        self.rows: List[ManifestRow] = []

    def set_up(self, states) -> None:
        """Step 1 (``states``: :class:`~.writer.SavedStates`)."""
        self.states = states
        try:                    # a rank failing here must still take part in the collectives
            if states.error is not None:
                raise states.error
            self.meta_json = metadata_json(states, self.metadata)
            self.fs, self.root = prepare_root(self.path)
            if self.comm.rank == 0:     # rank 0 holds the save lock for the whole collective
                self.lock = lock_for_save(self.fs, self.root, self.path)
        except Exception as e:
            self.error = e

    def plan(self) -> None:
        """Step 2.

        Raises:
            CheckpointError: a rank failed before writing (this rank's own error on it).
        """
        states, comm = self.states, self.comm
        # (a rank lost here: nothing was written anywhere; RankLostError names it)
        self.first_round = comm.all_gather_with_identity(
            (uuid.uuid4().hex[:12], [str(k) for k in states.keys],
             None if self.error is None else repr(self.error), states.regions))
        early = [(r, msg) for r, (_, _, msg, _) in enumerate(self.first_round)
                 if msg is not None]
        if early:
            if self.error is not None:
                raise self.error
            raise CheckpointError(f"collective save of checkpoint {self.path!r} failed on "
                                  f"rank {early[0][0]}: {early[0][1]}; nothing was written")
        self.save_id = self.first_round[0][0]
        self.blockwise = set(blockwise_states(json.loads(self.meta_json)).values())
        self.keys, self.whole = _keys_to_write(states, comm.rank, self.first_round,
                                               states.regions, self.blockwise)

    def write_data(self) -> None:
        """Step 3: this rank's shards, with their regions."""
        bar = save_progress(self.states, self.keys, self.root, self.progress)
        try:
            self.rows = region_rows(
                write_shards(self.states, self.fs, self.root, self.keys,
                             f"shard-{self.save_id}-r{self.comm.rank:05d}", self.shard_bytes,
                             bar, self.written, self.link),
                self.states.regions, self.blockwise, self.whole)
        except Exception as e:
            self.error = e
        finally:
            bar.close()

    def finish(self) -> None:
        """Step 4.

        Raises:
            CheckpointError, RankLostError, StateStoreIOError: the save failed on some rank
                (this rank's own error on it); the previous checkpoint is intact.
        """
        comm, fs, path, save_id, written = (self.comm, self.fs, self.path, self.save_id,
                                            self.written)
        error = self.error
        try:
            gathered = comm.all_gather((self.rows, self.meta_json,
                                        None if error is None else repr(error)))
        except RankLostError as e:      # rank 0 commits only after a whole gather
            return _after_lost_rank(comm, e, fs, path, save_id, written, error)
        failed = [(r, msg) for r, (_, _, msg) in enumerate(gathered) if msg is not None]
        status, committed = None, False
        if not failed and comm.rank == 0:
            try:
                _commit(fs, self.root, path, gathered, self.first_round, self.blockwise,
                        save_id, written, comm.world)
            except Exception as e:
                error = e
                status = f"{type(e).__name__}: {e}"
            committed = written.committed    # the manifest is in place
        if not failed:
            try:
                status, committed = comm.broadcast((status, committed))
            except RankLostError as e:
                if comm.rank != 0:
                    return _after_lost_rank(comm, e, fs, path, save_id, written, error)
                if not committed:       # rank 0 knows the outcome: its own
                    remove(fs, written)
                    raise as_io_error(error, path) if error is not None else e
                # committed: the new checkpoint is whole; the lost rank surfaces at the next
                # collective call
        _raise_failure(failed, status, committed, fs, written, error, path)
        if comm.rank == 0:
            remove_stale(fs, self.root, save_id)

    def close(self) -> None:
        """Release rank 0's save lock (always, after the steps)."""
        lock, self.lock = self.lock, None
        if lock is not None:
            lock.__exit__(None, None, None)


def _raise_failure(failed: list, status: Optional[str], committed: bool, fs, written,
                   error: Optional[BaseException], path: str) -> None:
    """A collective save that failed on some rank (``failed``, or rank 0's commit
    ``status``) removes this rank's shards unless committed, and raises."""
    if not failed and status is None:
        return
    if not committed:            # shards the new manifest names must stay
        remove(fs, written)
    if error is not None:
        raise as_io_error(error, path)
    who = failed[0] if failed else (0, status)
    raise CheckpointError(f"collective save of checkpoint {path!r} failed on rank "
                          f"{who[0]}: {who[1]}; the previous checkpoint (if any) is intact")


def _keys_to_write(states, rank: int, first_round: list, regions: Dict[str, Region],
                   blockwise: Set[str]) -> Tuple[list, Set[str]]:
    """The keys of ``states`` (:class:`~.writer.SavedStates`) this rank writes, given every rank's keys and regions
    (``first_round``), and the states of sharded parameters that are held whole.

    A state held by several ranks (replicated, not sharded) is written once, by the lowest;
    a state held as a region by the lowest rank holding that region (replicas of a shard,
    HSDP's, write it once; empty regions write nothing).
    A state of a sharded parameter not shaped like its region (NAdam's mu_product,
    Adafactor's row and column variances; not int8 scales) is held whole, the same on every
    rank: written once, by the lowest rank."""
    whole = {str(k) for k in states.keys if k.param in regions and k.state not in blockwise
             and tuple(states.spec(k).shape) != regions[k.param].shape}
    first: Dict[str, int] = {}
    holder: Dict[tuple, int] = {}
    for r, (_, ks, _, regs) in enumerate(first_round):
        for k in ks:
            first.setdefault(k, r)
        for name, reg in regs.items():
            holder.setdefault((name, reg), r)
    keys = [k for k in states.keys
            if (regions[k.param].numel > 0 and holder[(k.param, regions[k.param])] == rank
                if k.param in regions and str(k) not in whole
                else first[str(k)] == rank)]
    return keys, whole


def _commit(fs, root: str, path: str, gathered: list, first_round: list, blockwise: Set[str],
            save_id: str, written: _Written, world: int) -> None:
    """Rank 0 writes the manifest naming every rank's rows (``gathered``)."""
    all_rows = merge_rows([g[0] for g in gathered], [f[3] for f in first_round], blockwise)
    # The commit names every rank's shards: each must be here, in the directory the
    # manifest goes to, before it is renamed into place over a good checkpoint.
    missing = missing_shards(fs, root, all_rows)
    if missing:
        raise not_shared_error(path, missing)
    merged = merge_metadata([g[1] for g in gathered], [g[0] for g in gathered])
    write_manifest(fs, root, all_rows, merged, save_id, written, world_size=world)
