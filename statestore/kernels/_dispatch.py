"""Dispatch of :func:`adam_step` and :func:`grads_finite` to the compiled kernels.

* CPU tensors: the C++ SIMD kernel of ``statestore._C_adam`` (AVX-512, AVX2 or scalar, chosen
  at run time; ``STATESTORE_SIMD`` or :func:`set_simd` forces one).
* CUDA tensors: the fused multi-tensor CUDA kernel of the same extension when it was built
  with CUDA; otherwise torch's own fused Adam (``torch._fused_adamw_`` / ``_fused_adam_``).
* Anything else, a missing extension, or ``STATESTORE_FORCE_REFERENCE=1``: the vectorized torch
  reference (:func:`adam_step_reference`).

The extension is imported once, on first use; the ``ImportError`` is kept and reported once,
in the warning that announces the fallback, and by :func:`kernels_info`. Tensors the
kernel cannot take as they are (not contiguous, unusual dtypes) go to the reference path,
tensor by tensor, silently: results are the same to float32 rounding.
"""
from __future__ import annotations

import math
import os
import threading
import warnings
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
from torch import Tensor

from ._reference import adam_step_reference

__all__ = ["AdamHyper", "adam_step", "grads_finite", "kernels_info", "stream_copy_", "set_simd"]

_SIMD_NAMES = ("avx512", "avx2", "scalar", "auto")
_KERNEL_GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_lock = threading.Lock()
_state = {
    "loaded": False,     # load_extension() ran
    "ext": None,         # the module statestore._C_adam, or None
    "reason": None,      # why the reference path is used on CPU (str), or None
    "error": None,       # the ImportError, kept
    "warned": set(),     # fallback warnings already given, by key
}


def force_reference() -> bool:
    return os.environ.get("STATESTORE_FORCE_REFERENCE", "") not in ("", "0")


def _warn_once(key: str, message: str) -> None:
    with _lock:
        if key in _state["warned"]:
            return
        _state["warned"].add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _simd_ceiling() -> str:
    """STATESTORE_SIMD's path, or "" for none/auto/an unknown name."""
    want = os.environ.get("STATESTORE_SIMD", "").strip().lower()
    return want if want in ("avx512", "avx2", "scalar") else ""


def simd_supported() -> List[str]:
    """The CPU paths this process may use, best first, always ending in ``"scalar"``.

    The processor's paths, capped by ``STATESTORE_SIMD``: ``STATESTORE_SIMD=avx2`` on an
    AVX-512 host makes the process see the host as an AVX2 host (``avx2``, ``scalar``), and
    ``scalar`` as one without vector units. So the whole suite, benchmarks included, runs
    on an AVX-512 host as on the others (``make test-simd``)."""
    ext = load_extension()
    if ext is None:
        return []
    paths = list(ext.simd_supported())
    cap = _simd_ceiling()
    if cap and cap in paths:
        paths = paths[paths.index(cap):]
    return paths


def _apply_simd_env(ext) -> None:
    """Applies STATESTORE_SIMD, the best path the process may use (a ceiling, see
    :func:`simd_supported`): a path the processor lacks is clamped to the best it has, and
    an unknown name ignored, each with a warning (an environment variable shared by a
    heterogeneous cluster must not stop training)."""
    want = os.environ.get("STATESTORE_SIMD", "").strip().lower()
    if not want:
        return
    if want not in _SIMD_NAMES:
        warnings.warn(f"STATESTORE_SIMD={want!r} is not one of {', '.join(_SIMD_NAMES)}; "
                      f"using the best path this processor supports", RuntimeWarning, stacklevel=4)
        return
    supported = list(ext.simd_supported())
    if want != "auto" and want not in supported:
        warnings.warn(f"STATESTORE_SIMD={want!r}: this processor supports only "
                      f"{', '.join(supported)}; using {supported[0]!r}", RuntimeWarning,
                      stacklevel=4)
        want = supported[0]
    ext.set_simd(want)


def _register_fake() -> None:
    """Shape-only implementation of the mutating op, so that torch.compile / FakeTensor
    tracing (and ``torch.library.opcheck``) can see through it."""
    try:
        @torch.library.register_fake("statestore::adam_")
        def _(params, grads, exp_avgs, exp_avg_sqs, exp_avg_scales, exp_avg_sq_scales,
              max_exp_avg_sqs, masters, step_sizes, bc2_sqrts, seeds, offsets, hyper, moments):
            return None
    except RuntimeError:  # already registered (module reloaded)
        pass


