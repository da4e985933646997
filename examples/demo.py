"""statestore demo: train a small model with HybridAdam whose states live in a store on a
temporary directory, checkpoint it, resume in a fresh process, and check the resumed run is
bit-identical to the uninterrupted one.

    python examples/demo.py            # what `make demo` runs
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import warnings

import torch
from safetensors.torch import load_file, save_file

import statestore as ss
from statestore.optim import HybridAdam

STEPS, CKPT_AT = 20, 10


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.GELU(),
        torch.nn.Linear(1024, 1024), torch.nn.GELU(),
        torch.nn.Linear(1024, 256))


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(64, 256, generator=g)
    return x, torch.sin(x)


def make_store(directory: str) -> ss.StateStore:
    if hasattr(ss, "NVMeStore"):
        # A 4 MiB RAM budget for 12 MiB of states: the step streams them through it, as a
        # model whose states do not fit in RAM would (the default budget, 256 MiB, would
        # simply hold this small model's states whole).
        return ss.NVMeStore(directory, budget_bytes=4 << 20)
    return ss.FileStore(directory)


def train(model, opt, first: int, last: int):
    losses = []
    for step in range(first, last):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _fmt(value) -> str:
    if isinstance(value, bool) or not isinstance(value, int):
        return str(value)
    return f"{value / 2**20:,.1f} MiB" if value >= 1 << 20 else f"{value:,}"


# The figures of store.stats() a user reads first; every other key is printed after them.
_STATS_ROWS = (("nbytes", "state bytes held"), ("ntensors", "state tensors"),
               ("budget_bytes", "RAM budget"), ("buffer_bytes", "RAM buffers held"),
               ("pinned_bytes", "page-locked bytes"), ("disk_bytes", "bytes on disk"),
               ("bytes_read", "bytes read so far"), ("bytes_written", "bytes written so far"),
               ("engine", "I/O engine"), ("direct", "direct I/O"))


def print_stats(stats: dict) -> None:
    """``store.stats()`` as a short two-column table (nested figures left out)."""
    rows = [(label, _fmt(stats[key])) for key, label in _STATS_ROWS if key in stats]
    shown = {key for key, _ in _STATS_ROWS} | {"backend", "dir", "resident", "device"}
    rows += [(key, _fmt(v)) for key, v in stats.items()
             if key not in shown and not isinstance(v, (dict, list, tuple))]
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"  {label:<{width}}  {value:>14}")


def resume(work: str) -> None:
    """Second process: a new store, the checkpoint loaded, training continued."""
    model = make_model()
    model.load_state_dict(load_file(os.path.join(work, "model.safetensors")))
    with make_store(os.path.join(work, "states-resumed")) as store:
        store.load_checkpoint(os.path.join(work, "ckpt"))
        opt = HybridAdam(model.named_parameters(), lr=1e-3, state_store=store)
        losses = train(model, opt, CKPT_AT, STEPS)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                  os.path.join(work, "resumed.safetensors"))
    print(json.dumps(losses))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--resume", metavar="WORKDIR", help=argparse.SUPPRESS)
    args = ap.parse_args()
    warnings.simplefilter("ignore", RuntimeWarning)
    if args.resume:
        resume(args.resume)
        return
    with tempfile.TemporaryDirectory(prefix="statestore-demo-") as work:
        model = make_model()
        nparams = sum(p.numel() for p in model.parameters())
        store = make_store(os.path.join(work, "states"))
        opt = HybridAdam(model.named_parameters(), lr=1e-3, state_store=store)
        print(f"statestore {ss.__version__}: {nparams / 1e6:.2f}M parameters, "
              f"states in {type(store).__name__}, kernels: {ss.kernels_info()}")
        losses = train(model, opt, 0, CKPT_AT)
        store.save_checkpoint(os.path.join(work, "ckpt"))
        save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                  os.path.join(work, "model.safetensors"))
        print(f"step {CKPT_AT}: checkpoint written to {os.path.join(work, 'ckpt')}: "
              f"{sorted(os.listdir(os.path.join(work, 'ckpt')))}")
        losses += train(model, opt, CKPT_AT, STEPS)
        stats = store.stats()
        rss = rss_mib()
        out = subprocess.run([sys.executable, __file__, "--resume", work], check=True,
                             capture_output=True, text=True)
        resumed = json.loads(out.stdout.strip().splitlines()[-1])
        other = load_file(os.path.join(work, "resumed.safetensors"))
        identical = all(torch.equal(v, other[k]) for k, v in model.state_dict().items())

        print("\nloss curve (uninterrupted | resumed in a fresh process from step "
              f"{CKPT_AT}):")
        for i, l in enumerate(losses):
            r = resumed[i - CKPT_AT] if i >= CKPT_AT else None
            print(f"  step {i + 1:3d}  {l:.6f}" + (f"  | {r:.6f}" if r is not None else ""))
        held = stats.get("buffer_bytes", stats["nbytes"]) if not stats["resident"] else stats["nbytes"]
        print(f"\nwhere states live: {type(store).__name__} in {stats.get('dir', work)}")
        print_stats(stats)
        if stats["resident"]:
            print(f"  RAM saved: none by design of {type(store).__name__} "
                  f"(states mapped from files; the page cache holds them)")
        else:
            print(f"  RAM saved: {(stats['nbytes'] - held) / 2**20:.1f} MiB "
                  f"(the store holds {held / 2**20:.1f} MiB of buffers); process RSS {rss:.0f} MiB")
        print(f"resumed run bit-identical to the uninterrupted one: {identical}")
        store.close()
        if not identical:
            sys.exit(1)


if __name__ == "__main__":
    main()
