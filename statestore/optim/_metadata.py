"""The optimizer metadata: one schema, with its producer, its validator and the resume check.

The metadata is the JSON object an optimizer attaches to its stores
(:meth:`StateStore.attach_metadata`) and every checkpoint carries (``docs/checkpoint-format.md``,
"Optimizer metadata")::

    {"optimizer": "HybridAdam", "version": 1,
     "param_groups": [{<hyperparameters: "lr": ..., "betas": [b1, b2], ...>,
                       "params": [parameter keys]}],
     "steps": {key: int}, "params": {key: {"shape": [ints], "dtype": "bfloat16"}},
     <the optimizer's own keys: "moment_dtype": "fp32", "moment_encoding": {...} (Adam);
      "optimizer_class": "torch.optim.adafactor.Adafactor" (StoreOptimizer)>}

What a group's hyperparameters look like, which states a parameter keeps and which keys the
optimizer adds are its :class:`~statestore.optim._layout.StateLayout`'s; the rest is common.

* :func:`metadata_source` produces it (a callable the store keeps);
* :func:`optimizer_metadata_problem` validates one read from a checkpoint (the checkpoint
  package's check of the shape every saved and loaded metadata must have, re-exported here);
* :func:`resume` checks a store's states and metadata against an optimizer and applies them:
  param groups are matched by position, as ``torch.optim.Optimizer.load_state_dict`` matches
  them, and each group's parameters by key (the name given through ``named_parameters()``, else
  the index in torch's ``state_dict()`` numbering). A group takes every saved key but its
  parameters (``lr``, ``betas``, ``eps``, ``weight_decay``, ``initial_lr`` written by an LR
  scheduler, and any other key a user or library added), as ``load_state_dict`` does.
  Differences raise one :class:`CheckpointMismatchError` whose message stays short
  (:class:`MismatchReport`).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Collection, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor

from .._regions import Region
from ..checkpoint.metadata import optimizer_metadata_problem
from ..errors import CheckpointMismatchError, StateStoreError
from ..offload._seam import PARAM_STATE
from ._dtensor import local, region_of
from ._resume_warnings import lrs_to_check, warn_replaced
from ._table import ParamTable, failed_message

__all__ = ["OPTIMIZER_METADATA_VERSION", "MismatchReport", "short_names", "metadata_source",
           "failed_message", "optimizer_metadata_problem", "resume", "pick_up"]

OPTIMIZER_METADATA_VERSION = 1
#: how many names a summary line shows
_SHOW = 3


def short_names(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in list(names)[:_SHOW])
    more = len(names) - _SHOW
    return shown + (f" and {more} more" if more > 0 else "")


def _numbered(names) -> bool:
    names = list(names)
    return bool(names) and all(n.isdigit() for n in names)


class MismatchReport:
    """Collects the differences between a checkpoint (or a store's states) and an optimizer,
    by kind, and raises one :class:`CheckpointMismatchError` whose message stays short
    whatever the model's size: counts, the first few names of each kind, and a hint."""

    def __init__(self, ckpt_params: Sequence[str], opt_params: Sequence[str],
                 ckpt_groups: Optional[int] = None, opt_groups: Optional[int] = None,
                 source: str = "checkpoint"):
        self.source = source
        self.ckpt_params, self.opt_params = list(ckpt_params), list(opt_params)
        self.ckpt_groups, self.opt_groups = ckpt_groups, opt_groups
        self._kinds: Dict[str, List[str]] = {}
        self._order: List[str] = []

    def add(self, kind: str, line: str) -> None:
        """One difference; ``kind`` groups lines that are summarized together."""
        if kind not in self._kinds:
            self._kinds[kind] = []
            self._order.append(kind)
        if line not in self._kinds[kind]:
            self._kinds[kind].append(line)

    def __bool__(self) -> bool:
        return bool(self._kinds)

    def message(self) -> str:
        total = sum(len(v) for v in self._kinds.values())
        head = (f"the {self.source} does not match the optimizer ({total} difference"
                f"{'s' if total != 1 else ''}): {self.source} has {len(self.ckpt_params)} "
                f"parameters")
        if self.ckpt_groups is not None:
            head += f" in {self.ckpt_groups} param group{'s' if self.ckpt_groups != 1 else ''}"
        head += f", optimizer has {len(self.opt_params)}"
        if self.opt_groups is not None:
            head += f" in {self.opt_groups} param group{'s' if self.opt_groups != 1 else ''}"
        # the fix first, then the differences
        lines = [head, "fix: " + self.hint(), "differences:"]
        for kind in self._order:
            items = self._kinds[kind]
            lines += ["  " + x for x in items[:_SHOW]]
            if len(items) > _SHOW:
                lines.append(f"  ... and {len(items) - _SHOW} more ({kind})")
        return "\n".join(lines)

    def hint(self) -> str:
        ck, op = self.ckpt_params, self.opt_params
        if ck and op and _numbered(op) and not _numbered(ck):
            return (f"the {self.source} names its parameters ({short_names(ck)}) but the optimizer "
                    f"numbers them: pass model.named_parameters() to the optimizer")
        if ck and op and _numbered(ck) and not _numbered(op):
            return (f"the {self.source} numbers its parameters ({short_names(ck)}) but the optimizer "
                    f"names them ({short_names(op)}): pass model.parameters() as when it was saved")
        return ("parameters are matched by name where the optimizer was given "
                "named_parameters() (else by position); pass named_parameters(), the same "
                f"param groups in the same order, and the same model as when the {self.source} "
                "was saved")

    def raise_if_any(self) -> None:
        if self._kinds:
            raise CheckpointMismatchError(self.message())




# ------------------------------------------------------------------------------ producer
def metadata_source(name: str, param_groups: List[dict], table: ParamTable,
                    layout) -> Callable[[], dict]:
    """A callable producing the metadata of optimizer class ``name`` that holds the
    containers it reads (groups and ``table``'s keys, parameters, step counts) and the
    optimizer's ``layout`` (its :class:`~statestore.optim._layout.StateLayout`: the groups'
    form and the keys it adds), not the optimizer: the store keeps it after the optimizer is
    gone, so a later optimizer on the store picks up the step counts.

    The callable raises :class:`StateStoreError` once a step failed part-way (a checkpoint
    then would mix states of two steps and look valid). It holds ``table`` weakly: the table
    maps parameters to their stores, and a store holding itself through the callable (kept
    in the registry of stores shared by optimizers) would never be freed."""
    keys, steps, params, failed = table.keys, table.steps, table.params, table.failed
    table_ref = weakref.ref(table)

    def metadata() -> dict:
        live = table_ref()
        if live is not None:        # the optimizer's rules (an open step ended, a lost load)
            live.check_usable(name, end_open_step=True)
        elif failed:                # the optimizer is gone: its failure still holds
            raise StateStoreError(failed_message(name, failed[0]))
        groups = []
        for g in param_groups:
            hyper = layout.group_metadata(g)
            hyper["params"] = [keys[p] for p in g["params"]]
            groups.append(hyper)
        return {
            "optimizer": name,
            "version": OPTIMIZER_METADATA_VERSION,
            "param_groups": groups,
            "steps": dict(steps),
            "params": {keys[p]: {"shape": list(p.shape),
                                 "dtype": str(p.dtype).replace("torch.", "")}
                       for p in params},
            **layout.metadata(),        # at save time: what the steps so far found out
        }
    return metadata


def _whole(meta: Any) -> Tuple[dict, Set[str]]:
    return (meta if isinstance(meta, dict) else {}), set()


# ------------------------------------------------------------------------------ resume check
def resume(store, table: ParamTable, param_groups: List[dict], layout, *, owner: str,
           keep: Collection[str], sharded: bool, loaded: bool = False,
           part: Callable[[Any], Tuple[dict, Set[str]]] = _whole) -> None:
    """:func:`pick_up` (same arguments); when ``loaded`` and the checkpoint does not fit,
    the optimizer also refuses to go on until a load into ``store`` succeeds
    (:meth:`ParamTable.loaded`)."""
    try:
        pick_up(store, table, param_groups, layout, owner=owner, keep=keep, sharded=sharded,
                loaded=loaded, part=part)
    except BaseException as e:
        if loaded:
            table.loaded(store, f"{type(e).__name__}: {e}"[:500])
        raise


def pick_up(store, table: ParamTable, param_groups: List[dict], layout, *, owner: str,
            keep: Collection[str], sharded: bool, loaded: bool = False,
            part: Callable[[Any], Tuple[dict, Set[str]]] = _whole) -> None:
    """Pick up the states already in ``store`` (a loaded checkpoint, or an earlier optimizer
    on it): step counts, and, from a loaded checkpoint, the param groups' hyperparameters.

    Args:
        store: a store of the optimizer (``table.stores`` maps its parameters to it).
        table: the optimizer's bookkeeping; its step counts are updated.
        param_groups: the optimizer's groups; they take the checkpoint's hyperparameters.
        layout: the optimizer's :class:`~statestore.optim._layout.StateLayout`.
        owner: the optimizer's class name, for messages.
        keep: the optimizer's own hyperparameters: a group keeps them where the checkpoint's
            group has none (other keys the checkpoint's group lacks are dropped).
        sharded: the optimizer has a process group: states of parameters other ranks keep
            are dropped from ``store``.
        loaded: ``store.load_checkpoint`` just replaced the states under the optimizer
            (torch's resume order).
        part: ``part(metadata)``: the part of a store's metadata that is this optimizer's,
            and the parameter keys of the other optimizers sharing the store (whose states
            are theirs): :func:`statestore.optim._shared.part_of`.

    Raises:
        CheckpointMismatchError: the store's states or metadata do not fit the optimizer
            (one error summarizing every difference). Everything is checked before anything
            changes.
        ValueError, TypeError: a saved hyperparameter fails the constructor's checks.
    """
    keys = table.keys
    ours = _claim_states(store, table, sharded)
    raw_ckpt = store.loaded_metadata
    meta, foreign, from_ckpt = _metadata_to_check(store, raw_ckpt, loaded, part)
    stored_params = _stored_params(store, foreign)
    if not loaded and not stored_params and not meta.get("params"):
        return
    every = {keys[p]: p for p in table.params}
    saved = meta.get("params")
    saved = saved if isinstance(saved, dict) and saved else None
    saved_groups = meta.get("param_groups") if from_ckpt else None
    saved_groups = saved_groups if isinstance(saved_groups, list) and saved_groups else None
    report = MismatchReport(list(saved) if saved else list(stored_params), list(every),
                            len(saved_groups) if saved_groups else None, len(param_groups))
    for name in sorted(set(stored_params) - set(ours)):
        report.add("parameters with states in the store, not in the optimizer",
                   f"unexpected parameter {name!r} in the store")
    new_hyper = _match_groups(report, param_groups, saved_groups, keys, layout)
    if saved is not None:
        _check_params(report, saved, every)
    groups = {p: {**g, **h} for g, h in zip(param_groups, new_hyper) for p in g["params"]}
    problem = layout.resume_problem(meta, bool(stored_params))
    if problem:
        report.add("states", problem)
    for name, p in ours.items():
        if name in stored_params:       # else a new parameter: its states start fresh
            _check_states(report, name, p, stored_params[name], groups[p], layout, owner)
    report.raise_if_any()
    for g, h in zip(param_groups, new_hyper):
        layout.check_group({**g, **h})
    # ResumeWarning (a failed load cleared the store: it raises, and says so itself)
    warn_replaced(param_groups, new_hyper, table.steps, ours, loaded and raw_ckpt is not None)
    _apply_groups(param_groups, new_hyper, saved_groups, keep)
    if saved_groups is not None and from_ckpt and not loaded:     # the load-first order
        table.lr_after_load = lrs_to_check(param_groups, saved_groups)
    _apply_steps(table, meta, ours, stored_params, loaded)


def _claim_states(store, table: ParamTable, sharded: bool) -> Dict[str, Tensor]:
    """The optimizer's parameters kept in ``store``, by key, once their states are there:
    deferred states loaded, regions recorded and, when ``sharded``, other ranks' dropped."""
    keys = table.keys
    ours = {keys[p]: p for p, s in table.stores.items() if s is store}
    # DTensor parameters: the store holds (and a load fetches) each one's local shard
    regions = {n: region_of(p) for n, p in ours.items()}
    # (a no-op where the last load deferred nothing: pyarrow then stays unimported)
    store.load_deferred(list(ours), {n: r for n, r in regions.items() if r is not None})
    store.record_regions({n: r or Region.whole(local(ours[n]).shape) for n, r in regions.items()})
    if sharded:                              # drop states other ranks own
        every_name = set(keys.values())
        theirs = [k for k in store.keys() if k.param in every_name and k.param not in ours]
        if theirs:
            store.delete(theirs)
    return ours


def _metadata_to_check(store, raw_ckpt: Any, loaded: bool,
                       part: Callable[[Any], Tuple[dict, Set[str]]]
                       ) -> Tuple[dict, Set[str], bool]:
    """The metadata to check the store's states against: ``(metadata, the other optimizers'
    parameter keys, whether its hyperparameters come from a checkpoint)``."""
    ckpt, ckpt_foreign = part(raw_ckpt) if isinstance(raw_ckpt, dict) else ({}, set())
    if loaded:
        return ckpt, ckpt_foreign, True
    try:
        raw = store.metadata()
    except StateStoreError:
        if len(store):  # an earlier optimizer that failed part-way: its states are mixed
            raise
        raw = None      # ... on a store emptied since: nothing of it to pick up
    meta, foreign = part(raw)
    # Hyperparameters come from a checkpoint, not from an earlier optimizer on the
    # store, unless that optimizer took the checkpoint's when it was loaded and has not
    # stepped since (an optimizer of torch's resume order still alive when a new one is
    # built), or the store's metadata has no part for this optimizer but the checkpoint
    # has (another optimizer sharing the store was built first).
    from_ckpt = raw is not None and (raw is raw_ckpt or (
        bool(ckpt) and meta.get("steps") == ckpt.get("steps")
        and meta.get("param_groups") == ckpt.get("param_groups")))
    if not meta and ckpt:
        return ckpt, foreign | ckpt_foreign, True
    return meta, foreign, from_ckpt


def _stored_params(store, foreign: Set[str]) -> Dict[str, Dict[str, Any]]:
    """The specs of the states in ``store``, by parameter key and state name."""
    stored_params: Dict[str, Dict[str, Any]] = {}
    for k in store.keys():
        # not a parameter's data (offload_parameters), nor another optimizer's state
        if k.state != PARAM_STATE and k.param not in foreign:
            stored_params.setdefault(k.param, {})[k.state] = store.spec(k)
    return stored_params


def _match_groups(report: MismatchReport, param_groups: List[dict],
                  saved_groups: Optional[List[dict]], keys: Dict[Tensor, str],
                  layout) -> List[Dict[str, Any]]:
    """Each group's hyperparameters from the checkpoint's group of the same position (none
    without ``saved_groups``); groups whose parameters differ are reported."""
    new_hyper: List[Dict[str, Any]] = [{} for _ in param_groups]
    if saved_groups is None:
        return new_hyper
    if len(saved_groups) != len(param_groups):
        report.add("param groups", f"the checkpoint has {len(saved_groups)} param "
                   f"groups, the optimizer {len(param_groups)}")
        return new_hyper
    for i, (g, sg) in enumerate(zip(param_groups, saved_groups)):
        ck = [n for n in sg.get("params", [])]
        op = [keys[p] for p in g["params"]]
        if set(ck) != set(op):
            only_ck = [n for n in ck if n not in set(op)]
            only_op = [n for n in op if n not in set(ck)]
            report.add("param groups", f"param group {i}: {len(ck)} parameters in "
                       f"the checkpoint, {len(op)} in the optimizer (only in the "
                       f"checkpoint: {short_names(only_ck) or 'none'}; only in the "
                       f"optimizer: {short_names(only_op) or 'none'})")
        new_hyper[i] = layout.group_from_saved(sg, g)
    return new_hyper


def _apply_groups(param_groups: List[dict], new_hyper: List[Dict[str, Any]],
                  saved_groups: Optional[List[dict]], keep: Collection[str]) -> None:
    """A group becomes the saved one (as torch's load_state_dict), its parameters and this
    optimizer's own hyperparameters kept where the checkpoint has none."""
    for g, h, sg in zip(param_groups, new_hyper, saved_groups or [None] * len(new_hyper)):
        if sg is not None:
            for k in [k for k in g if k not in h and k not in ("params", "param_names")
                      and k not in keep]:
                del g[k]
        g.update(h)


def _apply_steps(table: ParamTable, meta: dict, ours: Dict[str, Tensor],
                 stored_params: Dict[str, Dict[str, Any]], loaded: bool) -> None:
    """The step counts of the parameters with states in the store, from ``meta``."""
    steps = meta.get("steps", {})
    steps = steps if isinstance(steps, dict) else {}
    for name in ours:
        if name in stored_params:
            table.steps[name] = int(steps.get(name, 0))
        elif loaded:
            table.steps.pop(name, None)     # its states were replaced by none


def _check_params(report: MismatchReport, saved: Dict[str, Any],
                  every: Dict[str, Tensor]) -> None:
    """The checkpoint's parameters (names, shapes, dtypes) against the optimizer's."""
    for name in sorted(set(saved) - set(every)):
        report.add("parameters of the checkpoint not in the optimizer",
                   f"parameter {name!r} of the checkpoint is not in the optimizer")
    for name in sorted(set(every) - set(saved)):
        report.add("parameters of the optimizer not in the checkpoint",
                   f"parameter {name!r} of the optimizer is not in the checkpoint")
    for name in sorted(set(saved) & set(every)):
        shape = tuple(saved[name].get("shape", ())) if isinstance(saved[name], dict) else ()
        if shape != tuple(every[name].shape):
            report.add("shapes", f"parameter {name!r}: shape {tuple(every[name].shape)} "
                       f"in the optimizer, {shape} in the checkpoint")
        dtype = saved[name].get("dtype") if isinstance(saved[name], dict) else None
        ours_dtype = str(every[name].dtype).replace("torch.", "")
        if isinstance(dtype, str) and dtype != ours_dtype:
            report.add("dtypes", f"parameter {name!r}: dtype {ours_dtype} in the "
                       f"optimizer, {dtype} in the checkpoint")


def _check_states(report: MismatchReport, name: str, p: Tensor, stored: Dict[str, Any],
                  group: dict, layout, owner: str) -> None:
    """The states ``stored`` (``{state: spec}``) of parameter ``name`` against what the
    optimizer keeps for it."""
    needed = layout.names(p, group)
    for state, spec in stored.items():
        if not layout.known(state):
            report.add("states", f"parameter {name!r}: unexpected state {state!r} in "
                       f"the store ({layout.describe(owner)})")
            continue
        problem = layout.stored_problem(state, p, group)
        if problem:
            report.add("states", f"parameter {name!r}: {problem}")
            continue
        shape, dtype = layout.spec(state, p)
        if spec.shape != shape:
            report.add("states", f"parameter {name!r}: state {state!r} has shape "
                       f"{spec.shape}, the optimizer expects {shape}")
        if spec.dtype != dtype:
            report.add("states", f"parameter {name!r}: state {state!r} has dtype "
                       f"{spec.dtype}, the optimizer keeps {dtype}{layout.dtype_note()}")
    missing = [s for s in needed if s not in stored and not layout.optional(s)]
    if missing and stored:
        report.add("states", f"parameter {name!r}: states {missing} missing from the "
                   f"store")