@dataclass(frozen=True)
class AdamHyper:
    """The scalar hyperparameters of one Adam update, as the op ``statestore::adam_`` takes
    them: :meth:`pack` gives its ``hyper`` argument (``csrc/adam_math.h``, ``AdamHyper``)."""
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw_mode: bool
    maximize: bool = False
    grad_scale: float = 1.0

    def pack(self) -> List[float]:
        return [float(self.lr), float(self.beta1), float(self.beta2), float(self.eps),
                float(self.weight_decay), float(self.grad_scale), float(bool(self.adamw_mode)),
                float(bool(self.maximize))]


def run_op(params, grads, exp_avgs, exp_avg_sqs, *, steps, hyper: AdamHyper, moments: str,
           exp_avg_scales=(), exp_avg_sq_scales=(), max_exp_avg_sqs=(), masters=(), seeds=(),
           offsets=()) -> None:
    """One call of the compiled op ``statestore::adam_`` for tensors it takes as they are:
    ``moments`` is its encoding argument ("fp32", "bf16-nearest", "bf16-stochastic",
    "int8-nearest", "int8-stochastic"); ``seeds``: (exp_avg, exp_avg_sq) pairs; the optional
    lists empty where unused (``csrc/adam/adam_checks.h`` documents every argument)."""
    step_sizes, bc2_sqrts = bias_terms(steps, hyper.lr, hyper.beta1, hyper.beta2)
    torch.ops.statestore.adam_(
        list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(exp_avg_scales),
        list(exp_avg_sq_scales), list(max_exp_avg_sqs), list(masters), step_sizes, bc2_sqrts,
        [int(x) for pair in seeds for x in pair], [int(o) for o in offsets], hyper.pack(),
        moments)


def load_extension():
    """Imports the extension once; returns it or None."""
    if _state["loaded"]:
        return _state["ext"]
    with _lock:
        if _state["loaded"]:
            return _state["ext"]
        ext = None
        try:
            from statestore import _C_adam as ext  # noqa: N814
        except ImportError as e:  # missing, or built against another torch
            _state["error"] = e
            _state["reason"] = f"statestore._C_adam failed to import: {e}"
        if ext is not None:
            _register_fake()
            try:
                _apply_simd_env(ext)
            except Exception as e:  # noqa: BLE001 - keep the kernel, report the setting
                warnings.warn(f"STATESTORE_SIMD could not be applied: {e}", RuntimeWarning,
                              stacklevel=3)
        _state["ext"] = ext
        _state["loaded"] = True
        return ext


def set_simd(name: str) -> str:
    """Selects the CPU path for this process: ``"avx512"``, ``"avx2"``, ``"scalar"`` or
    ``"auto"`` (the best of :func:`simd_supported`). Raises :class:`RuntimeError` where the
    path is not in :func:`simd_supported` (the processor lacks it, or ``STATESTORE_SIMD``
    caps the process below it) or the extension is missing, :class:`ValueError` for an
    unknown name. Returns the path now used."""
    if name not in _SIMD_NAMES:
        raise ValueError(f"simd: unknown path {name!r}; expected one of {', '.join(_SIMD_NAMES)}")
    ext = load_extension()
    if ext is None:
        raise RuntimeError(f"simd: the C++ kernels are unavailable ({_state['reason']})")
    allowed = simd_supported()
    if name == "auto":
        name = allowed[0]
    elif name not in allowed and name in ext.simd_supported():
        raise RuntimeError(f"set_simd: STATESTORE_SIMD={_simd_ceiling()} caps this process at "
                           f"{', '.join(allowed)}; {name!r} is above it")
    return ext.set_simd(name)


def kernels_info() -> dict:
    """Which implementation :func:`adam_step` uses: ``cpu`` ("simd" or "reference"), ``simd``
    (path name), ``simd_width`` (bits), ``simd_supported``, ``cuda`` ("fused-cuda",
    "torch-fused", "reference" or "unavailable"), ``threads`` and ``reason`` (why a fallback
    is in use, else None)."""
    ext = load_extension()
    forced = force_reference()
    info = {"extension": ext is not None, "threads": torch.get_num_threads(),
            "reason": _state["reason"], "simd": None, "simd_width": None, "simd_supported": []}
    if ext is not None:
        name, width = ext.simd()
        info.update(simd=name, simd_width=width, simd_supported=simd_supported())
    if forced:
        info["reason"] = "STATESTORE_FORCE_REFERENCE is set"
    info["cpu"] = "simd" if ext is not None and not forced else "reference"
    if not torch.cuda.is_available():
        info["cuda"] = "unavailable"
    elif forced:
        info["cuda"] = "reference"
    elif ext is not None and getattr(ext, "with_cuda", False):
        info["cuda"] = "fused-cuda"
    else:
        info["cuda"] = "torch-fused"
    return info


