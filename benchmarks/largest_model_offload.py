"""A Llama-shaped model trained with its parameters AND its optimizer states on disk
(``statestore.offload_parameters`` + ``HybridAdam`` on ``NVMeStore``s), checkpointed and
resumed bit for bit in a fresh process.

The model is defined here (no download): token embedding, ``--layers`` decoder layers
(RMSNorm, q/k/v/o projections with rotary embeddings and grouped-query attention, RMSNorm,
SwiGLU MLP), final RMSNorm, an untied LM head; bf16 parameters, fp32 masters and moments in
the optimizer's store (``int8`` moments where ``HybridAdam`` has ``moment_dtype``). It is
created on the ``meta`` device and built straight into the parameter store one module at a
time, so the model never sits in RAM. Each decoder layer runs under non-reentrant activation
checkpointing.

One run, two processes:

1. **train** (this process): ``--steps`` steps (the first creates the states), a checkpoint
   (``handle.save_checkpoint``: the optimizer store's checkpoint plus ``model.safetensors``),
   ``--check-steps`` more steps, each followed by a digest of every parameter (streamed from
   the store one parameter at a time);
2. **resume** (a fresh child): new stores, ``handle.load_checkpoint(ckpt, states)``, a new
   optimizer, the same ``--check-steps`` steps: its digests must equal the train run's.

Printed: parameters, peak RSS of each process (VmHWM), disk used by stores and checkpoint,
each step's time against its I/O floor (bytes both stores read and wrote / the disk's
sequential bandwidth measured first with O_DIRECT), save, load and resume times.

    .venv/bin/python benchmarks/largest_model_offload.py --dir /tmp/big --hidden 2048 --layers 16
    .venv/bin/python benchmarks/largest_model_offload.py --dir /tmp/big --no-offload-params ...

``--no-offload-params`` keeps the parameters in RAM (the optimizer states still on disk), for
the comparison. The folder is removed at the end unless ``--keep``. Figures: docs/offload.md.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import inspect
import json
import math
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from _common import folder_bytes, probe_disk, proc_status  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

GB = 1e9


# ------------------------------------------------------------------ the model
class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def reset_parameters(self):
        nn.init.ones_(self.weight)

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _rope(x, pos):
    d = x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = pos[:, None].float() * inv[None, :]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Layer(nn.Module):
    def __init__(self, h, ffn, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, h // heads
        self.attn_norm = RMSNorm(h)
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, kv_heads * self.hd, bias=False)
        self.v_proj = nn.Linear(h, kv_heads * self.hd, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)
        self.mlp_norm = RMSNorm(h)
        self.gate_proj = nn.Linear(h, ffn, bias=False)
        self.up_proj = nn.Linear(h, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, h, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        pos = torch.arange(t)
        a = self.attn_norm(x)
        q = self.q_proj(a).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.k_proj(a).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v_proj(a).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        q, k = _rope(q, pos), _rope(k, pos)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.kv_heads != self.heads)
        x = x + self.o_proj(o.transpose(1, 2).reshape(b, t, -1))
        m = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))


class LlamaLike(nn.Module):
    def __init__(self, vocab, h, layers, ffn, heads, kv_heads):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, h)
        self.layers = nn.ModuleList(Layer(h, ffn, heads, kv_heads) for _ in range(layers))
        self.norm = RMSNorm(h)
        self.lm_head = nn.Linear(h, vocab, bias=False)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        logits = self.lm_head(self.norm(x)).float()
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                               ids[:, 1:].reshape(-1))


def init_module(m: nn.Module) -> None:
    """Deterministic per-module init (std 0.02 normal, norms at one), seeded by shape so a
    module's values do not depend on the order modules are built in."""
    if isinstance(m, RMSNorm):
        nn.init.ones_(m.weight)
        return
    for p in m.parameters(recurse=False):
        g = torch.Generator().manual_seed(hash(tuple(p.shape)) % (2 ** 31))
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(0.02))


def build(args):
    with torch.device("meta"):
        model = LlamaLike(args.vocab, args.hidden, args.layers, args.ffn, args.heads,
                          args.kv_heads)
    return model.to(torch.bfloat16)


