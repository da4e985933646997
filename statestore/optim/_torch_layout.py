"""The states of a torch optimizer class, as :class:`~statestore.optim.StoreOptimizer` keeps
them in a store: :class:`TorchLayout`, learnt by probing the class.

**Probing.** A torch optimizer creates a parameter's states itself, in ``step()`` (its
``_init_group``) or, for ``Adagrad``, in its constructor. To learn them without memory, the
class is built over a *meta-device* copy of the parameter (same shape and dtype, no data) with
the group's hyperparameters, given a meta gradient and stepped: what its ``state`` holds
afterwards names every state with its shape, dtype and device (the meta device: the
parameter's; the CPU: a CPU scalar, as NAdam's ``mu_product``). A step that fails on the meta
device after the states were made (``Tensor.item()`` in Adafactor's and ASGD's updates) is
expected; one that fails before is reported. ``"step"`` is the class's step count: a tensor
(its dtype and device recorded) or a number, or absent (SGD, Muon); the store does not hold
it (the optimizer's step counts do, and ``"step"`` is rebuilt from them for each update).

**Units.** A parameter is cut into element ranges only where the update is element-wise
(torch's classes listed in :data:`ELEMENTWISE`, or ``elementwise=True``) and the parameter is
fp32 or fp64: ATen's vectorized and scalar loops round fp16/bf16 arithmetic differently, so a
low-precision parameter cut elsewhere than torch's own loop would cut it differs in its last
bits. A state shaped like the parameter follows the range; a per-parameter scalar
(NAdam's ``mu_product``, ASGD's ``eta`` and ``mu``) rides in the parameter's first unit.
Anything else (Adafactor's row and column variances; Muon's whole-matrix update) makes the
parameter one unit.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from itertools import repeat
from operator import is_
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .._types import StateKey
from ..errors import StateStoreError, StateStoreValueError
from ._layout import IMPL_KEYS, StateLayout, json_group
from ._dtensor import local, sharded_over_ranks

__all__ = ["TorchLayout", "SavedLayout", "Probe", "ELEMENTWISE", "WHOLE", "REFUSED",
           "STATE_DTYPES", "group_structure", "class_name", "check_class", "ctor_kwargs",
           "check_state_dtype"]

#: torch's optimizers whose update is element by element (cut into element ranges)
ELEMENTWISE = ("SGD", "Adagrad", "RMSprop", "Adam", "AdamW", "NAdam", "RAdam", "Adamax",
               "Adadelta", "ASGD", "Rprop")
#: torch's optimizers whose update needs the whole tensor (one unit per parameter)
WHOLE = ("Adafactor", "Muon")
#: torch's optimizers StoreOptimizer refuses, and why
REFUSED = {
    "LBFGS": "LBFGS keeps a history of flattened gradients and directions over all "
             "parameters and re-evaluates the closure within step(): it has no "
             "per-parameter states to keep in a store",
    "SparseAdam": "SparseAdam updates sparse gradients row by row; a store keeps dense "
                  "states (use StoreOptimizer(torch.optim.Adam, ...) on dense gradients)",
}
_SWITCHES = ("fused", "capturable", "differentiable")
#: ``state_dtype`` values: how the store keeps the class's floating states
STATE_DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def check_state_dtype(value: Any) -> str:
    """``value`` if it is one of :data:`STATE_DTYPES`.

    Raises:
        StateStoreValueError: anything else, naming ``state_dtype``.
    """
    if not isinstance(value, str) or value not in STATE_DTYPES:
        raise StateStoreValueError(f"StoreOptimizer: state_dtype must be one of "
                                   f"{sorted(STATE_DTYPES)}, got {value!r}")
    return value


def class_name(cls: type) -> str:
    """``torch.optim.Adafactor`` for torch's classes, else ``module.QualName``."""
    if getattr(torch.optim, cls.__name__, None) is cls:
        return f"torch.optim.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_torch_class(cls: type, names) -> bool:
    return cls.__name__ in names and getattr(torch.optim, cls.__name__, None) is cls


