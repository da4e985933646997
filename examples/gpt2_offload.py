"""GPT-2 small on CPU with optimizer states in RAM vs on disk: ColossalAI's NVMe-offload
tutorial experiment, with statestore's HybridAdam.

``GPT2LMHeadModel(GPT2Config())``, random init, batch 4, sequence 128, 3 training steps on CPU,
``HybridAdam(model.parameters(), nvme_offload_fraction=f, nvme_offload_dir=...)`` for f = 0.0
and 1.0, and f = 1.0 once more with ``update_in_backward=True`` (each parameter is updated
during backward as soon as its gradient is final, so the disk I/O runs while backward
computes). Each configuration runs in its own process (so RSS is its own) and prints the
tutorial's lines; a summary table follows. Needs ``transformers`` (installed in the benchmark venv only:
``benchmarks/.venv-peers``); without it, a GPT-2-small-shaped stack of linear layers stands in
and the output says so.

    benchmarks/.venv-peers/bin/python examples/gpt2_offload.py
    benchmarks/.venv-peers/bin/python examples/gpt2_offload.py --steps 5 --dir /nvme/tmp
    benchmarks/.venv-peers/bin/python examples/gpt2_offload.py --fractions 1.0+,1.0+:bf16,1.0+:int8

A ``:bf16`` / ``:int8`` suffix sets ``moment_dtype`` (compressed Adam moments in the store);
``--moment-dtype fp32,bf16,int8`` runs every fraction without a suffix once per moment dtype
and adds a table of each offloaded step against the fp32-moment step of the same fraction;
``--param-dtype bf16`` trains bf16 parameters (fp32 masters in the store, the case the
compressed moments are for: 12 bytes a parameter each way with fp32 moments, 8 with bf16,
6 with int8):

    benchmarks/.venv-peers/bin/python examples/gpt2_offload.py --fractions 1.0 \
        --moment-dtype fp32,bf16,int8 --param-dtype bf16 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _trimmed_rss() -> int:
    """RSS after glibc's ``malloc_trim(0)`` gives freed heap memory back to the OS: what the
    process holds live, without the allocator's retention of freed activations (which moves
    the plain RSS by a few hundred MB from run to run here). 0 where glibc is absent."""
    import ctypes
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return 0
    return _rss()


def _cached() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024
    return 0


def _model():
    import torch
    from torch import nn

    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        GPT2Config = None
    if GPT2Config is not None:
        config = GPT2Config()
        return GPT2LMHeadModel(config), config.vocab_size, "GPT2LMHeadModel(GPT2Config())"

    class Stack(nn.Module):
        """GPT-2-small-shaped parameters, without attention: embeddings, 12 blocks of the
        same linear layers and norms, a tied head."""

        def __init__(self, vocab=50257, d=768, layers=12, ctx=1024):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
            self.blocks = nn.ModuleList(nn.ModuleDict(dict(
                ln_1=nn.LayerNorm(d), c_attn=nn.Linear(d, 3 * d), c_proj=nn.Linear(d, d),
                ln_2=nn.LayerNorm(d), c_fc=nn.Linear(d, 4 * d), mlp_proj=nn.Linear(4 * d, d)))
                for _ in range(layers))
            self.ln_f = nn.LayerNorm(d)

        def forward(self, input_ids, attention_mask=None):
            pos = torch.arange(input_ids.shape[1])
            x = self.wte(input_ids) + self.wpe(pos)
            for b in self.blocks:
                h = b["c_attn"](b["ln_1"](x))[..., :x.shape[-1]]
                x = x + b["c_proj"](h)
                x = x + b["mlp_proj"](torch.nn.functional.gelu(b["c_fc"](b["ln_2"](x))))

            class Out:
                pass
            o = Out()
            o.logits = self.ln_f(x) @ self.wte.weight.t()
            return o

    return Stack(), 50257, "GPT-2-small-shaped stack (transformers not installed)"


def train(fraction: float, steps: int, directory: str, in_backward: bool = False,
          moment_dtype: str = "fp32", param_dtype: str = "fp32") -> dict:
    import torch
    from torch import nn

    from statestore.optim import HybridAdam

    torch.manual_seed(0)
    model, vocab, what = _model()
    if param_dtype == "bf16":
        model = model.to(torch.bfloat16)
        what += ", bf16 parameters (fp32 masters in the store)"
    loss_fn = nn.CrossEntropyLoss()
    opt = HybridAdam(model.parameters(), nvme_offload_fraction=fraction,
                     nvme_offload_dir=directory if fraction > 0 else None,
                     update_in_backward=in_backward, moment_dtype=moment_dtype)
    numel = sum(p.numel() for p in model.parameters())
    print(f"{what}")
    print(f"Model numel: {numel / 1024 ** 3:.3f} B")
    cached0 = _cached()
    step_times, phases = [], []
    start = time.time()
    for step in range(steps):
        t0 = time.perf_counter()
        ids = torch.randint(vocab, (4, 128))
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        loss = loss_fn(logits[..., :-1, :].float().reshape(-1, logits.shape[-1]),
                       ids[..., 1:].reshape(-1))
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter()
        step_times.append(t3 - t0)
        phases.append((t1 - t0, t2 - t1, t3 - t2))
        print(f"[{step}] loss: {loss.item():.3f}")
    for st in getattr(opt, "_owned_stores", []):   # the last write-behind counts
        st.sync()
    total = time.time() - start
    rss = _rss()
    print(f"Time: {total:.3f} s")
    print(f"Mem usage: {rss / 1024 ** 2:.3f} MB")
    return {"time": total, "rss": rss, "rss_trimmed": _trimmed_rss(), "numel": numel,
            "steps": step_times, "phases": phases, "cache_growth": _cached() - cached0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="nvme_offload_dir (default: a temporary directory)")
    ap.add_argument("--fractions", default="0.0,1.0,1.0+",
                    help="comma-separated; a trailing + also sets update_in_backward=True, "
                         "a suffix :bf16 or :int8 the moment_dtype (e.g. 1.0+:int8)")
    ap.add_argument("--moment-dtype", default=None,
                    help="comma-separated moment dtypes (fp32,bf16,int8): each fraction without "
                         "a :suffix runs once per moment dtype, and a table compares each "
                         "step with the fp32-moment step")
    ap.add_argument("--param-dtype", default="fp32", choices=["fp32", "bf16"],
                    help="parameter dtype (bf16: fp32 masters kept in the store)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the configurations this many times, interleaved (the disk and "
                         "the CPU here are noisy); the table gives medians over all rounds")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        cfg = json.loads(args.worker)
        out = train(cfg["fraction"], cfg["steps"], cfg["dir"], cfg["in_backward"],
                    cfg.get("moment_dtype", "fp32"), cfg.get("param_dtype", "fp32"))
        print("@@JSON " + json.dumps(out), flush=True)
        return
    runs: dict = {}
    specs = []
    for spec in args.fractions.split(","):
        if ":" in spec or not args.moment_dtype:
            specs.append(spec)
        else:
            specs += [f"{spec}:{md}" for md in args.moment_dtype.split(",")]
    moments_of = {}
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpt2-offload-", dir=args.dir) as d:
        for rnd in range(args.rounds):
            for spec in specs:
                spec, _, md = spec.partition(":")
                md = md or "fp32"
                f, plus = float(spec.rstrip("+")), spec.endswith("+")
                name = f"{f}, update_in_backward" if plus else f"{f}"
                if md != "fp32":
                    name += f", {md} moments"
                moments_of[name] = (spec, md)
                print(f"\n### nvme_offload_fraction={name}"
                      + (f" (round {rnd + 1}/{args.rounds})" if args.rounds > 1 else ""))
                p = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker",
                                    json.dumps(dict(fraction=f, steps=args.steps, dir=d,
                                                    in_backward=plus, moment_dtype=md,
                                                    param_dtype=args.param_dtype))],
                                   capture_output=True, text=True)
                for line in p.stdout.splitlines():
                    if line.startswith("@@JSON "):
                        runs.setdefault(name, []).append(json.loads(line[7:]))
                    else:
                        print(line)
                if p.returncode != 0:
                    print(p.stderr[-2000:])
        left = os.listdir(d)
    if not runs:
        return
    med = statistics.median
    def later(r, key):      # the steps after the first (or the only one)
        return r[key][1:] or r[key]

    results = {name: {"time": med(r["time"] for r in rs), "rss": med(r["rss"] for r in rs),
                      "rss_trimmed": med(r["rss_trimmed"] for r in rs),
                      "cache_growth": med(r["cache_growth"] for r in rs),
                      "step": med(t for r in rs for t in later(r, "steps")),
                      "phases": [med(p[i] for r in rs for p in later(r, "phases")) for i in range(3)],
                      "numel": rs[0]["numel"]} for name, rs in runs.items()}
    n = next(iter(results.values()))["numel"]
    print(f"\n| nvme_offload_fraction | time, {args.steps} steps (s) | median step after the first (s) "
          f"| forward / backward / step() (s) | RSS (MB) | RSS after malloc_trim (MB) "
          f"| page cache grown (MB) |")
    print("|---|---|---|---|---|---|---|")
    for f, r in results.items():
        ph = " / ".join(f"{x:.2f}" for x in r["phases"])
        print(f"| {f} | {r['time']:.3f} | {r['step']:.3f} | {ph} | {r['rss'] / 2**20:.1f} | "
              f"{r['rss_trimmed'] / 2**20:.1f} | {r['cache_growth'] / 2**20:.1f} |")
    if args.rounds > 1:
        print(f"(medians over {args.rounds} interleaved rounds)")
    fp32_step = {moments_of[n][0]: r["step"] for n, r in results.items()
                 if moments_of[n][1] == "fp32"}
    fp32_opt = {moments_of[n][0]: r["phases"][2] for n, r in results.items()
                if moments_of[n][1] == "fp32"}
    cmp = [(n, r["phases"][2], fp32_opt[moments_of[n][0]], r["step"],
            fp32_step[moments_of[n][0]]) for n, r in results.items()
           if moments_of[n][1] != "fp32" and moments_of[n][0] in fp32_step]
    if cmp:
        print(f"\nOffloaded optimizer step (step(): the states' disk traffic and the update) and "
              f"whole training step against fp32 moments ({args.param_dtype} parameters; target "
              f"for compressed moments on disk: step() at most 0.7x):\n")
        print("| configuration | step() (s) | fp32-moment step() (s) | vs fp32 moments "
              "| whole step (s) | vs fp32 moments |")
        print("|---|---|---|---|---|---|")
        for n, ob, oa, sb, sa in cmp:
            print(f"| {n} | {ob:.3f} | {oa:.3f} | {ob / oa:.2f}x | {sb:.3f} | {sb / sa:.2f}x |")
    if "0.0" in results:
        a = results["0.0"]
        sa = a["step"]
        for name, b in results.items():
            if name == "0.0" or not name.startswith("1.0"):
                continue
            sb = b["step"]
            saved = a["rss"] - b["rss"]
            trimmed = a["rss_trimmed"] - b["rss_trimmed"]
            print(f"\nfull offload ({name}): step x{sb / sa:.2f} of no offload; RSS saved "
                  f"{saved / 2**20:.0f} MB = {saved / (8 * n) * 100:.0f}% of the states' 8N = "
                  f"{8 * n / 2**20:.0f} MB (after malloc_trim: {trimmed / 2**20:.0f} MB = "
                  f"{trimmed / (8 * n) * 100:.0f}%)")
        print(f"files left in the offload dir: {len(left)}")


if __name__ == "__main__":
    main()
