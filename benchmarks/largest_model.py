"""The largest model this machine trains, checkpoints and resumes: a Llama-shaped model
(``examples/llama.py``, bf16 parameters, no download) with ``HybridAdam`` states (fp32
master, exp_avg, exp_avg_sq: 12 bytes a parameter) on an ``NVMeStore``.

One run, three processes:

1. **train** (a child): builds the model, trains ``--steps`` steps (the first creates the
   states), saves a checkpoint (linked: the store's files become its shards), times
   ``state_dict()``, goes on for ``--check-steps`` steps recording a digest of every
   parameter after each (the uninterrupted run), then starts one more step and is killed
   with SIGKILL part-way through it (the parent does it).
2. **resume** (a fresh child): loads the checkpoint into a new ``NVMeStore`` (linked: no copy),
   restores the bf16 weights from the checkpoint's fp32 masters (HybridAdam writes each
   bf16 parameter as its master rounded, so they are the model's weights; checked against the
   digest taken at the save), builds the optimizer and trains the same ``--check-steps``
   steps: every digest must equal the uninterrupted run's, bit for bit.
3. the parent measures the disk's sequential read and write bandwidth first (O_DIRECT, same
   directory), samples the filesystem's used bytes throughout, and prints the table: params,
   peak RSS of every phase and what it is made of, disk used, each step's time against its
   I/O floor (bytes the store read / read bandwidth + bytes written / write bandwidth), save,
   load and resume times.

    .venv/bin/python benchmarks/largest_model.py --size 1b --dir /tmp/big
    .venv/bin/python benchmarks/largest_model.py --size 3b --dir /tmp/big --steps 2 --check-steps 1
    .venv/bin/python benchmarks/largest_model.py --size 7b --layers 33 --kv-heads 8 \
        --offload-params --moments int8 --dir /tmp/big --steps 2 --check-steps 1 --reference rerun

``--offload-params`` (parameter offload, ``docs/offload.md``): the model is created on the
``meta`` device and built one module at a time straight into a second ``NVMeStore``
(``statestore.offload_parameters(model, params, prefetch=--prefetch)``), so neither its
weights nor its gradients (with ``release_grads``) sit in RAM; the checkpoint is
``handle.save_checkpoint`` (the states plus a stock ``model.safetensors``) and the resumed
process loads it with ``handle.load_checkpoint`` instead of restoring the weights from the
masters. Digests read each parameter from the store, one at a time. ``--moments`` is
``HybridAdam``'s ``moment_dtype`` (``int8``: 2 bytes a parameter for both moments instead of 8).

Disk (fp32 moments; int8 moments: about 6.1 bytes a parameter instead of 12): the states, plus
as much again free: a linked save refuses to start without room for the copy-on-write of the
files it links (the store's next writes), and training on after the checkpoint makes those
copies. ``--reference rerun`` writes the states once: the train process stops at its
checkpoint, the resumed process removes the checkpoint once loaded (its store keeps the
links, then the only names of the files, and writes into them in place), and a third
process trains from the same seed without stopping, for the digests to compare. With
``--offload-params`` add the bf16 parameters' store (2 bytes a parameter) and the
checkpoint's model file (2 more). The run refuses to start without the free space it needs
(``--force`` to try anyway).

``--fork``: the train, resume and reference processes are forked from the parent once it has
imported torch, statestore, ``llama`` and ``torch._dynamo`` (which building an optimizer
imports) instead of starting a new interpreter each. Each is still a new process with its
own model, store and optimizer, killed and resumed as above, and its phases' peak RSS is
measured over its own built model as before; only the seconds of interpreter start and
imports a process are not repeated (the tests use it).

Results (and the commands that produced them): docs/scale.md.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

from _common import folder_bytes, probe_disk, proc_status, reset_peak, run_forked_child  # noqa: E402

GiB = 1 << 30


# ------------------------------------------------------------------ memory figures
class Phase:
    """Times a phase and records its peak RSS (VmHWM after a reset)."""

    def __init__(self, out: dict, name: str, **extra):
        self.out, self.name, self.extra = out, name, extra

    def __enter__(self):
        self.rss0 = reset_peak(trim=True)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.out.setdefault("phases", []).append(dict(
                name=self.name, seconds=time.perf_counter() - self.t0, rss_before=self.rss0,
                peak=proc_status("VmHWM"), **self.extra))


# ------------------------------------------------------------------ children
def _digest(model, handle=None) -> str:
    """xxh3-128 of every parameter; offloaded ones are read from the store one at a time."""
    import torch
    import xxhash
    h = xxhash.xxh3_128()
    if handle is not None:
        handle.sync()
    for name, p in model.named_parameters():
        v = p.detach() if handle is None else handle.store.get(handle.key(name))
        h.update(name.encode())
        h.update(memoryview(v.contiguous().view(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def _io(store, handle):
    """Bytes read and written so far by the optimizer's store and the parameters' store."""
    stats = [store.stats()] + ([handle.store.stats()] if handle is not None else [])
    return (sum(s["bytes_read"] for s in stats), sum(s["bytes_written"] for s in stats))


def _step(model, opt, store, c, args, step, out, name, handle=None):
    import llama
    ids = llama.batch(step, c, args.batch, args.seq)
    before = _io(store, handle)
    grads = {}
    with Phase(out, name, step=step) as ph:
        loss = model(ids, labels=ids)
        loss.backward()
        grads["held"] = sum(p.grad.numel() * p.grad.element_size()
                            for p in model.parameters() if p.grad is not None)
        opt.step()
        opt.zero_grad(set_to_none=True)
    store.sync()            # the step's last writes belong to its I/O
    if handle is not None:
        handle.sync()
    after = _io(store, handle)
    ph_out = out["phases"][-1]
    ph_out.update(loss=loss.item(), grads_after_backward=grads["held"],
                  seconds_with_sync=time.perf_counter() - ph.t0,
                  bytes_read=after[0] - before[0], bytes_written=after[1] - before[1],
                  ring=store.stats()["buffer_bytes"])
    return loss.item()


def _optimizer(model, store, args):
    from statestore.optim import HybridAdam
    kw = {} if args.moments == "fp32" else {"moment_dtype": args.moments}
    return HybridAdam(model.named_parameters(), lr=args.lr, weight_decay=0.1, state_store=store,
                      update_in_backward=args.in_backward,
                      release_grads=args.in_backward and args.release_grads, **kw)


def _build(args, c, tag, init=True):
    """The model and, with ``--offload-params``, its handle: created on ``meta`` and built
    into the NVMeStore ``params-<tag>`` one module at a time, with the values
    ``llama.build`` gives (same generator, same module order); zeros without ``init``."""
    import torch

    import llama
    import statestore as ss
    if not args.offload_params:
        return llama.build(c, seed=args.seed, init=init), None
    with torch.device("meta"):
        model = llama.Llama(c)
    model = model.to(torch.bfloat16)
    g = torch.Generator().manual_seed(args.seed)

    def fill(mod):
        for pname, p in mod._parameters.items():
            if p is None:
                continue
            p.zero_()
            if init:
                if pname == "weight" and isinstance(mod, llama.RMSNorm):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02, generator=g)

    params = ss.NVMeStore(os.path.join(args.dir, f"params-{tag}"),
                          budget_bytes=args.budget_mib << 20)
    return model, ss.offload_parameters(model, params, prefetch=args.prefetch, init=fill)


def _largest_module_bytes(model) -> int:
    return max(sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
               for m in model.modules())


def _config(args):
    import llama
    return llama.LlamaConfig.preset(args.size, hidden_size=args.hidden,
                                    num_hidden_layers=args.layers,
                                    intermediate_size=args.ffn, vocab_size=args.vocab,
                                    num_attention_heads=args.heads,
                                    num_key_value_heads=args.kv_heads)


def child_train(args) -> None:
    import torch
    from tqdm.auto import tqdm

    import llama
    import statestore as ss
    torch.set_num_threads(args.threads)
    c = _config(args)
    out: dict = {"role": "train"}
    with Phase(out, "build model" + (" into the parameter store" if args.offload_params else "")):
        model, handle = _build(args, c, "a")
    out["params"] = sum(p.numel() for p in model.parameters())
    out["param_bytes"] = llama.param_bytes(model)
    out["largest_module_bytes"] = _largest_module_bytes(model)
    out["base_rss"] = reset_peak(trim=True)
    if args.compute_probe and handle is None:
        # forward + backward alone, no optimizer: the step's compute, for comparison
        ids = llama.batch(0, c, args.batch, args.seq)
        with Phase(out, "forward + backward alone (no optimizer)"):
            model(ids, labels=ids).backward()
        model.zero_grad(set_to_none=True)
    store = ss.NVMeStore(os.path.join(args.dir, "run-a"), budget_bytes=args.budget_mib << 20)
    opt = _optimizer(model, store, args)
    for step in tqdm(range(args.steps), desc="train", unit="step"):
        _step(model, opt, store, c, args, step, out, "first step (creates states)" if step == 0
              else "step", handle)
    ckpt = os.path.join(args.dir, "ckpt")
    with Phase(out, "save_checkpoint" + (" (states + model.safetensors)" if handle else "")):
        if handle is not None:
            handle.save_checkpoint(ckpt, store, progress=True)
        else:
            store.save_checkpoint(ckpt, progress=True)
    out["checkpoint_bytes"] = folder_bytes(ckpt)
    out["digest_at_save"] = _digest(model, handle)
    out["state_nbytes"] = store.stats()["nbytes"]
    if handle is not None:
        out["handle_stats"] = handle.stats()
    if args.moments == "fp32":
        with Phase(out, "state_dict()"):
            sd = opt.state_dict()
            n = sum(t.numel() * t.element_size() for st in sd["state"].values()
                    for t in st.values() if t.dim())
        out["state_dict_bytes"] = n
        del sd
    # else: state_dict() decodes compressed moments to fp32 into an unlinked temporary file
    # beside the store (8 bytes a parameter of disk): not part of this run
    digests = []
    for i in range(args.check_steps if args.reference == "continue" else 0):
        step = args.steps + i
        _step(model, opt, store, c, args, step, out, "step after save (reference)", handle)
        digests.append(_digest(model, handle))
    out["digests"] = digests
    out["store_stats"] = {k: v for k, v in store.stats().items() if k != "engine_stats"}
    with open(os.path.join(args.dir, "train.json"), "w") as f:
        json.dump(out, f)
    print("READY-TO-KILL", flush=True)
    step = args.steps + args.check_steps
    while True:             # killed part-way through one of these
        ids = llama.batch(step, c, args.batch, args.seq)
        model(ids, labels=ids).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1


def child_resume(args) -> None:
    import torch
    from tqdm.auto import tqdm

    import llama
    import statestore as ss
    torch.set_num_threads(args.threads)
    c = _config(args)
    out: dict = {"role": "resume"}
    with Phase(out, "build model (uninitialized)"):
        model, handle = _build(args, c, "b", init=False)
    out["base_rss"] = reset_peak(trim=True)
    store = ss.NVMeStore(os.path.join(args.dir, "run-b"), budget_bytes=args.budget_mib << 20)
    t0 = time.perf_counter()
    if handle is not None:
        with Phase(out, "load_checkpoint"):
            handle.load_checkpoint(os.path.join(args.dir, "ckpt"), store)
    else:
        with Phase(out, "load_checkpoint"):
            store.load_checkpoint(os.path.join(args.dir, "ckpt"), progress=True)
        with Phase(out, "weights from the masters"), torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(store.get((name, "master")))
    with Phase(out, "build optimizer"):
        opt = _optimizer(model, store, args)
    out["resume_seconds"] = time.perf_counter() - t0
    out["digest_at_load"] = _digest(model, handle)
    if args.reference == "rerun":
        # the checkpoint goes: the store keeps its links, now the files' only names, and
        # writes into them in place (disk: the states once, not twice)
        shutil.rmtree(os.path.join(args.dir, "ckpt"))
    out["linked_files"] = store.stats()["files"]
    out["bytes_written_by_load"] = store.stats()["bytes_written"]
    digests = []
    for i in tqdm(range(args.check_steps), desc="resumed", unit="step"):
        _step(model, opt, store, c, args, args.steps + i, out,
              "first step after resume" if i == 0 else "step after resume", handle)
        digests.append(_digest(model, handle))
    out["digests"] = digests
    store.close()
    if handle is not None:
        handle.store.close()
    with open(os.path.join(args.dir, "resume.json"), "w") as f:
        json.dump(out, f)


def child_reference(args) -> None:
    """``--reference rerun``: the uninterrupted run, trained from the same seed without a
    checkpoint or a kill, with digests after the same steps."""
    import torch
    from tqdm.auto import tqdm

    import llama
    import statestore as ss
    torch.set_num_threads(args.threads)
    c = _config(args)
    out: dict = {"role": "reference"}
    model, handle = _build(args, c, "c")
    out["base_rss"] = reset_peak(trim=True)
    store = ss.NVMeStore(os.path.join(args.dir, "run-c"), budget_bytes=args.budget_mib << 20)
    opt = _optimizer(model, store, args)
    digests = []
    for step in tqdm(range(args.steps + args.check_steps), desc="reference", unit="step"):
        _step(model, opt, store, c, args, step, out, "step (reference run)", handle)
        if step == args.steps - 1:
            out["digest_at_save"] = _digest(model, handle)
        if step >= args.steps:
            digests.append(_digest(model, handle))
    out["digests"] = digests
    store.close()
    if handle is not None:
        handle.store.close()
    with open(os.path.join(args.dir, "reference.json"), "w") as f:
        json.dump(out, f)


ROLES = {"train": child_train, "resume": child_resume, "reference": child_reference}


# ------------------------------------------------------------------ parent
class _Forked:
    """A child process forked from this one (``--fork``) running ``ROLES[role]``, with the
    part of ``subprocess.Popen`` the parent uses: ``stdout`` (a pipe, with ``pipe``),
    ``send_signal`` and ``wait`` (the exit status; -N when killed by signal N)."""

    def __init__(self, args, role: str, pipe: bool):
        sys.stdout.flush()
        sys.stderr.flush()
        r, w = os.pipe() if pipe else (-1, -1)
        self.pid = os.fork()
        if self.pid == 0:
            def child() -> None:
                if pipe:
                    os.close(r)
                    os.dup2(w, 1)
                    os.close(w)
                args.role = role
                ROLES[role](args)
            run_forked_child(child)
        self.stdout = None
        if pipe:
            os.close(w)
            self.stdout = os.fdopen(r, "r")

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def wait(self) -> int:
        _, status = os.waitpid(self.pid, 0)
        if self.stdout is not None:
            self.stdout.close()
        return os.waitstatus_to_exitcode(status)


def _start(args, role: str, pipe: bool = False):
    """The ``role`` process: forked (``--fork``) or a new interpreter running this script."""
    if args.fork:
        return _Forked(args, role, pipe)
    me = [sys.executable, os.path.abspath(__file__)] + sys.argv[1:] + ["--role", role]
    return subprocess.Popen(me, stdout=subprocess.PIPE if pipe else None, text=pipe)


class DiskSampler(threading.Thread):
    """Largest disk use (allocated blocks, each inode once) under ``d``, sampled every
    0.5 s: the filesystem is shared, so its own used-bytes figure would count others' files."""

    def __init__(self, d: str):
        super().__init__(daemon=True)
        self.d, self.peak, self.stop = d, 0, threading.Event()

    def run(self):
        while not self.stop.wait(0.5):
            self.peak = max(self.peak, folder_bytes(self.d, follow_symlinks=True))


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="folder for the states and the checkpoint")
    ap.add_argument("--size", default="1b", help="preset of examples/llama.py: tiny, 100m, 1b, 3b, 7b")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--ffn", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--kv-heads", type=int)
    ap.add_argument("--steps", type=int, default=3, help="steps before the checkpoint")
    ap.add_argument("--check-steps", type=int, default=2,
                    help="steps after the checkpoint, run by both processes and compared")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--budget-mib", type=int, default=256, help="the store's RAM budget")
    ap.add_argument("--offload-params", action="store_true",
                    help="parameters on disk too (statestore.offload_parameters into a second "
                         "NVMeStore), not in RAM")
    ap.add_argument("--prefetch", type=int, default=2,
                    help="--offload-params: modules whose parameters are read ahead")
    ap.add_argument("--moments", choices=["fp32", "bf16", "int8"], default="fp32",
                    help="HybridAdam's moment_dtype")
    ap.add_argument("--no-in-backward", dest="in_backward", action="store_false",
                    help="step after backward instead of update_in_backward=True")
    ap.add_argument("--no-release-grads", dest="release_grads", action="store_false")
    ap.add_argument("--probe-gib", type=float, default=2.0)
    ap.add_argument("--kill-after", type=float, default=3.0,
                    help="seconds into the train process's next step before SIGKILL")
    ap.add_argument("--no-compute-probe", dest="compute_probe", action="store_false",
                    help="skip timing one forward + backward without the optimizer")
    ap.add_argument("--force", action="store_true", help="run without the free-disk check")
    ap.add_argument("--keep", action="store_true", help="leave states and checkpoint behind")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--reference", choices=["continue", "rerun"], default="continue",
                    help="the uninterrupted run to compare with: the train process going on "
                         "after its checkpoint (disk: twice the states), or a third process "
                         "training from the same seed while the resumed one drops the "
                         "checkpoint after loading it (disk: the states once)")
    ap.add_argument("--fork", action="store_true",
                    help="fork the train, resume and reference processes from this one once "
                         "it has imported torch and statestore, instead of a new interpreter each")
    ap.add_argument("--role", choices=sorted(ROLES), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        return ROLES[args.role](args)

    import llama
    c = _config(args)
    n = c.num_parameters()
    states = state_bytes_per_param(args.moments) * n
    os.makedirs(args.dir, exist_ok=True)
    free = shutil.disk_usage(args.dir).free
    # the states twice: a linked save refuses to start without room for the copy-on-write of
    # every file it links (the store's next writes), and training on after the checkpoint
    # makes those copies; offloaded parameters: their store and the checkpoint's model file
    need = 2 * states + (4 << 30) + (4 * n if args.offload_params else 0)
    with open("/proc/meminfo") as f:
        mem = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in f}
    print(f"model: {n / 1e9:.2f}B parameters ({c}); bf16 weights {_gb(2 * n)} "
          f"({'on disk' if args.offload_params else 'in RAM'}), states ({args.moments} moments) "
          f"{_gb(states)}; disk free {_gb(free)} (needs ~{_gb(need)}), RAM available "
          f"{_gib(mem.get('MemAvailable', 0))}", flush=True)
    if free < need and not args.force:
        sys.exit(f"not enough free disk under {args.dir}: {_gb(free)} < {_gb(need)} (states, "
                 "plus as much again for the copy-on-write a linked checkpoint reserves"
                 f"{', parameters and the model file' if args.offload_params else ''}); --force "
                 "to try anyway")
    w_bw, r_bw = probe_disk(args.dir, int(args.probe_gib * GiB))
    print(f"disk probe ({args.probe_gib:g} GiB, O_DIRECT, 64 MiB requests): write "
          f"{w_bw:.2f} GB/s, read {r_bw:.2f} GB/s", flush=True)
    if args.fork:           # what every child imports, once (before the sampler's thread)
        import statestore  # noqa: F401
        import tqdm.auto  # noqa: F401
        import xxhash  # noqa: F401
        import torch._dynamo  # noqa: F401   (the optimizer's constructor imports it)
    sampler = DiskSampler(args.dir)
    sampler.start()
    t0 = time.perf_counter()
    for f in ("train.json", "resume.json", "reference.json"):
        if os.path.exists(os.path.join(args.dir, f)):
            os.unlink(os.path.join(args.dir, f))
    train = _start(args, "train", pipe=True)
    killed = False
    for line in train.stdout:
        sys.stdout.write(line)
        if line.startswith("READY-TO-KILL"):
            time.sleep(args.kill_after)
            train.send_signal(signal.SIGKILL)
            killed = True
            break
    rc = train.wait()
    if not killed:
        sys.exit(f"the train process exited ({rc}) before it could be killed")
    print(f"train process killed part-way through a step (exit {rc})", flush=True)
    disk_after_train = folder_bytes(args.dir, follow_symlinks=True)
    for sub in ("run-a", "params-a"):
        shutil.rmtree(os.path.join(args.dir, sub), ignore_errors=True)
    rc = _start(args, "resume").wait()
    if rc:
        sys.exit(f"the resume process failed ({rc})")
    if args.reference == "rerun":
        for sub in ("run-b", "params-b"):
            shutil.rmtree(os.path.join(args.dir, sub), ignore_errors=True)
        rc = _start(args, "reference").wait()
        if rc:
            sys.exit(f"the reference process failed ({rc})")
    sampler.stop.set()
    wall = time.perf_counter() - t0
    with open(os.path.join(args.dir, "train.json")) as f:
        tr = json.load(f)
    with open(os.path.join(args.dir, "resume.json")) as f:
        rs = json.load(f)
    if args.reference == "rerun":
        with open(os.path.join(args.dir, "reference.json")) as f:
            ref = json.load(f)
        if ref["digest_at_save"] != tr["digest_at_save"]:
            print("the reference run's weights at the checkpoint step differ from the train "
                  "process's: training is not deterministic here", flush=True)
        tr["digests"] = ref["digests"]
    report(args, c, tr, rs, w_bw, r_bw, sampler.peak, disk_after_train, wall,
           ref if args.reference == "rerun" else None)
    if not args.keep:
        for sub in ("run-a", "run-b", "run-c", "params-a", "params-b", "params-c", "ckpt"):
            shutil.rmtree(os.path.join(args.dir, sub), ignore_errors=True)