def bias_terms(steps, lr, beta1, beta2):
    step_sizes, bc2_sqrts = [], []
    for i, s in enumerate(steps):
        s = int(s)
        if s < 1:
            raise ValueError(f"steps[{i}] = {s}: step counts start at 1 (the count after "
                             f"this update)")
        step_sizes.append(lr / (1.0 - beta1 ** s))
        bc2_sqrts.append(math.sqrt(1.0 - beta2 ** s))
    return step_sizes, bc2_sqrts


def _kernel_ok(p, g, m, v, vmax, master) -> bool:
    """True when the compiled kernel takes this tensor as it is."""
    w = master if master is not None else p
    ts = (p, g, m, v, w) if vmax is None else (p, g, m, v, w, vmax)
    n = p.numel()
    for t in ts:
        if t.numel() != n or not t.is_contiguous() or t.device != p.device:
            return False
    if m.dtype != torch.float32 or v.dtype != torch.float32 or w.dtype != torch.float32:
        return False
    if vmax is not None and vmax.dtype != torch.float32:
        return False
    if g.dtype not in _KERNEL_GRAD_DTYPES:
        return False
    if master is not None and p.dtype not in _KERNEL_GRAD_DTYPES:
        return False
    return True


def _check_lists(params, grads, exp_avgs, exp_avg_sqs, steps, amsgrad, max_exp_avg_sqs,
                 masters):
    n = len(params)
    for name, lst in (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs),
                      ("steps", steps)):
        if len(lst) != n:
            raise ValueError(f"adam_step: {name} has {len(lst)} entries, params has {n}")
    if amsgrad and (max_exp_avg_sqs is None or len(max_exp_avg_sqs) != n):
        raise ValueError("adam_step: amsgrad=True needs max_exp_avg_sqs, one tensor per param")
    if masters is not None and len(masters) != n:
        raise ValueError(f"adam_step: masters has {len(masters)} entries, params has {n}")


def _torch_fused_step(idx, params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2,
                      eps, weight_decay, adamw_mode, amsgrad, max_exp_avg_sqs, masters,
                      maximize, grad_scale):
    """torch's fused Adam for the tensors ``idx`` (the GPU fallback). The grads are never
    modified: torch's op unscales its grads in place, so an unscaled copy is passed."""
    by_dtype = {}
    for i in idx:
        master = masters[i] if masters is not None else None
        w = master if master is not None else params[i]
        by_dtype.setdefault(w.dtype, []).append(i)
    op = torch._fused_adamw_ if adamw_mode else torch._fused_adam_
    for dtype, ids in by_dtype.items():
        ws, gs = [], []
        for i in ids:
            master = masters[i] if masters is not None else None
            ws.append(master if master is not None else params[i])
            g = grads[i]
            if grad_scale != 1.0:
                g = g.to(dtype) / grad_scale
            elif g.dtype != dtype:
                g = g.to(dtype)
            gs.append(g)
        st = [torch.tensor(float(steps[i]), dtype=torch.float32, device=ws[0].device) for i in ids]
        op(ws, gs, [exp_avgs[i] for i in ids], [exp_avg_sqs[i] for i in ids],
           [max_exp_avg_sqs[i] for i in ids] if amsgrad else [], st,
           lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
           amsgrad=amsgrad, maximize=maximize)
        for i in ids:
            if masters is not None and masters[i] is not None:
                params[i].copy_(masters[i])


