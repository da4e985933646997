"""``TieredStore``: states placed across several stores (GPU, pinned CPU, RAM, disk) by
fraction of state bytes.

ColossalAI's ``nvme_offload_fraction=f`` is its two-tier case,
``TieredStore.from_fraction(f, dir)``: a fraction ``f`` of the state bytes in an
:class:`~statestore.NVMeStore` under ``dir``, the rest in RAM.

Placement is per parameter (every state of one parameter lives in one tier, so a parameter's
``exp_avg``/``exp_avg_sq``/``master`` are always read together) and greedy: each parameter, in
creation order, goes to the tier furthest below its target share of the bytes placed so far.
The achieved fractions are reported by ``stats()["tiers"]``; with few very large parameters
they are as close to the targets as per-parameter granularity allows. Placement depends only
on the order and sizes of the states created, so a resumed run places them the same way.

The pipeline runs one child pipeline per tier in lockstep: resident tiers hand out views of
their live tensors, disk tiers read ahead and write behind within their own RAM budget. Tensors
handed out are on :attr:`device`; a tier on another device (e.g. a disk tier under a GPU
store) is staged through a copy of the current unit on :attr:`device`, copied back when the
caller moves on.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .._access import PipelineAccess
from .._links import FileLinks
from .._types import LinkableFile, Slice, StateKey, StateSpec, as_key
from ..errors import StateStoreClosedError, StateStoreError, StateStoreValueError
from ..pipeline import StatePipeline, check_mode, check_slice, unit_lists
from ..store import StateStore

__all__ = ["TieredStore"]


class TierLinks(FileLinks):
    """A TieredStore's links: the files of its tiers (each asked for its own states); a
    checkpoint's shard is never adopted whole (its states may belong to several tiers)."""

    def __init__(self, tiers: Sequence[StateStore]):
        self.tiers = tiers

    def linkable(self, keys: Sequence[StateKey], root: str,
                 shard_bytes: int) -> List[LinkableFile]:
        out: List[LinkableFile] = []
        for t in self.tiers:
            mine = [k for k in keys if k in t]
            if mine:
                out += t.links.linkable(mine, root, shard_bytes)
        return out


