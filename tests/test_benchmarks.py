"""The I/O benchmark runs end to end on a tiny size (its figures are not checked: timing never
decides a test; that the table comes out, with a number in every store and probe cell, is)."""
import os
import re
import subprocess
import sys

import pytest

from statestore.io import probe_engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("files", ["fresh", "reuse"])
def test_nvme_io_prints_store_and_probe_rows(tmp_path, files):
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "nvme_io.py"), "--sizes", "8M",
           "--reps", "2", "--no-peers", "--files", files, "--dir", str(tmp_path),
           "--only", "NVMeStore|probe|ss:threads", "--json", str(tmp_path / "reps.json")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
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
