"""Which int8 moment map trains like fp32 moments: a simulation that isolates ``exp_avg``'s and
``exp_avg_sq``'s maps (docs/moments.md, why this map; figures in benchmarks/RESULTS.md).

The model, data, batches and schedule of ``benchmarks/moments_training.py`` (GPT-2 config,
byte-level LM); the optimizer is AdamW in fp32 (torch ops), and after every step each
parameter's ``exp_avg`` and ``exp_avg_sq`` are replaced by their quantized-then-dequantized
values under a map (blocks of 256, nearest rounding), so a map can be tried without a kernel:

* ``fp32``: no quantization (the reference run);
* ``v1``: statestore's int8 encoding version 1, ``sign(c)(c/127)**2`` / ``(c/255)**4`` of the
  block's largest (codes rounded to nearest in code space, as its kernels did);
* ``dyn``: the dynamic tree map (Dettmers 2015; bitsandbytes' and torchao's 8-bit optimizers
  use it), signed for ``exp_avg``, unsigned for ``exp_avg_sq``, generated here from its
  definition (decades 1e-6..1, linear fractions), nearest value;
* ``f8``: statestore's int8 encoding (version 2: E4M3 ``exp_avg``, E4M4 ``sqrt(exp_avg_sq)``,
  :mod:`statestore.kernels._quant`).

A run is ``<exp_avg map>+<exp_avg_sq map>`` (e.g. ``dyn+v1``: only ``exp_avg``'s map changed).
Reported: windowed loss and the gap to the ``fp32`` run, as ``moments_training.py`` does.

    PYTHONPATH=. python benchmarks/moment_maps.py --runs fp32,v1+v1,dyn+v1,f8+f8
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moments_training import (add_training_args, batches, corpus, make_model,  # noqa: E402
                              windows)

from statestore.kernels import _quant as Q  # noqa: E402

B = Q.BLOCK


def _blocks(x):
    n = x.numel()
    nb = (n + B - 1) // B
    if nb * B != n:
        x = torch.cat([x, x.new_zeros(nb * B - n)])
    return x.view(nb, B), n


def _nearest(table, x):
    """Nearest entry of the sorted ``table`` for each of ``x``."""
    i = torch.searchsorted(table, x).clamp(1, table.numel() - 1)
    lo, hi = table[i - 1], table[i]
    return torch.where((x - lo) <= (hi - x), lo, hi)


def _by_table(x, table):
    xb, n = _blocks(x)
    s = xb.abs().amax(1, keepdim=True)
    s = torch.where(s > 0, s, torch.ones_like(s))
    return (_nearest(table, (xb / s).clamp(-1, 1)) * s).reshape(-1)[:n]


def dynamic_map(signed: bool) -> torch.Tensor:
    """The dynamic tree map's 256 values, from its definition: for i = 0..6, the midpoints of
    2**i + 1 (signed) or 2**(i+1) + 1 (unsigned) points spaced linearly over [0.1, 1]
    (float32), times 10**(i - 6); both signs when signed; plus 0 and 1."""
    data = []
    for i in range(7):
        k = 2 ** i + 1 if signed else 2 ** (i + 1) + 1
        b = torch.linspace(0.1, 1, k)
        mids = (10 ** (i - 6) * ((b[:-1] + b[1:]) / 2)).tolist()
        data += mids + ([-x for x in mids] if signed else [])
    data += [0.0, 1.0]
    return torch.tensor(sorted(data), dtype=torch.float32)


def _sqrt32(x):
    return torch.sqrt(x.double()).float()


def _v1(x, which):
    """Version 1's encode (nearest) and decode, in its float32 operations."""
    xb, n = _blocks(x)
    a = xb.abs()
    scale = a.amax(1)
    scale = torch.where(scale < 2.0 ** -126, torch.zeros_like(scale), scale)
    ok = (scale > 0)[:, None]
    if which == 0:
        inv = torch.where(scale > 0, 1.0 / torch.where(scale > 0, scale, torch.ones_like(scale)),
                          torch.zeros_like(scale))
        c = torch.clamp(torch.floor(_sqrt32(a * inv[:, None]) * 127.0 + 0.5), max=127.0)
        c = torch.where(ok, c, torch.zeros_like(c))
        c = torch.where(xb < 0, -c, c)
        y = ((c * c.abs()) * torch.tensor(1.0 / (127 * 127), dtype=torch.float32)) * scale[:, None]
    else:
        sinv = torch.where(scale > 0, 1.0 / _sqrt32(torch.where(scale > 0, scale,
                                                                torch.ones_like(scale))),
                           torch.zeros_like(scale))
        r = _sqrt32(a) * sinv[:, None]
        c = torch.clamp(torch.floor(_sqrt32(r) * 255.0 + 0.5), max=255.0)
        c = torch.where(ok, c, torch.zeros_like(c))
        q = (c * c) * torch.tensor(1.0 / (255 * 255), dtype=torch.float32)
        y = (q * q) * scale[:, None]
    return y.reshape(-1)[:n]


