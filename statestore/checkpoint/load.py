"""Loading a checkpoint into a store (whole, or one rank's shard with the rest deferred) and
verifying one without loading it (``docs/checkpoint-io.md``, "Loading: verification").
:class:`CheckpointReader` is the load's one object, driven by ``StateStore.load_checkpoint``
in its documented order; :func:`load_checkpoint` and :func:`load_deferred` are the function
forms of the store's methods.

Loading reads the manifest (:mod:`.manifest`), checks every shard's header against it
(:mod:`.shard_check`), takes the shards a store can adopt by hard link (:mod:`.linked_load`),
and streams every other tensor into the store through its pipeline (:func:`.stream.write_states`),
verifying its checksum on the way. The manifest and every shard header are checked before the
store changes: a checkpoint refused then leaves the store (and an optimizer on it) as it was;
an error while the tensors stream leaves the store without the states it was loading.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional

import xxhash

from .._regions import Region
from .._signals import deferred_signals
from ..distributed import Collective, owners_from_metadata, resolve_load_group
from ..errors import (CheckpointCorruptError, CheckpointError, RankLostError,
                      StateStoreClosedError, StateStoreError, StateStoreValueError)
from .filesystem import join
from .filesystem import progress as progress_bar
from .format import Manifest, ManifestRow
from .linked_load import link_shards, verify_linked
from .manifest import read_manifest
from .reader import READ_PIECE, ShardReader, reader_pool
from .region_load import Assembly, load_assembled, plan_regions, split_rows
from .shard_check import by_file, check_shard_header
from .stream import check_store, write_states

__all__ = ["load_checkpoint", "load_deferred", "CheckpointReader", "load_deferred_into",
           "verify_checkpoint", "Deferred", "agree"]


@dataclass
class Deferred:
    """States of a checkpoint that a sharded load left on disk (other ranks' shards): the
    optimizer built on the store fetches those it turns out to need (another partition, or
    no sharding at all) with :meth:`StateStore.load_deferred`.

    Attributes:
        path: the checkpoint's path, as given to ``load_checkpoint``.
        save_id: the save id of the manifest loaded (a later save at ``path`` is refused).
        rows: the manifest rows still on disk.
        rank: this process's rank in the load's group.
        world: the group's size.
        regions: parameters loaded as a region (a rank's shard of an FSDP2 checkpoint, or
            of one loaded into FSDP2) that no optimizer has taken yet; their rows stay in
            ``rows`` so that another region can be loaded instead.
    """
    path: str
    save_id: Optional[str]
    rows: List[ManifestRow]
    rank: int
    world: int
    regions: Dict[str, Region] = field(default_factory=dict)


def load_checkpoint(store, path: str, *, progress: Optional[bool] = None,
                    process_group: Any = "auto", link: bool = True) -> None:
    """Replace the states of ``store`` with the checkpoint at ``path``, verifying every
    checksum while streaming. The exception of a failed load names the file and tensor. A
    checkpoint refused before a tensor is read (missing; a corrupt manifest or shard header)
    leaves the store as it was; an error later (a checksum mismatch, I/O) leaves it empty
    (never half-loaded), and :attr:`StateStore.load_error` says why.

    An optimizer already attached to ``store`` (torch's order: build the optimizer, then
    load) takes the checkpoint's step counts and param-group hyperparameters once the states
    are loaded.

    Args:
        store: the :class:`~statestore.StateStore` to fill (any backend; the checkpoint may
            come from any other).
        path: the checkpoint directory: a local path or any fsspec URL.
        progress: a byte progress bar: True always, None (default) for loads over a second,
            False never.
        process_group: ``"auto"`` (default) is the default group when torch.distributed is
            initialized with more than one rank, else None. With a group, each rank loads
            only the states of the parameters it owns at the group's size (the optimizer's
            partition, computed from the checkpoint's manifest; any world size the
            checkpoint was saved at), reading only their byte ranges; the others stay on
            disk until an optimizer asks for them (:meth:`StateStore.load_deferred`). A
            load over a group is a collective (every rank calls it) and ends the same way on
            every rank: when any rank's part fails (a damaged shard only it reads), every
            rank raises that error, and every store is left as a failed load leaves it (as it
            was, or empty with :attr:`StateStore.load_error`).
        link: an :class:`~statestore.NVMeStore` on the checkpoint's local filesystem takes
            the shards a linked save wrote by hard link instead of copying them
            (copy-on-write: the store never writes them), their checksums still verified;
            False copies every state.

    Raises:
        StateStoreValueError: a bad argument.
        StateStoreClosedError: the store is closed.
        CheckpointNotFoundError: no complete checkpoint at ``path``.
        CheckpointCorruptError: a file or tensor is truncated, altered or missing (named).
        CheckpointMismatchError: an attached optimizer's parameters or groups do not fit
            the checkpoint.
        StateStoreIOError: reading failed (names the file).
        RankLostError: a collective load lost a rank of its group.
    """
    check_store(store)
    store.load_checkpoint(path, progress=progress, process_group=process_group, link=link)


class CheckpointReader:
    """Loads one checkpoint into a store: ``StateStore.load_checkpoint`` makes these calls,
    in this order, the mirror of :class:`~.save.CheckpointWriter`'s:

    0. ``CheckpointReader(path, progress=..., process_group=..., link=...)``: the arguments
       checked, the group chosen (``"auto"``: the default group of several ranks).
    1. :meth:`set_up` ``(store, record, adopt)``: the store to fill, its bookkeeping (its
       :class:`~statestore._record.CheckpointRecord`) and its operation that takes a shard
       as a file of its own (linked loads: ``adopt(path, rows, names) -> bool``).
    2. :meth:`read_metadata`: the manifest read, this rank's rows planned, every shard
       header they read checked; a checkpoint refused here leaves the store and its
       optimizer as they were (collective: every rank refuses with the same error).
    3. :meth:`read_data`: ``record.begin_load()``, then the store's states replaced through
       its public ``clear``, ``create_many`` and ``stream`` (linked shards adopted, every
       checksum verified); a failure leaves the store empty (collective: on every rank).
    4. :meth:`finish`: ``record.record_regions(...)`` and ``record.loaded(...)`` (an
       attached optimizer takes the checkpoint's steps and hyperparameters).
    """

    def __init__(self, path: str, *, progress: Optional[bool] = None,
                 process_group: Any = "auto", link: bool = True):
        if not isinstance(link, bool):
            raise StateStoreValueError(f"link must be True or False, got {link!r}")
        self.path, self.progress, self.link = path, progress, link
        self.group = resolve_load_group(process_group)
        self.comm = Collective(self.group, f"collective load of checkpoint {path!r}") \
            if self.group is not None else None

    def set_up(self, store, record, adopt) -> None:
        """Step 1 (class docstring)."""
        self.store, self.record, self.adopt = store, record, adopt

    def read_metadata(self) -> None:
        """Step 2 (class docstring)."""
        store, comm = self.store, self.comm
        try:
            check_store(store)
            if store.closed:
                raise StateStoreClosedError(f"{type(store).__name__} is closed")
            known = store.regions       # an attached FSDP2 optimizer's shards (torch's order)
            self.m = read_manifest(self.path)
            self.rank, self.world = (comm.rank, comm.world) if comm is not None else (0, 1)
            self.rows, self.assembled, self.regions, self.later = _rows_of_rank(
                self.m, self.rank, self.world, known)
            _check_headers(self.m, self.rows, self.assembled)   # refused: nothing changed
        except BaseException as e:
            if comm is None:
                raise
            agree(comm, e)
        if comm is not None:
            agree(comm, None)   # another rank's refusal: refused here too, nothing changed

    def read_data(self) -> None:
        """Step 3 (class docstring)."""
        _replace_states(self.store, self.record, self.adopt, self.m, self.rows, self.progress,
                        self.link, self.assembled, self.comm)

    def finish(self) -> None:
        """Step 4 (class docstring)."""
        m, later = self.m, self.later
        self.record.record_regions(self.regions)
        # then an optimizer already on the store takes the checkpoint's steps
        self.record.loaded(self.store, m.metadata,
                           Deferred(self.path, m.info.get("save_id"), later, self.rank,
                                    self.world, dict(self.regions)) if later else None,
                           self.group if later else None)


def _rows_of_rank(m: Manifest, rank: int, world: int, known: Any):
    """``(rows to load, assembled regions, regions, rows left on disk)``: this rank's part
    of the checkpoint, by region when regions were saved or are needed
    (docs/checkpoint-format.md), else by the optimizer's partition at ``world`` ranks."""
    targets = plan_regions(m, rank, world, known)
    if targets is not None:
        rows, assembled, regions = split_rows(m, targets)
        return rows, assembled, regions, [r for r in m.rows if r.param in regions]
    if world <= 1:
        return m.rows, [], {}, []
    numels: Dict[str, int] = {}
    for r in m.rows:
        numels.setdefault(r.param, r.spec.numel)
    owners = owners_from_metadata(m.metadata, numels, world)
    return ([r for r in m.rows if owners[r.param] == rank], [], {},
            [r for r in m.rows if owners[r.param] != rank])


def _replace_states(store, record, adopt, m: Manifest, rows: List[ManifestRow], progress: Optional[bool],
                    link: bool, assembled: List[Assembly], comm: Optional[Collective]) -> None:
    """Replace the store's states with ``rows``; on failure (on any rank of ``comm``) the
    store is left empty."""
    # The store's states are replaced (or, on failure, removed): the metadata of the optimizer
    # that used them no longer describes them. Detached, an optimizer built next takes its
    # step counts from this checkpoint, not from the optimizer the store had before.
    record.begin_load()
    store.clear()
    try:
        _load_rows(store, m, rows, progress, on_error=store.clear,
                   adopt=adopt if link else None, assembled=assembled, checked=True)
    except BaseException as e:
        if comm is None:
            raise
        agree(comm, e)
    if comm is not None:
        try:
            agree(comm, None)
        except BaseException:
            with deferred_signals():    # another rank's load failed: this one fails too
                store.clear()
            raise


def agree(comm: Collective, error: Optional[BaseException]) -> None:
    """One step of a collective load ends the same way on every rank: every rank's outcome
    (``error``: this rank's, None when it succeeded) is gathered, and when any rank failed,
    every rank raises the error of the lowest rank that failed: the same class and message
    (the failing rank raises its own exception, the others one built from its class and
    arguments; an exception from outside statestore, or a Ctrl-C, reaches the others as a
    :class:`CheckpointError` that names it and the rank).

    Raises:
        StateStoreError: some rank failed (the lowest's error), or a rank was lost
            (:class:`RankLostError`).
    """
    mine = None if error is None else _describe(error)
    try:
        outcomes = comm.all_gather(mine)
    except RankLostError as lost:
        if error is not None:
            raise error from lost
        raise
    failed = [(r, o) for r, o in enumerate(outcomes) if o is not None]
    if not failed:
        return
    r, (name, args, text) = failed[0]
    if error is not None and r == comm.rank:
        raise error
    raise _rebuilt(comm, r, name, args, text) from error


def _describe(e: BaseException):
    """What the other ranks need to raise ``e`` again: class name, arguments (when plain
    values), message."""
    args = e.args if all(isinstance(a, (str, int, float, type(None))) for a in e.args) else None
    return type(e).__name__, args, str(e)[:4000]


def _rebuilt(comm: Collective, rank: int, name: str, args, text: str) -> BaseException:
    """The exception rank ``rank`` raised (class ``name``, ``args``, message ``text``), raised
    here too."""
    from .. import errors
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, StateStoreError) and args is not None:
        try:
            e = cls(*args)
            if str(e) == text:
                return e
        except Exception:
            pass
    if isinstance(cls, type) and issubclass(cls, StateStoreError):
        return cls(text) if not issubclass(cls, OSError) else CheckpointError(text)
    return CheckpointError(f"{comm.what} failed on rank {rank}: {name}: {text}")


