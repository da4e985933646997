"""ZeRO-Offload against HybridAdam's offload path: one training step of the same model, side by side.

A stack of bf16 ``Linear(width, width)`` layers on one GPU; each contestant runs forward, backward
and the optimizer step on ``--tokens`` rows, its fp32 master weights and Adam moments in host
memory:

* ``DeepSpeed ZeRO-Offload``: ``deepspeed.initialize`` with ZeRO stage 2, ``offload_optimizer``
  on the CPU (pinned), bf16, AdamW (DeepSpeedCPUAdam, JIT-built on first use: nvcc and ninja);
* ``HybridAdam, PinnedCPUStore``: the staging path (docs/gpu.md), ``step()`` after backward;
* ``HybridAdam, update_in_backward``: the same store, each gradient applied as backward makes it;
* ``forward + backward``: the same model with no optimizer, the floor a perfectly hidden step
  would reach.

Contestants run interleaved, ``--reps`` times after ``--warmup`` steps each; medians are
printed, with each one's ratio to DeepSpeed's. One process (world size 1; DeepSpeed's process
group on 127.0.0.1). Without CUDA, or without DeepSpeed, the script says so and exits 0.

    python benchmarks/gpu_zero_offload.py                        # 8 x 8192^2 (537M parameters)
    python benchmarks/gpu_zero_offload.py --layers 16             # ~1.07B parameters

A machine without network gets DeepSpeed from the wheelhouse ``scripts/gpu_wheelhouse.sh``
builds (``scripts/gpu_session.sh`` installs it).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
from torch import nn  # noqa: E402

DEV = "cuda"


def _model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)]
                         ).to(DEV, torch.bfloat16)


def _timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _deepspeed(layers, width, lr):
    import deepspeed

    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                 ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29531")):
        os.environ.setdefault(k, v)
    deepspeed.init_distributed(dist_backend="nccl", verbose=False)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                              "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.01}},
        "steps_per_print": 10 ** 9,
    }
    model = _model(layers, width)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=cfg)

    def step(x):
        loss = engine(x).float().square().mean()
        engine.backward(loss)
        engine.step()
    return step


def _hybrid(layers, width, lr, in_backward):
    import statestore as ss
    from statestore.optim import HybridAdam

    model = _model(layers, width)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        store = ss.PinnedCPUStore()
    opt = HybridAdam(model.parameters(), lr=lr, weight_decay=0.01, state_store=store,
                     update_in_backward=in_backward)

    def step(x):
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _backward_only(layers, width):
    model = _model(layers, width)

    def step(x):
        model(x).float().square().mean().backward()
        model.zero_grad(set_to_none=True)
    return step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=4096, help="rows of the input")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args(argv)
    print(f"command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    n = args.layers * args.width * args.width
    contestants = {"forward + backward": _backward_only(args.layers, args.width),
                   "HybridAdam, PinnedCPUStore": _hybrid(args.layers, args.width, 1e-4, False),
                   "HybridAdam, update_in_backward": _hybrid(args.layers, args.width, 1e-4, True)}
    try:
        contestants["DeepSpeed ZeRO-Offload"] = _deepspeed(args.layers, args.width, 1e-4)
    except ImportError as e:
        print(f"DeepSpeed is not importable here ({e}): its row is left out "
              "(scripts/gpu_wheelhouse.sh builds a wheelhouse for a machine without network)")
    x = torch.randn(args.tokens, args.width, device=DEV, dtype=torch.bfloat16)
    times = {k: [] for k in contestants}
    for _ in range(args.warmup):
        for fn in contestants.values():
            fn(x)
    for _ in range(args.reps):
        for k, fn in contestants.items():
            times[k].append(_timed(lambda: fn(x)))
    med = {k: statistics.median(v) for k, v in times.items()}
    ds = med.get("DeepSpeed ZeRO-Offload")
    print(f"\n### One training step, {args.layers} x Linear({args.width}, {args.width}) bf16 "
          f"({n / 1e6:.0f}M parameters), {args.tokens} rows, states in host memory; "
          f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}\n")
    print("| contestant | step (ms, median) | / DeepSpeed |")
    print("|---|---|---|")
    for k, t in med.items():
        ratio = f"{t / ds:.2f}x" if ds else "n/a"
        print(f"| {k} | {t * 1e3:.1f} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