def _f8(x, which):
    c, s = Q.encode("int8", which, x, rounding="nearest")
    return Q.decode("int8", which, c, s)


_SD, _UD = dynamic_map(True), dynamic_map(False)
MAPS = {
    "v1": _v1,
    "dyn": lambda x, which: _by_table(x, _SD if which == 0 else _UD),
    "f8": _f8,
}


def run(spec: str, args, data):
    qm = qv = None
    if spec != "fp32":
        mm, _, vm = spec.partition("+")
        qm, qv = MAPS[mm], MAPS[vm or mm]
    model = make_model(args.layers, args.hidden, args.ctx, args.seed)
    ps = list(model.parameters())
    st = [(torch.zeros(p.numel()), torch.zeros(p.numel())) for p in ps]
    b1, b2, eps = 0.9, 0.95, 1e-8
    losses, warm, t0 = [], max(1, args.steps // 20), time.perf_counter()
    for step, x in enumerate(batches(data, args.steps, args.batch, args.ctx, args.seed + 1)):
        if step < warm:                        # as moments_training.py
            lr = args.lr * (step + 1) / warm
        else:
            t = (step - warm) / max(1, args.steps - warm)
            lr = args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))
        loss = model(x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ps, 1.0)
        bc1, bc2s = 1 - b1 ** (step + 1), math.sqrt(1 - b2 ** (step + 1))
        with torch.no_grad():
            for p, (m, v) in zip(ps, st):
                g = p.grad.reshape(-1)
                p.mul_(1 - lr * args.wd)
                m.lerp_(g, 1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                p.view(-1).addcdiv_(m, (v.sqrt() / bc2s).add_(eps), value=-lr / bc1)
                if qm is not None:
                    m.copy_(qm(m, 0))
                    v.copy_(qv(v, 1))
                p.grad = None
        losses.append(float(loss.detach()))
    return losses, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", default="fp32,v1+v1,dyn+v1,f8+f8",
                    help="comma-separated: fp32 or <exp_avg map>+<exp_avg_sq map> of "
                         f"{sorted(MAPS)}")
    add_training_args(ap, ctx=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    data = corpus(4 << 20)
    res = {}
    for spec in args.runs.split(","):
        res[spec] = run(spec, args, data)
        print(f"# {spec}: final loss {statistics.fmean(res[spec][0][-args.window:]):.4f}, "
              f"{res[spec][1]:.0f} s", file=sys.stderr, flush=True)
    ref = windows(res["fp32"][0], args.window) if "fp32" in res else None
    print(f"\n## simulated int8 maps, GPT-2 config {args.layers} layers, hidden {args.hidden}, "
          f"ctx {args.ctx}, batch {args.batch}, {args.steps} steps\n")
    print("| maps (exp_avg+exp_avg_sq) | windowed loss | largest gap | final gap |")
    print("|---|---|---|---|")
    for spec, (losses, _) in res.items():
        w = windows(losses, args.window)
        gaps = [(a - b) / b for a, b in zip(w, ref)] if ref else [float("nan")]
        big = max(gaps, key=abs)
        print(f"| {spec} | " + " ".join(f"{x:.4f}" for x in w) +
              f" | {big:+.2%} | {gaps[-1]:+.2%} |")


if __name__ == "__main__":
    main()