def load_deferred(store, params: Iterable[str],
                  regions: Optional[Dict[str, Region]] = None) -> None:
    """Load the states of ``params`` that a sharded :func:`load_checkpoint` left on disk, or
    loaded as another region than ``regions`` asks.

    Args:
        store: the store the sharded load filled.
        params: parameter names; those without deferred states are ignored.
        regions: the region each parameter's states must hold (an optimizer over FSDP2
            parameters: its shards); parameters absent from it are needed whole.

    Raises:
        CheckpointError: the checkpoint was replaced since it was loaded.
        CheckpointCorruptError: a file or tensor is damaged (the states this call created
            are removed again).
        CheckpointMismatchError: an int8 moment asked in another region than it was saved in.
    """
    check_store(store)
    store.load_deferred(params, regions)


def load_deferred_into(store, record, params: Iterable[str],
                       regions: Optional[Dict[str, Region]] = None) -> None:
    """:func:`load_deferred`, as ``store.load_deferred`` calls it with its ``record``
    (:class:`~statestore._record.CheckpointRecord`: ``deferred``, then ``record_regions`` and
    ``record_deferred_loaded``)."""
    d = record.deferred
    if d is None:
        return
    want = set(params)
    regions = regions or {}
    waiting = {r.param for r in d.rows}
    todo: Dict[str, Optional[Region]] = {}
    for p in want:
        need, held = regions.get(p), d.regions.get(p)
        if held is not None:
            if need != held:
                todo[p] = need
        elif p in waiting or (need is not None and not need.is_whole
                              and any(k.param == p for k in store.keys())):
            todo[p] = need
    if todo:
        _reload(store, record, d, todo)
    d.rows = [r for r in d.rows if r.param not in want]
    for p in want:
        d.regions.pop(p, None)
    if not d.rows:
        record.record_deferred_loaded()


