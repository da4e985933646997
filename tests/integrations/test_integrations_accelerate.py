"""accelerate: prepare / save_state / load_state resume bit for bit, through the store's
checkpoint (statestore.integrations.accelerate.prepare) and through accelerate's own
torch.save path (plain accelerator.prepare), on a disk store and a resident one."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from helpers.integration import (STORES, assert_same_params, make_optimizer, params_of,  # noqa: E402
                                 tiny_llama, token_batches, warmup)

from statestore.integrations import accelerate as ss_accelerate  # noqa: E402

ACCUM, STEPS, SAVE_AT = 2, 6, 3


def _train(accelerator, model, opt, sched, batches, steps):
    for b in batches:
        with accelerator.accumulate(model):
            loss = model(input_ids=b, labels=b).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)


def _setup(tmp_path, store_name, tag, integration, kind="hybrid"):
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
    model = tiny_llama()
    store = STORES[store_name](tmp_path / f"store-{tag}")
    opt = make_optimizer(model, store, kind=kind)
    sched = warmup(opt)
    prep = ss_accelerate.prepare if integration else (lambda acc, *o: acc.prepare(*o))
    model, opt, sched = prep(accelerator, model, opt, sched)
    return accelerator, model, opt, sched, store


@pytest.mark.parametrize("store_name,integration,kind", [
    (s, i, "hybrid") for s in STORES for i in (True, False)] + [("nvme", True, "adafactor")])
def test_accelerate_resume_bit_for_bit(tmp_path, store_name, integration, kind):
    batches = token_batches(STEPS * ACCUM)
    ckpt = tmp_path / "ckpt"
    acc, model, opt, sched, store = _setup(tmp_path, store_name, "full", integration, kind)
    assert opt.optimizer.state_store is store          # how to reach the store after prepare
    _train(acc, model, opt, sched, batches[:SAVE_AT * ACCUM], SAVE_AT)
    acc.save_state(str(ckpt))
    _train(acc, model, opt, sched, batches[SAVE_AT * ACCUM:], STEPS - SAVE_AT)
    full, lr_full = params_of(model), opt.param_groups[0]["lr"]
    store.close()
    if integration:
        assert (ckpt / "statestore").is_dir()
        assert os.path.getsize(ckpt / "optimizer.bin") < 64 * 1024   # param groups only

    acc, model, opt, sched, store = _setup(tmp_path, store_name, "resumed", integration, kind)
    acc.load_state(str(ckpt))
    _train(acc, model, opt, sched, batches[SAVE_AT * ACCUM:], STEPS - SAVE_AT)
    assert opt.param_groups[0]["lr"] == lr_full
    assert_same_params(full, params_of(model))
    store.close()


@pytest.mark.parametrize("store_name", list(STORES))
def test_prepare_leaves_states_in_store(tmp_path, store_name):
    """An optimizer that already holds states (a loaded checkpoint) is prepared without a
    state_dict()/load_state_dict() round trip: nothing is copied or rewritten."""
    from accelerate import Accelerator
    model = tiny_llama()
    store = STORES[store_name](tmp_path / "a")
    opt = make_optimizer(model, store)
    b = token_batches(1)[0]
    model(input_ids=b, labels=b).loss.backward()
    opt.step()
    store.save_checkpoint(str(tmp_path / "ck"))
    store.close()
    store = STORES[store_name](tmp_path / "b")
    store.load_checkpoint(str(tmp_path / "ck"))
    opt = make_optimizer(model, store)
    before = {k: store.get(k).clone() for k in store.keys()}
    written = store.stats().get("bytes_written")

    def refuse(*a, **k):
        raise AssertionError("prepare round-tripped the optimizer's states")
    opt.state_dict = refuse
    opt.load_state_dict = refuse
    accelerator = Accelerator(cpu=True)
    model, popt = ss_accelerate.prepare(accelerator, model, opt)
    del opt.state_dict, opt.load_state_dict
    assert popt.optimizer is opt and popt.state_store is store
    # statestore keeps what it registers in a table of its own: accelerate's object gains
    # no attribute of statestore's
    assert not [a for a in vars(accelerator) if "statestore" in a], vars(accelerator).keys()
    assert store.stats().get("bytes_written") == written
    assert all(torch.equal(store.get(k), v) for k, v in before.items())
    store.close()
