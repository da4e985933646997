"""``examples/fsdp2_train.py`` under ``torchrun``: a two-node run simulated on one host (two
torchrun agents, ``--nnodes 2``, c10d rendezvous on 127.0.0.1), its checkpoint resumed at 3
ranks (forked with torchrun's environment from a server that imported torch once) and at 1
(in this process). Every launch runs in its own session and is killed past its timeout."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from statestore.checkpoint import read_manifest

from helpers import fsdp2_worker as W
from helpers import paths

ROOT = Path(paths.ROOT)
EXAMPLE = str(ROOT / "examples" / "fsdp2_train.py")
TIMEOUT = 240


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(torchrun_args, example_args, log: Path) -> subprocess.Popen:
    env = paths.env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--max_restarts", "0",
                             *torchrun_args, EXAMPLE, *example_args],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                            start_new_session=True)


def _wait(procs, logs) -> None:
    """Wait for every launch, at most TIMEOUT seconds in all; kill each session left."""
    try:
        for p in procs:
            p.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"torchrun still running after {TIMEOUT} s; log: {logs[0].read_text()[-2000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log.read_text()[-3000:]


def _in_process(args) -> None:
    """The example's ``main`` in this process as rank 0 of 1 (torchrun's environment)."""
    import runpy
    import torch.distributed as dist
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_port())}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        runpy.run_path(EXAMPLE)["main"](args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _losses(path: Path) -> dict:
    return {int(s): float(v) for s, v in (line.split() for line in path.read_text().splitlines())}


@pytest.mark.slow
def test_fsdp2_example_on_two_nodes_resumes_at_3_and_1(tmp_path):
    """Two agents (one rank each) meet through c10d on 127.0.0.1 and train the example 3
    steps, saving one checkpoint (regions of both ranks); it resumes at 3 ranks and at 1
    (another mesh, other shards: DCP reshards the weights, statestore the optimizer states),
    and both continuations train the same global batches to the same losses (float32
    rounding of the gradient reduction)."""
    run = tmp_path / "run"
    port = _port()
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    nodes = [_launch(["--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d",
                      "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "fsdp2-test"],
                     ["--dir", str(run), "--steps", "3", "--losses", str(tmp_path / "l2.txt")],
                     log)
             for log in logs]
    _wait(nodes, logs)
    m = read_manifest(str(run / "ckpt"))
    assert m.info["format_version"] == 2 and m.metadata["steps"]["head.weight"] == 3
    assert {r.offsets[0] for r in m.rows if r.key == "head.weight/exp_avg"} == {0, 129}

    resumed = {}
    for world in (3, 1):
        d = tmp_path / f"resume{world}"
        d.mkdir()
        for part in ("ckpt", "model-3"):
            shutil.copytree(run / part, d / part)
        args = ["--dir", str(d), "--steps", "5", "--resume", "--losses", str(d / "losses.txt")]
        if world > 1:   # the ranks torchrun --standalone would start, without its agent
            W.run_ranks(W.run_example, world, EXAMPLE, args, timeout=TIMEOUT)
        else:   # one rank: what torchrun --nproc_per_node 1 runs, here (a process less)
            _in_process(args + ["--store", "ram"])
        assert read_manifest(str(d / "ckpt")).metadata["steps"]["head.weight"] == 5
        resumed[world] = _losses(d / "losses.txt")
    assert set(resumed[3]) == set(resumed[1]) == {4, 5}         # went on from step 3
    for step in (4, 5):
        assert resumed[3][step] == pytest.approx(resumed[1][step], rel=1e-5), step
    assert resumed[3][4] < _losses(tmp_path / "l2.txt")[1]