def _reload(store, record, d: Deferred, todo: Dict[str, Optional[Region]]) -> None:
    """Replace the states of ``todo``'s parameters with the region each needs (None: whole)
    of the checkpoint ``d`` came from."""
    m = read_manifest(d.path)
    if m.info.get("save_id") != d.save_id:
        raise CheckpointError(f"checkpoint {d.path!r} was replaced since it was loaded (save "
                              f"{d.save_id}, now {m.info.get('save_id')}); load it again")
    glob = {r.param: r.global_shape for r in m.rows if r.param in todo}
    targets = {p: (need if need is not None else Region.whole(glob[p]))
               for p, need in todo.items() if p in glob}
    rows, assembled, regions = split_rows(m, targets)
    old = [k for k in store.keys() if k.param in targets]
    if old:
        store.delete(old)
    created = [r.state_key for r in rows] + [a[0] for a in assembled]

    def undo():
        store.delete([k for k in created if k in store])
    _load_rows(store, m, rows, None, on_error=undo, assembled=assembled)
    record.record_regions({p: regions.get(p, Region.whole(glob[p])) for p in targets})


def _check_headers(m: Manifest, rows: List[ManifestRow], assembled: List[Assembly]) -> None:
    """Check the header of every shard ``rows`` and ``assembled`` read against the manifest.

    Raises:
        CheckpointCorruptError: a shard is missing or its header differs (named).
    """
    groups = by_file(rows)
    for name, rs in groups.items():
        check_shard_header(m, name, rs)
    sources = by_file([r for a in assembled for r in a[3] if r.file not in groups])
    for name, rs in sources.items():
        check_shard_header(m, name, rs)


