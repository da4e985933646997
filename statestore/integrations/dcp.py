"""torch.distributed.checkpoint (DCP): a ``Stateful`` over a statestore optimizer whose
``state_dict``/``load_state_dict`` stream through the store's RAM budget.

What a user writes::

    import torch.distributed.checkpoint as dcp
    from statestore.integrations.dcp import StateStoreStateful
    dcp.save({"model": model.state_dict(), "optim": StateStoreStateful(opt)}, checkpoint_id=path)
    ...
    dcp.load({"model": model.state_dict(), "optim": StateStoreStateful(opt)}, checkpoint_id=path)

The state dict is keyed by parameter name (the optimizer's parameter keys: names where it
was given ``named_parameters()``/``param_names``, else indices), one entry per parameter of
the optimizer, so that saving and loading ask DCP for the same keys whatever has stepped::

    {"state": {name: {"step": tensor, <the states of its entry in opt.state_dict()>}},
     "param_groups": [{"lr": ..., ..., "params": [names]}]}

(Adam: ``exp_avg``, ``exp_avg_sq``, [``max_exp_avg_sq``], [``master``]; a
``StoreOptimizer``: its class's states, ``"step"`` being the optimizer's step count even where
the class keeps none.) A parameter without states yet is saved as zeros with ``step`` 0
(:meth:`StateStoreOptimizer.torch_state_specs` says which) and left without states when
loaded. On a disk store (``NVMeStore``, ``FileStore``, tiered) the tensors are not in
RAM: ``state_dict()`` streams the states through the store's pipeline into an unlinked
temporary file in the store's folder and hands out tensors mapped from it (the kernel loads
and evicts their pages), DCP reads into / writes from those, and ``load_state_dict`` writes
them into the store one parameter at a time. On a resident store the tensors are views of
the states themselves. Step counts and hyperparameters travel too; the scheduler is saved
by the user as usual.

With an optimizer sharded over a ``process_group``, each rank's dict holds the parameters
whose states that rank keeps: ``dcp.save`` on every rank writes the whole optimizer once, and
``dcp.load`` gives each rank its own (or a single process every parameter).
"""
from __future__ import annotations

import math
import os
import tempfile
from typing import Any, Dict, List, Tuple

import torch

from .._snapshot import unlinked_buffer
from ..errors import CheckpointMismatchError
from ..optim._dtensor import as_param_layout
from ..optim._sharding import SHARD_KEY
from ._common import find_store_optimizer

__all__ = ["StateStoreStateful"]

def _zeros_mapped(specs: List[Tuple[Tuple[int, ...], torch.dtype]],
                  directory: str) -> List[torch.Tensor]:
    """Zero tensors of ``(shape, dtype)`` backed by one unlinked sparse file (no RAM until
    written)."""
    offsets, pos = [], 0
    for shape, dtype in specs:
        offsets.append(pos)
        pos += math.prod(shape) * dtype.itemsize
        pos += (-pos) % 64
    flat = unlinked_buffer(pos, directory, ".dcp-states-")
    return [flat[o:o + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            for o, (shape, dtype) in zip(offsets, specs)]


class StateStoreStateful:
    """``torch.distributed.checkpoint.stateful.Stateful`` over a statestore optimizer (or a
    framework wrapper of one). See the module docstring."""

    def __init__(self, optimizer: Any):
        opt = find_store_optimizer(optimizer)
        if opt is None:
            raise TypeError(f"StateStoreStateful needs a statestore optimizer (CPUAdam, "
                            f"HybridAdam or StoreOptimizer), got {type(optimizer).__name__}")
        self.optimizer = opt

    # ------------------------------------------------------------------ layout
    def _params(self):
        """(index, name, param, group) for every parameter, in torch's numbering."""
        out, i = [], 0
        for g in self.optimizer.param_groups:
            names = g.get("param_names")
            for j, p in enumerate(g["params"]):
                out.append((i, str(names[j]) if names is not None else str(i), p, g))
                i += 1
        return out

    def _directory(self) -> str:
        store = self.optimizer.state_store
        d = getattr(store, "dir", None) if store is not None else None
        return d if d and os.path.isdir(d) else tempfile.gettempdir()

    # ------------------------------------------------------------------ Stateful
    def state_dict(self) -> Dict[str, Any]:
        # disk stores: file-backed, streamed. Sharded over a process group: this rank's
        # parameters only (no zeros for the others, which DCP would keep one copy of: maybe
        # a rank's zeros instead of the owner's states); dcp.save of every rank's merges.
        torch_sd = self.optimizer.shard_state_dict()
        mark = torch_sd.pop(SHARD_KEY, None)
        mine = None
        if mark is not None:
            import torch.distributed as dist
            rank = dist.get_rank(self.optimizer.process_group)
            mine = {i for i, r in enumerate(mark["owners"]) if r == rank}
        params = self._params()
        state: Dict[str, Dict[str, torch.Tensor]] = {}
        missing = []
        opt = self.optimizer
        for i, name, p, g in params:
            if mine is not None and i not in mine:
                continue
            st = torch_sd["state"].get(i)
            want = opt.torch_state_specs(p)
            if st is None or any(n not in st for n in want):
                missing.append((i, name, p, want))
                continue
            # the optimizer's own step count where its class keeps no "step" (SGD)
            step = st["step"] if "step" in st else opt.step_count(p)
            entry = {"step": torch.as_tensor(step, dtype=torch.float32).clone()}
            for n in want:
                entry[n] = st[n]
            state[name] = entry
        if missing:     # zeros of the local states (DTensor parameters: as DTensors)
            zeros = iter(_zeros_mapped([spec for _, _, _, want in missing
                                        for spec in want.values()], self._directory()))
            for i, name, p, want in missing:
                entry = {"step": torch.zeros((), dtype=torch.float32)}
                for n in want:
                    entry[n] = as_param_layout(p, next(zeros))
                state[name] = entry
        groups = []
        for sg, g in zip(torch_sd["param_groups"], self.optimizer.param_groups):
            ng = {k: v for k, v in sg.items() if k != "params"}
            ng["params"] = [params[i][1] for i in sg["params"]]
            groups.append(ng)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        params = self._params()
        by_name = {name: i for i, name, _, _ in params}
        saved = state_dict.get("state", {})
        unknown = sorted(set(saved) - set(by_name))
        if unknown:
            raise CheckpointMismatchError(
                f"DCP optimizer state names {len(unknown)} parameter(s) the optimizer does not "
                f"have (first: {unknown[:3]}); build the optimizer over the same named parameters")
        state = {}
        for name, entry in saved.items():
            step = entry.get("step", 0)
            step = float(step.item()) if isinstance(step, torch.Tensor) else float(step)
            if step > 0:
                state[by_name[name]] = dict(entry, step=torch.tensor(step))
        groups = []
        for g in state_dict.get("param_groups", []):
            ng = dict(g)
            ng["params"] = [by_name[n] for n in g.get("params", [])]
            groups.append(ng)
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
