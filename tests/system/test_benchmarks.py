"""The I/O benchmark runs end to end on a tiny size (its figures are not checked: timing never
decides a test; that the table comes out, with a number in every store and probe cell, is).
Each benchmark runs in a process forked from one that imported torch (helpers/warm.py)."""
import os
import re

import pytest
import torch

from statestore.io import probe_engine

from helpers import paths, warm

ROOT = paths.ROOT


@pytest.mark.parametrize("files", ["fresh", "reuse"])
def test_nvme_io_prints_store_and_probe_rows(tmp_path, files):
    res = warm.run_script(os.path.join(ROOT, "benchmarks", "nvme_io.py"), [
        "--sizes", "8M", "--reps", "2", "--no-peers", "--files", files, "--dir", str(tmp_path),
        "--only", "NVMeStore|probe|ss:threads", "--json", str(tmp_path / "reps.json")],
        timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = {}
    for line in res.stdout.splitlines():
        m = re.match(r"\| (NVMeStore pipeline|NVMeStore put / get|TensorNVMe store pipeline|probe|"
                     r"ss:threads)[^|]* \| "
                     r"([0-9.]+) \| ([0-9.]+) \|$", line)
        if m:
            rows[m.group(1)] = (float(m.group(2)), float(m.group(3)))
    want = {"NVMeStore pipeline", "NVMeStore put / get", "probe", "ss:threads"}
    if probe_engine("tensornvme") is None:      # the TensorNVMe store is a store row too
        want.add("TensorNVMe store pipeline")
    assert set(rows) == want, res.stdout
    assert all(w > 0 and r > 0 for w, r in rows.values())
    failed = re.findall(r"^note: .* at 8 MiB: \w*(?:Error|Exception)\b.*$", res.stdout, re.M)
    assert not failed, failed      # a contestant that raises is only noted by the benchmark
    assert os.listdir(tmp_path) == ["reps.json"]     # the bench directory is removed


def _gpu_step(*args, timeout=600):
    return warm.run_script(os.path.join(ROOT, "benchmarks", "gpu_step.py"), args, timeout=timeout)


def test_gpu_step_without_cuda_says_so():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: test_gpu_step_prints_both_tables runs instead")
    res = _gpu_step("--quick")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "CUDA is not available" in res.stdout and "|" not in res.stdout


@pytest.mark.cuda
def test_gpu_step_prints_both_tables(tmp_path):
    res = _gpu_step("--sizes", "4M", "--reps", "1", "--tensors", "3", "--dir", str(tmp_path),
                    "--layers", "2", "--width", "512", "--tokens", "256")
    assert res.returncode == 0, res.stderr[-2000:]
    ours = re.findall(r"^\| 4M \| (fp32|bf16) \| (fp32|bf16|int8) \| ([0-9.]+) \| ([0-9.]+) \| "
                      r"([0-9.]+)x \|", res.stdout, re.M)
    assert sorted(r[:2] for r in ours) == [("bf16", "fp32"), ("fp32", "bf16"), ("fp32", "fp32"),
                                           ("fp32", "int8")], res.stdout
    off = re.findall(r"^\| 4M \| (fp32|bf16) \| (pinned|nvme) \| ([0-9.]+) \|", res.stdout, re.M)
    assert len(off) == 4, res.stdout
    assert re.search(r"^\| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| -?[0-9.]+ \|$", res.stdout,
                     re.M), res.stdout          # table 3: overlap with backward
    assert os.listdir(tmp_path) == []       # the NVMe directories are removed


def _zero_offload(*args, timeout=600):
    return warm.run_script(os.path.join(ROOT, "benchmarks", "gpu_zero_offload.py"), args,
                           timeout=timeout)


def test_zero_offload_without_cuda_says_so():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: test_zero_offload_prints_its_table runs instead")
    res = _zero_offload("--layers", "2")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "no CUDA device" in res.stdout and "|" not in res.stdout


@pytest.mark.cuda
def test_zero_offload_prints_its_table():
    res = _zero_offload("--layers", "2", "--width", "512", "--tokens", "256", "--reps", "1",
                        "--warmup", "1")
    assert res.returncode == 0, res.stderr[-2000:]
    rows = dict(re.findall(r"^\| ([^|]+?) \| ([0-9.]+) \| (?:[0-9.]+x|n/a) \|$", res.stdout, re.M))
    want = {"forward + backward", "HybridAdam, PinnedCPUStore", "HybridAdam, update_in_backward"}
    assert want <= set(rows), res.stdout      # DeepSpeed's row where it is installed


def test_optimizer_probe_prints_a_ratio_per_round():
    res = warm.run_script(os.path.join(ROOT, "benchmarks", "optimizer_probe.py"), [
        "--size-m", "0.25", "--rounds", "2", "--steps", "2", "--threads", "1"], timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = re.findall(r"^\| \d+ \| ([0-9.]+) \| ([0-9.]+) \| [0-9.]+ \| [0-9.]+ \| ([0-9.]+)x \|$",
                      res.stdout, re.M)
    assert len(rows) == 2, res.stdout
    assert all(float(a) > 0 and float(b) > 0 and float(r) > 0 for a, b, r in rows)
    assert re.search(r"median [0-9.]+x, range [0-9.]+-[0-9.]+x over 2 rounds", res.stdout)


def test_small_states_prints_one_json_line(tmp_path):
    res = warm.run_script(os.path.join(ROOT, "benchmarks", "small_states.py"), [
        "--params", "50", "--sizes", "16,2000", "--dir", str(tmp_path / "b")], timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    import json
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for k in ("step_s", "save_s", "load_s", "peak_rss_mib", "checkpoint_bytes"):
        assert out[k] > 0, out
    assert out["state_bytes"] == 25 * (16 + 2000) * 4 * 2      # Adam: two fp32 states
    assert not (tmp_path / "b").exists()


def test_host_overhead_prints_a_row_per_tensor_count():
    """benchmarks/host_overhead.py --quick: a step row per tensor count for each store
    (positive figures, ratios) and a checkpoint row per tensor count for each store."""
    res = warm.run_script(os.path.join(ROOT, "benchmarks", "host_overhead.py"), ["--quick"],
                          timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in res.stdout.splitlines() if re.match(r"^\| \d+ \|", line)]
    steps = [r for r in rows if len(r) == 11]       # tensors, 6 figures, 4 ratios
    ckpts = [r for r in rows if len(r) == 9]        # tensors, 6 figures, 2 ratios
    assert [r[0] for r in steps] == ["3", "7"] * 2, res.stdout
    assert [r[0] for r in ckpts] == ["3", "7"] * 2, res.stdout
    for r in steps + ckpts:
        assert all(float(x.rstrip("x")) > 0 for x in r[1:]), res.stdout


def test_slab_stagger_prints_a_row_per_stagger():
    """benchmarks/slab_stagger.py at 1M parameters: a row per stagger, the distance of the
    moment buffers it reports is their size plus that stagger, and the library's stagger is
    restored (figures are not checked)."""
    res = warm.run_script(os.path.join(ROOT, "benchmarks", "slab_stagger.py"), [
        "--size-m", "1", "--moments", "bf16", "--staggers", "4096,65536", "--rounds", "1",
        "--steps", "1"], timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = re.findall(r"^\| (\d+) \| (0x[0-9a-f]+) \| [0-9.]+ \| [0-9.]+ \|$", res.stdout, re.M)
    assert [(int(s), int(d, 16)) for s, d in rows] == [(4096, (2 << 20) + 4096),
                                                        (65536, (2 << 20) + 65536)], res.stdout
