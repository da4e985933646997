"""HF transformers Trainer: resume from checkpoint-N bit for bit, with the integration
(``StateStoreTrainer``: the optimizer saved by ``save_checkpoint`` into checkpoint-N/statestore)
and without it (plain ``Trainer`` with ``optimizers=(opt, sched)``: ``torch.save`` of
``state_dict()``), on a disk store and a resident one."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from integration_helpers import (STORES, TokenDataset, assert_same_params, make_optimizer,  # noqa: E402
                                 params_of, tiny_llama, warmup)

from statestore.integrations.transformers import StateStoreTrainer  # noqa: E402

STEPS, SAVE_AT = 6, 3


def _args(out):
    from transformers import TrainingArguments
    return TrainingArguments(
        output_dir=str(out), max_steps=STEPS, save_strategy="steps", save_steps=SAVE_AT,
        per_device_train_batch_size=2, gradient_accumulation_steps=2, max_grad_norm=1.0,
        logging_strategy="no", report_to=[], use_cpu=True, seed=7, data_seed=7,
        dataloader_num_workers=0, disable_tqdm=True)


def _run(trainer_cls, tmp_path, store_name, tag, resume=None, dtype=torch.float32):
    model = tiny_llama(dtype=dtype)
    store = STORES[store_name](tmp_path / f"store-{tag}")
    opt = make_optimizer(model, store)
    trainer = trainer_cls(model=model, args=_args(tmp_path / "out"),
                          train_dataset=TokenDataset(32), optimizers=(opt, warmup(opt)))
    trainer.train(resume_from_checkpoint=resume)
    out = params_of(model)
    lr = opt.param_groups[0]["lr"]
    store.close()
    return out, lr


@pytest.mark.parametrize("store_name", list(STORES))
@pytest.mark.parametrize("integration", [True, False], ids=["integration", "plain"])
def test_trainer_resume_bit_for_bit(tmp_path, store_name, integration):
    from transformers import Trainer
    cls = StateStoreTrainer if integration else Trainer
    full, lr_full = _run(cls, tmp_path, store_name, "full")
    ckpt = tmp_path / "out" / f"checkpoint-{SAVE_AT}"
    if integration:
        assert (ckpt / "statestore" / "manifest.parquet").exists() or \
            any(f.startswith("manifest") for f in os.listdir(ckpt / "statestore"))
        assert not (ckpt / "optimizer.pt").exists()
    else:
        assert (ckpt / "optimizer.pt").exists()
    resumed, lr_resumed = _run(cls, tmp_path, store_name, "resumed", resume=str(ckpt))
    assert lr_resumed == lr_full
    assert_same_params(full, resumed)


def test_trainer_resume_bf16_masters(tmp_path):
    """bf16 parameters: the fp32 masters come back from checkpoint-N/statestore."""
    full, _ = _run(StateStoreTrainer, tmp_path, "nvme", "full", dtype=torch.bfloat16)
    resumed, _ = _run(StateStoreTrainer, tmp_path, "nvme", "resumed", dtype=torch.bfloat16,
                      resume=str(tmp_path / "out" / f"checkpoint-{SAVE_AT}"))
    assert_same_params(full, resumed)


def test_trainer_reads_plain_checkpoint(tmp_path):
    """A checkpoint written by a plain Trainer (optimizer.pt) resumes under StateStoreTrainer."""
    from transformers import Trainer
    full, _ = _run(Trainer, tmp_path, "nvme", "full")
    resumed, _ = _run(StateStoreTrainer, tmp_path, "nvme", "resumed",
                      resume=str(tmp_path / "out" / f"checkpoint-{SAVE_AT}"))
    assert_same_params(full, resumed)



def test_trainer_builds_the_optimizer(tmp_path):
    """optimizer_cls_and_kwargs=(HybridAdam, {"state_store": store, ...}) and the Trainer's own
    warmup schedule: the Trainer builds both, and resumes bit for bit through the store."""
    from statestore.optim import HybridAdam
    import statestore as ss

    def run(tag, resume=None):
        model = tiny_llama()
        store = ss.NVMeStore(str(tmp_path / f"store-{tag}"), budget_bytes=1 << 20)
        args = _args(tmp_path / "out")
        args.lr_scheduler_type, args.warmup_steps, args.learning_rate = "linear", 2, 3e-3
        trainer = StateStoreTrainer(model=model, args=args, train_dataset=TokenDataset(32),
                                    optimizer_cls_and_kwargs=(HybridAdam, {"state_store": store}))
        trainer.train(resume_from_checkpoint=resume)
        assert trainer.optimizer.optimizer.state_store is store
        out = params_of(model)
        store.close()
        return out
    full = run("full")
    assert (tmp_path / "out" / f"checkpoint-{SAVE_AT}" / "statestore").is_dir()
    assert_same_params(full, run("resumed", str(tmp_path / "out" / f"checkpoint-{SAVE_AT}")))


def test_trainer_resume_colossalai_style_tiered(tmp_path):
    """HybridAdam(..., nvme_offload_fraction=0.5, nvme_offload_dir=...): the tiered store the
    optimizer makes is opt.state_store, and checkpoints through it."""
    from statestore.optim import HybridAdam
    from integration_helpers import param_groups

    def run(tag, resume=None):
        model = tiny_llama()
        opt = HybridAdam(param_groups(model), lr=3e-3, nvme_offload_fraction=0.5,
                         nvme_offload_dir=str(tmp_path / f"offload-{tag}"))
        trainer = StateStoreTrainer(model=model, args=_args(tmp_path / "out"),
                                    train_dataset=TokenDataset(32), optimizers=(opt, warmup(opt)))
        trainer.train(resume_from_checkpoint=resume)
        out = params_of(model)
        opt.close()
        return out
    full = run("full")
    assert (tmp_path / "out" / f"checkpoint-{SAVE_AT}" / "statestore").is_dir()
    assert_same_params(full, run("resumed", str(tmp_path / "out" / f"checkpoint-{SAVE_AT}")))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_example_hf_trainer_resumes_in_a_new_process(tmp_path):
    """examples/hf_trainer.py: train, checkpoint, resume in a fresh process, bit for bit."""
    import subprocess
    import sys
    res = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "hf_trainer.py"),
                          "--dir", str(tmp_path), "--steps", "4", "--save-at", "2"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "bit for bit: True" in res.stdout


@pytest.mark.slow
def test_trainer_checkpoint_benchmark_prints_both_modes(tmp_path):
    """benchmarks/trainer_checkpoint.py on a tiny config: a row per mode, a number per cell
    (figures are not checked: timing never decides a test)."""
    import re
    import subprocess
    import sys
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "trainer_checkpoint.py"),
                          "--dir", str(tmp_path / "b"), "--vocab", "256", "--hidden", "32",
                          "--inter", "64", "--layers", "1", "--heads", "4", "--kv-heads", "2",
                          "--seq", "16", "--threads", "1"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = [ln for ln in res.stdout.splitlines() if re.match(r"(integration|plain) +\|", ln)]
    assert len(rows) == 2, res.stdout
    for row in rows:
        cells = [c.strip() for c in row.split("|")[1:]]
        assert all(re.match(r"^[0-9.,/]+$", c) for c in cells), row
