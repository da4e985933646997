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
* ``--interrupts`` adds Ctrl-C and failing backward passes: the parent also sends SIGINT
  (once, or twice 10 ms apart) to the trainer at random moments, and some backward passes raise
  half-way (an autograd Function between the first two layers; odd launches train with
  ``update_in_backward=True``, so parameters are updated during the backward that fails). The
  trainer catches each as a training loop would and checks the contract of
  ``docs/reliability.md``: the optimizer is consistent (each parameter and its states equal the
  uninterrupted run at that parameter's step count, checked by the parent) or refuses every
  call with the recovery message; then it goes back to the last checkpoint in the same process
  (into the same store, the same optimizer unless it failed part-way) and trains on, and that
  reload is compared with the reference like a resume. A Ctrl-C during that handling is caught
  and the handling starts again.
* Timing decides only when kills and interrupts happen, never what counts as correct. The
  exit status is 1 when anything diverged, a checkpoint was corrupt, the contract was broken
  or a trainer died on its own.
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
import signal
import struct
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any, Dict, List, Optional, Tuple

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import statestore as ss  # noqa: E402
from statestore.checkpoint import read_manifest, verify_checkpoint  # noqa: E402
from statestore.kernels import kernels_info  # noqa: E402
from statestore.optim import CPUAdam, HybridAdam  # noqa: E402

warnings.filterwarnings("ignore", category=RuntimeWarning)   # pinned memory without CUDA

PHASES = {0: "launching", 1: "starting", 2: "step", 3: "save", 4: "done", 5: "recover"}
RECOVER = "Load the last checkpoint"     # what a refusing optimizer's errors say
_STATUS = struct.Struct("<iq")          # phase, step: written by the trainer, read by the parent


# ---------------------------------------------------------------------------------- training
class BackwardError(RuntimeError):
    """What an injected failure raises in the middle of backward."""


class _FailingBackward(torch.autograd.Function):
    """Identity whose backward raises: the layers above it have their gradients (and, with
    ``update_in_backward``, may be updated already), the layer below never gets one."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise BackwardError("injected failure in the middle of backward")


class Net(torch.nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.l1 = torch.nn.Linear(32, 256)
        self.l2 = torch.nn.Linear(256, 256)
        self.l3 = torch.nn.Linear(256, 8)
        self.gate = torch.nn.Parameter(torch.ones(256, dtype=torch.bfloat16))
        self.fail_backward = False      # the next backward raises between l2 and l1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.l1(x))
        if self.fail_backward:
            h = _FailingBackward.apply(h)
        h = torch.relu(self.l2(h)) * self.gate.float()
        return self.l3(h)


def make_optimizer(cfg: Dict[str, Any], model: Net, store: ss.StateStore,
                   update_in_backward: bool = False):
    named = list(model.named_parameters())
    groups = [{"params": [np for np in named if np[0].startswith(("l1.", "l2."))],
               "weight_decay": 0.01},
              {"params": [np for np in named if not np[0].startswith(("l1.", "l2."))],
               "lr": 3e-4, "amsgrad": True}]
    cls = HybridAdam if cfg["optimizer"] == "hybrid" else CPUAdam
    return cls(groups, lr=1e-3, state_store=store, update_in_backward=update_in_backward)


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


class _NoSigint:
    """SIGINT held (delivered as the block ends): around the weights files' safetensors
    calls, which turn a KeyboardInterrupt into a ValueError. Blocking the signal is not
    enough: one the process received just before (the second of a pair 10 ms apart) is
    already pending in the interpreter and would be raised inside the call; a recording
    handler takes it instead, and it is raised as the block ends."""

    def __enter__(self):
        self.old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        self.got = []
        self.prev = signal.signal(signal.SIGINT, lambda *_: self.got.append(1))

    def __exit__(self, exc_type, *exc):
        signal.signal(signal.SIGINT, self.prev)
        signal.pthread_sigmask(signal.SIG_SETMASK, self.old)
        if self.got and exc_type is None:
            raise KeyboardInterrupt


def _hash(t: torch.Tensor) -> str:
    return hashlib.sha1(t.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def digest(model: Net, store: ss.StateStore, steps: Dict[str, int]) -> Dict[str, Any]:
    """A sha1 of each parameter (``param:<name>``) and state (``state:<key>``), and the step
    counts: equal digests mean bit-identical training states, and a difference names what
    differs."""
    out: Dict[str, Any] = {f"param:{n}": _hash(p) for n, p in model.named_parameters()}
    out.update({f"state:{k}": _hash(store.get(k)) for k in store.keys()})
    out["steps"] = dict(sorted(steps.items()))
    return out


def differences(got: Dict[str, Any], want: Dict[str, Any]) -> List[str]:
    return sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))


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
    with _NoSigint():
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


def _phase(status, phase: int, step: int) -> None:
    _STATUS.pack_into(status, 0, phase, step)


def _start(cfg: Dict[str, Any], launch: int, store: ss.StateStore, uib: bool):
    """Resume from the checkpoint if there is one (into ``store``), else start afresh."""
    from safetensors.torch import load_file
    model = Net(cfg["seed"] + 1000 + launch)        # the weights file decides the values
    step = 0
    if os.path.exists(os.path.join(cfg["ckpt"], "manifest.parquet")):
        step = checkpoint_step(cfg["ckpt"])
        with _NoSigint():
            w = load_file(weights_file(cfg, step))
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(w[n])
        store.load_checkpoint(cfg["ckpt"], progress=False)
    else:
        store.clear()
        model = Net(cfg["seed"])
    return model, make_optimizer(cfg, model, store, uib), step


def _where(err: BaseException) -> str:
    """Where an exception came from, by the innermost function of its traceback that says."""
    names = []
    tb = err.__traceback__
    while tb is not None:
        names.append((tb.tb_frame.f_code.co_name, tb.tb_frame.f_code.co_filename))
        tb = tb.tb_next
    for fn, file in reversed(names):
        if fn == "grad_ready":
            return "backward (optimizer's hook)"
        if fn in ("backward", "_engine_run_backward"):
            return "backward (model)"
        if fn in ("save_checkpoint", "save"):
            return "save"
        if fn in ("load_checkpoint", "_start"):
            return "load"
        if fn == "step" and "statestore" in file:
            return "step()"
        if fn in ("zero_grad", "train_step"):
            return "step (loop)"
    return "elsewhere"


def _landed(err: BaseException) -> str:
    """Where an exception or Ctrl-C landed: the innermost line of its traceback in
    statestore (else the innermost line), as ``dir/file.py:line (function)``; a Ctrl-C held
    by deferred signals names the line whose block deferred it, marked "(deferred)"."""
    pkg = os.path.dirname(os.path.abspath(ss.__file__))
    inner = outer = None
    deferred = False
    tb = err.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        here = f"{os.path.basename(os.path.dirname(code.co_filename))}/" \
               f"{os.path.basename(code.co_filename)}:{tb.tb_lineno} ({code.co_name})"
        if code.co_filename.endswith("_signals.py"):
            deferred = True
        else:
            outer = here
            if os.path.abspath(code.co_filename).startswith(pkg):
                inner = here
        tb = tb.tb_next
    return (inner or outer or "?") + (" (deferred)" if deferred else "")


def _contract(cfg: Dict[str, Any], model: Net, store: ss.StateStore, opt) -> Dict[str, Any]:
    """After an exception or Ctrl-C: a refusing optimizer must refuse every call with the
    recovery message; a consistent one reports each parameter's step count and digests (the
    parent compares them with the reference at that count)."""
    table = opt._table
    if table.failed or table.lost:
        bad = []
        for name, call in (("step", opt.step), ("state_dict", opt.state_dict),
                           ("save_checkpoint", lambda: store.save_checkpoint(
                               os.path.join(cfg["work"], "refused"), progress=False))):
            try:
                call()
                bad.append(f"{name} did not refuse")
            except ss.StateStoreError as e:
                if RECOVER not in str(e):
                    bad.append(f"{name}: {str(e)[:200]}")
        return {"refusing": True, "bad": bad, "kernel": kernels_info()["cpu"]}
    return {"refusing": False, "digest": digest(model, store, opt._steps),
            "kernel": kernels_info()["cpu"]}


def died_file(cfg: Dict[str, Any], launch: int) -> str:
    return os.path.join(cfg["work"], f"died-{launch:05d}.txt")


def trainer_logged(cfg: Dict[str, Any], launch: int, max_steps: int) -> None:
    """:func:`trainer`, whose traceback, when it ends by an exception, is kept in
    :func:`died_file` with SIGINT blocked while it is written (the second Ctrl-C of a pair
    otherwise cuts multiprocessing's own print of it short, leaving no cause)."""
    try:
        trainer(cfg, launch, max_steps)
    except BaseException:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        with open(died_file(cfg, launch), "w") as f:
            traceback.print_exc(file=f)
        raise


def trainer(cfg: Dict[str, Any], launch: int, max_steps: int) -> None:
    """One trainer process: resume from the checkpoint if there is one, train to
    ``max_steps`` (in practice: until killed), checkpointing every ``ckpt_every`` steps. With
    interrupts, a Ctrl-C or a failing backward is caught, the contract checked and reported,
    and training goes back to the last checkpoint in this process."""
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")         # ResumeWarning of the in-process way back
    if cfg["interrupts"]:
        # Ctrl-C is a KeyboardInterrupt here however the soak was started: a shell starts a
        # background job (`soak.py ... &`) with SIGINT ignored, which Python then keeps, and
        # every SIGINT the parent sends would be lost (a soak without a single Ctrl-C)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    with open(cfg["status"], "r+b") as f:
        status = mmap.mmap(f.fileno(), _STATUS.size)
    _phase(status, 1, 0)
    rng = random.Random(cfg["seed"] * 7919 + launch)
    uib = bool(cfg["interrupts"]) and launch % 2 == 1
    store = make_store(cfg)
    model, opt, step = _start(cfg, launch, store, uib)
    if step:
        _write_json(os.path.join(cfg["work"], f"resumed-{launch:05d}.json"),
                    {"step": step, "digest": digest(model, store, opt._steps),
                     "statestore": ss.__file__})
    events = 0
    between = True                  # on the loop's own lines, between two steps
    while True:
        try:
            while step < max_steps:
                between = False
                try:
                    _phase(status, 2, step)
                    model.fail_backward = rng.random() < cfg["backward_error"]
                    train_step(cfg, model, opt, step)
                    step += 1
                    if step % cfg["ckpt_every"] == 0:
                        _phase(status, 3, step)
                        save(cfg, model, store, step)
                except (KeyboardInterrupt, BackwardError) as e:
                    events += 1
                    report: Dict[str, Any] = {"retries": 0}
                    try:                        # a second Ctrl-C while this is noted: noted less
                        report.update({"kind": type(e).__name__, "where": _where(e),
                                       "at": _landed(e),
                                       "phase": PHASES[_STATUS.unpack_from(status)[0]],
                                       "step": step, "update_in_backward": uib})
                    except KeyboardInterrupt:
                        report.update({"kind": type(e).__name__, "where": "?", "phase": "?",
                                       "step": step, "update_in_backward": uib, "retries": 1})
                    del e                       # its traceback holds frames (and their buffers)
                    if not torch.is_grad_enabled():
                        # a Ctrl-C inside torch.no_grad()'s __enter__ (after it turned grad mode
                        # off, before the block began) leaves it off: a loop turns it back on
                        report["grad_mode_left_off"] = True
                        torch.set_grad_enabled(True)
                    _phase(status, 5, step)
                    done = set()
                    while len(done) < 3:        # a Ctrl-C meanwhile: what was not done is done again
                        try:
                            if "contract" not in done:
                                report.update(_contract(cfg, model, store, opt))
                                done.add("contract")
                            if "reload" not in done:
                                report["reload"] = {"went_on": False}
                                at = _one_count(model, opt)
                                if at is not None and at in (step, step + 1) and not report["refusing"]:
                                    # every parameter at one step: no need to go back, the loop
                                    # goes on from there (a step that ended, or never began)
                                    opt.zero_grad(set_to_none=True)
                                    if at == step + 1:
                                        step = at
                                        if step % cfg["ckpt_every"] == 0:
                                            _phase(status, 3, step)
                                            save(cfg, model, store, step)
                                    report["reload"]["went_on"] = True
                                elif opt._table.failed:  # parameters of two steps: a new optimizer
                                    model, opt, step = _start(cfg, launch, store, uib)
                                else:                   # the same optimizer takes the checkpoint
                                    model, opt, step = _rollback(cfg, launch, store, model, opt, uib)
                                report["reload"].update(
                                    {"step": step, "digest": digest(model, store, opt._steps)})
                                done.add("reload")
                            _write_json(os.path.join(cfg["work"], f"event-{launch:05d}-{events:03d}.json"),
                                        report)
                            done.add("report")
                        except KeyboardInterrupt:
                            report["retries"] += 1
                between = True
            break
        except KeyboardInterrupt:
            # a Ctrl-C on the loop's own lines (its test, its jump back: outside the try
            # above) between two steps: nothing of a step began, training goes on, as
            # the first Ctrl-C a user's loop catches there would; elsewhere it ends the
            # trainer (counted by the parent as one that died)
            if not between:
                raise
            events += 1
    _phase(status, 4, step)
    _write_json(os.path.join(cfg["work"], "final.json"),
                {"step": step, "digest": digest(model, store, opt._steps)})
    store.close()


def _one_count(model: Net, opt) -> Optional[int]:
    """The step count of every parameter when they are all at one step, else None."""
    counts = {opt._steps.get(n, 0) for n, _ in model.named_parameters()}
    return counts.pop() if len(counts) == 1 else None


def _rollback(cfg: Dict[str, Any], launch: int, store: ss.StateStore, model: Net, opt,
              uib: bool):
    """Back to the last checkpoint in this process: the weights that go with it, the
    checkpoint loaded into the same store, the same optimizer (it takes the checkpoint's
    step counts); afresh when there is no checkpoint yet."""
    from safetensors.torch import load_file
    if not os.path.exists(os.path.join(cfg["ckpt"], "manifest.parquet")):
        return _start(cfg, launch, store, uib)
    step = checkpoint_step(cfg["ckpt"])
    with _NoSigint():
        w = load_file(weights_file(cfg, step))
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(w[n])
    opt.zero_grad(set_to_none=True)
    store.load_checkpoint(cfg["ckpt"], progress=False)
    if opt._table.failed or opt._table.lost:     # it did not take the checkpoint
        return _start(cfg, launch, store, uib)
    return model, opt, step


# ---------------------------------------------------------------------------------- parent
class Reference:
    """The uninterrupted run, advanced on demand; the digest of every step it passed is kept
    (a trainer rolled back asks for earlier steps)."""

    def __init__(self, cfg: Dict[str, Any]):
        self.cfg = cfg
        self.model = Net(cfg["seed"])
        self.store = ss.DeviceStore("cpu")
        self.opt = make_optimizer(cfg, self.model, self.store)
        self.step = 0
        self.hist: Dict[int, Dict[str, Any]] = {0: digest(self.model, self.store, {})}
        self.first = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        self._initial: Optional[Dict[str, str]] = None

    def initial_states(self) -> Dict[str, str]:
        """The digest of each state as a first step creates it, before it updates it: an
        fp32 master is its parameter's value, every other state zeros."""
        if self._initial is None:
            self.digest_at(1)
            self._initial = {}
            for k in self.store.keys():
                spec = self.store.spec(k)
                t = (self.first[k.param].float() if k.state == "master"
                     else torch.zeros(spec.shape, dtype=spec.dtype))
                self._initial[f"state:{k}"] = _hash(t)
        return self._initial

    def digest_at(self, step: int) -> Dict[str, Any]:
        while self.step < step:
            train_step(self.cfg, self.model, self.opt, self.step)
            self.step += 1
            self.hist[self.step] = digest(self.model, self.store, self.opt._steps)
        return self.hist[step]

    def compare_checkpoint(self, ck: str, weights: str) -> List[str]:
        """Differences between the checkpoint (states, step counts, the weights file that goes
        with it) and the reference at the same step."""
        from safetensors.torch import load_file
        with ss.DeviceStore("cpu") as s:
            s.load_checkpoint(ck, progress=False)
            got = {f"state:{k}": _hash(s.get(k)) for k in s.keys()}
            steps = s.loaded_metadata.get("steps", {})
        got.update({f"param:{n}": _hash(t) for n, t in load_file(weights).items()})
        got["steps"] = dict(sorted(steps.items()))
        return differences(got, self.digest_at(max(steps.values()) if steps else 0))

    def parameter_differences(self, got: Dict[str, Any]) -> List[str]:
        """A consistent optimizer's digest: each parameter and its states against the
        reference at that parameter's own step count."""
        out = []
        for n, _ in self.model.named_parameters():
            c = got["steps"].get(n, 0)
            want = self.digest_at(c)
            for k in set(want) | set(got):
                if k == f"param:{n}" or k.startswith(f"state:{n}/") and c > 0:
                    if got.get(k) != want.get(k):
                        out.append(f"{k} (count {c})")
                elif k.startswith(f"state:{n}/") and k in got:
                    # a parameter that never stepped may have its states created already:
                    # as good as none only when they hold what a first step creates (zero
                    # moments, the master its value); a zero master would be taken as the
                    # parameter's value by the next step (issue 47 item 7)
                    if got[k] != self.initial_states().get(k):
                        out.append(f"{k} (count 0, not its initial value)")
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
           "interrupts": args.sigint_rate > 0 or args.backward_error > 0,
           "backward_error": args.backward_error,
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
           "stale_files_max": 0, "stale_bytes_max": 0, "sigints": 0, "events": {},
           "consistent": 0, "refusing": 0, "contract_broken": 0, "reloads_verified": 0, "went_on_verified": 0, "grad_mode_left_off": 0,
           "handling_interrupted": 0}
    problems: List[str] = []
    seen_resumes: set = set()
    last_ck_step = 0

    kernel = kernels_info()["cpu"]

    def check_resumes() -> None:
        for path in sorted(glob.glob(os.path.join(work, "resumed-*.json"))):
            if path in seen_resumes:
                continue
            seen_resumes.add(path)
            with open(path) as f:
                r = json.load(f)
            if r["statestore"] != ss.__file__:
                problems.append(f"the trainer ran {r['statestore']}, not {ss.__file__}")
            if not differences(r["digest"], ref.digest_at(r["step"])):
                fig["resumes_verified"] += 1
            else:
                fig["divergences"] += 1
                problems.append(f"{os.path.basename(path)}: resumed state at step {r['step']} "
                                "differs from the reference")

    def check_events() -> None:
        for path in sorted(glob.glob(os.path.join(work, "event-*.json"))):
            if path in seen_resumes:
                continue
            seen_resumes.add(path)
            with open(path) as f:
                r = json.load(f)
            name = os.path.basename(path)
            key = f"{r['kind']} in {r['where']}" + (" (update_in_backward)"
                                                      if r["update_in_backward"] else "")
            fig["events"][key] = fig["events"].get(key, 0) + 1
            fig["handling_interrupted"] += r["retries"]
            fig["grad_mode_left_off"] += bool(r.get("grad_mode_left_off"))
            if r.get("kernel", kernel) != kernel:   # its steps round otherwise: all diverge
                problems.append(f"{name}: the trainer steps with the {r['kernel']} Adam "
                                f"kernel, this process with the {kernel} one")
            if r["refusing"]:
                fig["refusing"] += 1
                bad = r["bad"]
            else:
                fig["consistent"] += 1
                bad = ref.parameter_differences(r["digest"])
            if bad:
                fig["contract_broken"] += 1
                problems.append(f"{name}: after {key} at step {r['step']} (landed at "
                                f"{r.get('at', '?')}): {bad[:4]}")
            back = r["reload"]
            if back.get("went_on"):     # states created by a step that never began: as none
                diff = ref.parameter_differences(back["digest"]) + [
                    f"count {n}: {c}" for n, c in back["digest"]["steps"].items()
                    if c != back["step"]]
            else:
                diff = differences(back["digest"], ref.digest_at(back["step"]))
            if diff:
                fig["divergences"] += 1
                problems.append(f"{name}: the way back to step {r['reload']['step']} "
                                f"differs: {diff[:4]}")
            elif r["reload"].get("went_on"):
                fig["went_on_verified"] += 1
            else:
                fig["reloads_verified"] += 1

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
        diff = ref.compare_checkpoint(ck, weights_file(cfg, step))
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
        p = ctx.Process(target=this.trainer_logged, args=(cfg, launch, 1 << 40), daemon=True)
        p.start()
        fig["launches"] += 1
        kill_at = min(time.monotonic() + rng.uniform(args.kill_min, args.kill_max), deadline)
        while True:                 # SIGINTs at random moments until the kill
            now = time.monotonic()
            nxt = now + rng.expovariate(args.sigint_rate) if args.sigint_rate > 0 else kill_at
            p.join(timeout=max(0.0, min(nxt, kill_at) - now))
            if p.exitcode is not None or nxt >= kill_at:
                break
            if _read_status(cfg["status"])[0] in ("step", "save", "recover"):
                for _ in range(2 if rng.random() < 0.5 else 1):    # pressed once or twice
                    try:
                        os.kill(p.pid, signal.SIGINT)
                    except ProcessLookupError:      # it died meanwhile: counted below
                        break
                    fig["sigints"] += 1
                    time.sleep(0.01)
        phase, step = _read_status(cfg["status"])
        if p.exitcode is not None:              # it should never end by itself
            fig["crashes"] += 1
            cause = ""
            if os.path.exists(died_file(cfg, launch)):
                with open(died_file(cfg, launch)) as f:
                    cause = ": " + " | ".join(f.read().strip().splitlines()[-6:])
            problems.append(f"trainer {launch} exited by itself with status {p.exitcode}{cause}")
        else:
            p.kill()
            p.join()
            fig["kills"] += 1
            fig["killed_in"][phase] = fig["killed_in"].get(phase, 0) + 1
        check_resumes()
        check_events()
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
    p = ctx.Process(target=this.trainer_logged, args=(cfg, launch, final_step), daemon=True)
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
    check_events()
    ck_step = check_checkpoint("the final trainer")
    fig["steps_trained"] += max(0, final_step - last_ck_step)
    fig["furthest_step"] = max(fig["furthest_step"], final_step)
    final_path = os.path.join(work, "final.json")
    if os.path.exists(final_path):
        with open(final_path) as f:
            r = json.load(f)
        if differences(r["digest"], ref.digest_at(r["step"])):
            fig["divergences"] += 1
            problems.append(f"final state at step {r['step']} differs from the reference")
    else:
        problems.append("the final trainer wrote no final state")
    if fig["sigints"] >= 20 and not any(k.startswith("KeyboardInterrupt") for k in fig["events"]):
        problems.append(f"{fig['sigints']} SIGINTs sent and not one KeyboardInterrupt caught: "
                        f"the trainers did not get Ctrl-C (the run tested kills only)")
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
    ]
    if cfg["interrupts"]:
        events = ", ".join(f"{k}: {v}" for k, v in sorted(fig["events"].items()))
        rows += [
            ("SIGINTs sent (one, or two 10 ms apart)", fig["sigints"]),
            ("backward passes set to fail (probability per step)", args.backward_error),
            ("exceptions and Ctrl-C caught by the trainers", f"{sum(fig['events'].values())} "
                                                             f"({events})"),
            ("after which consistent (each parameter = reference at its count)",
             fig["consistent"]),
            ("after which refusing every call with the recovery message", fig["refusing"]),
            ("contract broken", fig["contract_broken"]),
            ("then all at one step: went on from there, verified", fig["went_on_verified"]),
            ("else back to the last checkpoint in the same process, verified",
             fig["reloads_verified"]),
            ("Ctrl-C during that handling (caught, handled again)", fig["handling_interrupted"]),
            ("grad mode left off by torch.no_grad() interrupted (turned back on)",
             fig["grad_mode_left_off"]),
        ]
    rows += [
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
    ap.add_argument("--sigint-rate", type=float, default=0.0,
                    help="SIGINTs per second sent to a running trainer (default 0: none)")
    ap.add_argument("--backward-error", type=float, default=0.0,
                    help="probability that a step's backward raises half-way (default 0)")
    ap.add_argument("--interrupts", action="store_true",
                    help="shorthand for --sigint-rate 2 --backward-error 0.02")
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one, "
                    "removed when everything passed)")
    args = ap.parse_args(argv)
    if args.interrupts:
        args.sigint_rate = args.sigint_rate or 2.0
        args.backward_error = args.backward_error or 0.02
    if args.ckpt_every <= 0 or args.minutes < 0 or not 0 <= args.kill_min <= args.kill_max:
        ap.error("--ckpt-every must be positive, --minutes non-negative, "
                 "0 <= --kill-min <= --kill-max")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
