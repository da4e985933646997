"""Adam's hot path: the tensors of one pipeline unit gathered for the Adam kernel and its
results put back (:class:`UnitTensors`), a few operations per parameter slice. The units
themselves are planned for every optimizer by :mod:`statestore.optim._plan`.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
from torch import Tensor

from ..errors import StateStoreValueError
from ..kernels import adam_step
from ..kernels._moments import adam_step_moments
from ._dtensor import local
from ._plan import Entry

__all__ = ["UnitTensors"]


class UnitTensors:
    """The tensors of one unit, as the kernel takes them: per entry the parameter slice
    (``params``), gradient, moments, amsgrad's maximum, master, step count and int8
    scales; plus what goes back to the parameters after the kernel (:meth:`put_back`).

    Args:
        tensors: the unit's state tensors, as the pipeline hands them out.
        entries: the unit's entries (:data:`Entry`).
        grads: each parameter's gradient.
        dev: the store's device (where the states are).
        off: the optimizer's staging path (CUDA parameters over host stores), or None.
        keys, steps: the optimizer's parameter keys and step counts.
        fmt: the optimizer's moment format; ``moment_dtypes`` its two moments' dtypes.

    Raises:
        StateStoreValueError: the store holds moments of another dtype than the optimizer's.
    """

    __slots__ = ("entries", "params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs",
                 "masters", "steps", "scales", "writeback", "uploads", "off")

    def __init__(self, tensors: List[Tensor], entries: Sequence[Entry],
                 grads: Dict[Tensor, Tensor], dev: torch.device, off, keys: Dict[Tensor, str],
                 steps: Dict[str, int], fmt, moment_dtypes: Tuple[torch.dtype, torch.dtype]):
        params, gs, m, v, vmax, masters, ssteps, writeback = [], [], [], [], [], [], [], []
        scales: list = []
        uploads: list = []
        pos = 0
        for p, a, b, names in entries:
            st = dict(zip(names, tensors[pos:pos + len(names)]))
            pos += len(names)
            w = local(p)
            whole = a == 0 and b == w.numel()        # the common case: no slicing
            pflat = w.view(-1) if w.is_contiguous() else None
            if off is not None and off.handles(p):
                # CUDA parameter, host states: page-locked staging, side stream (docs/gpu.md)
                g = off.grad_host(p, grads[p])[a:b]
                w = off.param_host(p)[a:b]
                uploads.append((p, a, b))
            else:
                if pflat is None or w.device != dev:
                    src = w.detach().reshape(-1)[a:b]
                    w = src.to(dev, copy=True)
                    writeback.append((p, a, b, w))
                else:
                    w = pflat if whole else pflat[a:b]
                g = grads[p].view(-1) if whole else grads[p].view(-1)[a:b]
                if g.device != dev:
                    g = g.to(dev)
            params.append(w)
            gs.append(g)
            m.append(st["exp_avg"])
            v.append(st["exp_avg_sq"])
            if (m[-1].dtype, v[-1].dtype) != moment_dtypes:
                raise StateStoreValueError(
                    f"parameter {keys[p]!r}: the store holds exp_avg/exp_avg_sq as "
                    f"{m[-1].dtype}/{v[-1].dtype}, but this optimizer keeps moment_dtype="
                    f"{fmt.name!r} ({moment_dtypes[0]}/{moment_dtypes[1]}); was a checkpoint "
                    f"of another moment_dtype loaded into its store?")
            vmax.append(st.get("max_exp_avg_sq"))
            masters.append(st.get("master"))
            ssteps.append(steps[keys[p]])
            scales.append((st.get("exp_avg_scale"), st.get("exp_avg_sq_scale"), a))
        self.params, self.grads, self.exp_avgs, self.exp_avg_sqs = params, gs, m, v
        self.max_exp_avg_sqs, self.masters, self.steps, self.scales = vmax, masters, ssteps, scales
        self.writeback, self.uploads, self.off = writeback, uploads, off
        self.entries = entries

    def update(self, group: dict, keys: Dict[Tensor, str], fmt, grad_scale: float) -> None:
        """Run the Adam kernel over the unit with ``group``'s hyperparameters (``keys``: the
        parameters' keys, which seed compressed moments' stochastic rounding)."""
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        if isinstance(lr, Tensor):
            lr = lr.item()
        kw = dict(steps=self.steps, lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"],
                  weight_decay=group["weight_decay"], adamw_mode=group["adamw_mode"],
                  amsgrad=group["amsgrad"],
                  max_exp_avg_sqs=self.max_exp_avg_sqs if group["amsgrad"] else None,
                  masters=self.masters if any(x is not None for x in self.masters) else None,
                  maximize=group["maximize"], grad_scale=grad_scale)
        if not fmt.compressed:
            adam_step(self.params, self.grads, self.exp_avgs, self.exp_avg_sqs, **kw)
            return
        scales = self.scales
        names = [keys[e[0]] for e in self.entries]
        adam_step_moments(self.params, self.grads, self.exp_avgs, self.exp_avg_sqs,
                          kind=fmt.name, rounding=fmt.rounding,
                          seeds=[fmt.seeds(k, s) for k, s in zip(names, self.steps)],
                          offsets=[a for _, _, a in scales],
                          exp_avg_scales=[x for x, _, _ in scales],
                          exp_avg_sq_scales=[y for _, y, _ in scales], **kw)

    def put_back(self) -> None:
        """Copy updated values computed away from their parameter back into it (a
        non-contiguous parameter, one on another device than the store), and queue the
        uploads of staged CUDA parameters."""
        for p, a, b, w in self.writeback:
            p = local(p)
            if p.is_contiguous():
                p.detach().view(-1)[a:b].copy_(w)
            else:
                flat = p.detach().reshape(-1).clone()
                flat[a:b].copy_(w.to(p.device))
                p.detach().copy_(flat.view(p.shape))
        for p, a, b in self.uploads:
            self.off.upload(p, a, b)
