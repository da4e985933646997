"""Several optimizers on one store (Muon for the matrices, HybridAdam for the rest): one
checkpoint holds them all.

A store keeps ONE optimizer metadata provider and ONE load callback
(:meth:`StateStore.attach_metadata`). Every statestore optimizer attaches through
:func:`attach`, which keeps, per store, the optimizers attached to it (their parameter keys,
metadata sources and load callbacks: a :class:`StoreShare`):

* one optimizer: the store gets that optimizer's metadata as it always did;
* several (their parameter keys disjoint): the store gets their metadata combined::

      {"optimizer": "StoreOptimizer+HybridAdam", "version": 1,
       "param_groups": [every group of the first, then of the second...],
       "steps": {every key: count}, "params": {every key: {shape, dtype}},
       "optimizers": [{"optimizer": "StoreOptimizer", "optimizer_class": "...",
                       "param_groups": [0, 1]},            # indices into param_groups
                      {"optimizer": "HybridAdam", "moment_dtype": "fp32",
                       "param_groups": [2]}]}

  and each optimizer reads its own part back (:meth:`StoreShare.part`): the part whose
  parameters are its own, the states of the other parts' parameters being theirs.

An optimizer built over parameters some attached optimizer already has (the same model's
optimizer built again) replaces it. A load (``store.load_checkpoint``) detaches every
optimizer; each live one then takes its part of the checkpoint and attaches again (torch's
resume order). The parameter keys of optimizers sharing a store must differ: pass
``named_parameters()`` to each (torch's numbering starts at 0 in every optimizer).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from ..errors import StateStoreValueError

__all__ = ["StoreShare", "attach", "check_keys", "share_of", "part_of"]

_SHARES: "weakref.WeakKeyDictionary[Any, StoreShare]" = weakref.WeakKeyDictionary()


class _Member:
    """One optimizer attached to a store: its live parameter keys (the table's key map),
    metadata source, load callback (held weakly) and process group."""

    __slots__ = ("keys", "source", "on_load", "group", "name")

    def __init__(self, keys: Dict, source: Callable[[], dict], on_load, group, name: str):
        self.keys, self.source, self.group, self.name = keys, source, group, name
        self.on_load = weakref.WeakMethod(on_load) if hasattr(on_load, "__func__") \
            else (lambda f: lambda: f)(on_load)     # None: a part no optimizer has taken

    def key_set(self) -> Set[str]:
        return set(self.keys.values())


class StoreShare:
    """The optimizers attached to one store (see the module docstring)."""

    def __init__(self, store):
        self._store = weakref.ref(store)
        self.members: List[_Member] = []

    def others(self, keys: Dict) -> Set[str]:
        """Parameter keys of the attached optimizers other than the one of ``keys`` (and
        other than those it replaces)."""
        mine, out = set(keys.values()), set()
        for m in self.members:
            ks = m.key_set()
            if m.keys is not keys and not ks & mine:
                out |= ks
        return out

    def adopt_parts(self, meta: Any, group) -> None:
        """Keep the parts of a loaded checkpoint's metadata ``meta`` that no attached
        optimizer has taken (an optimizer of the checkpoint not built yet), so that the
        store's checkpoints still carry them; the optimizer over their parameters replaces
        them when it attaches."""
        if not isinstance(meta, dict) or not isinstance(meta.get("optimizers"), list):
            return
        taken = set().union(*(m.key_set() for m in self.members)) if self.members else set()
        for part in meta["optimizers"]:
            idx = part.get("param_groups") if isinstance(part, dict) else None
            groups = meta.get("param_groups") if isinstance(meta.get("param_groups"), list) else []
            keys = _group_keys(groups, [i for i in idx if isinstance(i, int)
                                        and 0 <= i < len(groups)]) if isinstance(idx, list) else set()
            if not keys or keys & taken:
                continue
            view, _ = part_of(meta, keys, set())
            self.members.append(_Member({k: k for k in keys}, (lambda v: lambda: v)(view),
                                        None, group, str(view.get("optimizer"))))
            taken |= keys

    def kept_with(self, member: _Member) -> List[_Member]:
        """The attached optimizers that stay beside ``member`` (those it replaces go).

        Raises:
            StateStoreValueError: ``member`` and another live optimizer of another kind name
                the same parameter keys (torch's numbering of two optimizers).
        """
        mine = member.key_set()
        kept = []
        for m in self.members:
            same = m.key_set() & mine
            if m.keys is member.keys or same and _replaces(member, m, same):
                continue            # this optimizer again, or one it replaces
            if same:
                raise StateStoreValueError(
                    f"{member.name} and {m.name} share a store and both name parameters "
                    f"{sorted(same)[:3]}: optimizers on one store need distinct parameter "
                    f"keys; pass model.named_parameters() (or param_names) to each (torch "
                    f"numbers every optimizer's parameters from 0), or give each its own store")
            kept.append(m)
        return kept

    def add(self, member: _Member) -> None:
        kept = self.kept_with(member)
        for m in kept:
            if m.group is not member.group:
                raise StateStoreValueError(
                    f"{member.name} and {m.name} share a store but shard it over different "
                    f"process groups; give each its own store")
        self.members = kept + [member]

    def metadata(self) -> Optional[dict]:
        """The combined metadata of every member (one member: its own)."""
        if len(self.members) == 1:
            return self.members[0].source()
        metas = [m.source() for m in self.members]
        out: Dict[str, Any] = {"optimizer": "+".join(str(m.get("optimizer")) for m in metas),
                               "version": max(int(m.get("version", 1)) for m in metas),
                               "param_groups": [], "steps": {}, "params": {}, "optimizers": []}
        for m in metas:
            first = len(out["param_groups"])
            out["param_groups"] += list(m.get("param_groups", []))
            out["steps"].update(m.get("steps", {}))
            out["params"].update(m.get("params", {}))
            part = {k: v for k, v in m.items()
                    if k not in ("param_groups", "steps", "params", "version")}
            part["param_groups"] = list(range(first, len(out["param_groups"])))
            out["optimizers"].append(part)
        return out

    def loaded(self, store) -> None:
        """``store.load_checkpoint`` replaced the states: every member is detached; each
        live one takes its part of the checkpoint and attaches again (the first that does
        not fit raises, after the others had their turn)."""
        members, self.members = self.members, []
        error: Optional[BaseException] = None
        for m in members:
            cb = m.on_load()
            if cb is None:
                continue
            try:
                cb(store)
            except BaseException as e:      # noqa: PERF203 - each optimizer gets its turn
                error = error or e
        if error is not None:
            raise error

    def part(self, keys: Dict) -> Callable[[Any], Tuple[dict, Set[str]]]:
        """``part(metadata)`` for the optimizer of ``keys``: its part of a store's (or a
        checkpoint's) metadata, and the parameter keys that are other optimizers'."""
        def part(meta: Any) -> Tuple[dict, Set[str]]:
            return part_of(meta, set(keys.values()), self.others(keys))
        return part


def _replaces(new: _Member, old: _Member, keys: Set[str]) -> bool:
    """Whether ``new`` takes over ``old``'s parameters (sharing ``keys``): ``old`` is a part no
    optimizer holds, or its optimizer is gone, or it is the same kind of optimizer (the
    model's optimizer built again) or over the very same tensors."""
    if old.on_load() is None or old.name == new.name:
        return True
    by_key_old = {k: p for p, k in old.keys.items()}
    by_key_new = {k: p for p, k in new.keys.items()}
    return all(by_key_old.get(k) is by_key_new.get(k) for k in keys)


def part_of(meta: Any, mine: Set[str], others: Set[str]) -> Tuple[dict, Set[str]]:
    """The part of ``meta`` that belongs to the optimizer of parameter keys ``mine``, and the
    keys of the other parts (and ``others``: optimizers attached to the store). A metadata
    of one optimizer is one part; a part whose keys are all other attached optimizers' is
    theirs; of the rest, the part sharing most keys with ``mine`` (the only one left, even
    sharing none: its differences are then reported as a mismatch)."""
    if not isinstance(meta, dict):
        return {}, set(others)
    groups = meta.get("param_groups")
    groups = groups if isinstance(groups, list) else []
    parts = meta.get("optimizers")
    if not isinstance(parts, list) or not parts:
        keys = _group_keys(groups, range(len(groups))) | set(_dict(meta.get("params")))
        if keys and keys <= others and not keys & mine:
            return {}, set(others) | keys           # another attached optimizer's metadata
        return meta, set(others)
    views = []
    for part in parts:
        idx = part.get("param_groups") if isinstance(part, dict) else None
        idx = [i for i in idx if isinstance(i, int) and 0 <= i < len(groups)] \
            if isinstance(idx, list) else []
        views.append((part if isinstance(part, dict) else {}, idx, _group_keys(groups, idx)))
    candidates = [v for v in views if not (v[2] and v[2] <= others and not v[2] & mine)]
    if not candidates:
        return {}, set(others).union(*(v[2] for v in views))
    best = max(candidates, key=lambda v: len(v[2] & mine))
    if not best[2] & mine and len(candidates) > 1:
        return {}, set(others).union(*(v[2] for v in views))
    part, idx, keys = best
    view = {k: v for k, v in part.items() if k != "param_groups"}
    view["version"] = meta.get("version")
    view["param_groups"] = [groups[i] for i in idx]
    view["steps"] = {k: v for k, v in _dict(meta.get("steps")).items() if k in keys}
    view["params"] = {k: v for k, v in _dict(meta.get("params")).items() if k in keys}
    foreign = set(others).union(*(v[2] for v in views if v is not best))
    return view, foreign - keys


def _dict(x: Any) -> dict:
    return x if isinstance(x, dict) else {}


def _group_keys(groups: list, idx) -> Set[str]:
    out: Set[str] = set()
    for i in idx:
        g = groups[i]
        if isinstance(g, dict) and isinstance(g.get("params"), list):
            out.update(str(n) for n in g["params"])
    return out


def share_of(store) -> StoreShare:
    """The :class:`StoreShare` of ``store`` (made on first use)."""
    share = _SHARES.get(store)
    if share is None:
        share = _SHARES[store] = StoreShare(store)
    return share


def check_keys(store, keys: Dict, name: str) -> None:
    """Refuse, before anything changes, an optimizer whose parameter keys collide with those
    of another optimizer on ``store`` (:meth:`StoreShare.kept_with`)."""
    share = _SHARES.get(store)
    if share is not None:
        share.kept_with(_Member(keys, lambda: {}, _alive, None, name))


def _alive() -> None:
    """A load callback standing for a live optimizer in :func:`check_keys`."""


def attach(store, keys: Dict, source: Callable[[], dict], on_load, process_group,
           name: str) -> None:
    """Attach an optimizer (``keys``: its table's live key map; ``source``: its metadata
    source; ``on_load``: its bound load callback; ``name``: its class name) to ``store``,
    replacing any attached optimizer over the same parameters.

    Raises:
        StateStoreValueError: another optimizer on the store shards over another group.
    """
    share = share_of(store)
    share.add(_Member(keys, source, on_load, process_group, name))
    share.adopt_parts(store.loaded_metadata, process_group)
    provider = source if len(share.members) == 1 else share.metadata
    # the share is held by the registry as long as the store lives; the store holds its
    # load callback weakly, and a single optimizer's metadata source strongly (so that a
    # later optimizer on the store picks up its step counts after it is gone)
    store.attach_metadata(provider, process_group=process_group, on_load=share.loaded)
