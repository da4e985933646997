"""The kernel benchmarks' extra modes run end to end on tiny sizes (their figures are not
checked: timing never decides a test; that each table comes out, with a number in every
cell, is)."""
import os
import re

import pytest

from statestore.kernels import kernels_info

from helpers import paths, warm

ROOT = paths.ROOT

pytestmark = pytest.mark.skipif(kernels_info().get("simd") is None,
                                reason="statestore._C_adam is not built")


def _script(script, *args, timeout=300):
    """``python benchmarks/SCRIPT ARGS``, forked from the forkserver that has torch loaded
    (helpers.warm: no 3 s import per script)."""
    return warm.run_script(os.path.join(ROOT, "benchmarks", script), args, timeout=timeout)


def _run(script, *args):
    res = _script(script, *args)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


def test_adam_step_cache_resident_prints_every_slope():
    out = _run("adam_step.py", "--cache-resident", "--cr-sizes", "256,4096", "--cr-calls", "20",
               "--reps", "2", "--no-peers")
    num = r"(-?[0-9.]+|\?)"
    rows = re.findall(rf"^\| (statestore[a-z0-9, ]*|torch fused AdamW) \| ([0-9.]+) \| ([0-9.]+) \| "
                      rf"(-?[0-9.]+) \| {num} \| {num} \| {num}x? \| {num}x? \|$", out, re.M)
    assert [r[0] for r in rows] == [
        "torch fused AdamW", "statestore", "statestore bf16 moments, nearest",
        "statestore bf16 moments, stochastic", "statestore int8 moments, nearest",
        "statestore int8 moments, stochastic"], out
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows)
    assert "slope between 256 and 4096 params" in out


@pytest.mark.slow
def test_adam_step_stages_prints_every_stage():
    # -O0: the build is most of this test's time, and the figures are not checked
    out = _run("adam_step.py", "--stages", "--stage-elems", "256", "--reps", "1",
               "--stages-opt", "0", "--threads", "1,2", "--stage-seconds", "0")
    assert "built with -O0 (NOT the kernel's -O3" in out, out
    assert re.search(r"^\| stage \(per element\) \| avx[0-9]+ 1 thr ns \| avx[0-9]+ 2 thr ns \|", out, re.M), out
    names = re.findall(r"^\| ((?:stage|kernel): [^|]+) \| [0-9.]+ \| [0-9.]+ \|", out, re.M)
    assert any(n.startswith("stage: int8 block max") for n in names), out
    assert any(n.startswith("stage: random bits") for n in names), out
    assert sum(n.startswith("kernel:") for n in names) == 10, out


@pytest.mark.slow
def test_adam_step_overlap_prints_the_probe_and_the_kernels():
    out = _run("adam_step.py", "--overlap", "--stage-elems", "256", "--overlap-ram-m", "0.0625",
               "--reps", "1", "--stages-opt", "0", "--threads", "1,2", "--stage-seconds", "0")
    assert "built with -O0 (NOT the kernel's -O3" in out, out
    assert "65536 in RAM" in out, out
    num = r"[0-9.]+"
    sig = r"[+-][0-9.]+"
    # one block of rows for each vector ISA the host has (an AVX-512 host prints AVX-512's and
    # AVX2's, an AVX2 host AVX2's only): the host decides, never the test
    isas = [i for i in ("avx512", "avx2") if i in kernels_info()["simd_supported"]]
    probe = re.findall(rf"^\| (avx[0-9]+) \| ([12]) \| (\d+) \| {num} \| {num} \| {sig} \| ({sig}) \|$",
                       out, re.M)
    assert [(i, t, k) for i, t, k, _ in probe] == [
        (i, t, k) for i in isas for t in "12" for k in ("0", "1", "2", "4", "6", "8")], out
    # K = 0 is its own RAM yardstick: at most 0 above max(its arithmetic, itself)
    assert all(float(last) <= 0.0 for _, _, k, last in probe if k == "0"), out
    kern = re.findall(rf"^\| (avx[0-9]+) \| ([12]) \| ([a-z0-9 ]+ moments[a-z ]*) \| {num} \| {num} \| "
                      rf"({num}) \| {sig} \| ({num}) \|$", out, re.M)
    names = ["fp32 moments", "bf16 moments stochastic", "bf16 moments nearest", "int8 moments nearest"]
    assert [(i, t, n) for i, t, n, _, _ in kern] == [(i, t, n) for i in isas for t in "12" for n in names], out
    # the fp32 row is its own yardstick: its bytes at its own rate, and 1.00 of itself
    assert all(r == "1.00" for _, _, n, _, r in kern if n == "fp32 moments"), out
    # bf16 moves 20/28 and int8 16.0625/28 of fp32's bytes
    f32 = {(i, t): float(b) for i, t, n, b, _ in kern if n == "fp32 moments"}
    for i, t, n, b, _ in kern:
        want = f32[i, t] * {"fp32": 28, "bf16": 20, "int8": 16.0625}[n.split()[0]] / 28
        assert abs(float(b) - want) <= 0.0015, (n, b, want)


