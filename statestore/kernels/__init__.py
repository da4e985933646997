"""Adam/AdamW update kernels, dispatched by device: C++ SIMD on CPU, fused CUDA on GPU,
the vectorized torch reference as the fallback (see ``docs/kernels.md``).

The optimizers call :func:`adam_step` (:func:`adam_step_moments` for compressed moments)
and :func:`grads_finite` only. Every Adam entry point (the two and the reference,
:func:`adam_step_reference`) takes the same three things: the tensors
(:class:`AdamTensors`), the hyperparameters (:class:`AdamHyper`, built from a param group
by :meth:`AdamHyper.of_group`) and, for compressed moments, their codes
(:class:`MomentCodes`); both update functions run one compiled op,
``torch.ops.statestore.adam_`` (an :class:`AdamHyper` is its ``hyper`` argument as it is, the
moments' encoding is an argument); kernels never touch stores. :func:`stream_copy_` is the copy stores use to fill a ring buffer bound for disk.
"""
from __future__ import annotations

from ._dispatch import (AdamHyper, AdamTensors, adam_step, grads_finite, kernels_info, set_simd,
                        stream_copy_)
from ._moments import MomentCodes, adam_step_moments
from ._reference import adam_step_reference

__all__ = ["AdamHyper", "AdamTensors", "MomentCodes", "adam_step", "adam_step_moments",
           "adam_step_reference", "grads_finite", "kernels_info", "set_simd", "stream_copy_"]

#: the name the kernel tests and benchmarks have used for :func:`set_simd`
_set_simd = set_simd
