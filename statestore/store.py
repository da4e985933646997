"""``StateStore``: the abstract store every backend implements, and everything written once
on top of its few primitives (the pipeline, ``get``/``put``, stats, checkpoints).

A store holds named state tensors (keys are :class:`~statestore.StateKey`) plus the optimizer
metadata attached to it. Backends come in two kinds:

* **resident** (``resident = True``): states live in addressable memory (a torch device,
  pinned or pageable RAM, an mmap'd file). The backend implements :meth:`_allocate`,
  :meth:`_free` and :meth:`_view`; the pipeline hands out views of the live tensors.
* **non-resident** (``resident = False``): states live where the CPU cannot address them
  directly (files read and written with direct I/O). The backend implements
  :meth:`_allocate`, :meth:`_free`, :meth:`_submit_read` and :meth:`_submit_write` (both
  return ``concurrent.futures.Future``-like objects), and may override
  :meth:`_alloc_host_buffer` (aligned, page-locked) and :meth:`_flush` (fsync). The
  pipeline moves states through a ring of host buffers of ``budget_bytes``.

Order of calls a backend sees: ``__init__`` → (``_allocate`` | ``_free`` | ``_view`` |
``_submit_read`` | ``_submit_write``)* → ``_flush`` (from :meth:`sync`) → ``_close``.

Stores are not thread-safe: one thread drives a store (its own background I/O aside).
"""
from __future__ import annotations

import errno
import weakref
from abc import ABC
from collections import deque
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .checkpoint.parquet_guard import MAX_NDIM
from ._types import Slice, StateKey, StateSpec
from .errors import (StateKeyError, StateStoreClosedError, StateStoreError, StateStoreIOError,
                     StateStoreValueError)
from .kernels import stream_copy_
from .pipeline import Pipeline, RingArena, unit_lists

__all__ = ["StateStore", "DEFAULT_BUDGET_BYTES"]

#: Default RAM budget of non-resident (disk) stores: buffers for read-ahead, compute and
#: write-behind, and for checkpoint streaming, never exceed it.
DEFAULT_BUDGET_BYTES = 256 * 1024 * 1024

_SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                     torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
_MAX_NBYTES = 2 ** 63 - 1           # a state's bytes must fit an int64 (checkpoint manifests)


class LinkableFile:
    """A state file a checkpoint can take as a shard (:meth:`StateStore._linkable`).

    ``rows``: ``(key, absolute byte offset)`` of the states in it; ``hashes``: checksums of
    its states' bytes already known (the checkpoint adds the ones it computes); ``link(dst)``
    freezes the file (the store never writes it again: later writes of its states go to a new
    file) and hard-links it as ``dst``, raising ``OSError`` where it cannot; ``link(dst,
    mapped=True)``: ``dst`` will be mapped and removed, and the file must stay frozen even
    once nothing else links it (a ``state_dict()`` snapshot)."""

    __slots__ = ("rows", "hashes", "link")

    def __init__(self, rows: List[Tuple[StateKey, int]], hashes: Dict[StateKey, str],
                 link: Callable[[str], None]):
        self.rows, self.hashes, self.link = rows, hashes, link


#: Largest chunk of a ``get``/``put``/checkpoint load through a non-resident store's pipeline.
CHUNK_BYTES = 16 << 20


def _as_key(key) -> StateKey:
    if isinstance(key, StateKey):
        return key
    if isinstance(key, tuple) and len(key) == 2 and all(isinstance(k, str) for k in key):
        return StateKey(*key)
    if isinstance(key, str):
        try:
            return StateKey.parse(key)
        except ValueError as e:
            raise StateStoreValueError(str(e)) from None
    raise StateStoreValueError(f"a state key must be a StateKey, a (param, state) tuple of str "
                               f"or a 'param/state' string, got {key!r}")


def _data_problem(value: torch.Tensor) -> Optional[str]:
    """Why ``value`` cannot be copied into a state (None when it can)."""
    if value.layout != torch.strided:
        return f"is a {value.layout} tensor; a dense (strided) tensor is needed"
    if value.is_meta:
        return "is on the meta device, which holds no data"
    return None