def test_adam_step_cpu_clock_prints_every_moment_row():
    out = _run("adam_step.py", "--sizes", "1", "--tensors", "1", "--threads", "1",
               "--grads", "fp32", "--reps", "1", "--no-foreach", "--no-peers", "--clock", "cpu")
    assert re.search(r"^clock: cpu; load average at start: [0-9.]+, [0-9.]+, [0-9.]+$", out, re.M)
    rows = re.findall(r"^\| 1M \| 1 \| 1 \| fp32 \| fp32 \| statestore \| (fp32|bf16|int8) \| "
                      r"([0-9.]+) G \|", out, re.M)
    assert [r[0] for r in rows] == ["fp32", "bf16", "int8"], out
    assert all(float(r[1]) > 0 for r in rows), out


def test_adam_step_cache_resident_rejects_bad_sizes():
    res = _script("adam_step.py", "--cache-resident", "--cr-sizes", "4096,256", "--no-peers",
                  timeout=120)
    assert res.returncode != 0
    assert "--cr-sizes" in res.stderr


def test_optimizer_probe_layouts_prints_every_contestant_every_round():
    out = _run("optimizer_probe.py", "--size-m", "0.25", "--rounds", "2", "--steps", "2",
               "--threads", "1", "--layouts")
    names = ["CPUAdam.step", "torch fused", "kernel, m v separate", "kernel, m v back to back",
             "kernel, m v 4 KiB apart"]
    assert "| round | " + " | ".join(names) + " |" in out, out
    cell = r"[0-9.]+ \([0-9.]+x\)"
    rows = re.findall(r"^\| \d+ \| " + r" \| ".join([cell] * len(names)) + r" \|$", out, re.M)
    assert len(rows) == 2, out
    for k in names:
        if k != "torch fused":
            assert re.search(re.escape(k) + r": median [0-9.]+x of torch fused, range "
                             r"[0-9.]+-[0-9.]+x over 2 rounds", out), out


@pytest.mark.slow
def test_kernel_ab_times_both_builds_and_catches_other_bits(tmp_path):
    # A: a copy of the sources whose hash constant differs, so the stochastic roundings draw
    # other bits and nothing else changes; B: the working tree. -O0: a quicker build, the
    # figures are not checked.
    import shutil
    shutil.copytree(os.path.join(ROOT, "csrc"), tmp_path / "csrc")
    body = tmp_path / "csrc" / "adam" / "adam_moments_body.h"
    text = body.read_text()
    assert "kWeyl = 0x9E3779B1u" in text
    body.write_text(text.replace("kWeyl = 0x9E3779B1u", "kWeyl = 0x9E3779B3u"))
    res = _script("kernel_ab.py", "--base", str(tmp_path), "--elems", "256", "--rounds", "1",
                  "--round-elems", "256", "--opt", "0")
    out = res.stdout
    assert res.returncode == 1, (res.returncode, out, res.stderr[-2000:])
    differ = set(re.findall(r"^BITS DIFFER: (.+)$", out, re.M))
    assert {"bf16 moments, stochastic", "int8 moments, stochastic"} <= differ, out
    assert not {d for d in differ if "nearest" in d or d.startswith("fp32")}, out
    rows = re.findall(r"^\| ([a-z0-9, ]+) \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \|$", out, re.M)
    assert len(rows) == 11, out
    assert "built with -O0 (NOT the kernels' -O3" in out, out
