"""torch's optimizer format, both ways: ``state_dict()`` / ``load_state_dict()`` of the
optimizers, and ``statestore convert --to torch`` (:func:`statestore.__main__.to_torch_state_dict`).

torch's format is ``{"state": {index: {"step": tensor, "exp_avg": ..., ...}},
"param_groups": [{hyperparameters..., "params": [indices]}]}``, parameters numbered over the
groups in order. What differs between optimizers is their layout's
(:class:`~statestore.optim._layout.StateLayout`): the names of a parameter's entry and its
``"step"``, the form of a group (Adam's carries torch's implementation switches and
``decoupled_weight_decay``, our ``adamw_mode``, so that ``torch.optim.AdamW`` loads it), and
the states' conversions (Adam's compressed moments are decoded to torch's fp32
``exp_avg``/``exp_avg_sq`` on the way out and encoded on the way in). The layout always
comes from the optimizer: its own, or for a checkpoint, that of the optimizer its metadata
names (:meth:`~statestore.optim.StateStoreOptimizer.checkpoint_layout`).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .._types import StateKey
from ..errors import CheckpointError, CheckpointMismatchError
from ._args import is_real
from ._dtensor import as_param_layout, local_shape, local_state
from ._metadata import MismatchReport, short_names
from ._table import ParamTable

__all__ = ["export_state_dict", "read_state_dict", "write_states", "checkpoint_groups",
           "checkpoint_states", "LoadPlan"]

#: one parameter's states to write: (parameter, key, store, [(state, tensor)], step count)
LoadPlan = List[Tuple[Tensor, str, Any, List[Tuple[str, Tensor]], int]]


# ------------------------------------------------------------------------------ out
def export_state_dict(param_groups: List[dict], table: ParamTable, layout) -> Dict[str, Any]:
    """The optimizer's ``state_dict()`` (see :meth:`StateStoreOptimizer.state_dict`): every
    parameter of ``table`` with a step count whose states this rank keeps, its states
    exported by ``layout`` (:meth:`StateLayout.export`)."""
    keys, steps = table.keys, table.steps
    index = {p: i for i, p in enumerate(table.params)}
    groups = [layout.torch_group(g, [index[p] for p in g["params"]]) for g in param_groups]
    group_of = {p: g for g in param_groups for p in g["params"]}
    state: Dict[int, Dict[str, Any]] = {}
    by_store: Dict[Any, List[Tensor]] = {}
    for p in table.params:
        if p in table.stores:           # with a process group: this rank's shard only
            by_store.setdefault(table.stores[p], []).append(p)
    for store, ps in by_store.items():
        tensors = layout.export(store, [(keys[p], p, group_of[p]) for p in ps
                                        if keys[p] in steps])
        for p in ps:
            k = keys[p]
            if k not in steps:
                continue
            entry: Dict[str, Any] = {}
            step = layout.torch_step(steps[k])
            if step is not None:
                entry["step"] = step
            for n in layout.torch_names(p, group_of[p]):
                t = tensors.get(StateKey(k, n))
                if t is not None:
                    entry[n] = as_param_layout(p, t)      # DTensor parameters: DTensors
            if entry:                   # torch keeps no entry without states (plain SGD)
                state[index[p]] = entry
    return {"state": state, "param_groups": groups}


# ------------------------------------------------------------------------------ in
def read_state_dict(state_dict: Dict[str, Any], param_groups: List[dict], table: ParamTable,
                    owns: Callable[[Tensor], bool], layout
                    ) -> Tuple[List[Dict[str, Any]], LoadPlan]:
    """Check ``state_dict`` (torch's format) against the optimizer; changes nothing.

    Returns:
        the new hyperparameters of each group, and the states to write
        (:func:`write_states`) for the parameters whose states this rank keeps (``owns``).

    Raises:
        ValueError, TypeError: a malformed state dict, naming the group, parameter or state.
        CheckpointMismatchError: groups or parameter counts that differ.
    """
    if not isinstance(state_dict, dict) or "state" not in state_dict \
            or "param_groups" not in state_dict:
        raise ValueError("state_dict must be a dict with 'state' and 'param_groups'")
    saved_groups = state_dict["param_groups"]
    states = state_dict["state"]
    if not isinstance(saved_groups, (list, tuple)):
        raise TypeError(f"state_dict['param_groups'] must be a list, got "
                        f"{type(saved_groups).__name__}")
    if not isinstance(states, dict):
        raise TypeError(f"state_dict['state'] must be a dict, got {type(states).__name__}")
    for i, sg in enumerate(saved_groups):
        if not isinstance(sg, dict) or not isinstance(sg.get("params"), (list, tuple)):
            raise ValueError(f"loaded state dict: parameter group {i} must be a dict with "
                             f"a 'params' list")
    keys = table.keys
    every = [keys[p] for p in table.params]
    saved_ids = [sid for sg in saved_groups for sid in sg["params"]]
    report = MismatchReport([str(x) for x in saved_ids], every, len(saved_groups),
                            len(param_groups), source="state dict")
    if len(saved_groups) != len(param_groups):
        report.add("param groups", f"loaded state dict has {len(saved_groups)} parameter "
                   f"groups, optimizer has {len(param_groups)}")
    else:
        for i, (g, sg) in enumerate(zip(param_groups, saved_groups)):
            if len(g["params"]) != len(sg["params"]):
                report.add("param groups", f"loaded state dict contains a parameter group "
                           f"{i} with {len(sg['params'])} parameters, optimizer's has "
                           f"{len(g['params'])}")
    report.raise_if_any()
    id_map = _match_ids(saved_groups, saved_ids, param_groups, table)
    for sid in states:
        if sid not in id_map:
            raise ValueError(f"loaded state dict has state for unknown parameter {sid!r}")
    # 1. the new hyperparameters of each group (every saved key, as torch's
    # load_state_dict), checked as the constructor checks them
    new_hyper: List[Dict[str, Any]] = []
    for i, (g, sg) in enumerate(zip(param_groups, saved_groups)):
        h = layout.group_from_saved(sg, g)
        if "betas" in h and isinstance(g.get("betas"), tuple) \
                and not isinstance(h["betas"], tuple):
            raise ValueError(f"loaded state dict: parameter group {i}: "
                             f"Invalid betas: {h['betas']!r}")
        layout.check_group({**g, **h})
        new_hyper.append(h)
    # 2. every state, checked before anything changes
    new_groups = {p: {**g, **h} for g, h in zip(param_groups, new_hyper) for p in g["params"]}
    plan: LoadPlan = []
    for sid, st in states.items():
        p = id_map[sid]
        if not owns(p):
            continue                    # another rank's shard
        key = keys[p]
        if not isinstance(st, dict):
            raise TypeError(f"state of parameter {key!r} must be a dict, got "
                            f"{type(st).__name__}")
        plan.append((p, key, table.stores[p],
                     _read_entries(p, key, st, new_groups[p], layout), _read_step(key, st)))
    return new_hyper, plan


def _match_ids(saved_groups, saved_ids, param_groups: List[dict],
               table: ParamTable) -> Dict[Any, Tensor]:
    """The optimizer's parameter of each state key of the state dict: by name when the keys
    are exactly the optimizer's names (DCP's fully qualified names, or our own
    ``named_parameters()`` keys), else by position in the groups, as torch does."""
    keys = table.keys
    by_name = {keys[p]: p for p in table.params}
    if saved_ids and all(isinstance(x, str) for x in saved_ids) \
            and set(saved_ids) == set(by_name):
        for i, (g, sg) in enumerate(zip(param_groups, saved_groups)):
            ours = {keys[p] for p in g["params"]}
            if set(sg["params"]) != ours:
                raise CheckpointMismatchError(
                    f"loaded state dict: parameter group {i} holds "
                    f"{short_names(sorted(set(sg['params']) - ours))}, which the optimizer "
                    f"has in another group")
        return dict(by_name)
    id_map = {}
    for g, sg in zip(param_groups, saved_groups):
        for p, sid in zip(g["params"], sg["params"]):
            id_map[sid] = p
    return id_map


def _read_entries(p: Tensor, key: str, st: Dict[str, Any], group: dict,
                  layout) -> List[Tuple[str, Tensor]]:
    """The states of parameter ``p`` in ``st``, in torch's names (an optional state left
    out, such as Adam's ``master``, starts from its default: the parameter); a DTensor
    parameter's are the local parts (:func:`statestore.optim._dtensor.local_state`)."""
    names = layout.torch_names(p, group)
    for n in names:
        if not layout.optional(n) and n not in st:
            raise ValueError(f"state of parameter {key!r} lacks {n!r}")
    entries = []
    pshape = local_shape(p)
    for n in names:
        src = st.get(n)
        if src is None and layout.optional(n):
            src = layout.default_state(n, p)
        if not isinstance(src, Tensor):
            raise TypeError(f"state {n!r} of parameter {key!r} must be a tensor, got "
                            f"{type(src).__name__}")
        if src.layout != torch.strided or src.is_meta or not src.is_floating_point():
            raise TypeError(f"state {n!r} of parameter {key!r} must be a dense "
                            f"floating-point tensor with data, got {src.layout} "
                            f"{src.dtype} on {src.device}")
        shape = tuple(layout.spec(n, p)[0])
        if shape == pshape:     # shaped like the parameter (a DTensor's: its local part)
            if tuple(src.shape) != tuple(p.shape):
                raise ValueError(f"state {n!r} of parameter {key!r} has shape "
                                 f"{tuple(src.shape)}, parameter has {tuple(p.shape)}")
            src = local_state(p, key, n, src)
        elif tuple(src.shape) != shape:
            raise ValueError(f"state {n!r} of parameter {key!r} has shape "
                             f"{tuple(src.shape)}, the optimizer keeps {shape}")
        entries.append((n, src))
    return entries