def n_params(args) -> int:
    h, f, kv = args.hidden, args.ffn, args.kv_heads * (args.hidden // args.heads)
    layer = 2 * h + 2 * h * h + 2 * h * kv + 3 * h * f
    return 2 * args.vocab * h + args.layers * layer + h


def batch(step, args):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(args.vocab, (args.batch, args.seq), generator=g)


# ------------------------------------------------------------------ measurement
def digest(model, handle) -> str:
    """xxh3-128 of every parameter, one at a time (read from the store when offloaded)."""
    import xxhash
    from statestore.offload._handle import param_value
    h = xxhash.xxh3_128()
    for name, p in model.named_parameters():
        v = param_value(p) if handle is not None else p.detach()
        h.update(name.encode())
        h.update(memoryview(v.contiguous().view(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


# ------------------------------------------------------------------ a run
def setup(args, tag):
    import statestore as ss
    from statestore.optim import HybridAdam
    budget = args.budget_mib << 20
    states = ss.NVMeStore(os.path.join(args.dir, f"states-{tag}"), budget_bytes=budget)
    model = build(args)
    handle = None
    t = time.perf_counter()
    if args.offload_params:
        params = ss.NVMeStore(os.path.join(args.dir, f"params-{tag}"), budget_bytes=budget)
        handle = ss.offload_parameters(model, params, prefetch=args.prefetch, init=init_module)
    else:
        model.to_empty(device="cpu")
        for m in model.modules():
            init_module(m)
    built = time.perf_counter() - t
    return model, handle, states, built


def make_optimizer(model, states, args):
    from statestore.optim import HybridAdam
    sig = inspect.signature(HybridAdam.__init__).parameters
    kw = dict(update_in_backward=True)
    if "release_grads" in sig:
        kw["release_grads"] = True
    if "moment_dtype" in sig and args.moments != "fp32":
        kw["moment_dtype"] = args.moments
    return HybridAdam(model.named_parameters(), lr=1e-4, weight_decay=0.1, state_store=states,
                      **kw), kw


def stores_io(handle, states):
    out = [states.stats()]
    if handle is not None:
        out.append(handle.store.stats())
    return sum(s["bytes_read"] for s in out), sum(s["bytes_written"] for s in out)


def run_steps(model, handle, states, opt, steps, args, out, name, digests=None):
    for step in steps:
        r0, w0 = stores_io(handle, states)
        t = time.perf_counter()
        loss = model(batch(step, args))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if handle is not None:
            handle.sync()
        states.sync()
        dt = time.perf_counter() - t
        r1, w1 = stores_io(handle, states)
        row = dict(phase=name, step=step, seconds=dt, loss=loss.item(), bytes_read=r1 - r0,
                   bytes_written=w1 - w0, rss=proc_status("VmRSS"), hwm=proc_status("VmHWM"))
        if digests is not None:
            row["digest"] = digest(model, handle)
            digests.append(row["digest"])
        out["steps"].append(row)
        print(f"  {name} step {step}: {dt:.1f} s, loss {row['loss']:.4f}, "
              f"read {row['bytes_read'] / GB:.2f} GB, written {row['bytes_written'] / GB:.2f} GB, "
              f"RSS {row['rss'] / 2**30:.2f} GiB (peak {row['hwm'] / 2**30:.2f})", flush=True)


def child_resume(args):
    torch.set_num_threads(args.threads)
    out = {"steps": []}
    model, handle, states, built = setup(args, "resume")
    ck = os.path.join(args.dir, "ckpt")
    t = time.perf_counter()
    if handle is not None:
        handle.load_checkpoint(ck, states)
    else:
        from safetensors.torch import load_file
        states.load_checkpoint(ck)
        model.load_state_dict(load_file(os.path.join(ck, "model.safetensors")))
    out["load_seconds"] = time.perf_counter() - t
    opt, _ = make_optimizer(model, states, args)
    digests = []
    s0 = args.steps
    run_steps(model, handle, states, opt, range(s0, s0 + args.check_steps), args, out, "resume",
              digests)
    out["digests"] = digests
    out["hwm"] = proc_status("VmHWM")
    print("RESULT " + json.dumps(out), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="folder for stores and checkpoint (removed)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--ffn", type=int, default=None, help="default: 8/3 hidden, rounded to 256")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=2, help="steps before the checkpoint")
    ap.add_argument("--check-steps", type=int, default=1, help="steps after it, compared")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--budget-mib", type=int, default=256, help="each store's RAM budget")
    ap.add_argument("--moments", default="int8", help="moment_dtype where supported")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--probe-gib", type=float, default=1.0)
    ap.add_argument("--no-offload-params", dest="offload_params", action="store_false")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--role", choices=["resume"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ffn is None:
        args.ffn = int(math.ceil(args.hidden * 8 / 3 / 256) * 256)
    if args.role == "resume":
        return child_resume(args)
    torch.set_num_threads(args.threads)
    os.makedirs(args.dir, exist_ok=True)
    out = {"args": vars(args), "params": n_params(args), "steps": []}
    print(f"model: {n_params(args) / 1e9:.2f} B parameters (hidden {args.hidden}, layers "
          f"{args.layers}, ffn {args.ffn}, vocab {args.vocab}), bf16; parameters "
          f"{'on disk' if args.offload_params else 'in RAM'}, states on disk", flush=True)
    wall = time.perf_counter()
    try:
        w_bw, r_bw = probe_disk(args.dir, int(args.probe_gib * 2 ** 30))
        out["disk_write_GBps"], out["disk_read_GBps"] = w_bw, r_bw
        print(f"disk: write {w_bw:.2f} GB/s, read {r_bw:.2f} GB/s (O_DIRECT, sequential)")
        gc.collect()
        model, handle, states, built = setup(args, "train")
        out["build_seconds"] = built
        opt, kw = make_optimizer(model, states, args)
        out["optimizer"] = {k: str(v) for k, v in kw.items()}
        run_steps(model, handle, states, opt, range(args.steps), args, out, "train")
        ck = os.path.join(args.dir, "ckpt")
        t = time.perf_counter()
        if handle is not None:
            handle.save_checkpoint(ck, states)
        else:
            from safetensors.torch import save_file
            states.save_checkpoint(ck)
            save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                      os.path.join(ck, "model.safetensors"))
        out["save_seconds"] = time.perf_counter() - t
        out["checkpoint_bytes"] = folder_bytes(ck)
        digests = []
        run_steps(model, handle, states, opt, range(args.steps, args.steps + args.check_steps),
                  args, out, "train-on", digests)
        out["disk_bytes"] = folder_bytes(args.dir)
        out["train_hwm"] = proc_status("VmHWM")
        if handle is not None:
            out["handle"] = handle.stats()
            handle.store.close()
        states.close()
        del model, handle, states, opt
        gc.collect()
        for tag in ("params-train", "states-train"):     # the checkpoint keeps what it links
            shutil.rmtree(os.path.join(args.dir, tag), ignore_errors=True)
        cmd = [sys.executable, os.path.abspath(__file__), "--role", "resume"] + sys.argv[1:]
        t = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True)
        sys.stdout.write("".join(l + "\n" for l in r.stdout.splitlines()
                                 if not l.startswith("RESULT ")))
        if r.returncode != 0:
            sys.stderr.write(r.stderr[-4000:])
            raise SystemExit(f"resume failed ({r.returncode})")
        res = json.loads(next(l for l in r.stdout.splitlines() if l.startswith("RESULT "))[7:])
        out["resume"] = res
        out["resume_wall_seconds"] = time.perf_counter() - t
        out["bit_exact"] = res["digests"] == digests
        report(args, out, w_bw, r_bw)
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    out["wall_seconds"] = time.perf_counter() - wall
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def report(args, out, w_bw, r_bw):
    gib = 2 ** 30
    print()
    print(f"| figure | value |")
    print(f"|---|---|")
    print(f"| parameters | {out['params'] / 1e9:.2f} B ({'on disk' if args.offload_params else 'in RAM'}) |")
    print(f"| optimizer | HybridAdam {out['optimizer']} |")
    print(f"| peak RSS, train process | {out['train_hwm'] / gib:.2f} GiB |")
    print(f"| peak RSS, resume process | {out['resume']['hwm'] / gib:.2f} GiB |")
    print(f"| disk (stores + checkpoint, peak after train-on) | {out['disk_bytes'] / 1e9:.1f} GB |")
    print(f"| checkpoint | {out['checkpoint_bytes'] / 1e9:.1f} GB, saved in {out['save_seconds']:.1f} s |")
    print(f"| build into the store | {out['build_seconds']:.1f} s |")
    print(f"| load (resume) | {out['resume']['load_seconds']:.1f} s |")
    for s in out["steps"] + out["resume"]["steps"]:
        floor = s["bytes_read"] / (r_bw * GB) + s["bytes_written"] / (w_bw * GB)
        print(f"| {s['phase']} step {s['step']} | {s['seconds']:.1f} s; I/O floor {floor:.1f} s "
              f"({s['bytes_read'] / 1e9:.1f} GB read, {s['bytes_written'] / 1e9:.1f} GB written) |")
    if "handle" in out:
        h = out["handle"]
        print(f"| parameter reads (train process) | {h['reads']} ({h['read_bytes'] / 1e9:.1f} GB), "
              f"{h['sync_reads']} outside the read-ahead; {h['writes']} write-backs |")
    print(f"| resumed bit for bit | {'yes' if out['bit_exact'] else 'NO'} |")


if __name__ == "__main__":
    main()
