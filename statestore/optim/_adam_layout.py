"""Adam's states and hyperparameters as the optimizer base sees them: :class:`AdamLayout`.

A parameter keeps ``exp_avg`` and ``exp_avg_sq`` (fp32, or encoded with ``moment_dtype``:
:mod:`statestore.optim._moments`, int8 adding one scale state per moment),
``max_exp_avg_sq`` with ``amsgrad`` and an fp32 ``master`` for fp16/bf16 parameters, all of
the parameter's shape (scales: one per block of 256 elements). Hyperparameters are torch's
``AdamW`` keys plus ``adamw_mode`` (torch's ``decoupled_weight_decay``); torch's format
decodes compressed moments to fp32 on the way out and encodes them on the way in.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._types import StateKey
from ..offload._seam import param_value
from ._args import validate_hyper
from ._layout import IMPL_KEYS, StateLayout, json_group
from ._dtensor import local, local_shape
from ._moments import SCALE_OF, MomentFormat, export_fp32

__all__ = ["AdamLayout", "HYPER", "STATE_NAMES", "ALL_STATE_NAMES", "LOW_PRECISION",
           "ADAM_IMPL_KEYS", "state_names", "saved_group_hyper"]

#: hyperparameters saved in metadata and state_dict (torch's AdamW keys plus ours)
HYPER = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "adamw_mode")
#: the logical states of a parameter
STATE_NAMES = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master")
#: every state a store may hold for a parameter (int8 moments add their scales)
ALL_STATE_NAMES = STATE_NAMES + tuple(SCALE_OF.values())
#: parameter dtypes that keep an fp32 ``master`` in the store
LOW_PRECISION = (torch.float16, torch.bfloat16)
#: torch's switches, and ``decoupled_weight_decay`` (our ``adamw_mode``): never carried
ADAM_IMPL_KEYS = IMPL_KEYS | {"decoupled_weight_decay"}
#: keys torch's AdamW groups always carry, with the value a group without them gets
_TORCH_GROUP_DEFAULTS = (("foreach", None), ("capturable", False), ("differentiable", False),
                         ("fused", None), ("maximize", False), ("amsgrad", False))


def state_names(p: Tensor, group: Dict[str, Any]) -> List[str]:
    """The logical states of parameter ``p`` in ``group``: the two moments, amsgrad's
    ``max_exp_avg_sq``, and an fp32 ``master`` for fp16/bf16 parameters."""
    names = ["exp_avg", "exp_avg_sq"]
    if group["amsgrad"]:
        names.append("max_exp_avg_sq")
    if p.dtype in LOW_PRECISION:
        names.append("master")
    return names


def saved_group_hyper(saved: Dict[str, Any]) -> Dict[str, Any]:
    """What a group takes from a saved group (metadata or torch's ``state_dict``): every key
    but its parameters and torch's implementation switches; ``betas`` as a tuple, torch's
    ``decoupled_weight_decay`` as our ``adamw_mode``."""
    h = {k: v for k, v in saved.items()
         if isinstance(k, str) and k not in ("params", "param_names") and k not in ADAM_IMPL_KEYS}
    if "betas" in h and isinstance(h["betas"], (list, tuple)):
        h["betas"] = tuple(h["betas"])
    if "adamw_mode" not in h and "decoupled_weight_decay" in saved:
        h["adamw_mode"] = bool(saved["decoupled_weight_decay"])
    for k in ("amsgrad", "maximize", "adamw_mode"):
        if k in h:
            h[k] = bool(h[k])
    return h


class AdamLayout(StateLayout):
    """The states and hyperparameters of ``CPUAdam``/``HybridAdam`` (``fmt``: the
    optimizer's ``moment_dtype``)."""

    impl_keys = ADAM_IMPL_KEYS

    def __init__(self, fmt: MomentFormat):
        super().__init__()
        self.fmt = fmt
        #: the dtypes of the two moments in the store
        self.moment_dtypes = (fmt.spec("exp_avg", (1,))[1], fmt.spec("exp_avg_sq", (1,))[1])

    # ------------------------------------------------------------------ states
    def names(self, p: Tensor, group: Dict[str, Any]) -> List[str]:
        return self.fmt.stored_names(state_names(p, group))

    def known(self, name: str) -> bool:
        return self.fmt.known(name)

    def all_names(self) -> List[str]:
        return list(ALL_STATE_NAMES)

    def visible_names(self) -> List[str]:
        return list(STATE_NAMES)

    def describe(self, owner: str) -> str:
        return (f"an Adam optimizer with moment_dtype={self.fmt.name!r} keeps "
                f"{self.fmt.stored_names(STATE_NAMES)}")

    def dtype_note(self) -> str:
        return f" (moment_dtype={self.fmt.name!r})"

    def stored_problem(self, name: str, p: Tensor, group: Dict[str, Any]) -> Optional[str]:
        if name == "master" and p.dtype not in LOW_PRECISION:
            return f"the store holds an fp32 master but the parameter is {p.dtype}"
        return None

    def spec(self, name: str, p: Tensor) -> Tuple[Tuple[int, ...], torch.dtype]:
        return self.fmt.spec(name, local_shape(p))

    def initial(self, name: str, p: Tensor) -> Optional[Tensor]:
        # the parameter itself: the store converts it a chunk at a time (a whole fp32 copy
        # of every parameter would come before the first step)
        return local(p).detach() if name == "master" else None

    # ------------------------------------------------------------------ units
    def state_range(self, name: str, p: Tensor, a: int, b: int) -> Optional[Tuple[int, int]]:
        return self.fmt.state_range(name, a, b)

    def cut_elems(self, store, align: int) -> int:
        return self.fmt.cut_elems(store, align)     # compressed moments: whole blocks

    def unit_itemsize(self, p: Tensor, names: Sequence[str]) -> Tuple[int, int]:
        return self.fmt.unit_itemsize(names)

    # ------------------------------------------------------------------ hyperparameters
    def check_group(self, group: Dict[str, Any]) -> None:
        validate_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"])

    def group_metadata(self, group: Dict[str, Any]) -> Dict[str, Any]:
        hyper = {k: (list(group[k]) if k == "betas" else group[k]) for k in HYPER}
        if isinstance(hyper["lr"], Tensor):
            hyper["lr"] = hyper["lr"].item()
        for k in ("lr", "eps", "weight_decay"):     # numpy scalars: plain JSON numbers
            hyper[k] = float(hyper[k])
        hyper["betas"] = [float(b) for b in hyper["betas"]]
        for k in ("amsgrad", "maximize", "adamw_mode"):
            hyper[k] = bool(hyper[k])
        # initial_lr of a scheduler, and others
        hyper.update(json_group(group, set(HYPER) | self.impl_keys))
        return hyper

    def group_from_saved(self, saved: Dict[str, Any], group: Dict[str, Any]) -> Dict[str, Any]:
        return saved_group_hyper(saved)

    def torch_group(self, group: Dict[str, Any], ids: List[Any]) -> Dict[str, Any]:
        """Every key but ``params``, ``betas`` as a tuple, ``adamw_mode`` as torch's
        ``decoupled_weight_decay`` (only: a group with exactly torch's keys is what
        ``torch.distributed.checkpoint`` needs to load torch's optimizer checkpoints into ours
        and ours into torch's), and torch's switches where missing."""
        ng = {k: v for k, v in group.items() if k not in ("params", "adamw_mode")}
        ng["betas"] = tuple(group.get("betas", (0.9, 0.999)))
        ng["decoupled_weight_decay"] = bool(group.get("adamw_mode", True))
        for k, v in _TORCH_GROUP_DEFAULTS:
            ng.setdefault(k, v)
        ng["params"] = ids
        return ng

    # ------------------------------------------------------------------ metadata
    def metadata(self) -> Dict[str, Any]:
        return self.fmt.metadata()

    def resume_problem(self, meta: Dict[str, Any], stored: bool) -> Optional[str]:
        # checkpoints of optimizers from before moment_dtype existed hold fp32 moments; a
        # store without optimizer metadata is checked by its states' dtypes alone
        if stored and meta.get("optimizer_class"):
            return (f"the store holds the states of StoreOptimizer({meta['optimizer_class']}), "
                    f"not of an Adam optimizer: load them into that optimizer, or move them "
                    f"through state_dict()")
        saved_fmt = meta.get("moment_dtype", "fp32" if meta.get("optimizer") else None)
        if stored and saved_fmt is not None and saved_fmt != self.fmt.name:
            return (f"moment_dtype {self.fmt.name!r} in the optimizer, {saved_fmt!r} in the "
                    f"store's metadata (load the states through state_dict() to convert)")
        if stored:
            return self.fmt.encoding_mismatch(meta)
        return None

    # ------------------------------------------------------------------ torch's format
    def torch_names(self, p: Tensor, group: Dict[str, Any]) -> List[str]:
        return state_names(p, group)

    def torch_spec(self, name: str, p: Tensor) -> Tuple[Tuple[int, ...], torch.dtype]:
        return local_shape(p), torch.float32       # compressed moments: decoded to fp32

    def torch_step(self, count: int) -> Any:
        return torch.tensor(float(count))

    def export(self, store, params) -> Dict[StateKey, Tensor]:
        """Views or mapped snapshots of the fp32 states; compressed moments decoded to
        fp32 (torch's format)."""
        from .._snapshot import export_states
        fmt = self.fmt
        plain = ("max_exp_avg_sq", "master") if fmt.compressed else STATE_NAMES
        out = export_states(store, [StateKey(k, n) for k, _, _ in params for n in plain
                                    if StateKey(k, n) in store])
        if fmt.compressed:
            out.update(export_fp32(store, fmt, [(k, local_shape(p)) for k, p, _ in params]))
        return out

    def optional(self, name: str) -> bool:
        return name == "master"

    def default_state(self, name: str, p: Tensor) -> Optional[Tensor]:
        return param_value(p) if name == "master" else None

    def encode(self, name: str, src: Tensor, p: Tensor) -> Dict[str, Tensor]:
        if self.fmt.compressed and name in SCALE_OF:
            return self.fmt.from_fp32(name, src)
        return {name: src.detach().float().cpu()}

    # ------------------------------------------------------------------ checkpoints
    def scale_of(self, name: str) -> Optional[str]:
        return SCALE_OF.get(name) if self.fmt.name == "int8" else None

    def to_torch(self, name: str, t: Tensor, scales: Optional[Tensor] = None) -> Tensor:
        if name in SCALE_OF and t.dtype != torch.float32:
            return self.fmt.to_fp32(name, t, scales).view(t.shape)
        return t

    def torch_entry(self, entry: Dict[str, Any]) -> Dict[str, Any]:
        """Compressed moments decoded to torch's fp32, their scales dropped."""
        for n, sn in SCALE_OF.items():
            if n in entry and entry[n].dtype != torch.float32:
                entry[n] = self.to_torch(n, entry[n], entry.pop(sn, None))
        return entry

    @staticmethod
    def of_metadata(metadata: Dict[str, Any]) -> "AdamLayout":
        """The layout of the Adam optimizer that wrote ``metadata`` (its ``moment_dtype``
        and encoding)."""
        return AdamLayout(MomentFormat(metadata.get("moment_dtype", "fp32"),
                                       encoding=metadata.get("moment_encoding")))