def _load_rows(store, m: Manifest, rows: List[ManifestRow], enabled, on_error,
               adopt=None, assembled: List[Assembly] = (), checked: bool = False
               ) -> None:
    """Create ``rows``' states in ``store`` and stream them in (``adopt``, the store's
    operation: shards the store can take by hard link are linked, :mod:`.linked_load`), then the states ``assembled``
    from regions (:mod:`.region_load`); ``on_error()`` on failure. ``checked``: the shard
    headers were checked already (:func:`_check_headers`)."""
    groups = by_file(rows)
    if not checked:
        try:
            _check_headers(m, rows, assembled)
        except BaseException:
            on_error()
            raise
    try:
        linked = link_shards(store, adopt, m, groups) if adopt is not None else {}  # scale.md
        store.create_many([(r.state_key, r.spec.shape, r.spec.dtype, None) for r in rows
                           if r.file not in linked]
                          + [(k, want.shape, first.spec.dtype, None)
                             for k, want, first, _ in assembled])
        total = sum(r.nbytes for r in rows) + sum(w.numel * f.spec.itemsize
                                                  for _, w, f, _ in assembled)
        bar = progress_bar(total, f"load {os.path.basename(m.root)}", enabled)
        try:
            verify_linked(store, m, linked, bar)
            with reader_pool() as pool:
                for name, rs in groups.items():
                    if name in linked:
                        continue
                    fpath = join(m.root, name)
                    with ShardReader(m.fs, fpath, pool) as f:
                        _load_tensors(store, f, fpath, rs, bar)
                load_assembled(store, m, assembled, pool, bar)
        finally:
            bar.close()
        store.sync()
    except BaseException:
        try:
            with deferred_signals():        # a Ctrl-C now would leave the store half-cleared
                on_error()
        except Exception:
            pass
        raise


