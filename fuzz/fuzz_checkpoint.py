"""Long-run fuzzing of statestore's checkpoint reader (hypothesis-based).

Runs the targets of ``tests/helpers/fuzz_targets.py`` (manifest bytes, schema and optimizer metadata,
manifest rows, shard headers, shard data) with fresh random seeds, round-robin, until the
time budget is spent, and checks every example with the same oracle as ``tests/reliability/test_fuzz.py``
(only success-with-the-right-data or a ``CheckpointError``; verify and load agree; the loader
never asks for more state bytes than the files hold; pyarrow's allocations stay within a
bound of the manifest's size; no read outside a file).

Usage (from the repository root)::

    PYTHONPATH=$PWD python fuzz/fuzz_checkpoint.py --minutes 10
    PYTHONPATH=$PWD python fuzz/fuzz_checkpoint.py --minutes 2 --target shard_header --seed 7

A violation stops the run with exit status 1 after hypothesis has shrunk it; the report
shows the draws of the minimal example and a ``@reproduce_failure`` blob to replay it. An
example that aborts the interpreter (a C++ exception escaping pyarrow, a segfault) cannot be
reported that way: each damaged checkpoint is copied to ``--keep-last`` before it is checked,
so after a crash that directory holds it.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from helpers import fuzz_targets as F  # noqa: E402


def run_chunk(target: str, examples: int, chunk_seed: int, counts: dict,
              keep: str) -> None:
    @seed(chunk_seed)
    @settings(max_examples=examples, deadline=None, database=None, print_blob=True,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def run(data):
        counts[target]["examples"] += 1
        out = F.run_target(target, data, keep=keep)
        counts[target]["loaded" if out["loaded"] else
                       ("manifest_ok" if out["manifest_ok"] else "refused")] += 1
    run()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0, help="time budget (default 10)")
    p.add_argument("--target", action="append", choices=sorted(F.TARGETS),
                   help="target(s) to run (default: all, round-robin)")
    p.add_argument("--chunk", type=int, default=200, help="examples per seed (default 200)")
    p.add_argument("--seed", type=int, default=None, help="seed of the seed sequence")
    p.add_argument("--keep-last", default=os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                       "statestore-fuzz-last"),
                   help="where each damaged checkpoint is copied before it is checked: after "
                        "a crash of the interpreter it holds the culprit")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    targets = args.target or sorted(F.TARGETS)
    rng = random.Random(args.seed)
    counts = {t: {"examples": 0, "loaded": 0, "manifest_ok": 0, "refused": 0} for t in targets}
    F.template()
    start = time.monotonic()
    deadline = start + args.minutes * 60
    i = 0
    status = 0
    try:
        while time.monotonic() < deadline:
            t = targets[i % len(targets)]
            s = rng.randrange(2 ** 32)
            try:
                run_chunk(t, args.chunk, s, counts, args.keep_last)
            except Exception as e:     # hypothesis re-raises the shrunk failure
                print(f"\nVIOLATION in target {t} (chunk seed {s}): {type(e).__name__}: {e}",
                      file=sys.stderr)
                for note in getattr(e, "__notes__", []):    # the draws, the blob
                    print(note, file=sys.stderr)
                status = 1
                break
            i += 1
    except KeyboardInterrupt:
        pass
    minutes = (time.monotonic() - start) / 60
    total = sum(c["examples"] for c in counts.values())
    print(f"\n{total} examples in {minutes:.1f} min "
          f"({'VIOLATION found' if status else 'no violation'})")
    for t, c in counts.items():
        print(f"  {t:18s} {c['examples']:7d} examples: {c['loaded']:6d} loaded, "
              f"{c['manifest_ok']:6d} manifest read but load refused, "
              f"{c['refused']:6d} manifest refused")
    return status


if __name__ == "__main__":
    sys.exit(main())