def adam_step(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    *,
    steps: Sequence[int],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool,
    amsgrad: bool = False,
    max_exp_avg_sqs: Optional[Sequence[Tensor]] = None,
    masters: Optional[Sequence[Optional[Tensor]]] = None,
    maximize: bool = False,
    grad_scale: float = 1.0,
) -> None:
    """Applies one Adam/AdamW step in place; same contract as :func:`adam_step_reference`.

    ``steps[i]`` is the step count of tensor ``i`` after this update. All tensors of one call
    are on one device. Where ``masters[i]`` is an fp32 tensor, it is updated and written back
    into ``params[i]`` (fp32, fp16 or bf16) in the same pass.
    """
    if len(params) == 0:
        return
    _check_lists(params, grads, exp_avgs, exp_avg_sqs, steps, amsgrad, max_exp_avg_sqs, masters)
    if not (grad_scale > 0 and math.isfinite(grad_scale)):
        raise ValueError(f"adam_step: grad_scale must be a positive finite number, got {grad_scale}")
    kw = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
              adamw_mode=adamw_mode, maximize=maximize, grad_scale=grad_scale)
    device = params[0].device
    ext = None if force_reference() else load_extension()
    if force_reference():
        _warn_once("forced", "statestore: STATESTORE_FORCE_REFERENCE is set; Adam steps use the "
                             "vectorized torch reference path")
    elif device.type == "cpu" and ext is None:
        _warn_once("cpu", f"statestore: using the vectorized torch Adam on CPU: "
                          f"{_state['reason']}")
    elif device.type == "cuda" and (ext is None or not getattr(ext, "with_cuda", False)):
        why = _state["reason"] or "statestore._C_adam was built without CUDA"
        _warn_once("cuda", f"statestore: using torch's fused Adam on CUDA: {why}")
        with torch.no_grad():
            _torch_fused_step(range(len(params)), params, grads, exp_avgs, exp_avg_sqs, steps,
                              lr, beta1, beta2, eps, weight_decay, adamw_mode, amsgrad,
                              max_exp_avg_sqs, masters, maximize, grad_scale)
        return
    if ext is None or device.type not in ("cpu", "cuda"):
        adam_step_reference(params, grads, exp_avgs, exp_avg_sqs, steps=steps, amsgrad=amsgrad,
                            max_exp_avg_sqs=max_exp_avg_sqs, masters=masters, **kw)
        return

    fast, slow = [], []
    for i in range(len(params)):
        master = masters[i] if masters is not None else None
        vmax = max_exp_avg_sqs[i] if amsgrad else None
        if _kernel_ok(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], vmax, master):
            fast.append(i)
        else:
            slow.append(i)
    with torch.no_grad():
        if fast:
            sel = (lambda lst: [lst[i] for i in fast]) if slow else (lambda lst: list(lst))
            run_op(sel(params), sel(grads), sel(exp_avgs), sel(exp_avg_sqs), steps=sel(steps),
                   hyper=AdamHyper(**kw), moments="fp32",
                   max_exp_avg_sqs=sel(max_exp_avg_sqs) if amsgrad else (),
                   masters=sel(masters) if masters is not None else ())
        if slow:
            pick = lambda lst: [lst[i] for i in slow]  # noqa: E731
            adam_step_reference(pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs),
                                steps=pick(steps), amsgrad=amsgrad,
                                max_exp_avg_sqs=pick(max_exp_avg_sqs) if amsgrad else None,
                                masters=pick(masters) if masters is not None else None, **kw)


def grads_finite(grads: Sequence[Tensor]) -> bool:
    """True when every gradient is finite (no inf or nan); the optimizers skip a step
    otherwise. One pass over each gradient, multi-threaded and vectorized on CPU."""
    if len(grads) == 0:
        return True
    ext = None if force_reference() else load_extension()
    cpu = [g for g in grads if g.device.type == "cpu"]
    other = [g for g in grads if g.device.type != "cpu"]
    if cpu:
        if ext is not None:
            if not torch.ops.statestore.grads_finite(cpu):
                return False
        elif not all(bool(torch.isfinite(g).all()) for g in cpu):
            return False
    if other:
        flags = torch.stack([torch.isfinite(g).all() for g in other])
        return bool(flags.all())
    return True


# Below this, the call's overhead outweighs what streaming stores save.
STREAM_COPY_MIN_BYTES = 1 << 20


def stream_copy_(dst: Tensor, src: Tensor) -> Tensor:
    """``dst.copy_(src)`` for a host buffer headed to a device (a store's ring buffer about to
    be written to disk): with the SIMD path's non-temporal stores, which leave the caches
    alone and move 2 bytes over the memory bus per byte copied instead of 3. Falls back to
    ``dst.copy_(src)`` (with its conversions and broadcasting) unless both are contiguous CPU
    tensors of one dtype and size, at least ``STREAM_COPY_MIN_BYTES``, and the extension is
    available. Returns ``dst``."""
    ext = load_extension()
    if (ext is not None and dst.dtype == src.dtype and dst.shape == src.shape
            and dst.device.type == "cpu" and src.device.type == "cpu"
            and dst.is_contiguous() and src.is_contiguous()
            and not (src.is_conj() or src.is_neg())
            and src.numel() * src.element_size() >= STREAM_COPY_MIN_BYTES):
        ext.stream_copy(dst, src)
    else:
        dst.copy_(src)
    return dst
