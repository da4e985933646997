"""``python -m statestore`` / ``statestore``: inspect, verify, convert (via main(argv), and
through real subprocesses for the exit status and output streams)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import statestore as ss
from statestore.__main__ import main, to_torch_state_dict
from statestore.optim import CPUAdam

from helpers import ckpt as H  # noqa: E402
from helpers.ckpt import CONFIGS, STORE_KINDS, make_store  # noqa: E402


def _trained_checkpoint(tmp_path, cfg="mixed", kind="device-cpu", steps=3):
    c = CONFIGS[cfg]
    named = H.make_params(c)
    path = str(tmp_path / "ckpt")
    with make_store(kind, str(tmp_path / "s")) as s:
        opt = H.make_opt(c, named, s)
        H.train(opt, [p for _, p in named], 0, steps)
        s.save_checkpoint(path, shard_bytes=8192, progress=False)
    return path, named


def _flip_a_byte(path):
    from statestore.checkpoint import read_manifest
    r = read_manifest(path).rows[0]
    p = os.path.join(path, r["file"])
    with open(p, "r+b") as f:
        f.seek(r["offset"] + 3)
        b = f.read(1)
        f.seek(r["offset"] + 3)
        f.write(bytes([b[0] ^ 1]))
    return r


@pytest.fixture(scope="module")
def subprocess_runs(tmp_path_factory):
    """Both subprocess invocations, started together (each pays torch's import once)."""
    tmp = tmp_path_factory.mktemp("cli")
    good, _ = _trained_checkpoint(tmp / "g")
    bad, _ = _trained_checkpoint(tmp / "b")
    row = _flip_a_byte(bad)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs = {
        "inspect": subprocess.Popen([sys.executable, "-m", "statestore", "inspect", good],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env),
        "verify-bad": subprocess.Popen([sys.executable, "-m", "statestore", "verify", bad],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env),
    }
    out = {k: (p.communicate(timeout=300), p.returncode) for k, p in procs.items()}
    return out, row


def test_subprocess_inspect(subprocess_runs):
    runs, _ = subprocess_runs
    (stdout, stderr), rc = runs["inspect"]
    assert rc == 0, stderr
    assert "statestore-checkpoint v1" in stdout
    assert "layer0.weight/exp_avg" in stdout and "layer1.weight/master" in stdout
    assert "CPUAdam" in stdout and "step         3" in stdout


def test_subprocess_verify_fails_with_nonzero_exit(subprocess_runs):
    runs, row = subprocess_runs
    (stdout, stderr), rc = runs["verify-bad"]
    assert rc == 1
    assert "checksum mismatch" in stderr and row["key"] in stderr and row["file"] in stderr


def test_inspect_lists_tensors_steps_groups(tmp_path, capsys):
    path, named = _trained_checkpoint(tmp_path)
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    for n, p in named:
        assert f"{n}/exp_avg" in out and f"{n}/max_exp_avg_sq" in out
    assert "BF16" not in out and "F32" in out            # states are fp32, masters too
    assert "33x17" in out and "4099" in out
    assert "step         3" in out
    assert "group" in out and "0.01" in out and "0.003" in out   # both groups' lr


def test_progress_bars_on_a_terminal_only(tmp_path, capsys, monkeypatch):
    """verify, inspect and convert draw tqdm bars on stderr when it is a terminal, none when
    it is piped (as under pytest's capture) or with -q."""
    path, _ = _trained_checkpoint(tmp_path)
    out = str(tmp_path / "sd.pt")
    commands = {"verify": (["verify", path], ["verify", "manifest"]),
                "inspect": (["inspect", path], ["manifest"]),
                "convert": (["convert", path, "--to", "torch", out],
                            ["manifest", "checksums", "write sd.pt"])}
    for argv, _ in commands.values():
        assert main(argv) == 0
        cap = capsys.readouterr()
        assert cap.err == "", argv                     # piped: quiet
    assert cap.out.startswith("wrote ")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    for argv, bars in commands.values():
        assert main(argv) == 0
        cap = capsys.readouterr()
        for bar in bars:
            assert f"{bar}:" in cap.err, (argv, cap.err[-500:])
        assert main(argv[:1] + ["-q"] + argv[1:]) == 0
        assert capsys.readouterr().err == ""
    assert main(["verify", path]) == 0
    assert capsys.readouterr().out.startswith("OK:")


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing-shard", "no-manifest"])
def test_verify_reports_damage(tmp_path, capsys, damage):
    path, _ = _trained_checkpoint(tmp_path)
    from statestore.checkpoint import read_manifest
    m = read_manifest(path)
    shard = os.path.join(path, m.files[-1])
    if damage == "flip":
        r = _flip_a_byte(path)
        words = ["checksum mismatch", r["key"], r["file"]]
    elif damage == "truncate":
        os.truncate(shard, os.path.getsize(shard) - 10)
        words = ["truncated", m.files[-1]]
    elif damage == "missing-shard":
        os.unlink(shard)
        words = ["shard missing", m.files[-1]]
    else:
        os.unlink(os.path.join(path, "manifest.parquet"))
        words = ["manifest.parquet"]
    assert main(["verify", "-q", path]) == 1
    err = capsys.readouterr().err
    for w in words:
        assert w in err


def test_missing_checkpoint_and_usage_errors(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "none")]) == 1
    assert "no checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit) as ei:
        main(["convert", str(tmp_path), "--to", "jax", "x"])
    assert ei.value.code == 2
    with pytest.raises(SystemExit):
        main([])


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_convert_to_torch_adamw_and_train_on(tmp_path, capsys, kind):
    """convert's output loads into torch.optim.AdamW; training on matches training on with
    our optimizer resumed from the checkpoint (to float32 rounding)."""
    c = CONFIGS["fp32"]
    named = H.make_params(c)
    params = [p for _, p in named]
    path = str(tmp_path / "ckpt")
    with make_store(kind, str(tmp_path / "s")) as s:
        opt = H.make_opt(c, named, s)
        H.train(opt, params, 0, 3)
        s.save_checkpoint(path, progress=False)
        torch_p = [torch.nn.Parameter(p.detach().clone()) for p in params]
        out = str(tmp_path / "adamw.pt")
        assert main(["convert", path, "--to", "torch", out]) == 0
        assert "wrote" in capsys.readouterr().out
        ref = torch.optim.AdamW(H.param_groups(c, list(zip([n for n, _ in named], torch_p))),
                                lr=1e-3, weight_decay=0.0)
        ref.load_state_dict(torch.load(out))
        assert [g["lr"] for g in ref.param_groups] == [1e-2, 3e-3]
        assert ref.param_groups[0]["weight_decay"] == 0.05
        assert ref.state[torch_p[0]]["step"].item() == 3
        H.train(opt, params, 3, 4)
        H.train(ref, torch_p, 3, 4)
    for a, b in zip(params, torch_p):
        # float32 rounding: the SIMD kernel and torch order a few operations differently
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


def test_convert_numbers_named_params_by_group_order(tmp_path):
    path, named = _trained_checkpoint(tmp_path)           # named, 2 groups, amsgrad, bf16 masters
    sd = to_torch_state_dict(path)
    assert [g["params"] for g in sd["param_groups"]] == [[0, 1], [2, 3]]
    assert sd["param_groups"][1]["param_names"] == ["layer2.weight", "layer3.weight"]
    assert set(sd["state"][1]) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master"}
    with ss.DeviceStore("cpu") as s:
        s.load_checkpoint(path, progress=False)
        for i, (n, _) in enumerate(named):
            for st in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                assert torch.equal(sd["state"][i][st], s.get(f"{n}/{st}"))


def test_convert_refuses_damaged_checkpoint(tmp_path, capsys):
    path, _ = _trained_checkpoint(tmp_path)
    r = _flip_a_byte(path)
    out = str(tmp_path / "x.pt")
    assert main(["convert", path, "--to", "torch", out]) == 1
    assert r["key"] in capsys.readouterr().err
    assert not os.path.exists(out)
