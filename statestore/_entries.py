"""Validation of what callers hand a store: ``create_many`` entries and the tensors ``put``
and ``create``'s ``init`` copy into states; and :func:`with_initial_values`, which leaves no
state a creation made without its initial value."""
from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from ._signals import deferred_signals
from ._types import MAX_NDIM, StateKey, StateSpec, as_key, check_key
from .errors import StateKeyError, StateStoreValueError

__all__ = ["SUPPORTED_DTYPES", "check_entries", "check_value", "data_problem",
           "with_initial_values"]

#: dtypes a state may have (those of the checkpoint format)
SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
_MAX_NBYTES = 2 ** 63 - 1           # a state's bytes must fit an int64 (checkpoint manifests)


def data_problem(value: torch.Tensor) -> Optional[str]:
    """Why ``value`` cannot be copied into a state (None when it can)."""
    if value.layout != torch.strided:
        return f"is a {value.layout} tensor; a dense (strided) tensor is needed"
    if value.is_meta:
        return "is on the meta device, which holds no data"
    return None


def check_entries(entries: Iterable[Tuple[Any, Sequence[int], torch.dtype, Optional[torch.Tensor]]],
                  existing) -> Tuple[List[Tuple[StateKey, StateSpec]],
                                     List[Tuple[StateKey, torch.Tensor]]]:
    """Validate ``create_many``'s entries against the keys in ``existing``.

    Returns:
        ``(new, inits)``: ``(key, spec)`` of every new state, and ``(key, init)`` of those
        with an initial value.

    Raises:
        StateStoreValueError: an entry is malformed (names the state and what is wrong).
        StateKeyError: a key exists already or appears twice.
    """
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
        k = check_key(as_key(key))      # the door: every form, StateKey included
        if k in existing or k in seen:
            raise StateKeyError(f"state {k} already exists")
        if not isinstance(dtype, torch.dtype) or dtype not in SUPPORTED_DTYPES:
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
            problem = data_problem(init)
            if problem:
                raise StateStoreValueError(f"state {k}: init {problem}")
            if tuple(init.shape) != shape_t:
                raise StateStoreValueError(f"state {k}: init has shape {tuple(init.shape)}, "
                                           f"expected {shape_t}")
            inits.append((k, init))
        seen.add(k)
        new.append((k, spec))
    return new, inits


def check_value(key: StateKey, spec: StateSpec, value) -> None:
    """Validate a value to copy into the state ``key`` of ``spec``.

    Raises:
        StateStoreValueError: ``value`` is not a dense tensor of the state's shape.
    """
    if not isinstance(value, torch.Tensor):
        raise StateStoreValueError(f"state {key}: value must be a tensor, got {type(value).__name__}")
    problem = data_problem(value)
    if problem:
        raise StateStoreValueError(f"state {key}: value {problem}")
    if tuple(value.shape) != spec.shape:
        raise StateStoreValueError(f"state {key}: value has shape {tuple(value.shape)}, "
                                   f"expected {spec.shape}")


@contextlib.contextmanager
def with_initial_values(store, new: List[Tuple[StateKey, StateSpec]],
                        inits: List[Tuple[StateKey, torch.Tensor]]) -> Iterator[None]:
    """``with with_initial_values(store, new, inits): create the states of new``: after the
    block, ``inits``' values are put into their states; on any exception, in the block or
    after it (a Ctrl-C included), the states of ``new`` that exist are removed again, with
    signals deferred, and the exception goes on: never a state without its initial value.
    (A Ctrl-C between the creation and the initial writes of a first step left a bf16
    parameter's fp32 master zero with its step count 0, and the step made again took that
    zero for the parameter's value: issue 47, ``benchmarks/soak.py --interrupts``.)"""
    try:
        yield
        for k, init in inits:
            store.put(k, init)
    except BaseException:
        with deferred_signals():
            for _ in range(2):      # the first wait may raise a failed initial write's error
                made = [k for k, _ in new if k in store]
                try:
                    if made:
                        store.delete(made)
                    break
                except Exception:
                    continue
        raise
