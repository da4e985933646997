"""The vectorized torch Adam/AdamW update: the reference every compiled kernel is checked
against, and the fallback used where the C++/CUDA extension is missing.

It follows ``torch.optim.adam._single_tensor_adam`` operation by operation, so results agree
with ``torch.optim.AdamW`` / ``torch.optim.Adam`` to float32 rounding.
"""
from __future__ import annotations

import math

import torch

__all__ = ["adam_step_reference"]


def adam_step_reference(tensors, hyper) -> None:
    """Apply one Adam step in place to every tensor of ``tensors``
    (:class:`~statestore.kernels.AdamTensors`) with ``hyper``
    (:class:`~statestore.kernels.AdamHyper`).

    ``steps[i]`` is the step number of tensor ``i`` after this update (1 for the first step).
    Where ``masters[i]`` is a tensor, it is the fp32 master copy of the low-precision
    ``params[i]``: the update is computed on the master, then copied into the parameter in its
    own dtype. Gradients may be fp32, fp16 or bf16; they are divided by ``grad_scale``.
    """
    h = hyper
    lr, beta1, beta2, eps, weight_decay = h.lr, h.beta1, h.beta2, h.eps, h.weight_decay
    adamw_mode, amsgrad, maximize, grad_scale = h.adamw_mode, h.amsgrad, h.maximize, h.grad_scale
    params, grads, exp_avgs, exp_avg_sqs, steps, max_exp_avg_sqs, masters = tensors
    for i, p in enumerate(params):
        master = masters[i] if masters is not None else None
        w = master if master is not None else p
        g = grads[i]
        if g.dtype != w.dtype or grad_scale != 1.0 or maximize:
            # float32 math for fp32/bf16/fp16 states; float64 where the states are float64
            # (the tests' high-precision reference)
            g = g.to(torch.float64 if w.dtype == torch.float64 else torch.float32)
            if grad_scale != 1.0:
                g = g / grad_scale
            if maximize:
                g = -g
        m, v = exp_avgs[i], exp_avg_sqs[i]
        step = steps[i]
        if weight_decay != 0:
            if adamw_mode:
                w.mul_(1 - lr * weight_decay)
            else:
                g = g.add(w, alpha=weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        step_size = lr / bias_correction1
        bc2_sqrt = math.sqrt(bias_correction2)
        if amsgrad:
            vmax = max_exp_avg_sqs[i]
            torch.maximum(vmax, v, out=vmax)
            denom = (vmax.sqrt() / bc2_sqrt).add_(eps)
        else:
            denom = (v.sqrt() / bc2_sqrt).add_(eps)
        w.addcdiv_(m, denom, value=-step_size)
        if master is not None:
            p.copy_(master)
