"""HF Trainer checkpoints of a statestore optimizer on an NVMeStore: the optimizer's part of
saving ``checkpoint-N`` and of ``resume_from_checkpoint``, with the integration
(``StateStoreTrainer``: ``save_checkpoint`` into ``checkpoint-N/statestore/``) and without it
(plain ``Trainer``: ``torch.save(optimizer.state_dict())`` / ``torch.load`` +
``load_state_dict``), on a Llama-config model of about 100M parameters (nothing downloaded).

    .venv/bin/python benchmarks/trainer_checkpoint.py --dir /path/on/the/disk

Each mode runs in two fresh processes: one trains a step and saves ``checkpoint-1``, the next
resumes from it and trains one more step. Timed: the Trainer's ``_save_optimizer_and_scheduler``
and ``_load_optimizer_and_scheduler`` (everything the optimizer and the scheduler cost; the
model's weights are saved and loaded alike in both modes). Peak RSS growth is VmHWM after
``/proc/self/clear_refs`` minus RSS before the call (file-backed pages included), plus the
process's peak RSS overall. Disk: bytes the checkpoint's optimizer files add (files
hard-linked to the store's files count nothing) and the peak growth, during the save, of
the disk held by the run's folder (each inode once) plus the unlinked files the process
holds open or mapped (``state_dict()``'s temporary file), sampled every 5 ms.
Between the two processes the checkpoint's pages are dropped from the page cache
(``posix_fadvise(DONTNEED)``), so the resume reads the disk. ``--rounds N`` repeats every
mode N times, interleaved, and prints medians.

``--fork``: each process is forked from the parent once it has imported torch, transformers
and statestore, instead of a new interpreter (the seconds of imports a process are not
repeated; the tests use it). The timed calls and their RSS growth mean the same; the
process's peak RSS counts the parent's pages at the fork (the imports, nothing more) and what
the process adds, not the transient memory of importing (a new interpreter's peak is
tens of MiB higher on a tiny model).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import stat
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from _common import folder_bytes, peak_growth, reset_peak, run_forked_child

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODES = ("integration", "plain")


def _disk_held(root: str) -> int:
    """Bytes of disk that files under ``root`` hold (each inode once), plus files this process
    holds open that are unlinked (``state_dict()``'s temporary file on a disk store)."""
    seen = set()
    total = folder_bytes(root, seen=seen)
    # Unlinked files still open or mapped: /proc/self/fd, and /proc/self/map_files for
    # mappings whose descriptor was closed (needs root; else those are not counted).
    held = [f"/proc/self/fd/{fd}" for fd in os.listdir("/proc/self/fd")]
    with open("/proc/self/maps") as f:
        held += [f"/proc/self/map_files/{ln.split()[0]}" for ln in f if ln.rstrip().endswith("(deleted)")]
    for path in held:
        try:
            st = os.stat(path)
        except OSError:
            continue
        if st.st_nlink == 0 and st.st_ino not in seen and stat.S_ISREG(st.st_mode):
            seen.add(st.st_ino)
            total += st.st_blocks * 512
    return total


class _DiskPeak:
    """Highest :func:`_disk_held` of ``root`` while active (sampled every 5 ms), minus the
    value at the start."""

    def __init__(self, root: str):
        self.root, self._stop = root, threading.Event()

    def __enter__(self):
        self.start = self.high = _disk_held(self.root)
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(0.005):
            self.high = max(self.high, _disk_held(self.root))

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.high = max(self.high, _disk_held(self.root))
        self.peak_used = self.high - self.start


def _measured(fn, disk_path, out: dict, prefix: str):
    def wrapper(*a, **k):
        base = reset_peak()
        with _DiskPeak(disk_path) as fs:
            t = time.perf_counter()
            fn(*a, **k)
            out[prefix + "_s"] = time.perf_counter() - t
        out[prefix + "_peak_rss"] = peak_growth(base)
        out[prefix + "_peak_disk"] = fs.peak_used
    return wrapper


class _Tokens:
    def __init__(self, vocab, seq, n=64):
        import torch
        g = torch.Generator().manual_seed(1)
        self.rows = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def _optimizer_bytes(ckpt: str) -> int:
    """Bytes the checkpoint's optimizer files hold that nothing else holds."""
    total = 0
    for root, _, files in os.walk(ckpt):
        for n in files:
            if root == ckpt and n != "optimizer.pt":
                continue                    # model, scheduler, RNG: alike in both modes
            st = os.stat(os.path.join(root, n))
            if st.st_nlink == 1:
                total += st.st_blocks * 512
    return total


def run_phase(a) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
    import statestore as ss
    from statestore.integrations.transformers import StateStoreTrainer
    from statestore.optim import HybridAdam
    torch.set_num_threads(a.threads)
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.inter,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads,
                      num_key_value_heads=a.kv_heads, max_position_embeddings=a.seq,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    nparams = sum(p.numel() for p in model.parameters())
    store = ss.NVMeStore(os.path.join(a.dir, f"store-{a.mode}-{a.phase}"))
    opt = HybridAdam(model.named_parameters(), lr=1e-4, state_store=store)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    out_dir = os.path.join(a.dir, f"out-{a.mode}")
    args = TrainingArguments(output_dir=out_dir, max_steps=1 if a.phase == "save" else 2,
                             save_steps=1, per_device_train_batch_size=1, report_to=[],
                             logging_strategy="no", use_cpu=True, seed=7, disable_tqdm=True)
    cls = StateStoreTrainer if a.mode == "integration" else Trainer
    trainer = cls(model=model, args=args, train_dataset=_Tokens(a.vocab, a.seq),
                  optimizers=(opt, sched))
    res = {"mode": a.mode, "phase": a.phase, "params": nparams,
           "state_bytes": store.stats()["nbytes"]}
    if a.phase == "save":
        trainer._save_optimizer_and_scheduler = _measured(
            trainer._save_optimizer_and_scheduler, a.dir, res, "save")
        trainer.train()
        res["state_bytes"] = store.stats()["nbytes"]
        res["optimizer_files"] = _optimizer_bytes(os.path.join(out_dir, "checkpoint-1"))
    else:
        trainer._load_optimizer_and_scheduler = _measured(
            trainer._load_optimizer_and_scheduler, a.dir, res, "load")
        trainer.train(resume_from_checkpoint=os.path.join(out_dir, "checkpoint-1"))
        res["state_bytes"] = store.stats()["nbytes"]
    res[a.phase + "_process_peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    store.close()
    return res


def _drop_cache(path: str) -> None:
    for root, _, files in os.walk(path):
        for n in files:
            try:
                fd = os.open(os.path.join(root, n), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _phase_process(a, phase: str, mode: str):
    """``run_phase`` in a new process: this script with ``--phase`` in a new interpreter, or
    (``--fork``) a child forked from this one. Returns (exit status, stdout + stderr)."""
    if not a.fork:
        argv = [sys.executable, __file__, "--phase", phase, "--mode", mode] + \
            [x for k in ("dir", "vocab", "hidden", "inter", "layers", "heads", "kv_heads", "seq",
                         "threads")
             for x in (f"--{k.replace('_', '-')}", str(getattr(a, k)))]
        p = subprocess.run(argv, capture_output=True, text=True)
        return p.returncode, p.stdout + p.stderr
    with tempfile.TemporaryFile("w+") as out:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            def child() -> None:
                os.dup2(out.fileno(), 1)
                os.dup2(out.fileno(), 2)
                res = run_phase(argparse.Namespace(**{**vars(a), "phase": phase, "mode": mode}))
                print("RESULT " + json.dumps(res), flush=True)
            run_forked_child(child)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        return os.waitstatus_to_exitcode(status), out.read()


def _mib(n) -> str:
    return f"{n / 2**20:,.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="working directory on the disk to measure "
                    "(default: a temporary one under /tmp, removed at the end)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1, help="repeat every mode; medians")
    ap.add_argument("--fork", action="store_true", help="fork each process from this one once "
                    "it has imported torch, transformers and statestore")
    ap.add_argument("--phase", choices=("save", "resume"), help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.phase:
        print("RESULT " + json.dumps(run_phase(a)), flush=True)
        return
    tmp = None
    if a.dir is None:
        tmp = a.dir = tempfile.mkdtemp(prefix="trainer_checkpoint-")
    os.makedirs(a.dir, exist_ok=True)
    if a.fork:                  # what every process imports, once
        import torch  # noqa: F401
        import transformers  # noqa: F401
        from transformers import LlamaForCausalLM, Trainer  # noqa: F401
        from statestore.integrations.transformers import StateStoreTrainer  # noqa: F401
    runs = {}
    try:
        for _ in range(a.rounds):               # interleaved rounds: medians below
            for mode in a.modes.split(","):
                row = {}
                for phase in ("save", "resume"):
                    if phase == "resume":
                        _drop_cache(os.path.join(a.dir, f"out-{mode}"))
                    rc, text = _phase_process(a, phase, mode)
                    line = next((ln for ln in text.splitlines()
                                 if ln.startswith("RESULT ")), None)
                    if rc != 0 or line is None:
                        sys.stderr.write(text[-8000:])
                        raise SystemExit(f"{mode}/{phase} failed (exit {rc})")
                    row.update(json.loads(line[len("RESULT "):]))
                for name in (f"out-{mode}", f"store-{mode}-save", f"store-{mode}-resume"):
                    shutil.rmtree(os.path.join(a.dir, name), ignore_errors=True)
                runs.setdefault(mode, []).append(row)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    rows = {m: {k: (statistics.median(r[k] for r in rs) if isinstance(rs[0][k], (int, float))
                    else rs[0][k]) for k in rs[0]} for m, rs in runs.items()}
    any_row = next(iter(rows.values()))
    print(f"\nHF Trainer checkpoint of HybridAdam on NVMeStore: Llama config, "
          f"{any_row['params'] / 1e6:.1f}M parameters, {_mib(any_row['state_bytes'])} MiB of "
          f"optimizer states; medians of {a.rounds} round(s)\n")
    cols = [("save s", lambda r: f"{r['save_s']:.2f}"),
            ("save peak RSS +MiB", lambda r: _mib(r["save_peak_rss"])),
            ("save peak disk +MiB", lambda r: _mib(r["save_peak_disk"])),
            ("optimizer files MiB", lambda r: _mib(r["optimizer_files"])),
            ("resume s", lambda r: f"{r['load_s']:.2f}"),
            ("resume peak RSS +MiB", lambda r: _mib(r["load_peak_rss"])),
            ("process peak RSS MiB save/resume",
             lambda r: f"{_mib(r['save_process_peak_rss'])}/{_mib(r['resume_process_peak_rss'])}")]
    head = ["mode"] + [c for c, _ in cols]
    table = [[m] + [f(r) for _, f in cols] for m, r in rows.items()]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *table)]
    print(" | ".join(h.ljust(w) for h, w in zip(head, widths)))
    print("-+-".join("-" * w for w in widths))
    for row in table:
        print(" | ".join(str(x).ljust(w) for x, w in zip(row, widths)))
    if "integration" in rows and "plain" in rows:
        i, p = rows["integration"], rows["plain"]
        print(f"\nplain / integration: save {p['save_s'] / max(i['save_s'], 1e-9):.1f}x, "
              f"resume {p['load_s'] / max(i['load_s'], 1e-9):.1f}x")


if __name__ == "__main__":
    main()
