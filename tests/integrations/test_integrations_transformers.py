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

from helpers.integration import (STORES, TokenDataset, assert_same_params, make_optimizer,  # noqa: E402
                                 params_of, tiny_llama, warmup)
from helpers import paths, warm  # noqa: E402

from statestore.integrations.transformers import StateStoreTrainer  # noqa: E402

STEPS, SAVE_AT = 6, 3


def _args(out):
    from transformers import TrainingArguments
    return TrainingArguments(
        output_dir=str(out), max_steps=STEPS, save_strategy="steps", save_steps=SAVE_AT,
        per_device_train_batch_size=2, gradient_accumulation_steps=2, max_grad_norm=1.0,
        logging_strategy="no", report_to=[], use_cpu=True, seed=7, data_seed=7,
        dataloader_num_workers=0, disable_tqdm=True)


def _run(trainer_cls, tmp_path, store_name, tag, resume=None, dtype=torch.float32,
         kind="hybrid"):
    model = tiny_llama(dtype=dtype)
    store = STORES[store_name](tmp_path / f"store-{tag}")
    opt = make_optimizer(model, store, kind=kind)
    trainer = trainer_cls(model=model, args=_args(tmp_path / "out"),
                          train_dataset=TokenDataset(32), optimizers=(opt, warmup(opt)))
    trainer.train(resume_from_checkpoint=resume)
    out = params_of(model)
    lr = opt.param_groups[0]["lr"]
    store.close()
    return out, lr


@pytest.mark.parametrize("store_name,integration,kind", [
    (s, i, "hybrid") for s in STORES for i in (True, False)] + [("nvme", True, "adafactor")])
def test_trainer_resume_bit_for_bit(tmp_path, store_name, integration, kind):
    from transformers import Trainer
    cls = StateStoreTrainer if integration else Trainer
    full, lr_full = _run(cls, tmp_path, store_name, "full", kind=kind)
    ckpt = tmp_path / "out" / f"checkpoint-{SAVE_AT}"
    if integration:
        assert (ckpt / "statestore" / "manifest.parquet").exists() or \
            any(f.startswith("manifest") for f in os.listdir(ckpt / "statestore"))
        assert not (ckpt / "optimizer.pt").exists()
    else:
        assert (ckpt / "optimizer.pt").exists()
    resumed, lr_resumed = _run(cls, tmp_path, store_name, "resumed", resume=str(ckpt),
                               kind=kind)
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
        # the Trainer's groups, named: the store (and its checkpoint) is keyed by names
        assert {k.param for k in store.keys()} == {
            n for n, p in model.named_parameters() if p.requires_grad}
        out = params_of(model)
        store.close()
        return out
    full = run("full")
    assert (tmp_path / "out" / f"checkpoint-{SAVE_AT}" / "statestore").is_dir()
    assert_same_params(full, run("resumed", str(tmp_path / "out" / f"checkpoint-{SAVE_AT}")))


def _args_mapped(out, **kw):
    args = _args(out)
    args.learning_rate, args.adam_beta1, args.adam_beta2 = 3e-3, 0.8, 0.95
    args.adam_epsilon, args.weight_decay = 1e-6, 0.1
    args.lr_scheduler_type, args.warmup_steps = "linear", 2
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_state_store_builds_hybridadam_from_the_training_arguments(tmp_path):
    """StateStoreTrainer(..., state_store=store): HybridAdam from the TrainingArguments (lr,
    betas, eps, weight decay on the Trainer's decay group only, its linear schedule), keyed by
    parameter names; it trains as the plain Trainer's torch AdamW does (to float32 rounding),
    checkpoints through the store and resumes bit for bit."""
    import statestore as ss
    from transformers import Trainer
    from statestore.integrations import find_store_optimizer
    from statestore.optim import HybridAdam

    torch_model = tiny_llama()
    Trainer(model=torch_model, args=_args_mapped(tmp_path / "torch"),
            train_dataset=TokenDataset(32)).train()

    def run(tag, resume=None):
        model = tiny_llama()
        store = ss.NVMeStore(str(tmp_path / f"store-{tag}"), budget_bytes=1 << 20)
        trainer = StateStoreTrainer(model=model, args=_args_mapped(tmp_path / "out"),
                                    train_dataset=TokenDataset(32), state_store=store)
        trainer.train(resume_from_checkpoint=resume)
        opt = find_store_optimizer(trainer.optimizer)
        assert type(opt) is HybridAdam and opt.state_store is store
        decay = set(trainer.get_decay_parameter_names(model))
        g0, g1 = opt.param_groups
        assert set(g0["param_names"]) == {n for n, p in model.named_parameters()
                                          if p.requires_grad and n in decay}
        assert g1["param_names"] and not set(g1["param_names"]) & decay
        assert (g0["weight_decay"], g1["weight_decay"]) == (0.1, 0.0)
        assert g0["betas"] == (0.8, 0.95) and g0["eps"] == 1e-6
        assert g0["initial_lr"] == 3e-3 and g0["lr"] == 3e-3 * (STEPS - STEPS) / (STEPS - 2)
        # the store (and its checkpoint) keyed by names, not indices
        assert {k.param for k in store.keys()} == set(g0["param_names"]) | set(g1["param_names"])
        out = params_of(model)
        store.close()
        return out
    full = run("full")
    ckpt = tmp_path / "out" / f"checkpoint-{SAVE_AT}"
    assert (ckpt / "statestore").is_dir() and not (ckpt / "optimizer.pt").exists()
    reference = params_of(torch_model)
    for n, p in full.items():
        torch.testing.assert_close(p, reference[n], rtol=1e-5, atol=1e-6, msg=n)
    assert_same_params(full, run("resumed", str(ckpt)))


