"""Training with compressed Adam moments against fp32 moments: a GPT-2-config model (HF
transformers' GPT2LMHeadModel, reduced: ``--layers``, ``--hidden``), byte-level language
modelling on a fixed text (the Python sources of the installed torch package, read in a fixed
order: real text, no download), the same batches and initial weights for every run.

Runs (each in this process, one after the other, same seed): CPUAdam with moment_dtype fp32
(the reference), bf16 and int8 (their default rounding), plus the other rounding of each
(``--all-roundings``), and, where importable, bitsandbytes' 8-bit AdamW and torchao's
AdamW8bit (``--peers``; they are not statestore dependencies: run under an interpreter that
has them). Reported: the loss curve (mean over windows of ``--window`` steps) of each run, and
its largest and final gap to the fp32-moment curve, relative to the fp32 loss.

    PYTHONPATH=. .venv/bin/python benchmarks/moments_training.py            # 4 layers, 256, 200 steps
    PYTHONPATH=. .venv/bin/python benchmarks/moments_training.py --steps 50 --layers 2
"""
from __future__ import annotations

import argparse
import glob
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def corpus(nbytes: int) -> torch.Tensor:
    """``nbytes`` of text: torch's own .py files, sorted by path, concatenated (uint8)."""
    root = os.path.dirname(torch.__file__)
    out, have = [], 0
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        with open(path, "rb") as f:
            b = f.read()
        out.append(b)
        have += len(b)
        if have >= nbytes:
            break
    data = b"".join(out)[:nbytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def make_model(layers: int, hidden: int, ctx: int, seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=256, n_positions=ctx, n_embd=hidden, n_layer=layers,
                     n_head=max(1, hidden // 64), resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def batches(data: torch.Tensor, steps: int, batch: int, ctx: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    n = data.numel() - ctx - 1
    for _ in range(steps):
        idx = torch.randint(0, n, (batch,), generator=g)
        x = torch.stack([data[i:i + ctx] for i in idx.tolist()])
        yield x


def make_opt(kind: str, model, lr: float, wd: float):
    params = list(model.named_parameters())
    if kind.startswith("statestore"):
        from statestore.optim import CPUAdam
        _, md, rnd = kind.split(":")
        return CPUAdam(params, lr=lr, betas=(0.9, 0.95), weight_decay=wd, moment_dtype=md,
                       moment_rounding=None if rnd == "default" else rnd)
    ps = [p for _, p in params]
    if kind == "torch-adamw":
        return torch.optim.AdamW(ps, lr=lr, betas=(0.9, 0.95), weight_decay=wd)
    if kind == "bnb-adamw8bit":
        import bitsandbytes as bnb
        return bnb.optim.AdamW8bit(ps, lr=lr, betas=(0.9, 0.95), weight_decay=wd)
    if kind == "torchao-adamw8bit":
        from torchao.optim import AdamW8bit
        return AdamW8bit(ps, lr=lr, betas=(0.9, 0.95), weight_decay=wd)
    raise ValueError(kind)


def run(kind, args, data):
    model = make_model(args.layers, args.hidden, args.ctx, args.seed)
    opt = make_opt(kind, model, args.lr, args.wd)
    losses = []
    t0 = time.perf_counter()
    warm = max(1, args.steps // 20)
    for step, x in enumerate(batches(data, args.steps, args.batch, args.ctx, args.seed + 1)):
        if step < warm:                        # linear warm-up, then cosine to 10%
            lr = args.lr * (step + 1) / warm
        else:
            t = (step - warm) / max(1, args.steps - warm)
            lr = args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))
        for g in opt.param_groups:
            if torch.is_tensor(g["lr"]):       # torchao keeps lr as a tensor
                g["lr"].fill_(lr)
            else:
                g["lr"] = lr
        loss = model(x, labels=x).loss
        if not math.isfinite(float(loss.detach())):
            raise FloatingPointError(f"loss is {float(loss.detach())} at step {step}")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, time.perf_counter() - t0, sum(p.numel() for p in model.parameters())


def windows(xs, w):
    return [statistics.fmean(xs[i:i + w]) for i in range(0, len(xs), w)]


def add_training_args(ap, ctx: int) -> None:
    """The training run's options (model, batches, schedule), shared with moment_maps.py."""
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=ctx)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_training_args(ap, ctx=128)
    ap.add_argument("--all-roundings", action="store_true",
                    help="also bf16 with nearest and int8 with stochastic rounding")
    ap.add_argument("--peers", action="store_true",
                    help="also bitsandbytes AdamW8bit and torchao AdamW8bit where importable")
    ap.add_argument("--dump", default=None, help="append each finished run's losses to this "
                    "JSON-lines file")
    ap.add_argument("--from-dump", default=None, help="print the tables from a --dump file "
                    "(runs that finished) instead of training")
    ap.add_argument("--kinds", default=None, help="comma-separated runs instead of the "
                    "default ones (statestore:<fp32|bf16|int8>:<default|nearest|stochastic>, "
                    "bnb-adamw8bit, torchao-adamw8bit, torch-adamw); with --from-dump, "
                    "runs added to the dumped ones")
    ap.add_argument("--tolerance", type=float, default=0.02,
                    help="stated tolerance: largest windowed loss gap to fp32 moments, relative")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    data = corpus(4 << 20)
    kinds = ["statestore:fp32:default", "statestore:int8:default", "statestore:bf16:default"]
    skipped = {}
    res = {}
    if args.from_dump:
        import json
        with open(args.from_dump) as f:
            for line in f:
                d = json.loads(line)
                res[d["kind"]] = (d["losses"], d["secs"], d["nparams"])
        kinds = []
    if args.kinds:
        kinds = [k for k in args.kinds.split(",") if k and k not in res]
    if args.peers and not args.from_dump:
        for k, mod in (("bnb-adamw8bit", "bitsandbytes"), ("torchao-adamw8bit", "torchao.optim")):
            try:
                __import__(mod)
                kinds.append(k)
            except Exception as e:  # noqa: BLE001 - report and go on
                skipped[k] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    if args.all_roundings and not args.from_dump:
        kinds += ["statestore:bf16:nearest", "statestore:int8:stochastic"]
    for k in kinds:
        try:
            res[k] = run(k, args, data)
        except Exception as e:  # noqa: BLE001
            skipped[k] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            continue
        if args.dump:
            import json
            with open(args.dump, "a") as f:
                f.write(json.dumps({"kind": k, "losses": res[k][0], "secs": res[k][1],
                                    "nparams": res[k][2]}) + "\n")
        print(f"# {k}: final loss {statistics.fmean(res[k][0][-args.window:]):.4f}, "
              f"{res[k][1]:.0f} s", file=sys.stderr, flush=True)
    if "statestore:fp32:default" not in res:
        sys.exit("moments_training: no fp32-moment run to compare with (the reference); add "
                 "statestore:fp32:default to --kinds, or read earlier runs with --from-dump "
                 "FILE (the finished runs are in --dump's file)")
    ref = windows(res["statestore:fp32:default"][0], args.window)
    nparams = res["statestore:fp32:default"][2]
    print(f"\n## GPT-2 config, {args.layers} layers, hidden {args.hidden}, {nparams / 1e6:.2f}M "
          f"params, byte-level LM, ctx {args.ctx}, batch {args.batch}, {args.steps} steps, "
          f"lr {args.lr} (warm-up + cosine), wd {args.wd}, clip 1.0, {args.threads} threads")
    cols = [f"{i * args.window}-{min(args.steps, (i + 1) * args.window) - 1}"
            for i in range(len(ref))]
    print("\nLoss, mean over windows of steps:\n")
    print("| optimizer | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for k, (losses, _, _) in res.items():
        print(f"| {k} | " + " | ".join(f"{x:.4f}" for x in windows(losses, args.window)) + " |")
    print(f"\nGap to fp32 moments (windowed loss, relative); stated tolerance "
          f"{args.tolerance:.0%} at every window:\n")
    print("| optimizer | largest gap | final gap | within tolerance | time (s) |")
    print("|---|---|---|---|---|")
    for k, (losses, secs, _) in res.items():
        w = windows(losses, args.window)
        gaps = [(a - b) / b for a, b in zip(w, ref)]
        big = max(gaps, key=abs)
        print(f"| {k} | {big:+.2%} | {gaps[-1]:+.2%} | "
              f"{'yes' if max(abs(g) for g in gaps) <= args.tolerance else 'NO'} | {secs:.0f} |")
    for k, why in skipped.items():
        print(f"\nskipped {k}: {why}")


if __name__ == "__main__":
    main()
