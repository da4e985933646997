"""``StateStore``: the base of every store, and what is written once over the backend
primitives: catalogue, ``get``/``put``, pipeline and ``stream``, prefetch, ``sync``, metadata,
checkpoints, stats, lifetime. Backends subclass ``ResidentStore`` or ``StreamingStore``
(``backends/base.py``; the primitives and their call order: docs/architecture.md, "Stores" and
"Adding a backend"). Not thread-safe: one thread drives a store (its own background I/O aside).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ._access import CHUNK_BYTES, PipelineAccess
from ._entries import check_entries, check_value, with_initial_values
from ._inflight import InFlightWrites
from ._links import NO_LINKS, FileLinks
from ._record import CheckpointRecord
from ._regions import Region
from ._ring import aligned_buffer
from ._signals import deferred_signals
from ._types import LinkableFile, Slice, StateKey, StateSpec, as_key
from .errors import StateKeyError, StateStoreClosedError, StateStoreError, StateStoreValueError
from .kernels import stream_copy_
from ._stream import StateStream
from .pipeline import StatePipeline

__all__ = ["StateStore", "DEFAULT_BUDGET_BYTES", "CHUNK_BYTES", "LinkableFile"]

#: Default RAM budget of streaming stores' buffers (read-ahead, compute, write-behind, saves).
DEFAULT_BUDGET_BYTES = 256 * 1024 * 1024


class StateStore(ABC):
    """The base every store is an instance of; backends subclass
    :class:`~statestore.ResidentStore` or :class:`~statestore.StreamingStore` (module
    docstring).

    Args:
        budget_bytes: RAM budget of the pipeline's host buffers (streaming stores only;
            default :data:`DEFAULT_BUDGET_BYTES`). Resident stores ignore it.

    Raises:
        StateStoreValueError: ``budget_bytes`` is not a positive int.
    """

    #: True when states live in addressable memory and the pipeline hands out views (set by
    #: the kind: True for ResidentStore, False for StreamingStore; TieredStore derives it).
    resident: bool = True
    #: Byte alignment of buffer offsets and file offsets for non-resident stores.
    alignment: int = 1
    #: Where callers cut a long state into pipeline slices: at multiples of this many bytes
    #: (a multiple of :attr:`alignment`), so transfers start where the store aligned the
    #: state's data (NVMeStore: 1 MiB; docs/nvme.md, "Alignment of the data").
    transfer_alignment: int = 1
    #: How checkpoints link its files and adopt theirs (``_links.py``; NVMeStore's own).
    links: FileLinks = NO_LINKS
    #: Streaming stores that move several slices of a unit by one request: the object that
    #: lays units out (``unit_plan``, ``start_extent``, ``write_extent``: NVMeStore's
    #: ``PackedStates``, ``backends/_nvme_packed.py``); None moves each slice on its own.
    extents: Optional[Any] = None

    def __init__(self, *, budget_bytes: Optional[int] = None):
        if budget_bytes is None:
            budget_bytes = DEFAULT_BUDGET_BYTES
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise StateStoreValueError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self._specs: Dict[StateKey, StateSpec] = {}
        self._closed = False
        align = self.alignment
        self._in_flight = InFlightWrites(
            spec=self.spec, alignment=align, budget_bytes=budget_bytes,
            alloc_buffer=self._alloc_host_buffer, state_bytes=lambda: self._aligned_bytes)
        self._aligned_bytes = 0     # sum of _ring_bytes of the states, kept as they change
        #: the attached optimizer and the last load (_record.py)
        self._record = CheckpointRecord()
        #: pipelines, streams and the prefetch kept between calls (``_access.py``)
        self._access = PipelineAccess(self)

    # ------------------------------------------------------------------ backend primitives
    @abstractmethod
    def _allocate(self, entries: Sequence[Tuple[StateKey, StateSpec]]) -> None:
        """Create storage for new states, zero-filled."""

    @abstractmethod
    def _free(self, keys: Sequence[StateKey]) -> None:
        """Release the storage of states (their specs are already gone)."""

    # _view, _submit_read, _submit_write: declared abstract by the two kinds (backends/base.py)

    def _alloc_host_buffer(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 host buffer for the pipeline's ring; aligned to :attr:`alignment`."""
        return aligned_buffer(nbytes, self.alignment)

    def _flush(self) -> None:
        """Make every completed write durable (e.g. fsync)."""

    def _check_files(self) -> None:
        """File-backed stores: raise :class:`StateStoreIOError` when a state file was truncated
        (every time) or removed (once) under the open store. Called before every pipeline and
        resident ``get``/``put``, so such damage is reported before any state is touched."""

    def _close(self) -> None:
        """Release memory, file descriptors and temporary files."""

    def _ring_bytes(self, spec: StateSpec) -> int:
        """Ring bytes a state takes (the ring is never larger than all states' sum)."""
        return -(-spec.nbytes // self.alignment) * self.alignment

    def _backend_stats(self) -> Dict[str, Any]:
        return {}

    @property
    def device(self) -> torch.device:
        """The device of the tensors the pipeline hands out."""
        return torch.device("cpu")

    # ------------------------------------------------------------------ state catalogue
    def keys(self) -> List[StateKey]:
        """Every state key, in creation order."""
        return list(self._specs)

    def __contains__(self, key) -> bool:
        return as_key(key) in self._specs

    def __len__(self) -> int:
        return len(self._specs)

    def __bool__(self) -> bool:     # ``if store:`` is "a store was given"; len() counts states
        return True

    def spec(self, key) -> StateSpec:
        """Shape and dtype of a state.

        Raises:
            StateKeyError: no such state. StateStoreValueError: not a state key.
        """
        k = as_key(key)
        try:
            return self._specs[k]
        except KeyError:
            raise StateKeyError(f"no state {k} in {type(self).__name__}") from None

    def create(self, key, shape: Sequence[int], dtype: torch.dtype = torch.float32,
               init: Optional[torch.Tensor] = None) -> None:
        """Create one state, zero-filled or copied from ``init``; as :meth:`create_many`."""
        self.create_many([(key, shape, dtype, init)])

    def create_many(self, entries: Iterable[Tuple[Any, Sequence[int], torch.dtype,
                                                    Optional[torch.Tensor]]]) -> None:
        """Create several states at once (backends may lay them out together), all or none.

        Args:
            entries: ``(key, shape, dtype, init)`` tuples; ``init`` (None for zeros) is a
                dense tensor of the given shape; dtypes are those of the checkpoint format.

        Raises:
            StateKeyError: a key exists already (or twice in ``entries``); nothing created.
            StateStoreValueError: a malformed entry (names the state and what is wrong).
            StateStoreIOError: the backend cannot hold them (e.g. ENOSPC, naming bytes).
        """
        self._check_open()
        self.cancel_prefetch()
        new, inits = check_entries(entries, self._specs)
        self._record.load_error = None      # states made anew: no longer a load's remains
        if not new:
            return
        # the backend's storage and the catalogue agree; then the initial values are written
        with with_initial_values(self, new, inits), deferred_signals():
            self._allocate(new)
            for k, spec in new:
                self._specs[k] = spec
                self._aligned_bytes += self._ring_bytes(spec)

    def delete(self, keys) -> None:
        """Remove states and release their storage (after waiting for pending writes).

        Args:
            keys: a state key or an iterable of them.

        Raises:
            StateKeyError: a key names no state (nothing removed).
            StateStoreIOError: a background write failed (raised by the wait).
        """
        self._check_open()
        self.cancel_prefetch()
        if isinstance(keys, (str, StateKey)):
            keys = [keys]
        if not isinstance(keys, Iterable):
            raise StateStoreValueError(f"delete: keys must be a state key or an iterable of "
                                       f"them, got {keys!r}")
        ks = [as_key(k) for k in keys]
        for k in ks:
            self.spec(k)
        self.sync()
        with deferred_signals():        # the catalogue and the backend's storage agree
            for k in ks:
                self._aligned_bytes -= self._ring_bytes(self._specs.pop(k))
                self._in_flight.repaired(k)
            self._free(ks)

    def clear(self) -> None:
        """Remove every state and the loaded checkpoint metadata."""
        self._check_open()
        self._record.clears += 1
        self._record.load_error = None
        if self._specs:
            self.delete(list(self._specs))
        self._record.cleared()

    # ------------------------------------------------------------------ pipelines
    def pipeline(self, units: Sequence[Sequence[Slice]], mode: str = "rw",
                 wait: bool = True) -> StatePipeline:
        """The read / compute / write pipeline over ``units`` (lists of :class:`Slice`
        visited together; modes ``"rw"``, ``"r"``, ``"w"``; ``wait=False`` leaves the last
        writes in flight). Arguments, return and errors: :meth:`PipelineAccess.pipeline
        <statestore._access.PipelineAccess.pipeline>`, which this store's holds."""
        self._check_open()
        self._check_files()
        return self._access.pipeline(units, mode, wait)

    def stream(self, keys, mode: str = "r", *, chunk_bytes: Optional[int] = None,
               wait: bool = True) -> StateStream:
        """Whole states, chunk by chunk (``Chunk(slice, tensor)`` pairs), through one
        :meth:`pipeline`: the way to move states in or out without holding them in RAM.
        Arguments, return and errors: :meth:`PipelineAccess.stream
        <statestore._access.PipelineAccess.stream>`, which this store's holds."""
        self._check_open()
        self._check_files()
        return self._access.stream(keys, mode, chunk_bytes, wait)

    def prefetch(self, units: Sequence[Sequence[Slice]], mode: str = "rw") -> None:
        """Start reading ``units`` now, for a :meth:`pipeline` that will ask for exactly these
        units (and mode) later, typically an optimizer's next step: the reads then overlap
        whatever runs in between (forward and backward). Reads start as far as the RAM budget
        allows without waiting; :meth:`pump` starts more as write-behind frees buffers. Any
        other use of the store (another pipeline, put, create, delete, load, close) cancels
        the prefetch first, so it never hands out stale values. A no-op on resident stores.

        Raises:
            as :meth:`pipeline`.
        """
        self._check_open()
        self._access.prefetch(units, mode)

    def pump(self) -> None:
        """Never blocks: retire finished background writes and start more prefetch reads in
        the RAM they free. Optimizers call it from gradient hooks during backward."""
        self._access.pump()

    def cancel_prefetch(self) -> None:
        """Drop a :meth:`prefetch` not yet used (reads in flight are drained), and end the
        pipelines lent across calls (:meth:`~statestore.pipeline.StatePipeline.lend`): what
        every call that changes the store's states, or needs its ring, does first."""
        self._access.cancel_prefetch()

    def cut_alignment(self, max_bytes: Optional[int]) -> int:
        """Bytes at whose multiples to cut a state into slices of at most ``max_bytes``:
        :attr:`transfer_alignment`, halved while larger than ``max_bytes`` (small budgets),
        never below :attr:`alignment`."""
        a = max(self.transfer_alignment, self.alignment)
        while max_bytes is not None and a > self.alignment and a > max_bytes and a % 2 == 0:
            a //= 2
        return a

    @property
    def unit_bytes(self) -> Optional[int]:
        """Suggested upper size of a pipeline unit: None (no limit) for resident stores, a
        quarter of the budget for others, so read-ahead, compute and write-behind overlap."""
        return None if self.resident else max(self.alignment, self.budget_bytes // 4)

    @property
    def in_flight(self) -> InFlightWrites:
        """The store's write-behind (:class:`~statestore._inflight.InFlightWrites`): the ring
        its pipelines carve buffers from, their writes in flight, and the states whose last
        write failed. Pipelines and backends use it; callers use :meth:`sync`."""
        return self._in_flight

    # ------------------------------------------------------------------ whole-tensor access
    def get(self, key) -> torch.Tensor:
        """The state's value.

        Resident stores return the live tensor (a view: changes to it change the store);
        streaming stores return a fresh CPU tensor read through the pipeline, a chunk at a
        time, after waiting for the pending writes of the state.

        Args:
            key: a :class:`StateKey`, ``(param, state)`` or ``"param/state"``.

        Returns:
            A tensor of the state's shape and dtype.

        Raises:
            StateKeyError: no such state.
            StateStoreIOError: a read failed, a background write failed (its error surfaces
                here), or the state's last write failed (its stored value is stale).
            StateStoreClosedError: the store is closed.
        """
        self._check_open()
        k = as_key(key)
        spec = self.spec(k)
        out = torch.empty(spec.shape, dtype=spec.dtype)
        flat = out.view(-1)
        with self.stream([k], "r") as chunks:
            for s, t in chunks:
                flat[s.start:s.stop].copy_(t)
        return out

    def put(self, key, value: torch.Tensor) -> None:
        """Overwrite a state's value (the dtype is converted).

        Streaming stores return once the value is copied into their ring and write it
        behind: a later read of the state, :meth:`sync`, a checkpoint or :meth:`close` waits
        for the write and raises its error (the state is then refused until replaced).

        Args:
            key: a :class:`StateKey`, ``(param, state)`` or ``"param/state"``.
            value: a dense tensor of the state's shape, on any device.

        Raises:
            StateKeyError: no such state.
            StateStoreValueError: ``value`` is not a dense tensor of the state's shape.
            StateStoreIOError: an earlier background write failed (its error surfaces here).
            StateStoreClosedError: the store is closed.
        """
        k, spec = self._check_put(key, value)
        self._in_flight.repaired(k)        # a whole new value: no longer stale once written
        src = value.detach().reshape(-1)
        # Write-behind, as a step's: the value is copied into the ring before put returns;
        # a later read, sync(), a checkpoint or close() waits for the writes (and raises
        # their errors), so consecutive puts keep the disk busy. The copy uses streaming
        # stores: the ring's bytes go to the disk, not back to this processor.
        with self.stream([k], "w", wait=False) as chunks:
            for s, t in chunks:
                stream_copy_(t, src[s.start:s.stop])

    def _check_put(self, key, value) -> Tuple[StateKey, StateSpec]:
        """Validate :meth:`put`'s arguments; returns the key and its spec."""
        self._check_open()
        self.cancel_prefetch()
        k = as_key(key)
        spec = self.spec(k)
        check_value(k, spec, value)
        return k, spec

    def sync(self) -> None:
        """Wait for every background write, make it durable (e.g. fsync), and raise the first
        error. A no-op on a closed store.

        Raises:
            StateStoreIOError: a background write or the flush failed.
        """
        if self._closed:
            return
        self._in_flight.drain()
        self._flush()

    def _adopt_file(self, path: str, rows: Sequence[Tuple[StateKey, StateSpec, int, str]],
                    names: Sequence[str]) -> bool:
        """For linked loads (handed to the load as an operation): take the checkpoint shard
        ``path`` (``rows``: ``(key, spec, data offset, checksum)`` of its states; ``names``:
        its tensors but pads) as a file of the store (:attr:`links`) and register its states.
        True when they are here (the caller verifies their checksums), False where the store
        cannot (nothing changed)."""
        self._check_open()
        self.cancel_prefetch()
        with deferred_signals():        # the backend's file and the catalogue agree
            if any(k in self._specs for k, _, _, _ in rows) or \
                    not self.links.adopt(path, rows, names):
                return False
            for k, spec, _, _ in rows:
                self._specs[k] = spec
                self._aligned_bytes += self._ring_bytes(spec)
                self._in_flight.repaired(k)
        return True

    # ------------------------------------------------------------------ metadata
    # The store's side of the checkpoints' and optimizers' seam: self._record (_record.py).
    def attach_metadata(self, provider: Callable[[], Optional[dict]], *,
                        process_group: Any = "keep",
                        on_load: Optional[Callable[["StateStore"], None]] = None) -> None:
        """Attach the optimizer metadata saved with checkpoints (``provider()``), the group
        the optimizer shards the states over (``"keep"``: unchanged) and its ``on_load(store)``
        callback: :meth:`CheckpointRecord.attach <statestore._record.CheckpointRecord.attach>`.
        """
        self._record.attach(provider, process_group, on_load)

    @property
    def regions(self) -> Dict[str, Region]:
        """``{parameter name: Region}`` (a copy) of the parameters whose states here are a
        region of theirs (one rank's FSDP2 shard); checkpoints record them."""
        return self._record.regions

    def record_regions(self, regions: Dict[str, Region]) -> None:
        """Record the region each of ``regions``' parameters holds here (a whole region
        removes the entry; the optimizer over DTensor parameters, or a load, calls it).

        Raises:
            StateStoreValueError: a value that is not a Region fitting its global shape.
        """
        self._record.record_regions(regions)

    def metadata(self) -> Optional[dict]:
        """The attached optimizer's metadata now, else the metadata of the last loaded
        checkpoint, else None."""
        return self._record.metadata()

    @property
    def load_error(self) -> Optional[str]:
        """Why the last :meth:`load_checkpoint` failed after emptying the store (its
        optimizer refuses to go on, saves are refused until a load succeeds), else None."""
        return self._record.load_error

    @property
    def loaded_metadata(self) -> Optional[dict]:
        """Metadata of the checkpoint last loaded into this store (None if none)."""
        return self._record.loaded_metadata

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str, **kwargs) -> None:
        """Write every state and the attached optimizer metadata to ``path`` (a local path or
        an fsspec URL), atomically. When the store holds one rank's shard (an optimizer with a
        ``process_group`` is attached, or the store was loaded over a group), this is a
        collective: every rank calls it and one checkpoint results.

        Args:
            path: a local directory or any fsspec URL.
            **kwargs: ``shard_bytes``, ``progress``, ``metadata``, ``process_group``,
                ``link``: see :func:`statestore.checkpoint.save_checkpoint`.

        Raises:
            StateStoreValueError, StateStoreClosedError, CheckpointError, StateStoreIOError:
                as :func:`statestore.checkpoint.save_checkpoint`; the previous checkpoint at
                ``path`` stays intact.
            StateStoreError: a failed :meth:`load_checkpoint` left the store empty.
        """
        from .checkpoint import CheckpointWriter
        if self._record.load_error is not None:
            raise StateStoreError(f"this store's last load_checkpoint failed "
                                  f"({self._record.load_error}) and left it empty: a save "
                                  f"would write an empty checkpoint. Load the last checkpoint "
                                  f"into the store first")
        # The writer's call order (checkpoint/save.py): the store hands it its states once,
        # and it reaches the disk without calling the store again.
        with CheckpointWriter(path, **kwargs) as writer:    # 0) the arguments checked
            self._check_open()
            writer.set_up(self._saved_states())             # 1) states, metadata, the path
            writer.plan()                                   # 2) what this process writes
            writer.write_data()                             # 3) the shards
            writer.finish()                                 # 4) the manifest: committed

    def _saved_states(self):
        """What a save reads (``checkpoint/writer.py``'s ``SavedStates``), after waiting for
        this store's writes (a failure of that wait is handed over, for a collective save to
        fail on every rank)."""
        from .checkpoint import SavedStates
        error = None
        try:
            self.sync()
        except Exception as e:
            error = e
        rec = self._record
        return SavedStates(list(self._specs), dict(self._specs), rec.metadata,
                           rec.process_group, rec.regions, rec.deferred, self.links,
                           self._in_flight.check_damaged, self._access.stream, self._check_files,
                           self.unit_bytes, error)

    def load_checkpoint(self, path: str, **kwargs) -> None:
        """Replace this store's states with those of the checkpoint at ``path`` (written by
        any store, at any world size). Under an initialized ``torch.distributed`` group of
        several ranks, each rank loads only the shard it owns at that size. An optimizer
        already attached to the store takes the checkpoint's step counts and hyperparameters.
        A checkpoint refused before any tensor is read leaves store and optimizer as they
        were; a load failing later leaves the store empty (:attr:`load_error`).

        Args:
            path: the checkpoint directory: a local path or any fsspec URL.
            **kwargs: ``progress``, ``process_group``, ``link``: see
                :func:`statestore.checkpoint.load_checkpoint`.

        Raises:
            CheckpointNotFoundError, CheckpointCorruptError, CheckpointMismatchError,
            StateStoreValueError, StateStoreClosedError, StateStoreIOError: as
                :func:`statestore.checkpoint.load_checkpoint`.
        """
        from .checkpoint import CheckpointReader
        clears = self._record.clears
        try:            # the reader's call order (checkpoint/load.py), the writer's mirror
            reader = CheckpointReader(path, **kwargs)       # 0) the arguments checked
            reader.set_up(self, self._record, self._adopt_file)     # 1) its bookkeeping
            reader.read_metadata()          # 2) manifest, headers: a refusal changes nothing
            reader.read_data()              # 3) the states replaced
            reader.finish()                 # 4) recorded; the attached optimizer told
        except BaseException as e:
            if not self._closed and not self._specs:
                self._record.load_failed(self, e, clears)
            raise

    def load_deferred(self, params: Iterable[str],
                      regions: Optional[Dict[str, Region]] = None) -> None:
        """Load the states of parameters ``params`` (names) that a sharded
        :meth:`load_checkpoint` left on disk for another rank, or loaded as another region
        than ``regions`` names (the region each must hold: FSDP2 parameters' shards; absent:
        whole); a no-op for those already here. Optimizers call it when their partition
        differs from the load's (or they are not sharded).

        Raises:
            StateStoreClosedError: the store is closed.
            CheckpointError: the checkpoint was replaced since the load.
            CheckpointCorruptError: a file or tensor is damaged (the states this call
                created are removed again).
        """
        if self._record.deferred is None:
            return          # nothing to load (and pyarrow stays unimported)
        self._check_open()
        from .checkpoint import load_deferred_into
        load_deferred_into(self, self._record, params, regions)

    # ------------------------------------------------------------------ stats and lifetime
    def stats(self) -> Dict[str, Any]:
        """What the store holds and has moved.

        Returns:
            A dict with ``backend``, ``nbytes`` (bytes of states held), ``ntensors``,
            ``device`` and ``resident``; streaming stores add ``budget_bytes``,
            ``buffer_bytes`` (the ring now), ``bytes_read`` and ``bytes_written``; then the
            backend's own figures (pinned bytes, bytes on disk, ...).
        """
        out: Dict[str, Any] = {
            "backend": type(self).__name__,
            "nbytes": sum(s.nbytes for s in self._specs.values()),
            "ntensors": len(self._specs),
            "device": str(self.device),
            "resident": self.resident,
        }
        if not self.resident:
            out["budget_bytes"] = self.budget_bytes
            ring = self._in_flight.ring
            out["buffer_bytes"] = ring.capacity if ring is not None else 0
            out["bytes_read"] = self._in_flight.bytes_read
            out["bytes_written"] = self._in_flight.bytes_written
        out.update(self._backend_stats())
        return out

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        """Raise unless the store is open: what every call that uses the store (and every
        backend primitive's caller) checks first.

        Raises:
            StateStoreClosedError: the store was closed.
        """
        if self._closed:
            raise StateStoreClosedError(f"{type(self).__name__} is closed")

    def close(self) -> None:
        """Wait for pending writes, then release memory, descriptors and temporary files.
        Idempotent.

        Raises:
            StateStoreError: a background write failed (raised after everything is released).
        """
        if self._closed:
            return
        err = None
        try:
            self.cancel_prefetch()
            self.sync()
        except StateStoreError as e:
            err = e
        finally:
            self._closed = True
            try:
                self._close()
            finally:
                self._specs, self._aligned_bytes = {}, 0
                self._in_flight.close()
        if err is not None:
            raise err

    def __enter__(self):
        self._check_open()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close()
        except StateStoreError:
            if exc_type is None:
                raise

    def __repr__(self) -> str:
        st = "closed" if self._closed else f"{len(self._specs)} states"
        return f"{type(self).__name__}({st})"