def test_without_a_statestore_optimizer_the_trainer_says_so(tmp_path):
    """No silent fallback to torch's AdamW and optimizer.pt: nothing given is an error naming
    what to pass; a torch optimizer (or one without a store) a warning; optim arguments that
    do not map to HybridAdam an error."""
    import statestore as ss
    from statestore.errors import StateStoreValueError
    from statestore.optim import HybridAdam
    model, ds, store = tiny_llama(), TokenDataset(4), ss.DeviceStore("cpu")
    with pytest.raises(StateStoreValueError, match=r"needs a statestore optimizer.*state_store="):
        StateStoreTrainer(model=model, args=_args(tmp_path), train_dataset=ds)
    adamw = torch.optim.AdamW(model.parameters())
    with pytest.warns(UserWarning, match=r"torch\.optim\.adamw\.AdamW, not a statestore optimizer.*"
                                         r"plain Trainer \(optimizer\.pt\); pass state_store="):
        StateStoreTrainer(model=model, args=_args(tmp_path), train_dataset=ds,
                          optimizers=(adamw, None))
    with pytest.warns(UserWarning, match="HybridAdam without state_store="):
        StateStoreTrainer(model=model, args=_args(tmp_path), train_dataset=ds,
                          optimizers=(HybridAdam(model.parameters()), None))
    trainer = StateStoreTrainer(model=model, args=_args(tmp_path), train_dataset=ds,
                                optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.1}))
    with pytest.warns(UserWarning, match="SGD, not a statestore optimizer"):
        trainer.create_optimizer()
    with pytest.raises(StateStoreValueError, match=r"optim='sgd' is not AdamW: use optim='adamw_torch'"):
        StateStoreTrainer(model=model, args=_args_mapped(tmp_path, optim="sgd"),
                          train_dataset=ds, state_store=store)
    with pytest.raises(StateStoreValueError, match="optim_args='amsgrad=True' cannot be mapped"):
        StateStoreTrainer(model=model, args=_args_mapped(tmp_path, optim_args="amsgrad=True"),
                          train_dataset=ds, state_store=store)
    with pytest.raises(StateStoreValueError, match="not both"):
        StateStoreTrainer(model=model, args=_args(tmp_path), train_dataset=ds,
                          state_store=store, optimizers=(adamw, None))


def test_trainer_resume_colossalai_style_tiered(tmp_path):
    """HybridAdam(..., nvme_offload_fraction=0.5, nvme_offload_dir=...): the tiered store the
    optimizer makes is opt.state_store, and checkpoints through it."""
    from statestore.optim import HybridAdam
    from helpers.integration import param_groups

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

ROOT = paths.ROOT


@pytest.mark.slow
def test_example_hf_trainer_resumes_in_a_new_process(tmp_path):
    """examples/hf_trainer.py: train, checkpoint, resume in a fresh process, bit for bit (the
    first process forked from one that imported torch, helpers/warm.py; the example starts the
    second, a new interpreter)."""
    res = warm.run_script(os.path.join(ROOT, "examples", "hf_trainer.py"),
                          ["--dir", str(tmp_path), "--steps", "4", "--save-at", "2"],
                          timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "bit for bit: True" in res.stdout


@pytest.mark.slow
def test_trainer_checkpoint_benchmark_prints_both_modes(tmp_path):
    """benchmarks/trainer_checkpoint.py on a tiny config: a row per mode, a number per cell
    (figures are not checked: timing never decides a test). It runs in a process forked from
    one that imported torch (helpers/warm.py), and ``--fork`` forks its four processes from
    it once it imported transformers (seconds of imports each)."""
    import re
    res = warm.run_script(os.path.join(ROOT, "benchmarks", "trainer_checkpoint.py"),
                          ["--dir", str(tmp_path / "b"), "--vocab", "256", "--hidden", "32",
                           "--inter", "64", "--layers", "1", "--heads", "4", "--kv-heads", "2",
                           "--seq", "16", "--threads", "1", "--fork"],
                          timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = [ln for ln in res.stdout.splitlines() if re.match(r"(integration|plain) +\|", ln)]
    assert len(rows) == 2, res.stdout
    for row in rows:
        cells = [c.strip() for c in row.split("|")[1:]]
        assert all(re.match(r"^[0-9.,/]+$", c) for c in cells), row
