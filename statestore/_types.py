"""Small value types shared by stores, the pipeline, the checkpoint code and the optimizers."""
from __future__ import annotations

import reprlib
from dataclasses import dataclass
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from .errors import StateStoreValueError

#: Most dimensions a state's shape may have (stores and checkpoint manifests alike).
MAX_NDIM = 64

__all__ = ["StateKey", "StateSpec", "Slice", "LinkableFile", "as_key", "check_key", "key_problem",
           "short_repr", "DTYPE_NAMES", "MAX_NDIM", "dtype_from_name", "dtype_name"]


class StateKey(NamedTuple):
    """Names one state tensor: the parameter's key and the state's name.

    ``param`` is the parameter's name (from ``named_parameters()``) or its index in torch's
    ``state_dict()`` numbering, as a string; ``state`` is e.g. ``"exp_avg"``. Keys are stable
    across processes: never an ``id()``.
    """

    param: str
    state: str

    def __str__(self) -> str:
        return f"{self.param}/{self.state}"

    @classmethod
    def parse(cls, text: str) -> "StateKey":
        """Inverse of ``str(key)``: splits at the last ``/``."""
        param, sep, state = text.rpartition("/")
        if not sep or not param or not state:
            raise ValueError(f"not a state key (expected 'param/state'): {short_repr(text)}")
        return cls(param, state)


def short_repr(value, limit: int = 120) -> str:
    """``repr(value)`` cut to about ``limit`` characters (before formatting: never a copy of
    a long string), with a long string's length: keys in messages stay short."""
    r = reprlib.Repr()
    r.maxstring = r.maxother = r.maxlong = limit
    r.maxlevel = 2
    text = r.repr(value)
    if isinstance(value, str) and len(value) > limit:
        text += f" ({len(value)} characters)"
    return text


def key_problem(param, state) -> Optional[str]:
    """What makes ``(param, state)`` no state key (None when nothing does): the rules the
    checkpoint reader applies to every manifest row, so a store never holds a state its own
    checkpoint could not load (``docs/errors.md``, "State keys")."""
    if not isinstance(param, str) or not isinstance(state, str):
        return (f"param and state must be str, got {type(param).__name__} and "
                f"{type(state).__name__}")
    if not param:
        return "the parameter name is empty"
    if not state:
        return "the state name is empty"
    if "/" in state:
        return "a state name cannot contain '/' (str(key) would name another state)"
    if not (param.isascii() and state.isascii()):
        try:
            param.encode("utf-8")
            state.encode("utf-8")
        except UnicodeEncodeError:
            return "not encodable as UTF-8 (a lone surrogate)"
    return None


def check_key(key: "StateKey") -> "StateKey":
    """``key`` (a :class:`StateKey`) if it is a valid state key, else
    :class:`StateStoreValueError` naming it and what is wrong: the door every new state
    passes (``StateStore.create_many``)."""
    problem = key_problem(key.param, key.state)
    if problem is not None:
        raise StateStoreValueError(f"state key ({short_repr(key.param)}, "
                                   f"{short_repr(key.state)}): {problem}")
    return key


def as_key(key) -> StateKey:
    """``key`` as a :class:`StateKey`: a StateKey, a ``(param, state)`` tuple of str or a
    ``"param/state"`` string. The tuple and string forms are checked as keys are at
    creation (:func:`check_key`), so ``("a", "")`` is refused as ``"a/"`` is; a StateKey is
    taken as it is (a lookup of an invalid one finds no state).

    Raises:
        StateStoreValueError: ``key`` is none of these, or not a valid key.
    """
    if isinstance(key, StateKey):
        return key
    if isinstance(key, tuple) and len(key) == 2 and all(isinstance(k, str) for k in key):
        return check_key(StateKey(*key))
    if isinstance(key, str):
        try:
            return check_key(StateKey.parse(key))
        except ValueError as e:
            raise StateStoreValueError(str(e)) from None
    raise StateStoreValueError(f"a state key must be a StateKey, a (param, state) tuple of str "
                               f"or a 'param/state' string, got {short_repr(key)}")


@dataclass(frozen=True)
class StateSpec:
    """Shape and dtype of one state tensor."""

    shape: Tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize      # (an empty tensor per call cost 5 us, 4000x a step)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class Slice:
    """Elements ``[start, stop)`` of the flattened state ``key``."""

    key: StateKey
    start: int
    stop: int

    def __post_init__(self) -> None:
        # "param/state" strings and (param, state) tuples name the same state as a StateKey
        # (others are left for the store to reject by name).
        k = self.key
        if isinstance(k, str):
            try:
                object.__setattr__(self, "key", StateKey.parse(k))
            except ValueError:
                pass
        elif isinstance(k, tuple) and not isinstance(k, StateKey) and len(k) == 2 \
                and all(isinstance(x, str) for x in k):
            object.__setattr__(self, "key", StateKey(*k))

    @property
    def numel(self) -> int:
        return self.stop - self.start


class LinkableFile(NamedTuple):
    """A state file a checkpoint can take as a shard (``store.links.linkable``).

    ``rows``: ``(key, absolute byte offset)`` of the states in it; ``hashes``: checksums of
    its states' bytes already known (the checkpoint adds the ones it computes); ``link(dst)``
    freezes the file (the store never writes it again: later writes of its states go to a new
    file) and hard-links it as ``dst``, raising ``OSError`` where it cannot; ``link(dst,
    mapped=True)``: ``dst`` will be mapped and removed, and the file must stay frozen even
    once nothing else links it (a ``state_dict()`` snapshot)."""

    rows: List[Tuple[StateKey, int]]
    hashes: Dict[StateKey, str]
    link: Callable[..., None]


# safetensors' dtype names, which the checkpoint manifest also uses.
DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
_NAME_TO_DTYPE = {v: k for k, v in DTYPE_NAMES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"unsupported state dtype {dtype}") from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _NAME_TO_DTYPE[name]
    except KeyError:
        raise ValueError(f"unknown dtype name {name!r}") from None
