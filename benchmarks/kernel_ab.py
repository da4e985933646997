"""A change to the CPU Adam kernels against the code it replaces, in one process.

Compiles one ISA file (``csrc/adam/adam_avx2.cpp`` or ``adam_avx512.cpp``) of two source
trees with the extension's flags, links both into ``benchmarks/kernel_ab.cpp``'s driver and
runs it: the same arrays, rounds alternating between the builds (and over ten
configurations: fp32, bf16 and int8 moments, both roundings, bf16 gradients, bf16 parameters
with fp32 masters), and every output of both builds compared byte for byte. On a host whose
speed moves by up to 1.4x for tenths of a second at a time, two separate runs cannot time a
change of a few percent; this can (identical builds agree within about 1% cache-resident).

    python benchmarks/kernel_ab.py --base HEAD~1              # working tree (B) against HEAD~1 (A)
    python benchmarks/kernel_ab.py --base main --other my-branch --threads 2
    python benchmarks/kernel_ab.py --base HEAD --elems 67108864 --rounds 8 --round-elems 1   # in RAM

``--base`` / ``--other``: a git revision of this repository, or a directory holding a
``csrc`` tree (``--other`` defaults to the working tree). Exit status 1 when the bits differ.
Needs ``$CXX`` (default ``c++``); no torch.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ["-std=c++17", "-ffp-contract=off", "-fno-math-errno"]


def _isa_available() -> list:
    """The SIMD instruction sets this processor has, best first (from /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    isas = []
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= set(flags):
        isas.append("avx512")
    if {"avx2", "fma", "f16c"} <= set(flags):
        isas.append("avx2")
    return isas


def source_tree(spec: str, tmp: str, name: str) -> str:
    """A directory whose csrc/ is ``spec``'s: ``spec`` itself if it is a directory holding one,
    else the git revision ``spec`` of this repository, extracted under ``tmp``."""
    if os.path.isdir(os.path.join(spec, "csrc")):
        return os.path.abspath(spec)
    out = os.path.join(tmp, name)
    os.makedirs(out)
    archive = subprocess.run(["git", "-C", REPO, "archive", spec, "csrc"], capture_output=True)
    if archive.returncode != 0:
        sys.exit(f"kernel_ab: {spec!r} is neither a directory with a csrc/ nor a git revision: "
                 f"{archive.stderr.decode(errors='replace').strip()}")
    subprocess.run(["tar", "-x", "-C", out], input=archive.stdout, check=True)
    return out


def build(a_dir: str, b_dir: str, isa: str, tmp: str, opt: str = "3") -> str:
    cxx = os.environ.get("CXX", "c++")
    # each build's namespace renamed (statestore -> kab_a / kab_b), so that no inline function
    # of one stands in for the other's at link time; the driver is built against the B tree's
    # headers (AdamTensorArgs and SimdKernels must be the same structs in both trees). The
    # three compilations run at once.
    cmds, objs = [], []
    for tag, d in (("a", a_dir), ("b", b_dir)):
        obj = os.path.join(tmp, f"kernels_{tag}.o")
        cmds.append([cxx, f"-O{opt}", *FLAGS, "-I" + os.path.join(d, "csrc"),
                     f"-Dstatestore=kab_{tag}", f"-D{isa}_kernels=kab_kernels", "-c",
                     os.path.join(d, "csrc", "adam", f"adam_{isa}.cpp"), "-o", obj])
        objs.append(obj)
    driver = os.path.join(tmp, "driver.o")
    cmds.append([cxx, f"-O{opt}", *FLAGS, "-I" + os.path.join(b_dir, "csrc"), "-c",
                 os.path.join(REPO, "benchmarks", "kernel_ab.cpp"), "-o", driver])
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in cmds]
    for c, p in zip(cmds, procs):
        _, err = p.communicate()
        if p.returncode != 0:
            sys.exit(f"kernel_ab: {' '.join(c)} failed:\n{err[-3000:]}")
    exe = os.path.join(tmp, "kernel_ab")
    cmd = [cxx, driver, *objs, "-o", exe, "-lpthread"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"kernel_ab: {' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    return exe


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="A: a git revision or a directory with csrc/")
    ap.add_argument("--other", default=REPO, help="B: the same (default: the working tree)")
    ap.add_argument("--isa", choices=("avx512", "avx2"), help="default: the best this processor has")
    ap.add_argument("--elems", type=int, default=4096,
                    help="elements of each array (4096: cache-resident; 2^26: in RAM)")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--round-elems", type=int, default=400000,
                    help="elements a round times at least (whole calls of --elems)")
    ap.add_argument("--opt", choices=("0", "1", "2", "3"), default="3",
                    help="-O of the build; below 3 the times are not the kernels' (a check only)")
    args = ap.parse_args()
    have = _isa_available()
    isa = args.isa or (have[0] if have else None)
    if isa is None or isa not in have:
        sys.exit(f"kernel_ab: this processor has {have or 'neither AVX2 nor AVX-512'}; "
                 f"asked for {isa}")
    with tempfile.TemporaryDirectory() as tmp:
        a_dir = source_tree(args.base, tmp, "a")
        b_dir = source_tree(args.other, tmp, "b")
        exe = build(a_dir, b_dir, isa, tmp, args.opt)
        r = subprocess.run([exe, str(args.elems), str(args.rounds), str(args.threads),
                            str(args.round_elems)], capture_output=True, text=True)
    lines = r.stdout.splitlines()
    meta = dict(line.split("\t", 1) for line in lines if line.count("\t") == 1)
    rows = [line.split("\t") for line in lines if line.count("\t") == 3]
    for line in lines:
        if line.startswith(("bits:", "BITS DIFFER")):
            print(line)
    print(f"A: {args.base}; B: {'the working tree' if args.other == REPO else args.other}; "
          f"{meta.get('isa', isa)}; {args.elems} elements an array, {args.threads} thread(s), "
          f"best of {args.rounds} rounds, builds and configurations in turn; built with -O{args.opt}"
          + ("" if args.opt == "3" else " (NOT the kernels' -O3: the times are not theirs)"))
    print()
    print("| configuration (fp32 grads and params unless said) | A ns/element | B ns/element | B / A |")
    print("|---|---|---|---|")
    for name, a, b, ratio in rows:
        print(f"| {name} | {float(a):.4f} | {float(b):.4f} | {float(ratio):.3f} |")
    if r.returncode not in (0, 1) or not rows:
        sys.stderr.write(r.stderr[-3000:])
        return 2
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())