class TieredStore(StateStore):
    """States spread over ``tiers``, a sequence of ``(store, fraction)`` pairs.

    A composite: neither resident nor streaming itself, it places each state in one child
    store and delegates to it (``get``/``put``, and a pipeline over its children's pipelines
    in lockstep). :attr:`resident` is True when every tier is resident on :attr:`device`.

    Args:
        tiers: ``(store, fraction)`` pairs; fractions are non-negative and sum to 1 (within
            1e-6). The tiered store owns the child stores: :meth:`close` closes them.
        device: the device of the tensors its pipeline hands out (default: the first tier's).

    Example (a third of the state bytes on each tier)::

        TieredStore([(ss.DeviceStore("cuda"), 1/3), (ss.PinnedCPUStore(), 1/3),
                     (ss.NVMeStore("/nvme/run1"), 1/3)])
    """

    def __init__(self, tiers: Sequence[Tuple[StateStore, float]], *,
                 device: Optional[torch.device] = None):
        super().__init__()
        try:
            tiers = [(s, f) for s, f in tiers]
        except (TypeError, ValueError):
            raise StateStoreValueError("tiers must be a sequence of (store, fraction) pairs") from None
        if not tiers:
            raise StateStoreValueError("tiers must name at least one (store, fraction) pair")
        for i, (s, f) in enumerate(tiers):
            if not isinstance(s, StateStore):
                raise StateStoreValueError(f"tiers[{i}]: expected a StateStore, got {type(s).__name__}")
            if isinstance(s, TieredStore):
                raise StateStoreValueError(f"tiers[{i}]: a TieredStore cannot be a tier")
            if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
                raise StateStoreValueError(f"tiers[{i}]: fraction must be in [0, 1], got {f!r}")
            if s.closed:
                raise StateStoreClosedError(f"tiers[{i}]: the {type(s).__name__} is closed")
            if len(s):
                raise StateStoreValueError(f"tiers[{i}]: the store must be empty")
        if len({id(s) for s, _ in tiers}) != len(tiers):
            raise StateStoreValueError("tiers: the same store appears twice")
        total = sum(float(f) for _, f in tiers)
        if abs(total - 1.0) > 1e-6:
            raise StateStoreValueError(f"tiers: fractions must sum to 1, got {total}")
        self.tiers: List[StateStore] = [s for s, _ in tiers]
        self.links = TierLinks(self.tiers)
        self.fractions: List[float] = [float(f) for _, f in tiers]
        if device is None:
            self._device = self.tiers[0].device
        else:
            try:
                self._device = torch.device(device)
            except (RuntimeError, TypeError) as e:
                raise StateStoreValueError(f"TieredStore: invalid device {device!r}: "
                                           f"{str(e).splitlines()[0]}") from None
        self._resident = all(s.resident and s.device == self._device for s in self.tiers)
        self.alignment = max(s.alignment for s in self.tiers)
        self.transfer_alignment = max(s.transfer_alignment for s in self.tiers)
        self._tier_of_param: Dict[str, int] = {}
        self._tier_bytes = [0] * len(self.tiers)
        # stream() cuts states in chunks every tier's pipeline takes: by default those of the
        # disk tier of the smallest budget
        # (its pipeline: one per tier holding states of the units, in lockstep)
        self._access = PipelineAccess(
            self, sized_by=self._smallest_disk_tier,
            make_pipeline=lambda units, mode, wait: _TieredPipeline(self, units, mode, wait))

    @classmethod
    def from_fraction(cls, fraction: float, directory: Optional[str] = None, *,
                      ram_store: Optional[StateStore] = None, **nvme_kwargs) -> "TieredStore":
        """ColossalAI's ``nvme_offload_fraction``/``nvme_offload_dir``: ``fraction`` of the
        state bytes in an :class:`~statestore.NVMeStore` under ``directory`` (a temporary
        directory when None; ``nvme_kwargs`` are NVMeStore's, and ``engine="tensornvme"``
        makes the tier a :class:`~statestore.TensorNVMeStore`:
        :func:`~statestore.backends.nvme_store`), the rest in ``ram_store`` (default
        ``DeviceStore("cpu")``).

        The disk tier's ``budget_bytes`` defaults to 64 MiB here (``NVMeStore`` alone: 256 MiB):
        it reaches the disk's bandwidth on the benchmark machine while keeping the RAM saved by
        full offload above 90% of the states' bytes for a GPT-2-small-sized model; pass
        ``budget_bytes=`` to change it."""
        from .device import DeviceStore
        from .registry import nvme_store

        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) \
                or not 0.0 <= fraction <= 1.0:
            raise StateStoreValueError(f"nvme_offload_fraction must be in [0, 1], got {fraction!r}")
        if ram_store is not None and not isinstance(ram_store, StateStore):
            raise StateStoreValueError(f"ram_store must be a StateStore or None, got "
                                       f"{type(ram_store).__name__}")
        tiers: List[Tuple[StateStore, float]] = []
        if fraction < 1.0:
            tiers.append((ram_store if ram_store is not None else DeviceStore("cpu"), 1.0 - fraction))
        if fraction > 0.0:
            nvme_kwargs.setdefault("budget_bytes", 64 << 20)
            tiers.append((nvme_store(directory, **nvme_kwargs), float(fraction)))
        return cls(tiers, device=torch.device("cpu"))

    @property
    def resident(self) -> bool:
        """True when every tier is resident on :attr:`device`: the pipeline then hands out
        live views and ``get`` the live tensor."""
        return self._resident

    # ------------------------------------------------------------------ placement
    def _choose_tier(self, nbytes: int, placed: List[int]) -> int:
        total = sum(placed) + nbytes
        best, best_deficit = 0, None
        for i, f in enumerate(self.fractions):
            if f <= 0.0:
                continue
            deficit = f * total - placed[i]
            if best_deficit is None or deficit > best_deficit + 1e-9:
                best, best_deficit = i, deficit
        return best

    def _allocate(self, entries: Sequence[Tuple[StateKey, StateSpec]]) -> None:
        by_param: Dict[str, List[Tuple[StateKey, StateSpec]]] = {}
        for k, spec in entries:
            by_param.setdefault(k.param, []).append((k, spec))
        per_tier: Dict[int, List[Tuple[StateKey, StateSpec]]] = {}
        placed = list(self._tier_bytes)
        for param, items in by_param.items():
            nbytes = sum(spec.nbytes for _, spec in items)
            t = self._tier_of_param.get(param)
            if t is None:
                t = self._choose_tier(nbytes, placed)
            placed[t] += nbytes
            per_tier.setdefault(t, []).extend(items)
        done: List[int] = []
        try:
            for t, items in per_tier.items():
                self.tiers[t].create_many([(k, spec.shape, spec.dtype, None) for k, spec in items])
                done.append(t)
        except BaseException:
            for t in done:  # all or nothing
                self.tiers[t].delete([k for k, _ in per_tier[t]])
            raise
        for t, items in per_tier.items():
            for k, spec in items:
                self._tier_of_param.setdefault(k.param, t)
                self._tier_bytes[t] += spec.nbytes

    def _free(self, keys: Sequence[StateKey]) -> None:
        per_tier: Dict[int, List[StateKey]] = {}
        for k in keys:
            per_tier.setdefault(self._tier_index(k), []).append(k)
        for t, ks in per_tier.items():
            nbytes = sum(self.tiers[t].spec(k).nbytes for k in ks)
            self.tiers[t].delete(ks)
            self._tier_bytes[t] -= nbytes
        live = {k.param for k in self._specs}
        for p in [p for p in self._tier_of_param if p not in live]:
            del self._tier_of_param[p]

    def _tier_index(self, key: StateKey) -> int:
        for i, s in enumerate(self.tiers):
            if key in s:
                return i
        raise StateStoreError(f"state {key} is in no tier (internal error)")

    def tier_of(self, key) -> StateStore:
        """The child store holding ``key``."""
        k = as_key(key)
        self.spec(k)
        return self.tiers[self._tier_index(k)]

    # ------------------------------------------------------------------ access (delegated)
    def get(self, key) -> torch.Tensor:
        """The state's value, from its tier (a live view for resident tiers on
        :attr:`device`, else a copy)."""
        self._check_open()
        k = as_key(key)
        self.spec(k)
        t = self.tiers[self._tier_index(k)].get(k)
        if t.device != self._device:
            return t.to(self._device)
        # A store with a disk tier hands out copies everywhere, as non-resident stores do.
        return t if self.resident else t.clone()

    def put(self, key, value: torch.Tensor) -> None:
        k, _ = self._check_put(key, value)
        self.tiers[self._tier_index(k)].put(k, value)

    def _view(self, key: StateKey) -> torch.Tensor:
        return self.tiers[self._tier_index(key)]._view(key)

    def prefetch(self, units: Sequence[Sequence[Slice]], mode: str = "rw") -> None:
        """Prefetch in each non-resident tier the part of ``units`` it holds (see
        :meth:`StateStore.prefetch`); the next :meth:`pipeline` over the same units uses it."""
        self._check_open()
        _, per_tier = _split_units(self, units)
        for t, tier_units in enumerate(per_tier):
            if any(tier_units):
                self.tiers[t].prefetch(tier_units, mode)

    def pump(self) -> None:
        for s in self.tiers:
            s.pump()

    def cancel_prefetch(self) -> None:
        for s in getattr(self, "tiers", ()):
            s.cancel_prefetch()

    def _smallest_disk_tier(self) -> StateStore:
        """The disk tier of the smallest budget (this store when all tiers are resident)."""
        return min((s for s in self.tiers if not s.resident), key=lambda s: s.budget_bytes,
                   default=self)

    @property
    def unit_bytes(self) -> Optional[int]:
        sizes = [s.unit_bytes for s in self.tiers if s.unit_bytes is not None]
        return min(sizes) if sizes else None

    @property
    def device(self) -> torch.device:
        return self._device

    # ------------------------------------------------------------------ lifetime
    def _flush(self) -> None:
        err = None
        for s in self.tiers:
            try:
                s.sync()
            except StateStoreError as e:
                err = err or e
        if err is not None:
            raise err

    def _close(self) -> None:
        err = None
        for s in self.tiers:
            try:
                s.close()
            except StateStoreError as e:
                err = err or e
        if err is not None:
            raise err

    def _backend_stats(self) -> Dict[str, Any]:
        total = sum(self._tier_bytes) or 1
        tiers = []
        for s, f, b in zip(self.tiers, self.fractions, self._tier_bytes):
            tiers.append({"store": type(s).__name__, "target_fraction": f,
                          "fraction": b / total, "nbytes": b, "stats": s.stats()})
        out: Dict[str, Any] = {"tiers": tiers}
        for name in ("bytes_read", "bytes_written", "disk_bytes", "pinned_bytes"):
            vals = [t["stats"].get(name) for t in tiers if isinstance(t["stats"].get(name), int)]
            if vals:
                out[name] = sum(vals)
        return out