def _read_step(key: str, st: Dict[str, Any]) -> int:
    step = st.get("step", 0)
    if isinstance(step, Tensor) and step.numel() == 1:
        step = step.item()
    if not is_real(step) or step < 0 or step != int(step):
        raise ValueError(f"state of parameter {key!r}: step must be a non-negative "
                         f"whole number, got {step!r}")
    return int(step)


def write_states(param_groups: List[dict], new_hyper: List[Dict[str, Any]], plan: LoadPlan,
                 table: ParamTable, layout) -> None:
    """Apply what :func:`read_state_dict` checked: the groups' hyperparameters, then each
    parameter's states (replacing those in its store, one parameter at a time, encoded by
    ``layout``: compressed moments, the states' dtypes) and step count."""
    table.next_plans.clear()            # state names may change (amsgrad): plan afresh
    for g, h in zip(param_groups, new_hyper):
        g.update(h)
    for p, key, store, entries, step in plan:
        existing = [StateKey(key, n) for n in layout.all_names() if StateKey(key, n) in store]
        if existing:
            store.delete(existing)
        new = []
        for n, src in entries:
            for sn, t in layout.encode(n, src, p).items():
                shape, dtype = layout.spec(sn, p)
                t = t.reshape(shape)
                new.append((StateKey(key, sn), shape, dtype,
                            t if store.device.type == "cpu" else t.to(store.device)))
        store.create_many(new)
        table.steps[key] = step