def _load_tensors(store, f: ShardReader, fpath: str, rows: List[ManifestRow], bar) -> None:
    """Stream the tensors of ``rows`` (of one shard) from ``f`` into ``store`` through one
    stream, and check each checksum once its last byte is read."""
    by_key = {r.state_key: r for r in rows}
    hashes = {k: xxhash.xxh3_64() for k in by_key}
    offset = {k: r.offset for k, r in by_key.items()}

    def fill(k, view: memoryview) -> None:
        f.read(view, offset[k], by_key[k].key, hashes[k].update)
        offset[k] += len(view)
        bar.update(len(view))

    def finished(k) -> None:
        if hashes.pop(k).hexdigest() != by_key[k].checksum:
            raise CheckpointCorruptError(f"{fpath}: checksum mismatch in tensor "
                                         f"{by_key[k].key!r} (the file was altered or damaged)")
    write_states(store, [(r.state_key, r.spec) for r in rows], fill, finished)
    for k in list(hashes):      # empty tensors: their (empty) checksum
        finished(k)


def verify_checkpoint(path: str, *, progress: Optional[bool] = None) -> List[str]:
    """Check a checkpoint without loading it: manifest, shard headers and files, and every
    tensor checksum (``docs/checkpoint-io.md``, "Loading: verification").

    Args:
        path: the checkpoint directory: a local path or any fsspec URL.
        progress: a byte progress bar: True always, None (default) for checks over a
            second, False never.

    Returns:
        The problems found, one message each naming the file or tensor (empty when the
        checkpoint is intact). A bad manifest is the only problem reported.

    Raises:
        StateStoreValueError: ``path`` is not a path.
    """
    try:
        m = read_manifest(path)
    except CheckpointError as e:
        return [str(e)]
    problems: List[str] = []
    bar = progress_bar(m.nbytes, "verify", progress)
    buf = bytearray(min(4 * READ_PIECE, max((r.nbytes for r in m.rows), default=0)))
    mv = memoryview(buf)
    with reader_pool() as pool:
        for name, rows in by_file(m.rows).items():
            fpath = join(m.root, name)
            try:
                check_shard_header(m, name, rows)
                f = ShardReader(m.fs, fpath, pool)
            except CheckpointError as e:
                problems.append(str(e))
                continue
            with f:
                for r in rows:
                    h = xxhash.xxh3_64()
                    offset, left = r.offset, r.nbytes
                    try:
                        while left:
                            n = min(left, len(buf))
                            f.read(mv[:n], offset, r.key, h.update)
                            offset += n
                            left -= n
                            bar.update(n)
                    except StateStoreError as e:
                        problems.append(str(e))
                        continue
                    if h.hexdigest() != r.checksum:
                        problems.append(f"{fpath}: checksum mismatch in tensor {r.key!r}")
    bar.close()
    return problems