def _split_units(store: "TieredStore", units) -> Tuple[List[List[Tuple[int, int]]],
                                                      List[List[List[Slice]]]]:
    """Each unit's slices by tier: ``(layout, per_tier)``, ``layout[u]`` listing, per slice,
    ``(tier, index in that tier's unit u)``; ``per_tier[t]`` the child pipeline's units."""
    ntiers = len(store.tiers)
    layout: List[List[Tuple[int, int]]] = []
    per_tier: List[List[List[Slice]]] = [[] for _ in range(ntiers)]
    for u in unit_lists(units):
        buckets: List[List[Slice]] = [[] for _ in range(ntiers)]
        place = []
        for s in u:
            check_slice(store, s)
            t = store._tier_index(s.key)
            place.append((t, len(buckets[t])))
            buckets[t].append(s)
        layout.append(place)
        for t in range(ntiers):
            per_tier[t].append(buckets[t])
    return layout, per_tier


class _TieredPipeline(StatePipeline):
    """Child pipelines in lockstep; see the module docstring."""

    def __init__(self, store: TieredStore, units: Sequence[Sequence[Slice]], mode: str,
                 wait: bool):
        check_mode(mode)
        self._store = store
        self._mode = mode
        self._dev = store.device
        self._copy_views = mode == "r" and not store.resident
        ntiers = len(store.tiers)
        self._layout, per_tier = _split_units(store, units)
        self._pipes: Dict[int, StatePipeline] = {}
        try:
            for t in range(ntiers):
                if any(per_tier[t]):
                    self._pipes[t] = store.tiers[t].pipeline(per_tier[t], mode=mode, wait=wait)
        except BaseException:
            for p in self._pipes.values():
                p.cancel()
            raise
        self._next = 0
        self._staged: List[Tuple[torch.Tensor, torch.Tensor]] = []   # (child tensor, staged)
        self._closed = False

    def _unstage(self) -> None:
        staged, self._staged = self._staged, []
        if self._mode in ("rw", "w"):
            for child_t, t in staged:
                child_t.copy_(t)

    def __next__(self) -> List[torch.Tensor]:
        return self._advance(lambda p: next(p))

    def ready(self) -> bool:
        """Every tier's next unit has arrived (see :meth:`Pipeline.ready`); never blocks."""
        return all([p.ready() for p in self._pipes.values()])

    def take(self) -> Optional[List[torch.Tensor]]:
        """The next unit without waiting for I/O, else None (see :meth:`Pipeline.take`)."""
        if self._closed or self._next >= len(self._layout) or not self.ready():
            return None
        return self._advance(lambda p: p.take())

    def wait_next(self) -> Optional[List[torch.Tensor]]:
        """The next unit, waiting for each tier's reads only (see :meth:`Pipeline.wait_next`);
        None at the end."""
        if self._closed or self._next >= len(self._layout):
            return None
        return self._advance(lambda p: p.wait_next())

    def lend(self, give_back) -> None:
        for p in self._pipes.values():
            p.lend(give_back)

    def commit(self) -> None:
        """Hand the current unit back to every tier now (see :meth:`Pipeline.commit`)."""
        if self._closed:
            return
        self._unstage()
        for p in self._pipes.values():
            p.commit()

    def _advance(self, nxt) -> List[torch.Tensor]:
        if self._closed:
            left = len(self._layout) - self._next
            if left > 0:    # never an early end (see Pipeline._next)
                raise StateStoreClosedError(
                    f"this pipeline was closed or cancelled with {left} of its "
                    f"{len(self._layout)} units not handed out; open a new one")
            raise StopIteration
        self._unstage()
        if self._next >= len(self._layout):
            self.close()
            raise StopIteration
        got = {t: nxt(p) for t, p in self._pipes.items()}
        out = []
        for t, i in self._layout[self._next]:
            x = got[t][i]
            if x.device != self._dev:
                y = x.to(self._dev) if self._mode in ("r", "rw") else torch.empty_like(x, device=self._dev)
                self._staged.append((x, y))
                x = y
            elif self._copy_views and self._store.tiers[t].resident:
                x = x.clone()   # read-only mode: the caller's changes must not reach the store
            out.append(x)
        self._next += 1
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._unstage()
        err = None
        for p in self._pipes.values():
            try:
                p.close()
            except StateStoreError as e:
                err = err or e
        if err is not None:
            raise err

    def cancel(self) -> None:
        """Give up: no tier writes back the unit in hand (see :meth:`Pipeline.cancel`)."""
        self._closed = True
        self._staged = []
        for p in self._pipes.values():
            p.cancel()