# ------------------------------------------------------------------------------ checkpoints
def checkpoint_groups(path: str, metadata: Dict[str, Any], layout_of: Callable
                      ) -> Tuple[Dict[str, int], List[Dict[str, Any]], Any]:
    """torch's numbering of a checkpoint's parameters (in the order of its metadata's
    ``param_groups``) and its groups in torch's format (``param_names`` added where the keys
    are names), for ``statestore convert --to torch``, and the layout of the optimizer that
    wrote the checkpoint: ``layout_of(metadata)``
    (:meth:`~statestore.optim.StateStoreOptimizer.checkpoint_layout`), asked once the
    metadata is known to hold one optimizer's groups.

    Raises:
        CheckpointError: the metadata has no param groups.
    """
    groups = metadata.get("param_groups")
    if not groups:
        raise CheckpointError(f"{path}: the checkpoint carries no optimizer metadata "
                              f"(param_groups); it cannot be numbered for torch")
    parts = metadata.get("optimizers")
    if isinstance(parts, list) and len(parts) > 1:
        raise CheckpointError(f"{path}: the checkpoint holds the states of {len(parts)} "
                              f"optimizers ({metadata.get('optimizer')}), which no one torch "
                              f"state dict holds: load it into a store and take each "
                              f"optimizer's state_dict()")
    layout = layout_of(metadata)
    index: Dict[str, int] = {}
    out_groups = []
    for g in groups:
        names = [str(n) for n in g.get("params", [])]
        ids = []
        for n in names:
            index[n] = len(index)
            ids.append(index[n])
        ng = layout.torch_group(g, ids)
        if any(n != str(i) for n, i in zip(names, ids)):
            ng["param_names"] = names
        out_groups.append(ng)
    return index, out_groups, layout


