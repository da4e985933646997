"""Argument checks of the store-backed Adam optimizers: torch's checks and messages for the
hyperparameters (``ValueError("Invalid learning rate: -1")``), a ``TypeError`` naming the
argument where torch would fail comparing a non-number, and the checks of our own arguments
(stores, offload fraction, ``update_in_backward``, parameters)."""
from __future__ import annotations

import math
import numbers
import warnings
from typing import Dict, Optional, Sequence

import torch
from torch import Tensor

from ..errors import StateStoreClosedError, StateStoreError, StateStoreValueError
from ..store import StateStore

__all__ = ["is_real", "validate_hyper", "check_arguments", "check_params", "grad_scale_of",
           "FLOATS"]

#: parameter dtypes the optimizers accept
FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def is_real(x) -> bool:
    """A real number (numpy scalars included), not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def grad_scale_of(div_scale, update_in_backward: bool = False) -> Optional[float]:
    """What ``step(div_scale=...)`` divides gradients by: ``div_scale`` when it is > 0, else
    None: no scaling (None and the default -1, ColossalAI's convention). Checked before a step
    changes anything.

    Raises:
        TypeError: not a real number (or a one-element tensor).
        StateStoreValueError: nan or infinite (dividing by it would make every updated
            parameter nan or leave it unchanged; nan never means "no scaling"), or a scale
            with ``update_in_backward`` (backward applied the gradients unscaled).
    """
    if div_scale is None:
        return None
    if isinstance(div_scale, Tensor) and div_scale.numel() == 1:
        value = float(div_scale.item())
    elif is_real(div_scale):
        value = float(div_scale)
    else:
        raise TypeError(f"div_scale must be a float, got {div_scale!r}")
    if math.isnan(value) or math.isinf(value):
        raise StateStoreValueError(
            f"div_scale must be a finite number (> 0 divides the gradients by it, <= 0 or "
            f"None means no scaling), got {value}; nothing was changed. A loss scaler that "
            f"found inf or nan gradients should skip the step instead (skip_nonfinite=True)")
    if value > 0 and update_in_backward:
        raise StateStoreValueError(
            "update_in_backward: step(div_scale=...) is not supported (backward has already "
            "applied the gradients it produced, unscaled); unscale the loss instead, or set "
            "optimizer.update_in_backward = False. Nothing was changed: call step() without "
            "div_scale to finish this step")
    return value if value > 0 else None


def validate_hyper(lr, betas, eps, weight_decay) -> None:
    """Check one param group's hyperparameters as ``torch.optim.AdamW`` does.

    Raises:
        ValueError: a value out of range (torch's message), or ``betas`` not a pair.
        TypeError: a value that is not a number, naming the argument.
    """
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        lr = lr.item()
    eps, weight_decay = (v.item() if isinstance(v, Tensor) and v.numel() == 1 else v
                         for v in (eps, weight_decay))
    for name, v in (("learning rate", lr), ("epsilon value", eps),
                    ("weight_decay value", weight_decay)):
        if not is_real(v):
            raise TypeError(f"Invalid {name}: {v!r} (expected a float)")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    try:
        b0, b1 = betas
    except (TypeError, ValueError):
        raise ValueError(f"Invalid betas: {betas!r} (expected a pair of floats)") from None
    for i, b in enumerate((b0, b1)):
        if isinstance(b, Tensor) and b.numel() == 1:
            b = b.item()
        if not is_real(b):
            raise TypeError(f"Invalid beta parameter at index {i}: {b!r} (expected a float)")
    if not 0.0 <= b0 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {b0}")
    if not 0.0 <= b1 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {b1}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def check_arguments(owner: str, *, state_store, nvme_offload_fraction, nvme_offload_dir,
                    bias_correction, unused: Dict, skip_nonfinite, process_group,
                    update_in_backward, release_grads) -> None:
    """The constructor's checks of everything but the hyperparameters and ``moment_dtype``
    (``owner``: the optimizer's class name, for messages). Warns (``UserWarning``) where
    ``nvme_offload_dir`` has no effect.

    Raises:
        ValueError, TypeError: an argument of the wrong value or type, named.
        StateStoreClosedError: ``state_store`` is closed.
        StateStoreError: ``update_in_backward`` on a torch without the hook it needs.
    """
    if not bias_correction:
        raise ValueError("bias_correction=False is not supported (results would differ "
                         "from torch.optim.AdamW)")
    if unused:
        raise TypeError(f"{owner} got unexpected keyword arguments: {sorted(unused)}")
    if isinstance(nvme_offload_fraction, bool) \
            or not isinstance(nvme_offload_fraction, (int, float)) \
            or not 0.0 <= float(nvme_offload_fraction) <= 1.0:
        raise ValueError(f"Invalid nvme_offload_fraction: {nvme_offload_fraction!r} "
                         f"(expected a float in [0, 1])")
    if state_store is not None and not isinstance(state_store, StateStore):
        raise TypeError(f"state_store must be a statestore.StateStore, got "
                        f"{type(state_store).__name__}")
    if state_store is not None and nvme_offload_fraction > 0:
        raise ValueError("pass either state_store or nvme_offload_fraction, not both")
    if nvme_offload_dir is not None and not nvme_offload_fraction:
        where = "in the state_store passed" if state_store is not None else "in RAM"
        warnings.warn(f"nvme_offload_dir={nvme_offload_dir!r} has no effect without "
                      f"nvme_offload_fraction > 0: optimizer states stay {where}; pass "
                      f"nvme_offload_fraction=1.0 to keep them on disk under that directory",
                      UserWarning, stacklevel=3)
    if state_store is not None and state_store.closed:
        raise StateStoreClosedError(f"state_store: the {type(state_store).__name__} is closed")
    if not isinstance(update_in_backward, bool):
        raise TypeError(f"update_in_backward must be a bool, got {update_in_backward!r}")
    if not isinstance(release_grads, bool):
        raise TypeError(f"release_grads must be a bool, got {release_grads!r}")
    if release_grads and not update_in_backward:
        raise ValueError("release_grads=True needs update_in_backward=True (gradients are "
                         "applied, and can be released, during backward only then)")
    if update_in_backward and skip_nonfinite:
        raise ValueError("update_in_backward=True cannot be combined with skip_nonfinite=True "
                         "(parameters are updated before every gradient is known)")
    if update_in_backward and process_group is not None:
        raise ValueError("update_in_backward=True cannot be combined with process_group "
                         "(gradients are averaged over the group only after backward)")
    if update_in_backward and not hasattr(Tensor, "register_post_accumulate_grad_hook"):
        raise StateStoreError("update_in_backward=True needs "
                              "Tensor.register_post_accumulate_grad_hook (torch >= 2.1)")


def check_params(params: Sequence, keys: Dict[Tensor, str]) -> None:
    """Every parameter a dense float tensor with data.

    Raises:
        TypeError: not a tensor, another dtype, or sparse.
        StateStoreValueError: on the meta device.
    """
    for p in params:
        if not isinstance(p, Tensor):
            raise TypeError(f"optimizer can only optimize Tensors, got {type(p).__name__}")
        if p.dtype not in FLOATS:
            raise TypeError(f"parameter {keys[p]!r} has dtype {p.dtype}; "
                            f"expected float32, float16 or bfloat16")
        if p.is_sparse:
            raise TypeError(f"parameter {keys[p]!r} is sparse; not supported")
        if p.is_meta:
            raise StateStoreValueError(f"parameter {keys[p]!r} is on the meta device, "
                                       f"which holds no data; materialize it first")