class StateStore(ABC):
    """Abstract base of every state store. See the module docstring for the backend contract.

    Args:
        budget_bytes: RAM budget of the pipeline's host buffers (non-resident stores only;
            default :data:`DEFAULT_BUDGET_BYTES`). Resident stores ignore it.
    """

    #: True when states live in addressable memory and the pipeline hands out views.
    resident: bool = True
    #: Byte alignment of buffer offsets and file offsets for non-resident stores.
    alignment: int = 1
    #: Where callers cut a long state into pipeline slices: at multiples of this many bytes
    #: (a multiple of :attr:`alignment`), so transfers start where the store aligned the
    #: state's data (NVMeStore: 1 MiB; docs/nvme.md, "Alignment of the data").
    transfer_alignment: int = 1

    def __init__(self, *, budget_bytes: Optional[int] = None):
        if budget_bytes is None:
            budget_bytes = DEFAULT_BUDGET_BYTES
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise StateStoreValueError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self._specs: Dict[StateKey, StateSpec] = {}
        self._closed = False
        self._ring: Optional[RingArena] = None
        self._pending: deque = deque()          # [region, [(slice, future)]]
        self._pending_error: Optional[BaseException] = None
        self._metadata_provider: Optional[Callable[[], Optional[dict]]] = None
        self._on_load: Optional[Callable[[], Optional[Callable]]] = None
        self._loaded_metadata: Optional[dict] = None
        self._prefetched = None         # (mode, units, Pipeline) started by prefetch()
        self._process_group = None      # the group this store's states are sharded over
        self._deferred = None           # checkpoint states a sharded load left on disk
        self._bytes_read = 0
        self._bytes_written = 0
        #: states whose last write failed, with its error: their stored bytes are stale, so
        #: reading them raises until put(), delete() or load_checkpoint() replaces them.
        self._damaged: Dict[StateKey, BaseException] = {}

    # ------------------------------------------------------------------ backend primitives
    def _allocate(self, entries: Sequence[Tuple[StateKey, StateSpec]]) -> None:
        """Create storage for new states, zero-filled."""
        raise NotImplementedError

    def _free(self, keys: Sequence[StateKey]) -> None:
        """Release the storage of states (their specs are already gone)."""
        raise NotImplementedError

    def _view(self, key: StateKey) -> torch.Tensor:
        """Resident stores: the live tensor of ``key`` (its shape and dtype)."""
        raise NotImplementedError

    def _submit_read(self, s: Slice, out: torch.Tensor):
        """Non-resident stores: start reading slice ``s`` into ``out`` (1-D, ``s.numel``
        elements of the state's dtype, inside an aligned buffer whose rounded-up size is
        writable); returns a Future."""
        raise NotImplementedError

    def _submit_write(self, s: Slice, src: torch.Tensor, *, optimizer_pass: bool = False):
        """Non-resident stores: start writing ``src`` to slice ``s``; returns a Future.
        ``src`` stays untouched until the Future completes. ``optimizer_pass``: an optimizer
        pass (pipeline mode ``"rw"``) computes between writes, so the write does no extra
        work in the caller's time or on a helper thread that would take a core from its
        compute threads (NVMeStore: no checksum; a save reads the state back to hash it).
        """
        raise NotImplementedError

    def _alloc_host_buffer(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 host buffer for the pipeline's ring; aligned to :attr:`alignment`."""
        extra = self.alignment
        raw = torch.empty(nbytes + extra, dtype=torch.uint8)
        off = (-raw.data_ptr()) % extra
        return raw[off:off + nbytes]

    def _flush(self) -> None:
        """Make every completed write durable (e.g. fsync)."""

    def _check_files(self) -> None:
        """File-backed stores: raise :class:`StateStoreIOError` when a state file was truncated
        (every time) or removed (once) under the open store. Called before every pipeline and
        resident ``get``/``put``, so such damage is reported before any state is touched."""

    def _close(self) -> None:
        """Release memory, file descriptors and temporary files."""

    def _linkable(self, keys: Sequence[StateKey], root: str, shard_bytes: int) -> List["LinkableFile"]:
        """Files of the store that a checkpoint in the local directory ``root`` may hard-link
        as shards instead of copying their states (each holds only states of ``keys``, at
        most ``shard_bytes`` of them or a single state). Called after :meth:`sync`. Default:
        none."""
        return []

    def _adopt(self, path: str, rows: Sequence[Tuple[StateKey, StateSpec, int, str]],
               names: Sequence[str]) -> bool:
        """Take the checkpoint shard at the local ``path`` as one of the store's files (a
        hard link, never written: copy-on-write) instead of copying its states. ``rows``:
        ``(key, spec, data offset, checksum)`` of the states it holds, ``names``: every
        tensor in it but pads. True when the states are now in the store (the caller
        verifies their checksums); False where the backend cannot (default), and nothing
        changed."""
        return False

    def _adopt_file(self, path: str, rows: Sequence[Tuple[StateKey, StateSpec, int, str]],
                    names: Sequence[str]) -> bool:
        """:meth:`_adopt`, then the states are registered."""
        self._check_open()
        self.cancel_prefetch()
        if any(k in self._specs for k, _, _, _ in rows) or not self._adopt(path, rows, names):
            return False
        for k, spec, _, _ in rows:
            self._specs[k] = spec
            self._damaged.pop(k, None)
        return True

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
        return _as_key(key) in self._specs

    def __len__(self) -> int:
        return len(self._specs)

    def spec(self, key) -> StateSpec:
        """Shape and dtype of a state; :class:`StateKeyError` when unknown."""
        k = _as_key(key)
        try:
            return self._specs[k]
        except KeyError:
            raise StateKeyError(f"no state {k} in {type(self).__name__}") from None

    def create(self, key, shape: Sequence[int], dtype: torch.dtype = torch.float32,
               init: Optional[torch.Tensor] = None) -> None:
        """Create one state, zero-filled or copied from ``init``."""
        self.create_many([(key, shape, dtype, init)])

    def create_many(self, entries: Iterable[Tuple[Any, Sequence[int], torch.dtype,
                                                    Optional[torch.Tensor]]]) -> None:
        """Create several states at once (backends may lay them out together).

        Each entry is ``(key, shape, dtype, init)``; ``init`` (or None for zeros) must have
        the given shape.
        """
        self._check_open()
        self.cancel_prefetch()
        new: List[Tuple[StateKey, StateSpec]] = []
        inits: List[Tuple[StateKey, torch.Tensor]] = []
        seen = set()
        if isinstance(entries, (str, bytes, torch.Tensor)) or not isinstance(entries, Iterable):
            raise StateStoreValueError(f"create_many: entries must be an iterable of (key, shape, "
                                       f"dtype, init), got {type(entries).__name__}")
        for entry in entries:
            try:
                key, shape, dtype, init = entry
            except (TypeError, ValueError):
                raise StateStoreValueError(
                    f"create_many entries are (key, shape, dtype, init), got {entry!r}") from None
            k = _as_key(key)
            if k in self._specs or k in seen:
                raise StateKeyError(f"state {k} already exists")
            if not isinstance(dtype, torch.dtype) or dtype not in _SUPPORTED_DTYPES:
                raise StateStoreValueError(f"state {k}: unsupported dtype {dtype!r}")
            try:
                shape_t = tuple(int(d) for d in shape)
            except (TypeError, ValueError):
                raise StateStoreValueError(f"state {k}: shape must be a sequence of ints, "
                                           f"got {shape!r}") from None
            if any(d < 0 for d in shape_t):
                raise StateStoreValueError(f"state {k}: negative dimension in shape {shape_t}")
            if len(shape_t) > MAX_NDIM:
                raise StateStoreValueError(f"state {k}: shape has {len(shape_t)} dimensions, at "
                                           f"most {MAX_NDIM} are supported")
            spec = StateSpec(shape_t, dtype)
            if spec.nbytes > _MAX_NBYTES:
                raise StateStoreValueError(f"state {k}: shape {shape_t} of {dtype} is too large "
                                           f"({spec.nbytes} bytes)")
            if init is not None:
                if not isinstance(init, torch.Tensor):
                    raise StateStoreValueError(f"state {k}: init must be a tensor or None")
                problem = _data_problem(init)
                if problem:
                    raise StateStoreValueError(f"state {k}: init {problem}")
                if tuple(init.shape) != shape_t:
                    raise StateStoreValueError(f"state {k}: init has shape {tuple(init.shape)}, "
                                               f"expected {shape_t}")
                inits.append((k, init))
            seen.add(k)
            new.append((k, spec))
        if not new:
            return
        self._allocate(new)
        for k, spec in new:
            self._specs[k] = spec
        for k, init in inits:
            self.put(k, init)

    def delete(self, keys) -> None:
        """Remove states and release their storage."""
        self._check_open()
        self.cancel_prefetch()
        if isinstance(keys, (str, StateKey)):
            keys = [keys]
        if not isinstance(keys, Iterable):
            raise StateStoreValueError(f"delete: keys must be a state key or an iterable of "
                                       f"them, got {keys!r}")
        ks = [_as_key(k) for k in keys]
        for k in ks:
            self.spec(k)
        self.sync()
        for k in ks:
            del self._specs[k]
            self._damaged.pop(k, None)
        self._free(ks)

    def clear(self) -> None:
        """Remove every state and the loaded checkpoint metadata."""
        self._check_open()
        if self._specs:
            self.delete(list(self._specs))
        self._loaded_metadata = None
        self._deferred = None

    # ------------------------------------------------------------------ whole-tensor access
    def get(self, key) -> torch.Tensor:
        """The state's value. Resident stores return the live tensor (a view: changes to it
        change the store); others return a fresh CPU tensor read through the pipeline."""
        self._check_open()
        k = _as_key(key)
        spec = self.spec(k)
        if self.resident:
            self._raise_pending_error()
            self._check_files()
            return self._view(k)
        out = torch.empty(spec.shape, dtype=spec.dtype)
        flat = out.view(-1)
        chunks = self._chunks(spec)
        with self.pipeline([[Slice(k, a, b)] for a, b in chunks], mode="r") as pipe:
            for (a, b), (t,) in zip(chunks, pipe):
                flat[a:b].copy_(t)
        return out

    def put(self, key, value: torch.Tensor) -> None:
        """Overwrite a state's value (shape must match; dtype is converted). Non-resident
        stores return once the value is copied into their ring and write it behind: a later
        read of the state, :meth:`sync`, a checkpoint or :meth:`close` waits for the write
        and raises its error (the state is then refused until replaced)."""
        k, spec = self._check_put(key, value)
        if self.resident:
            self._raise_pending_error()
            self._check_files()
            self._view(k).copy_(value)
            return
        self._damaged.pop(k, None)         # a whole new value: no longer stale once written
        src = value.detach().reshape(-1)
        chunks = self._chunks(spec)
        # Write-behind, as a step's: the value is copied into the ring before put returns;
        # a later read, sync(), a checkpoint or close() waits for the writes (and raises
        # their errors), so consecutive puts keep the disk busy. The copy uses streaming
        # stores: the ring's bytes go to the disk, not back to this processor.
        with self.pipeline([[Slice(k, a, b)] for a, b in chunks], mode="w", wait=False) as pipe:
            for (a, b), (t,) in zip(chunks, pipe):
                stream_copy_(t, src[a:b])

    def _check_put(self, key, value) -> Tuple[StateKey, StateSpec]:
        """Validate :meth:`put`'s arguments; returns the key and its spec."""
        self._check_open()
        self.cancel_prefetch()
        k = _as_key(key)
        spec = self.spec(k)
        if not isinstance(value, torch.Tensor):
            raise StateStoreValueError(f"state {k}: value must be a tensor, got {type(value).__name__}")
        problem = _data_problem(value)
        if problem:
            raise StateStoreValueError(f"state {k}: value {problem}")
        if tuple(value.shape) != spec.shape:
            raise StateStoreValueError(f"state {k}: value has shape {tuple(value.shape)}, "
                                       f"expected {spec.shape}")
        return k, spec

    def _chunks(self, spec: StateSpec, limit: Optional[int] = None) -> List[Tuple[int, int]]:
        """Element ranges of at most ``limit`` bytes, cut at :meth:`cut_alignment`, that
        ``get``/``put``, checkpoint loads (default ``limit``) and saves move ``spec``'s state
        in. The default is half the budget, and for non-resident stores at most
        ``CHUNK_BYTES``, so that copying one chunk overlaps the disk transfer of the previous
        (256 MiB of puts into an NVMeStore: 3.7 GB/s with whole 64 MiB states as chunks,
        5.0 GB/s with 16 MiB chunks, same run)."""
        if limit is None:
            limit = (self.budget_bytes // 2 if self.resident
                     else min(self.budget_bytes // 2, CHUNK_BYTES))
        align = max(1, self.cut_alignment(limit) // max(spec.itemsize, 1))
        step = max(align, (limit // max(spec.itemsize, 1)) // align * align)
        if spec.numel == 0:
            return [(0, 0)]
        return [(a, min(a + step, spec.numel)) for a in range(0, spec.numel, step)]

    # ------------------------------------------------------------------ pipeline
    def pipeline(self, units: Sequence[Sequence[Slice]], mode: str = "rw",
                 wait: bool = True) -> Pipeline:
        """The read / compute / write pipeline over ``units`` (see :mod:`statestore.pipeline`).

        ``mode``: ``"rw"`` read, hand out, write back; ``"r"`` read only; ``"w"`` hand out
        uninitialized buffers (non-resident stores) or the live views (resident stores) and
        write back. ``wait=False`` leaves the last writes pending in the background (a later
        read of the same state, :meth:`sync`, checkpoints and :meth:`close` wait for them).
        """
        self._check_open()
        self._check_files()
        if self._prefetched is not None:
            pmode, punits, pipe = self._prefetched
            if pmode == mode and punits == unit_lists(units):
                self._prefetched = None
                pipe._wait = wait           # the reads started early: hand that pipeline out
                return pipe
            self.cancel_prefetch()
        return Pipeline(self, units, mode=mode, wait=wait)

    def prefetch(self, units: Sequence[Sequence[Slice]], mode: str = "rw") -> None:
        """Start reading ``units`` now, for a :meth:`pipeline` that will ask for exactly these
        units (and mode) later, typically an optimizer's next step: the reads then overlap
        whatever runs in between (forward and backward). Reads start as far as the RAM budget
        allows without waiting; :meth:`pump` starts more as write-behind frees buffers. Any
        other use of the store (another pipeline, put, create, delete, load, close) cancels
        the prefetch first, so it never hands out stale values. A no-op on resident stores."""
        self._check_open()
        self.cancel_prefetch()
        if self.resident:
            return
        units = unit_lists(units)
        self._prefetched = (mode, units, Pipeline(self, units, mode=mode, wait=False,
                                                  prefetch=True))

    def pump(self) -> None:
        """Never blocks: retire finished background writes and start more prefetch reads in
        the RAM they free. Optimizers call it from gradient hooks during backward."""
        if self._prefetched is None or self._closed:
            return
        self._poll_pending()
        self._prefetched[2]._fill(block=False)

    def cancel_prefetch(self) -> None:
        """Drop a :meth:`prefetch` not yet used (reads in flight are drained)."""
        p, self._prefetched = self._prefetched, None
        if p is not None:
            p[2]._abort()

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

    def _check_slice(self, s: Slice) -> None:
        if not isinstance(s, Slice):
            raise StateStoreValueError(f"pipeline units hold Slice objects, got {s!r}")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (s.start, s.stop)):
            raise StateStoreValueError(f"slice of {s.key}: start and stop must be ints, got "
                                       f"{s.start!r}, {s.stop!r}")
        spec = self.spec(s.key)
        if not (0 <= s.start <= s.stop <= spec.numel):
            raise StateStoreValueError(f"slice [{s.start}, {s.stop}) out of range for state "
                                       f"{s.key} of {spec.numel} elements")
        if not self.resident and (s.start * spec.itemsize) % self.alignment:
            raise StateStoreValueError(f"slice of {s.key} starts at element {s.start}, not a "
                                       f"multiple of {self.alignment} bytes")

    def _arena(self, need: int = 0) -> RingArena:
        """The pipeline's ring: ``budget_bytes``, or less while the states are smaller. It
        grows, up to the budget, when more states exist or a pipeline needs a unit of
        ``need`` bytes that it cannot hold: pending background writes (which hold ring
        buffers) are waited for first, so that a ring sized when few states existed (a
        ``load_state_dict`` creating states one parameter at a time) never refuses a unit
        that fits the budget."""
        states = sum(-(-sp.nbytes // self.alignment) * self.alignment for sp in self._specs.values())
        want = min(self.budget_bytes, max(states + (1 << 20) + 4 * self.alignment, need))
        ring = self._ring
        if ring is not None and ring.capacity < want and ring.used:
            self._poll_pending()
            if ring.capacity < max(need, 1) <= self.budget_bytes:
                # This pipeline cannot run in the ring as it is: wait for the writes that
                # hold its buffers (their errors surface at the next call, as usual).
                while self._wait_oldest_pending():
                    pass
        if ring is None or (ring.capacity < want and not self._pending and ring.used == 0):
            self._ring = None           # release the old buffer before allocating the new
            self._ring = RingArena(self._alloc_host_buffer(want), self.alignment,
                                   budget=self.budget_bytes)
        return self._ring

    # ------------------------------------------------------------------ background writes
    def _result(self, fut, key: StateKey, op: str):
        try:
            n = fut.result()
        except StateStoreError:
            raise
        except OSError as e:
            raise StateStoreIOError(e.errno, f"{op} of state {key} failed: {e}") from e
        except Exception as e:
            raise StateStoreIOError(f"{op} of state {key} failed: {e}") from e
        if isinstance(n, int):
            if op == "read":
                self._bytes_read += n
            else:
                self._bytes_written += n
        return n

    def _add_pending(self, region, futs) -> None:
        self._pending.append([region, futs])
        self._poll_pending()

    def _complete(self, entry) -> None:
        region, futs = entry
        try:
            for s, fut in futs:
                try:
                    self._result(fut, s.key, "write")
                except StateStoreError as e:
                    self._damaged.setdefault(s.key, e)
                    if self._pending_error is None:
                        self._pending_error = e
        finally:
            self._ring.release(region)

    def _poll_pending(self) -> None:
        while self._pending and all(f.done() for _, f in self._pending[0][1]):
            self._complete(self._pending.popleft())

    def _wait_oldest_pending(self) -> bool:
        if not self._pending:
            return False
        self._complete(self._pending.popleft())
        return True

    def _overlaps(self, s: Slice, key: StateKey, start: int, stop: Optional[int]) -> bool:
        """Whether pending-write slice ``s`` touches a disk block of ``key``'s elements
        ``[start, stop)`` (``stop=None``: the whole state). Blocks, not elements: a write that
        ends inside a block merges that block, so two slices sharing one are ordered."""
        if s.key != key:
            return False
        if stop is None:
            return True
        size, align = self.spec(key).itemsize, self.alignment
        return s.start * size // align < -(-stop * size // align) \
            and start * size // align < -(-s.stop * size // align)

    def _key_pending(self, key: StateKey, start: int = 0, stop: Optional[int] = None) -> bool:
        """True when a background write of ``key`` (of a block holding one of its elements
        ``[start, stop)``, when given) is still in flight."""
        self._poll_pending()
        return any(self._overlaps(s, key, start, stop) for _, futs in self._pending for s, _ in futs)

    def _wait_pending_key(self, key: StateKey, start: int = 0, stop: Optional[int] = None) -> None:
        """Wait for the background writes of ``key`` (only those of blocks holding its elements
        ``[start, stop)``, when given): later slices of a large state are read while earlier
        ones are still being written."""
        last = -1
        for i, (_, futs) in enumerate(self._pending):
            if any(self._overlaps(s, key, start, stop) for s, _ in futs):
                last = i
        for _ in range(last + 1):
            self._wait_oldest_pending()
        self._raise_pending_error()

    def _mark_damaged(self, keys, err: BaseException) -> None:
        """Record that the last write of ``keys`` failed with ``err`` (see :meth:`_check_damaged`)."""
        for k in keys:
            self._damaged.setdefault(k, err)

    def _check_damaged(self, key: StateKey) -> None:
        """Raise when ``key``'s last write failed: its stored value is stale, and handing it
        out would let training or a checkpoint go on silently with lost updates."""
        err = self._damaged.get(key)
        if err is not None:
            raise StateStoreIOError(
                getattr(err, "errno", None) or errno.EIO,
                f"state {key} lost an update: its last write failed ({err}); its stored value "
                "is stale until put(), delete() or load_checkpoint() replaces it",
                getattr(err, "filename", None))

    def _raise_pending_error(self) -> None:
        self._poll_pending()
        err, self._pending_error = self._pending_error, None
        if err is not None:
            raise err

    def sync(self) -> None:
        """Wait for every background write, make it durable, and raise the first error."""
        if self._closed:
            return
        while self._wait_oldest_pending():
            pass
        self._raise_pending_error()
        self._flush()

    # ------------------------------------------------------------------ metadata
    def attach_metadata(self, provider: Callable[[], Optional[dict]], *,
                        process_group: Any = "keep",
                        on_load: Optional[Callable[["StateStore"], None]] = None) -> None:
        """Attach the optimizer metadata saved with checkpoints: ``provider()`` returns a
        JSON-serializable dict (bound methods are held weakly). ``process_group``: the
        ``torch.distributed`` group the optimizer shards this store's states over (None:
        not sharded); :meth:`save_checkpoint` is then a collective over it. ``on_load``:
        called as ``on_load(store)`` after :meth:`load_checkpoint` has replaced the states
        (held weakly when a bound method), so that an optimizer that already exists takes the
        checkpoint's step counts and hyperparameters (torch's order: build the optimizer,
        then load); it attaches its metadata again when it accepts the checkpoint."""
        if not callable(provider):
            raise StateStoreValueError(f"attach_metadata: provider must be callable, got "
                                       f"{type(provider).__name__}")
        if on_load is not None and not callable(on_load):
            raise StateStoreValueError(f"attach_metadata: on_load must be callable or None, "
                                       f"got {type(on_load).__name__}")
        if hasattr(provider, "__self__") and hasattr(provider, "__func__"):
            ref = weakref.WeakMethod(provider)
            self._metadata_provider = lambda: (ref() or (lambda: None))()
        else:
            self._metadata_provider = provider
        if on_load is None:
            self._on_load = None
        elif hasattr(on_load, "__self__") and hasattr(on_load, "__func__"):
            self._on_load = weakref.WeakMethod(on_load)
        else:
            self._on_load = (lambda f: lambda: f)(on_load)
        if not (isinstance(process_group, str) and process_group == "keep"):
            self._process_group = process_group

    # ------------------------------------------------------------------ checkpoint state
    # What statestore.checkpoint reads and records on a store: its only way to the attached
    # optimizer's metadata, the group the states are sharded over and a sharded load's
    # states left on disk.
    @property
    def process_group(self) -> Any:
        """The ``torch.distributed`` group this store's states are sharded over (the
        attached optimizer's ``process_group``, or the group a sharded
        :meth:`load_checkpoint` used), else None. ``save_checkpoint`` is a collective over
        it."""
        return self._process_group

    @property
    def deferred(self) -> Any:
        """The :class:`statestore.checkpoint.Deferred` states a sharded
        :meth:`load_checkpoint` left on disk (other ranks' shards), else None."""
        return self._deferred

    def detach_metadata(self) -> None:
        """Forget the attached optimizer's metadata provider (its ``on_load`` stays):
        :meth:`load_checkpoint` replaces the states that metadata described."""
        self._metadata_provider = None

    def record_load(self, metadata: Optional[dict], deferred: Any = None,
                    process_group: Any = None) -> None:
        """Record a completed :meth:`load_checkpoint`, then tell the attached optimizer.

        Args:
            metadata: the checkpoint's optimizer metadata (:attr:`loaded_metadata`).
            deferred: the states left on disk for other ranks (:attr:`deferred`), or None.
            process_group: the group the load sharded over (None when nothing was
                deferred).

        Raises:
            CheckpointMismatchError: the attached optimizer does not fit the checkpoint.
        """
        self._loaded_metadata = metadata
        self._deferred = deferred
        self._process_group = process_group
        self._loaded()

    def record_deferred_loaded(self) -> None:
        """Every state a sharded load deferred is now here: the store holds the whole
        checkpoint and is sharded over no group."""
        self._deferred = None
        self._process_group = None

    def _loaded(self) -> None:
        """:meth:`load_checkpoint` replaced the states: tell the attached optimizer, if it is
        still alive (its ``on_load``), which may raise when the checkpoint does not fit it."""
        cb = self._on_load() if self._on_load is not None else None
        if cb is None:
            self._on_load = None
            return
        cb(self)

    def metadata(self) -> Optional[dict]:
        """The attached optimizer's metadata now, else the metadata of the last loaded
        checkpoint, else None."""
        if self._metadata_provider is not None:
            meta = self._metadata_provider()
            if meta is not None:
                return meta
        return self._loaded_metadata

    @property
    def loaded_metadata(self) -> Optional[dict]:
        """Metadata of the checkpoint last loaded into this store (None if none)."""
        return self._loaded_metadata

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
        """
        from .checkpoint import save_checkpoint
        save_checkpoint(self, path, **kwargs)

    def load_checkpoint(self, path: str, **kwargs) -> None:
        """Replace this store's states with those of the checkpoint at ``path`` (written by
        any store, at any world size). Under an initialized ``torch.distributed`` group of
        several ranks, each rank loads only the shard it owns at that size. An optimizer
        already attached to the store takes the checkpoint's step counts and hyperparameters
        (or forgets its step counts when the load fails and leaves the store empty).

        Args:
            path: the checkpoint directory: a local path or any fsspec URL.
            **kwargs: ``progress``, ``process_group``, ``link``: see
                :func:`statestore.checkpoint.load_checkpoint`.

        Raises:
            CheckpointNotFoundError, CheckpointCorruptError, CheckpointMismatchError,
            StateStoreValueError, StateStoreClosedError, StateStoreIOError: as
                :func:`statestore.checkpoint.load_checkpoint`; the store is then empty.
        """
        from .checkpoint import load_checkpoint
        try:
            load_checkpoint(self, path, **kwargs)
        except BaseException:
            # A failed load leaves the store empty: the attached optimizer forgets the step
            # counts of the states it lost, so that stepping on starts them afresh
            # consistently instead of with stale bias corrections.
            if not self._closed and not self._specs and self._on_load is not None:
                try:
                    self._loaded()
                except Exception:
                    pass
            raise

    def load_deferred(self, params: Iterable[str]) -> None:
        """Load the states of parameters ``params`` (names) that a sharded
        :meth:`load_checkpoint` left on disk because another rank owned them; a no-op for
        those already here. Optimizers call it when their partition differs from the
        load's (or they are not sharded).

        Args:
            params: parameter names.

        Raises:
            StateStoreClosedError: the store is closed.
            CheckpointError: the checkpoint was replaced since the load.
            CheckpointCorruptError: a file or tensor is damaged (the states this call
                created are removed again).
        """
        self._check_open()
        from .checkpoint import load_deferred
        load_deferred(self, params)

    # ------------------------------------------------------------------ stats and lifetime
    def stats(self) -> Dict[str, Any]:
        """``nbytes`` and ``ntensors`` of the states held, plus backend figures."""
        out: Dict[str, Any] = {
            "backend": type(self).__name__,
            "nbytes": sum(s.nbytes for s in self._specs.values()),
            "ntensors": len(self._specs),
            "device": str(self.device),
            "resident": self.resident,
        }
        if not self.resident:
            out["budget_bytes"] = self.budget_bytes
            out["buffer_bytes"] = self._ring.capacity if self._ring is not None else 0
            out["bytes_read"] = self._bytes_read
            out["bytes_written"] = self._bytes_written
        out.update(self._backend_stats())
        return out

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise StateStoreClosedError(f"{type(self).__name__} is closed")

    def close(self) -> None:
        """Wait for pending writes, then release memory, descriptors and temporary files.
        Idempotent. A background write error is raised after everything is released."""
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
                self._specs = {}
                self._ring = None
        if err is not None:
            raise err

    def __enter__(self):
        self._check_open()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except StateStoreError:
                pass

    def __repr__(self) -> str:
        st = "closed" if self._closed else f"{len(self._specs)} states"
        return f"{type(self).__name__}({st})"
