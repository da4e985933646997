"""Ctrl-C at sampled points inside statestore's code, and the checks of what must hold after
it (``tests/reliability/test_interrupts.py``, ``benchmarks/soak.py --interrupts``).

A real SIGINT is raised (``signal.raise_signal``) at the n-th line executed inside chosen
source files (a line tracer: ``sys.settrace``), optionally followed by a second one from
another thread some milliseconds later ("Ctrl-C pressed twice"). The signal is handled by a
handler installed for the call, which raises ``KeyboardInterrupt`` as Python's default one
does, so code that defers signals (``statestore/_signals.py``) defers these too; once the
call is over, late signals are ignored rather than interrupting the test itself.
"""
from __future__ import annotations

import os
import random
import signal
import sys
import threading
from typing import Callable, Dict, List, Optional, Sequence

import torch

import statestore as ss

PKG = os.path.dirname(os.path.abspath(ss.__file__))


def sources(*names: str) -> List[str]:
    """Paths of statestore source files, relative to the package (``"pipeline.py"``,
    ``"optim/adam.py"``...)."""
    return [os.path.join(PKG, n) for n in names]


class _Tracer:
    def __init__(self, files: Sequence[str], at: Optional[int], on_hit: Callable[[], None]):
        self.files, self.at, self.on_hit = set(files), at, on_hit
        self.count = 0
        self.hit_at: Optional[str] = None

    def global_trace(self, frame, event, arg):
        if frame.f_code.co_filename in self.files:
            return self.local_trace
        return None

    def local_trace(self, frame, event, arg):
        if event == "line":
            self.count += 1
            if self.count == self.at:
                self.hit_at = f"{os.path.relpath(frame.f_code.co_filename, PKG)}:" \
                              f"{frame.f_lineno} ({frame.f_code.co_name})"
                self.on_hit()
        return self.local_trace


class Interrupted:
    """What :func:`interrupt` observed: ``error`` (the exception the call raised, None when
    it returned), ``lines`` (line events counted in the files), ``where`` (the line the
    first signal was raised at, None when the call ended first)."""

    def __init__(self, error, lines, where):
        self.error, self.lines, self.where = error, lines, where

    def __repr__(self) -> str:
        return f"Interrupted({type(self.error).__name__ if self.error else None}, " \
               f"at {self.where}, of {self.lines} lines)"


def interrupt(call: Callable[[], object], files: Sequence[str], at: Optional[int],
              second_after: Optional[float] = None) -> Interrupted:
    """Run ``call()``; at its ``at``-th line event in ``files`` (None: never, only count)
    raise SIGINT, and ``second_after`` seconds later another one from a thread."""
    armed = [True]
    main = threading.get_ident()
    timer: List[threading.Timer] = []

    def handler(signum, frame):
        if armed[0]:
            raise KeyboardInterrupt

    def hit():
        if second_after is not None:
            t = threading.Timer(second_after, lambda: armed[0] and
                                signal.pthread_kill(main, signal.SIGINT))
            t.start()
            timer.append(t)
        signal.raise_signal(signal.SIGINT)

    tracer = _Tracer(files, at, hit)
    old = signal.signal(signal.SIGINT, handler)
    error = None
    try:
        sys.settrace(tracer.global_trace)
        try:
            call()
        finally:
            sys.settrace(None)
    except BaseException as e:      # noqa: B036 - KeyboardInterrupt is what we are after
        error = e
    finally:
        armed[0] = False
        for t in timer:
            t.cancel()
            t.join()
        signal.signal(signal.SIGINT, old)
    return Interrupted(error, tracer.count, tracer.hit_at)


def sample(total: int, n: int, seed: int) -> List[int]:
    """``n`` line numbers in ``[1, total]``, spread over the whole range (one per stratum,
    drawn with ``seed``)."""
    rng = random.Random(seed)
    n = min(n, total)
    edges = [1 + total * i // n for i in range(n + 1)]
    return sorted({rng.randrange(edges[i], max(edges[i] + 1, edges[i + 1])) for i in range(n)})


# ------------------------------------------------------------------------------ contract
def failed(opt) -> bool:
    """Whether the optimizer refuses to go on (a step failed part-way)."""
    return bool(opt._table.failed)


RECOVER = "Load the last checkpoint"


def refuses_everything(opt, store, ck_dir: str) -> List[str]:
    """The calls of a refusing optimizer that did NOT refuse with the recovery message."""
    out = []
    calls: Dict[str, Callable[[], object]] = {
        "step": opt.step, "state_dict": opt.state_dict,
        "save_checkpoint": lambda: store.save_checkpoint(os.path.join(ck_dir, "refused"),
                                                         progress=False),
        "master_weights": opt.master_weights,
    }
    for name, c in calls.items():
        try:
            c()
        except ss.StateStoreError as e:
            if RECOVER not in str(e):
                out.append(f"{name}: {e}")
            continue
        out.append(f"{name}: did not refuse")
    return out


def per_param_differences(named, store, counts: Dict[str, int],
                          reference: Callable[[int], Dict[str, torch.Tensor]]) -> List[str]:
    """Each parameter (``param:<name>``) and its states (``state:<name>/...``) against the
    reference run after as many steps as its count: a parameter or state of another step
    shows up as differing."""
    got = {}
    for n, p in named:
        got[f"param:{n}"] = p.detach().clone()
    for k in store.keys():
        got[f"state:{k}"] = store.get(k).clone()
    out = []
    for n, _ in named:
        want = reference(counts.get(n, 0))
        for k in [k for k in want if k == f"param:{n}" or k.startswith(f"state:{n}/")]:
            if k not in got:
                out.append(f"{k}: missing (count {counts.get(n)})")
            elif not torch.equal(got[k], want[k]):
                out.append(f"{k}: differs from the reference at its count {counts.get(n)}")
    return out