def state_bytes_per_param(moments: str) -> float:
    """Disk bytes of HybridAdam's states a parameter: fp32 master + both moments (int8: one
    byte each plus an fp32 scale per block of each: well under 0.1 byte a parameter)."""
    if moments == "int8":
        return 4 + 2 + 0.1
    return 4 + {"fp32": 8, "bf16": 4}[moments]


def report(args, c, tr, rs, w_bw, r_bw, disk_peak, disk_after_train, wall, ref=None) -> None:
    n, pb = tr["params"], tr["param_bytes"]
    off = args.offload_params
    print()
    print(f"## {n / 1e9:.2f}B-parameter Llama ({c.num_hidden_layers} layers, hidden "
          f"{c.hidden_size}, ffn {c.intermediate_size}, vocab {c.vocab_size}), bf16 weights "
          f"{_gib(pb)} {'on NVMeStore (offload_parameters, prefetch ' + str(args.prefetch) + ')' if off else 'in RAM'}, "
          f"states ({args.moments} moments) {_gib(tr['state_nbytes'])} on NVMeStore (budget "
          f"{args.budget_mib} MiB{' each' if off else ''}), update_in_backward={args.in_backward}, release_grads="
          f"{args.in_backward and args.release_grads}, batch {args.batch} x {args.seq} tokens")
    print(f"disk: write {w_bw:.2f} GB/s, read {r_bw:.2f} GB/s (O_DIRECT probe, same run); "
          f"peak disk used {_gb(disk_peak)}; after the train process {_gb(disk_after_train)}")
    print()
    print("| process | phase | time (s) | peak RSS | over the built model | grads held | "
          "ring | read | written | I/O floor (s) | time / floor |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    # offloaded: the working set (largest module x (prefetch + 2)), both stores' budgets and
    # 1 GiB of activations and slack, plus the gradients a phase still holds after backward
    work = tr.get("largest_module_bytes", 0) * (args.prefetch + 2) + 2 * (args.budget_mib << 20) \
        + GiB
    bound = work if off else 2 * pb + GiB
    over_bound = []
    for who, res in (("train", tr), ("resume", rs)) + ((("reference", ref),) if ref else ()):
        for ph in res["phases"]:
            over = ph["peak"] - res["base_rss"]
            rd, wr = ph.get("bytes_read"), ph.get("bytes_written")
            floor = (rd / (r_bw * 1e9) + wr / (w_bw * 1e9)) if rd is not None else None
            secs = ph.get("seconds_with_sync", ph["seconds"])
            if off and not ph["name"].startswith("build") \
                    and over > work + ph.get("grads_after_backward", 0):
                over_bound.append(f"{who}: {ph['name']}")
            print(f"| {who} | {ph['name']} | {secs:.1f} | {_gib(ph['peak'])} | "
                  f"{_gib(over) if not ph['name'].startswith('build') else '-'} | "
                  f"{_gib(ph['grads_after_backward']) if 'grads_after_backward' in ph else '-'} | "
                  f"{_gib(ph['ring']) if 'ring' in ph else '-'} | "
                  f"{_gb(rd) if rd is not None else '-'} | {_gb(wr) if wr is not None else '-'} | "
                  f"{f'{floor:.1f}' if floor else '-'} | "
                  f"{f'{secs / floor:.2f}' if floor else '-'} |")
    base = tr["base_rss"]
    print()
    if off:
        print(f"built model: RSS {_gib(base)} (interpreter and torch; the weights are on disk); "
              f"largest module {_gib(tr['largest_module_bytes'])}; bound per phase over that: "
              f"largest module x (prefetch + 2) + both budgets + 1 GiB = {_gib(work)}, plus the "
              f"gradients held after backward (release_grads: about a budget of them, the "
              f"first step included)")
        print(f"phases over the bound: {', '.join(over_bound) if over_bound else 'none'}; "
              f"checkpoint {_gb(tr['checkpoint_bytes'])}")
    else:
        print(f"built model: RSS {_gib(base)} (bf16 weights {_gib(pb)} + interpreter, torch and "
              f"the model's buffers {_gib(base - pb)}); bound per phase: weights + grads + 1 GiB "
              f"= {_gib(bound)} over the interpreter")
        peak_over = max(ph["peak"] for ph in tr["phases"] + rs["phases"]
                        if not ph["name"].startswith("build")) - (base - pb)
        print(f"largest peak over the interpreter: {_gib(peak_over)} "
              f"({'within' if peak_over <= bound else 'OVER'} the bound)")
    same = rs["digest_at_load"] == tr["digest_at_save"] and rs["digests"] == tr["digests"]
    print(f"uninterrupted run compared with: {args.reference} "
          f"({'the train process after its checkpoint' if args.reference == 'continue' else 'a third process trained from the same seed'})")
    print(f"resume: {rs['resume_seconds']:.1f} s (load_checkpoint linked {rs['linked_files']} "
          f"files, wrote {_gb(rs['bytes_written_by_load'])}); weights at load == weights at save: "
          f"{rs['digest_at_load'] == tr['digest_at_save']}; {len(tr['digests'])} steps after "
          f"resume bit-identical to the uninterrupted run: {rs['digests'] == tr['digests']}")
    if "state_dict_bytes" in tr:
        print(f"state_dict(): {tr['state_dict_bytes'] / 1e9:.2f} GB of tensors returned")
    else:
        print(f"state_dict(): not run ({args.moments} moments are decoded to fp32 into an "
              f"unlinked temporary file: 8 bytes a parameter of disk)")
    print(f"wall time {wall:.0f} s; {'OK' if same else 'MISMATCH'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), train=tr, resume=rs, reference=ref, write_gbps=w_bw,
                           read_gbps=r_bw, disk_peak=disk_peak, ok=same), f, indent=1)
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
