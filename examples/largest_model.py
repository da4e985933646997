"""Train a Llama-shaped model larger than RAM allows for its optimizer states: bf16 weights in
RAM, fp32 master, exp_avg and exp_avg_sq (12 bytes a parameter) on disk in an NVMeStore,
each parameter updated and its gradient released during backward. Checkpoint, and resume in a
new process.

    python examples/largest_model.py --size 1b --dir /nvme/run --steps 4
    python examples/largest_model.py --size 1b --dir /nvme/run --steps 2 --resume

A 3B model (``--size 3b``) needs about 6 GB of bf16 weights, up to 6 GB of gradients on the
first step, 36 GB of states on disk and as much again once training goes on after a
checkpoint. ``benchmarks/largest_model.py`` measures every phase; docs/scale.md has figures.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from tqdm.auto import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import statestore as ss  # noqa: E402
from statestore.optim import HybridAdam  # noqa: E402
from llama import LlamaConfig, batch, build  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="100m", help="tiny, 100m, 1b, 3b or 7b (examples/llama.py)")
    ap.add_argument("--dir", required=True, help="folder on the disk for states and checkpoint")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--resume", action="store_true", help="resume from DIR/ckpt first")
    args = ap.parse_args()

    config = LlamaConfig.preset(args.size)
    ckpt = os.path.join(args.dir, "ckpt")
    store = ss.NVMeStore(os.path.join(args.dir, f"states-{os.getpid()}"))
    first = 0
    if args.resume:
        model = build(config, init=False)
        t = time.perf_counter()
        # An NVMeStore on the checkpoint's filesystem links its shards: no copy, no extra disk.
        store.load_checkpoint(ckpt)
        with torch.no_grad():       # the bf16 weights are the fp32 masters, rounded
            for name, p in model.named_parameters():
                p.copy_(store.get((name, "master")))
        first = max(store.loaded_metadata["steps"].values())
        print(f"resumed at step {first} in {time.perf_counter() - t:.1f} s")
    else:
        model = build(config, seed=0)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters")
    opt = HybridAdam(model.named_parameters(), lr=1e-4, weight_decay=0.1, state_store=store,
                     update_in_backward=True, release_grads=True)
    for step in tqdm(range(first, first + args.steps), desc="train", unit="step"):
        ids = batch(step, config, 1, args.seq)
        loss = model(ids, labels=ids)
        loss.backward()             # parameters are updated here, gradients released
        opt.step()                  # finishes what backward could not
        opt.zero_grad(set_to_none=True)
        tqdm.write(f"step {step}: loss {loss.item():.4f}")
    t = time.perf_counter()
    store.save_checkpoint(ckpt)     # linked: the store's files become the shards
    print(f"checkpoint {ckpt} in {time.perf_counter() - t:.1f} s")
    store.close()


if __name__ == "__main__":
    main()
