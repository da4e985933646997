"""Soak: train for minutes with periodic checkpoints while a parent process kills the trainer
with SIGKILL at random moments and restarts it from the last checkpoint; after every resume
the trainer's parameters, states and step counts, and every checkpoint left behind, are
compared bit for bit with an uninterrupted reference run at the same step.

    .venv/bin/python benchmarks/soak.py --minutes 3 --store nvme --seed 0

* The trainer: a small MLP (fp32 layers plus a bf16 gate, whose fp32 master lives in the
  store), two parameter groups (the second with amsgrad), deterministic data for each step,
  ``HybridAdam`` (or ``--optimizer cpu``: ``CPUAdam``) over the chosen store. Every
  ``--ckpt-every`` steps it writes the model weights (temporary name, fsync, rename) and then
  re-saves the optimizer checkpoint to the same path (the atomic re-save of
  ``docs/checkpoint-io.md``). A killed trainer's successor resumes from whatever
  checkpoint is there, in the same store directory.
* The parent computes the reference run in-process, launches trainers as child processes
  (``multiprocessing`` forkserver with torch and statestore preloaded, so a restart costs
  milliseconds and kills can be many), and SIGKILLs each after a random delay. After each
  kill it runs ``verify_checkpoint``, loads the checkpoint and compares it (states, step
  counts, and the weights that go with it) with the reference; each resumed trainer reports a
  digest of what it loaded, compared likewise. At the end one last trainer runs to a clean
  exit, and the final states are compared too.
* Timing decides only when kills happen, never what counts as correct. The exit status is 1
  when anything diverged, a checkpoint was corrupt or a trainer died on its own.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import mmap
import multiprocessing as mp
import os
import random
import shutil
import struct
import sys
import tempfile
import time
import warnings
from typing import Any, Dict, List, Optional, Tuple

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import statestore as ss  # noqa: E402
from statestore.checkpoint import read_manifest, verify_checkpoint  # noqa: E402
from statestore.optim import CPUAdam, HybridAdam  # noqa: E402

warnings.filterwarnings("ignore", category=RuntimeWarning)   # pinned memory without CUDA

PHASES = {0: "launching", 1: "starting", 2: "step", 3: "save", 4: "done"}
_STATUS = struct.Struct("<iq")          # phase, step: written by the trainer, read by the parent


# ---------------------------------------------------------------------------------- training
class Net(torch.nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.l1 = torch.nn.Linear(32, 256)
        self.l2 = torch.nn.Linear(256, 256)
        self.l3 = torch.nn.Linear(256, 8)
        self.gate = torch.nn.Parameter(torch.ones(256, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.l1(x))
        h = torch.relu(self.l2(h)) * self.gate.float()
        return self.l3(h)


def make_optimizer(cfg: Dict[str, Any], model: Net, store: ss.StateStore):
    named = list(model.named_parameters())
    groups = [{"params": [np for np in named if np[0].startswith(("l1.", "l2."))],
               "weight_decay": 0.01},
              {"params": [np for np in named if not np[0].startswith(("l1.", "l2."))],
               "lr": 3e-4, "amsgrad": True}]
    cls = HybridAdam if cfg["optimizer"] == "hybrid" else CPUAdam
    return cls(groups, lr=1e-3, state_store=store)


def batch(seed: int, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randn(64, 32, generator=g), torch.randn(64, 8, generator=g)


def train_step(cfg: Dict[str, Any], model: Net, opt, step: int) -> None:
    x, y = batch(cfg["seed"], step)
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def make_store(cfg: Dict[str, Any]) -> ss.StateStore:
    kind, d = cfg["store"], cfg["store_dir"]
    if kind == "nvme":
        return ss.NVMeStore(d, engine=cfg["engine"], budget_bytes=cfg["budget"])
    if kind == "file":
        return ss.FileStore(d)
    if kind == "pinned":
        return ss.PinnedCPUStore()
    raise ValueError(kind)


def digest(model: Net, store: ss.StateStore, steps: Dict[str, int]) -> str:
    """sha256 of the parameters, every state and the step counts: equal digests mean
    bit-identical training states."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    for k in sorted(store.keys(), key=str):
        h.update(str(k).encode())
        h.update(store.get(k).contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    h.update(json.dumps(sorted(steps.items())).encode())
    return h.hexdigest()


def weights_file(cfg: Dict[str, Any], step: int) -> str:
    return os.path.join(cfg["weights_dir"], f"weights-{step:08d}.safetensors")


def checkpoint_step(ck: str) -> int:
    steps = read_manifest(ck).metadata.get("steps", {})
    return max(steps.values()) if steps else 0


def _write_json(path: str, obj: Any) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def save(cfg: Dict[str, Any], model: Net, store: ss.StateStore, step: int) -> None:
    """Weights first (atomically), then the optimizer checkpoint (atomic re-save); then the
    weights of older checkpoints go. A kill at any point leaves a checkpoint whose weights
    file exists."""
    from safetensors.torch import save_file
    w = weights_file(cfg, step)
    save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, w + ".tmp")
    fd = os.open(w + ".tmp", os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    os.replace(w + ".tmp", w)
    store.save_checkpoint(cfg["ckpt"], progress=False)
    for old in glob.glob(os.path.join(cfg["weights_dir"], "weights-*.safetensors")):
        if old != w:
            os.unlink(old)


def noop() -> None:
    """A first child, so that the forkserver is running (and prewarmed) before the clock."""


def trainer(cfg: Dict[str, Any], launch: int, max_steps: int) -> None:
    """One trainer process: resume from the checkpoint if there is one, train to
    ``max_steps`` (in practice: until killed), checkpointing every ``ckpt_every`` steps."""
    from safetensors.torch import load_file
    torch.set_num_threads(1)
    with open(cfg["status"], "r+b") as f:
        status = mmap.mmap(f.fileno(), _STATUS.size)
    _STATUS.pack_into(status, 0, 1, 0)
    model = Net(cfg["seed"] + 1000 + launch)        # the weights file decides the values
    store = make_store(cfg)
    step = 0
    if os.path.exists(os.path.join(cfg["ckpt"], "manifest.parquet")):
        step = checkpoint_step(cfg["ckpt"])
        w = load_file(weights_file(cfg, step))
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(w[n])
        store.load_checkpoint(cfg["ckpt"], progress=False)
    else:
        model = Net(cfg["seed"])
    opt = make_optimizer(cfg, model, store)
    if step:
        _write_json(os.path.join(cfg["work"], f"resumed-{launch:05d}.json"),
                    {"step": step, "digest": digest(model, store, opt._steps),
                     "statestore": ss.__file__})
    while step < max_steps:
        _STATUS.pack_into(status, 0, 2, step)
        train_step(cfg, model, opt, step)
        step += 1
        if step % cfg["ckpt_every"] == 0:
            _STATUS.pack_into(status, 0, 3, step)
            save(cfg, model, store, step)
    _STATUS.pack_into(status, 0, 4, step)
    _write_json(os.path.join(cfg["work"], "final.json"),
                {"step": step, "digest": digest(model, store, opt._steps)})
    store.close()


# ---------------------------------------------------------------------------------- parent
class Reference:
    """The uninterrupted run, advanced on demand (requests only move forward)."""

    def __init__(self, cfg: Dict[str, Any]):
        self.cfg = cfg
        self.model = Net(cfg["seed"])
        self.store = ss.DeviceStore("cpu")
        self.opt = make_optimizer(cfg, self.model, self.store)
        self.step = 0

    def at(self, step: int) -> "Reference":
        if step < self.step:
            raise RuntimeError(f"reference asked for step {step}, already at {self.step}")
        while self.step < step:
            train_step(self.cfg, self.model, self.opt, self.step)
            self.step += 1
        return self

    def digest(self) -> str:
        return digest(self.model, self.store, self.opt._steps)

    def compare_checkpoint(self, ck: str, weights: str) -> List[str]:
        """Differences between the checkpoint (states, step counts, the weights file that goes
        with it) and the reference at the same step."""
        from safetensors.torch import load_file
        out = []
        with ss.DeviceStore("cpu") as s:
            s.load_checkpoint(ck, progress=False)
            mine = {str(k) for k in self.store.keys()}
            theirs = {str(k) for k in s.keys()}
            if mine != theirs:
                out.append(f"state keys differ: {sorted(mine ^ theirs)}")
            for k in sorted(mine & theirs):
                if not torch.equal(s.get(k), self.store.get(k)):
                    out.append(f"state {k} differs")
            steps = s.loaded_metadata.get("steps", {})
            if steps != self.opt._steps:
                out.append(f"step counts differ: {steps} vs {self.opt._steps}")
        w = load_file(weights)
        for n, p in self.model.named_parameters():
            if n not in w or w[n].dtype != p.dtype or not torch.equal(w[n], p.detach()):
                out.append(f"weight {n} differs")
        return out


def _read_status(path: str) -> Tuple[str, int]:
    with open(path, "rb") as f:
        phase, step = _STATUS.unpack(f.read(_STATUS.size))
    return PHASES.get(phase, "?"), step


def _temporaries(ck: str) -> List[str]:
    return sorted(n for n in os.listdir(ck) if n.startswith(".")) if os.path.isdir(ck) else []


def _stale_store_bytes(cfg: Dict[str, Any]) -> Tuple[int, int]:
    files = glob.glob(os.path.join(cfg["store_dir"], "states-*.safetensors"))
    return len(files), sum(os.path.getsize(f) for f in files)


def run(args: argparse.Namespace) -> int:
    work = args.dir or tempfile.mkdtemp(prefix="statestore-soak-")
    os.makedirs(work, exist_ok=True)
    for sub in ("ckpt", "weights", "store"):
        shutil.rmtree(os.path.join(work, sub), ignore_errors=True)
    for f in glob.glob(os.path.join(work, "*.json")):
        os.unlink(f)
    cfg = {"seed": args.seed, "store": args.store, "engine": args.engine,
           "budget": args.budget, "optimizer": args.optimizer, "ckpt_every": args.ckpt_every,
           "work": work, "ckpt": os.path.join(work, "ckpt"),
           "weights_dir": os.path.join(work, "weights"),
           "store_dir": os.path.join(work, "store"), "status": os.path.join(work, "status")}
    os.makedirs(cfg["weights_dir"])
    with open(cfg["status"], "wb") as f:
        f.write(bytes(4096))
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    # Trainers are forked by a server that imported this module (as "soak": preloading
    # "__main__" does not work on Python < 3.12) and prewarmed it. The server takes its
    # import path from the environment (Python 3.11 ignores the sys.path it is given): this
    # directory, and the statestore this process imported.
    here = os.path.dirname(os.path.abspath(__file__))
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(ss.__file__)))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [here, pkg_root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    sys.path.insert(0, here)
    import soak as this
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["soak"])
    ref = Reference(cfg)
    warm = ctx.Process(target=this.noop)     # start the forkserver (it prewarms) before the clock
    warm.start()
    warm.join()

    fig = {"launches": 0, "kills": 0, "killed_in": {}, "resumes_verified": 0,
           "checkpoints_verified": 0, "steps_trained": 0, "furthest_step": 0,
           "divergences": 0, "corrupt": 0, "crashes": 0, "temporaries_seen": 0,
           "stale_files_max": 0, "stale_bytes_max": 0}
    problems: List[str] = []
    seen_resumes: set = set()
    last_ck_step = 0

    def check_resumes() -> None:
        for path in sorted(glob.glob(os.path.join(work, "resumed-*.json"))):
            if path in seen_resumes:
                continue
            seen_resumes.add(path)
            with open(path) as f:
                r = json.load(f)
            if r["statestore"] != ss.__file__:
                problems.append(f"the trainer ran {r['statestore']}, not {ss.__file__}")
            if ref.at(r["step"]).digest() == r["digest"]:
                fig["resumes_verified"] += 1
            else:
                fig["divergences"] += 1
                problems.append(f"{os.path.basename(path)}: resumed state at step {r['step']} "
                                "differs from the reference")

    def check_checkpoint(after: str) -> int:
        ck = cfg["ckpt"]
        if not os.path.exists(os.path.join(ck, "manifest.parquet")):
            return 0
        bad = verify_checkpoint(ck, progress=False)
        if bad:
            fig["corrupt"] += 1
            problems.append(f"after {after}: checkpoint does not verify: {bad[:3]}")
            return -1
        step = checkpoint_step(ck)
        diff = ref.at(step).compare_checkpoint(ck, weights_file(cfg, step))
        if diff:
            fig["divergences"] += 1
            problems.append(f"after {after}: checkpoint at step {step} diverges: {diff[:5]}")
        else:
            fig["checkpoints_verified"] += 1
        return step

    t0 = time.monotonic()
    deadline = t0 + args.minutes * 60
    launch = 0
    while time.monotonic() < deadline:
        launch += 1
        _write_status(cfg, 0)
        p = ctx.Process(target=this.trainer, args=(cfg, launch, 1 << 40), daemon=True)
        p.start()
        fig["launches"] += 1
        delay = rng.uniform(args.kill_min, args.kill_max)
        p.join(timeout=max(0.0, min(delay, deadline - time.monotonic())))
        phase, step = _read_status(cfg["status"])
        if p.exitcode is not None:              # it should never end by itself
            fig["crashes"] += 1
            problems.append(f"trainer {launch} exited by itself with status {p.exitcode}")
        else:
            p.kill()
            p.join()
            fig["kills"] += 1
            fig["killed_in"][phase] = fig["killed_in"].get(phase, 0) + 1
        check_resumes()
        start = last_ck_step
        ck_step = check_checkpoint(f"kill {launch} (in {phase} at step {step})")
        if ck_step >= 0:
            last_ck_step = max(last_ck_step, ck_step)
        fig["steps_trained"] += max(0, step - start)
        fig["furthest_step"] = max(fig["furthest_step"], step)
        fig["temporaries_seen"] += len(_temporaries(cfg["ckpt"]))
        n, b = _stale_store_bytes(cfg)
        fig["stale_files_max"] = max(fig["stale_files_max"], n)
        fig["stale_bytes_max"] = max(fig["stale_bytes_max"], b)

    # A last trainer runs to a clean exit: it resumes, trains 2 more checkpoint periods.
    final_step = last_ck_step + 2 * args.ckpt_every
    launch += 1
    p = ctx.Process(target=this.trainer, args=(cfg, launch, final_step), daemon=True)
    p.start()
    fig["launches"] += 1
    p.join(timeout=600)
    if p.exitcode != 0:
        fig["crashes"] += 1
        problems.append(f"the final trainer ended with status {p.exitcode}")
        if p.exitcode is None:
            p.kill()
            p.join()
    check_resumes()
    ck_step = check_checkpoint("the final trainer")
    fig["steps_trained"] += max(0, final_step - last_ck_step)
    fig["furthest_step"] = max(fig["furthest_step"], final_step)
    final_path = os.path.join(work, "final.json")
    if os.path.exists(final_path):
        with open(final_path) as f:
            r = json.load(f)
        if ref.at(r["step"]).digest() != r["digest"]:
            fig["divergences"] += 1
            problems.append(f"final state at step {r['step']} differs from the reference")
    else:
        problems.append("the final trainer wrote no final state")
    leftovers = _temporaries(cfg["ckpt"])
    n_stale, b_stale = _stale_store_bytes(cfg)
    elapsed = time.monotonic() - t0

    engine = args.engine
    if engine == "auto":
        from statestore.io import available_engines
        engine = os.environ.get("STATESTORE_IO_ENGINE", "auto")
        engine = available_engines()[0] if engine == "auto" else engine
    store_desc = args.store + (f" (engine {engine}, budget {args.budget >> 10} KiB)"
                               if args.store == "nvme" else "")
    killed_in = ", ".join(f"{k}: {v}" for k, v in sorted(fig["killed_in"].items()))
    rows = [
        ("wall time", f"{elapsed:.1f} s"),
        ("store / optimizer", f"{store_desc} / {'HybridAdam' if args.optimizer == 'hybrid' else 'CPUAdam'}"),
        ("steps trained (all trainers, redone steps included)", fig["steps_trained"]),
        ("furthest step", fig["furthest_step"]),
        ("trainer launches", fig["launches"]),
        ("kills (SIGKILL) survived", f"{fig['kills']} ({killed_in})"),
        ("resumes verified (params, states, step counts = reference)", fig["resumes_verified"]),
        ("checkpoints verified (verify_checkpoint + equal to reference)", fig["checkpoints_verified"]),
        ("final state after a clean exit", "equal to reference" if not any(
            "final" in x for x in problems) else "DIFFERS"),
        ("divergences", fig["divergences"]),
        ("corrupt checkpoints", fig["corrupt"]),
        ("trainers that died by themselves", fig["crashes"]),
        ("temporaries of killed saves seen (cleaned by the next save)", fig["temporaries_seen"]),
        ("temporaries left after the final save", len(leftovers)),
        ("store files left by killed trainers (max seen, at end)",
         f"{fig['stale_files_max']} files {fig['stale_bytes_max'] >> 10} KiB, "
         f"{n_stale} files {b_stale >> 10} KiB"),
    ]
    print(f"statestore soak: --minutes {args.minutes} --store {args.store} --seed {args.seed} "
          f"--ckpt-every {args.ckpt_every} (work dir {work})")
    width = max(len(r[0]) for r in rows)
    print(f"| {'figure':<{width}} | value |")
    print(f"|{'-' * (width + 2)}|-------|")
    for k, v in rows:
        print(f"| {k:<{width}} | {v} |")
    for p_ in problems:
        print("PROBLEM:", p_)
    if not args.dir and not problems and not leftovers:
        shutil.rmtree(work, ignore_errors=True)
    ok = not problems and not leftovers
    return 0 if ok else 1