def check_class(cls: Any) -> None:
    """Refuse what is not a torch optimizer class StoreOptimizer can run.

    Raises:
        TypeError: not a subclass of ``torch.optim.Optimizer`` (or a statestore one).
        StateStoreValueError: LBFGS or SparseAdam (:data:`REFUSED`, with the reason).
    """
    if not isinstance(cls, type) or not issubclass(cls, torch.optim.Optimizer):
        raise TypeError(f"StoreOptimizer: optimizer_cls must be a torch.optim.Optimizer "
                        f"subclass (e.g. torch.optim.Muon), got {cls!r}")
    if getattr(cls, "updates_offloaded_parameters", False):
        raise TypeError(f"StoreOptimizer: {cls.__name__} already keeps its states in a store; "
                        f"build it directly")
    for name, why in REFUSED.items():
        if _is_torch_class(cls, (name,)) or cls.__name__ == name and issubclass(
                cls, getattr(torch.optim, name)):
            raise StateStoreValueError(f"StoreOptimizer does not support {name}: {why}")


def ctor_kwargs(cls: type, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The keyword arguments ``cls`` is built with: the user's, ``foreach=False`` where the
    class takes it (the single-tensor update StoreOptimizer runs).

    Raises:
        StateStoreValueError: ``foreach``, ``fused``, ``capturable`` or ``differentiable``
            set True.
    """
    import inspect
    out = dict(kwargs)
    for k in ("foreach",) + _SWITCHES:
        if out.get(k):
            raise StateStoreValueError(
                f"StoreOptimizer({cls.__name__}, {k}=True): StoreOptimizer runs the "
                f"single-tensor update (what {cls.__name__}(..., foreach=False) computes), one "
                f"pipeline unit at a time; leave {k} unset or False")
    try:
        takes = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        takes = {}
    if "foreach" in takes:
        out["foreach"] = False
    return out


def meta_twin(p: Tensor) -> Tensor:
    """A parameter of ``p``'s local shape and dtype on the meta device (no memory)."""
    w = local(p)
    return torch.empty(w.shape, dtype=w.dtype, device="meta")


class Probe:
    """The states one torch optimizer class keeps for one parameter (see the module
    docstring): ``names`` (store states, in the class's order), ``specs`` (``{name: (shape,
    dtype, on_param_device)}``) and ``step`` (None, ``("tensor", dtype, on_param_device)``
    or ``("number", type)``)."""

    __slots__ = ("names", "specs", "step")

    def __init__(self, cls: type, kwargs: Dict[str, Any], group: Dict[str, Any], p: Tensor,
                 key: str, shape: Optional[Tuple[int, ...]] = None):
        twin = meta_twin(p) if shape is None else \
            torch.empty(shape, dtype=local(p).dtype, device="meta")
        hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        inner = cls([dict(hyper, params=[twin])], **kwargs)
        twin.grad = torch.empty_like(twin)
        failure: Optional[BaseException] = None
        try:
            with torch.no_grad():
                inner.step()
        except Exception as e:      # noqa: BLE001 - data-dependent ops fail on meta tensors
            failure = e
        state = inner.state.get(twin, {})
        if failure is not None and not state:
            raise StateStoreError(
                f"StoreOptimizer({class_name(cls)}): could not learn the states of parameter "
                f"{key!r}: a step of the class on a meta-device copy of it raised "
                f"{type(failure).__name__}: {failure} before creating any state (a class must "
                f"create a parameter's states before its first data-dependent operation; "
                f"see docs/extending.md, \"Adding an optimizer\")") from failure
        self.names: List[str] = []
        self.specs: Dict[str, Tuple[Tuple[int, ...], torch.dtype, bool]] = {}
        self.step: Optional[Tuple] = None
        for name, v in state.items():
            if not isinstance(name, str) or "/" in name:
                raise StateStoreError(f"StoreOptimizer({class_name(cls)}): state name "
                                      f"{name!r} cannot name a store state")
            if name == "step":
                self.step = _step_kind(cls, v, key)
            elif isinstance(v, Tensor):
                self.names.append(name)
                self.specs[name] = (tuple(v.shape), v.dtype, v.device.type == "meta")
            else:
                raise StateStoreError(
                    f"StoreOptimizer({class_name(cls)}) keeps tensor states in the store; the "
                    f"class keeps {name!r} = {type(v).__name__} for parameter {key!r}")


def _step_kind(cls: type, v: Any, key: str) -> Tuple:
    """How ``cls`` keeps ``"step"`` (its value ``v`` in a probe): ``("tensor", dtype,
    on_param_device)`` for a 0-dim tensor, ``("number", int|float)`` for a number.

    Raises:
        StateStoreError: any other ``"step"`` (a tensor with elements, as a state shaped like
            the parameter named ``"step"``): StoreOptimizer rebuilds ``"step"`` from the
            parameter's step count for each update and would hand the class a scalar.
    """
    if isinstance(v, Tensor) and v.dim() == 0:
        return "tensor", v.dtype, v.device.type == "meta"
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return "number", type(v)
    what = (f"a tensor of shape {tuple(v.shape)}" if isinstance(v, Tensor)
            else f"a {type(v).__name__}")
    raise StateStoreError(
        f"StoreOptimizer({class_name(cls)}): the class keeps a state named 'step' that is "
        f"{what} for parameter {key!r}; StoreOptimizer keeps \"step\" as the parameter's step "
        f"count (a number or a 0-dim tensor, as torch's classes keep it) and rebuilds it for "
        f"each update, so it cannot keep that state: give it another name in the class")


#: probes a layout keeps (least recently used dropped beyond): a key is the structure of the
#: hyperparameters, not their values, so a training run needs a handful
_MAX_PROBES = 256


def _structure(v: Any) -> Any:
    """What of a hyperparameter's value can decide which states a class keeps, their shapes
    and dtypes: a float's sign (zero, positive, negative, not finite), never its value (an LR
    scheduler changes ``lr`` every step; a momentum schedule may cross zero); bools, ints,
    strings and None as they are; a tensor's dtype, shape and device; containers element by
    element; any other object by identity (the group holds it)."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        if v != v:
            return ("f", "nan")
        return ("f", (v > 0) - (v < 0), math.isinf(v))
    if isinstance(v, Tensor):
        return ("t", v.dtype, tuple(v.shape), v.device.type)
    if isinstance(v, (tuple, list)):
        return (type(v).__name__,) + tuple(_structure(x) for x in v)
    return ("o", type(v).__qualname__, id(v))


_MISSING = object()


def _immutable(v: Any) -> bool:
    """Whether ``v`` cannot change in place (a number, string, None, or a tuple of those)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    return type(v) is tuple and all(_immutable(x) for x in v)


def group_structure(group: Dict[str, Any]) -> Tuple:
    """The key of ``group``'s probes: :func:`_structure` of each hyperparameter."""
    return tuple(sorted((str(k), _structure(v)) for k, v in group.items()
                        if k not in ("params", "param_names")))


class TorchLayout(StateLayout):
    """The states of ``cls`` (built with ``kwargs``), probed per parameter shape, dtype and
    group hyperparameters; ``elementwise``: whether its update is element by element;
    ``state_dtype``: ``"fp32"`` (states kept as the class keeps them) or ``"bf16"`` (its
    floating states kept as bf16: :meth:`spec` is the store's dtype, :meth:`class_dtype`
    the class's, torch's format the class's)."""

    def __init__(self, cls: type, kwargs: Dict[str, Any], elementwise: bool,
                 state_dtype: str = "fp32"):
        super().__init__()
        self.cls, self.kwargs, self.elementwise = cls, kwargs, elementwise
        self.state_dtype = check_state_dtype(state_dtype)
        #: the dtype floating states are kept in (None: the class's own)
        self.low: Optional[torch.dtype] = STATE_DTYPES[state_dtype]
        self.name = class_name(cls)
        #: probes by (shape, dtype, group structure), least recently used first (bounded)
        self._probes: "OrderedDict[Tuple, Probe]" = OrderedDict()
        #: every state name a probe showed, in order (kept when a probe is dropped)
        self._seen: Dict[str, None] = {}
        #: each parameter's last probe (a parameter's states asked without its group)
        self._last: Dict[Tensor, Probe] = {}
        self._groups: List[dict] = []
        self._keys: Dict[Tensor, str] = {}
        self._step: Optional[Tuple] = None
        #: during a step (:meth:`stepping`): each group's structure, by ``id``, computed once
        self._structures: Optional[Dict[int, Tuple]] = None
        #: each group's structure with the hyperparameters it was computed from (by ``id``)
        self._known: Dict[int, Tuple] = {}

    def bind(self, param_groups: List[dict], keys: Dict[Tensor, str]) -> None:
        """The optimizer's groups and parameter keys (for states asked by parameter)."""
        self._groups, self._keys = param_groups, keys

    def stepping(self, on: bool) -> None:
        """A step begins (``on``) or ends: while it runs, hyperparameters do not change, so
        each group's structure is computed once."""
        self._structures = {} if on else None

    def structure_of(self, group: Dict[str, Any]) -> Tuple:
        """:func:`group_structure` of ``group`` (once per step while :meth:`stepping`; across
        steps while its hyperparameters are the same objects, all immutable)."""
        memo = self._structures
        if memo is not None:
            got = memo.get(id(group))
            if got is not None and got[0] is group:
                return got[1]
        known = self._known.get(id(group))
        if known is not None and known[0] is group and len(group) == known[1] and all(
                map(is_, map(group.get, known[2], repeat(_MISSING)), known[3])):
            structure = known[4]
        else:
            structure = group_structure(group)
            hyper = [(k, v) for k, v in group.items() if k not in ("params", "param_names")]
            if all(_immutable(v) for _, v in hyper):
                if len(self._known) >= 64:
                    self._known.clear()
                # the values held: their ids are not reused while the entry lives
                self._known[id(group)] = (group, len(group), tuple(k for k, _ in hyper),
                                          tuple(v for _, v in hyper), structure)
        if memo is not None:
            memo[id(group)] = (group, structure)
        return structure

    def probe(self, p: Tensor, group: Optional[Dict[str, Any]] = None,
              name: Optional[str] = None) -> Probe:
        """The states of ``p`` in ``group`` (default: its own group; ``name``: ``p``'s name
        for messages, default its key). One probe serves every parameter of a shape and dtype
        in groups of one structure (:func:`group_structure`), whatever their values."""
        if group is None:
            group = next((g for g in self._groups if any(q is p for q in g["params"])), {})
        w = local(p)
        # a class needing the whole tensor, over a sharded parameter: the states of the whole
        # parameter, those shaped like it kept as the shard's (optim/_whole.py)
        whole = tuple(p.shape) if not self.elementwise and sharded_over_ranks(p) else None
        key = (tuple(w.shape), w.dtype, self.structure_of(group), whole)
        probes = self._probes
        pr = probes.get(key)
        if pr is None:
            pr = Probe(self.cls, self.kwargs, group, p,
                       name if name is not None else self._keys.get(p, "?"), shape=whole)
            if whole is not None:
                for n, (shape, dtype, on_dev) in pr.specs.items():
                    if tuple(shape) == whole:
                        pr.specs[n] = (tuple(w.shape), dtype, on_dev)
            probes[key] = pr
            if len(probes) > _MAX_PROBES:
                probes.popitem(last=False)
            for n in pr.names:
                self._seen.setdefault(n, None)
        elif len(probes) > 1:
            probes.move_to_end(key)
        self._last[p] = pr
        if self._step is None and pr.step is not None:
            self._step = pr.step
        return pr

    def probe_count(self) -> int:
        """How many probes the layout keeps (bounded: :data:`_MAX_PROBES`)."""
        return len(self._probes)

    def probe_of(self, p: Tensor) -> Probe:
        """``p``'s last probe (its states as its group last asked for them), else
        :meth:`probe` in its own group."""
        pr = self._last.get(p)
        return pr if pr is not None else self.probe(p)

    def step_kind(self) -> Optional[Tuple]:
        """How the class keeps ``"step"`` (from the probes so far)."""
        return self._step

    # ------------------------------------------------------------------ states
    def names(self, p: Tensor, group: Dict[str, Any]) -> List[str]:
        return list(self.probe(p, group).names)

    def known(self, name: str) -> bool:
        return name in self.all_names()

    def all_names(self) -> List[str]:
        return list(self._seen)

    def describe(self, owner: str) -> str:
        return f"StoreOptimizer({self.name}) keeps {self.all_names()}"

    def stored_problem(self, name: str, p: Tensor, group: Dict[str, Any]) -> Optional[str]:
        if name not in self.probe(p, group).names:
            return (f"state {name!r} is not one {self.name} keeps for it "
                    f"({self.probe(p, group).names})")
        return None

    def spec(self, name: str, p: Tensor) -> Tuple[Tuple[int, ...], torch.dtype]:
        pr = self.probe_of(p)
        if name not in pr.specs:
            raise StateStoreValueError(f"parameter {self._keys.get(p, '?')!r}: {self.name} "
                                       f"keeps no state {name!r} (it keeps {pr.names})")
        shape, dtype, _ = pr.specs[name]
        low = self.low
        if low is not None and dtype.is_floating_point and dtype.itemsize > low.itemsize:
            dtype = low
        return shape, dtype

    def class_dtype(self, name: str, p: Tensor) -> torch.dtype:
        """The dtype the class keeps state ``name`` of ``p`` in (what it is handed and what
        torch's format holds; :meth:`spec`'s where ``state_dtype`` is ``"fp32"``)."""
        return self.probe_of(p).specs[name][1]

    def on_param_device(self, name: str, p: Tensor) -> bool:
        return self.probe_of(p).specs[name][2]

    # ------------------------------------------------------------------ units
    def divisible(self, p: Tensor, group: Dict[str, Any]) -> bool:
        if not self.elementwise or local(p).dtype not in (torch.float32, torch.float64):
            return False
        n = local(p).numel()
        return all(math.prod(s) in (n, 1) for s, _, _ in self.probe(p, group).specs.values())

    def cut_elems(self, store, align: int) -> int:
        """The base's cut (``align``: the fp32 states' elements); states kept as bf16 also
        start each slice on the store's alignment (twice the elements of an fp32 state)."""
        need = max(1, align)
        low = self.low
        if low is None:
            return need
        step = max(1, (store.alignment if not store.resident else 1) // low.itemsize)
        return need * step // math.gcd(need, step)

    # ------------------------------------------------------------------ hyperparameters
    def check_group(self, group: Dict[str, Any]) -> None:
        """The class's own constructor checks (torch's messages), over meta copies of the
        group's parameters; the states of every parameter probed, those of each DTensor
        parameter sharded over several ranks as :meth:`_check_sharded` says: a class keeping
        what the store cannot (a non-scalar "step", a non-tensor state) is refused before any
        step."""
        names = group.get("param_names") or []
        hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        params = [meta_twin(p) for p in group.get("params", ()) if isinstance(p, Tensor)]
        if params:
            self.cls([dict(hyper, params=params)], **self.kwargs)
        memo, self._structures = self._structures, {}
        try:
            for i, p in enumerate(group.get("params", ())):
                if isinstance(p, Tensor):
                    name = names[i] if i < len(names) else self._keys.get(p, f"#{i}")
                    if sharded_over_ranks(p):
                        self._check_sharded(p, name, group)
                    self.probe(p, group, name=name)
        finally:
            self._structures = memo

    def _check_sharded(self, p: Tensor, name: str, group: Dict[str, Any]) -> None:
        """A DTensor parameter ``p`` sharded over several ranks: each rank keeps its shard of
        the states shaped like the parameter and, whole, the others (per-parameter scalars
        such as NAdam's ``mu_product``, Adafactor's row and column variances: the same on
        every rank, saved once); a class needing the whole tensor updates it gathered
        (optim/_whole.py). Probing here makes a class whose states cannot be learnt fail at
        construction."""
        self.probe(p, group, name=name)

    def metadata(self) -> Dict[str, Any]:
        return {"optimizer_class": self.name, "step_format": _step_format(self._step),
                "state_dtype": self.state_dtype}

    def resume_problem(self, meta: Dict[str, Any], stored: bool) -> Optional[str]:
        saved_dtype = meta.get("state_dtype", "fp32")
        if saved_dtype != self.state_dtype and (stored or "state_dtype" in meta):
            return (f"the store holds states of state_dtype={saved_dtype!r}, this optimizer "
                    f"keeps state_dtype={self.state_dtype!r} (move them through "
                    f"state_dict() to convert)")
        saved = meta.get("optimizer_class")
        if saved is not None and saved != self.name:
            return (f"the store holds the states of StoreOptimizer({saved}), this optimizer "
                    f"is StoreOptimizer({self.name})")
        if saved is None and stored and meta.get("optimizer"):
            return (f"the store holds the states of {meta['optimizer']}, this optimizer is "
                    f"StoreOptimizer({self.name}): move them through state_dict()")
        return None

    # ------------------------------------------------------------------ torch's format
    def torch_step(self, count: int) -> Any:
        return make_step(self._step, count, None)

    def torch_spec(self, name: str, p: Tensor) -> Tuple[Tuple[int, ...], torch.dtype]:
        return self.spec(name, p)[0], self.class_dtype(name, p)

    def export(self, store, params) -> Dict[Any, Tensor]:
        """The base's, states kept in a lower dtype than the class's (``state_dtype="bf16"``)
        converted to the class's (exactly: bf16 to fp32 loses nothing)."""
        out = super().export(store, params)
        if self.low is None:
            return out
        for k, p, g in params:
            for n in self.torch_names(p, g):
                sk = StateKey(k, n)
                t = out.get(sk)
                if t is not None:
                    cd = self.class_dtype(n, p)
                    if t.dtype != cd:
                        out[sk] = t.to(cd)
        return out


def make_step(kind: Optional[Tuple], count: int, device) -> Any:
    """``"step"`` as a class of ``kind`` keeps it after ``count`` steps (None: none)."""
    if kind is None:
        return None
    if kind[0] == "tensor":
        dev = device if kind[2] and device is not None else "cpu"
        return torch.tensor(float(count), dtype=kind[1], device=dev)
    return kind[1](count)


def _step_format(kind: Optional[Tuple]) -> Optional[str]:
    if kind is None:
        return None
    if kind[0] == "tensor":
        return "tensor:" + str(kind[1]).replace("torch.", "")
    return kind[1].__name__


class SavedLayout(StateLayout):
    """A :class:`~statestore.optim.StoreOptimizer` checkpoint's metadata read into torch's
    format (``statestore convert --to torch``): groups as saved, ``"step"`` as the class
    keeps it (its ``step_format``)."""

    impl_keys = IMPL_KEYS

    def __init__(self, metadata: Dict[str, Any]):
        super().__init__()
        fmt = metadata.get("step_format")
        self._step = None
        if isinstance(fmt, str) and fmt.startswith("tensor:"):
            self._step = ("tensor", getattr(torch, fmt.split(":", 1)[1], torch.float32), False)
        elif fmt in ("int", "float"):
            self._step = ("number", int if fmt == "int" else float)

    def torch_step(self, count: int) -> Any:
        return make_step(self._step, count, None)

    def group_metadata(self, group: Dict[str, Any]) -> Dict[str, Any]:
        return json_group(group, self.impl_keys)