def checkpoint_states(path: str, metadata: Dict[str, Any], layout, index: Dict[str, int],
                      rows: List[Dict[str, Any]],
                      open_tensor: Callable[[Dict[str, Any]], Tensor]) -> Dict[int, Dict]:
    """torch's ``state`` of a checkpoint: one entry per parameter index (``index``: from
    :func:`checkpoint_groups`) with its step count and the tensor of each manifest row
    (``open_tensor(row)``), in torch's form by ``layout`` (:meth:`StateLayout.torch_entry`:
    Adam's compressed moments decoded to fp32, in RAM).

    Raises:
        CheckpointError: states of a parameter no param group lists.
    """
    unknown = sorted({r.param for r in rows} - set(index))
    if unknown:
        raise CheckpointError(f"{path}: states of parameters {unknown} that no param group "
                              f"of the metadata lists")
    steps = metadata.get("steps", {})
    by_key: Dict[StateKey, List] = {}
    for r in rows:
        by_key.setdefault(r.state_key, []).append(r)
    scale_states = {layout.scale_of(k.state) for k in by_key} - {None}
    state: Dict[int, Dict[str, Any]] = {}
    for k, rs in by_key.items():
        if index[k.param] not in state:
            step = layout.torch_step(int(steps.get(k.param, 0)))
            state[index[k.param]] = {} if step is None else {"step": step}
        entry = state[index[k.param]]
        if len(rs) == 1 and rs[0].region.is_whole:
            entry[k.state] = open_tensor(rs[0])
        elif k.state not in scale_states:       # regions of an FSDP2 save: one tensor
            sc = layout.scale_of(k.state)
            entry[k.state] = _whole(rs, by_key.get(StateKey(k.param, sc)) if sc else None,
                                    layout, open_tensor)
    return {i: layout.torch_entry(entry) for i, entry in sorted(state.items())}


def _whole(rows: List, scale_rows: Optional[List], layout, open_tensor: Callable) -> Tensor:
    """One tensor from the regions ``rows`` of a state (in RAM); a state stored with scales
    (int8 moments) decoded one region at a time with the scales saved with it
    (``scale_rows``, in the regions' order)."""
    first = rows[0]
    blockwise = scale_rows is not None
    out = torch.empty(first.global_shape, dtype=torch.float32 if blockwise else first.spec.dtype)
    ordered = sorted((r for r in rows if r.spec.numel), key=lambda r: r.offsets)
    scales = sorted(scale_rows or [], key=lambda r: r.offsets)
    for i, r in enumerate(ordered):
        t = open_tensor(r)
        if blockwise:
            t = layout.to_torch(first.state, t, open_tensor(scales[i])).view(r.shape)
        out[tuple(slice(o, o + n) for o, n in zip(r.offsets, r.shape))] = t
    return out