def _write_status(cfg: Dict[str, Any], phase: int) -> None:
    with open(cfg["status"], "r+b") as f:
        f.write(_STATUS.pack(phase, 0))


def _prewarm() -> None:
    """In the forkserver, once: the one-time costs every trainer would otherwise pay
    (``torch.optim`` imports ``torch._dynamo`` lazily, seconds; safetensors; pyarrow; the I/O
    engine probes). Nothing computes, and no thread is left running, before it forks."""
    import pyarrow.parquet  # noqa: F401
    import safetensors.torch  # noqa: F401
    from tqdm.auto import tqdm
    from statestore.io import available_engines
    tqdm.get_lock()             # its multiprocessing lock: made once, not by every trainer
    available_engines()
    with ss.DeviceStore("cpu") as s:
        CPUAdam([torch.nn.Parameter(torch.zeros(2))], state_store=s)


if __name__ == "soak":      # imported by name: by the forkserver's preload (and the parent)
    _prewarm()


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=3.0, help="how long to keep killing (default 3)")
    ap.add_argument("--store", choices=["nvme", "file", "pinned"], default="nvme")
    ap.add_argument("--seed", type=int, default=0, help="model, data and kill times")
    ap.add_argument("--optimizer", choices=["hybrid", "cpu"], default="hybrid")
    ap.add_argument("--ckpt-every", type=int, default=25, help="steps between checkpoints")
    ap.add_argument("--engine", default="auto", help="NVMeStore I/O engine")
    ap.add_argument("--budget", type=int, default=1 << 20,
                    help="NVMeStore RAM budget in bytes (small: a step is many pipeline units)")
    ap.add_argument("--kill-min", type=float, default=0.2, help="seconds, shortest life of a trainer")
    ap.add_argument("--kill-max", type=float, default=2.5, help="seconds, longest life of a trainer")
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one, "
                    "removed when everything passed)")
    args = ap.parse_args(argv)
    if args.ckpt_every <= 0 or args.minutes < 0 or not 0 <= args.kill_min <= args.kill_max:
        ap.error("--ckpt-every must be positive, --minutes non-negative, "
                 "0 <= --kill-min <= --kill-max")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
