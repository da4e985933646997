"""torch.distributed.checkpoint: dcp.save / dcp.load of a StateStoreStateful (with the model
and the scheduler) resumes bit for bit, on a disk store and a resident one, in one process."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from helpers.integration import (STORES, assert_same_params, make_optimizer, params_of,  # noqa: E402
                                 tiny_llama, token_batches, warmup)

import statestore as ss  # noqa: E402
from statestore.integrations.dcp import StateStoreStateful  # noqa: E402

STEPS, SAVE_AT = 6, 3
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _train(model, opt, sched, batches):
    for b in batches:
        model(input_ids=b, labels=b).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("store_name,dtype,kind", [
    (s, d, "hybrid") for s in STORES for d in (torch.float32, torch.bfloat16)] + [
    ("nvme", torch.float32, "adafactor")])
def test_dcp_resume_bit_for_bit(tmp_path, store_name, dtype, kind):
    batches = token_batches(STEPS)
    ckpt = str(tmp_path / "dcp")
    model = tiny_llama(dtype=dtype)
    store = STORES[store_name](tmp_path / "a")
    opt = make_optimizer(model, store, kind=kind)
    sched = warmup(opt)
    _train(model, opt, sched, batches[:SAVE_AT])
    dcp.save({"model": model.state_dict(), "optim": StateStoreStateful(opt),
              "sched": sched.state_dict()}, checkpoint_id=ckpt)
    _train(model, opt, sched, batches[SAVE_AT:])
    full, lr_full = params_of(model), opt.param_groups[0]["lr"]
    store.close()

    model = tiny_llama(seed=123, dtype=dtype)              # other weights: all come from DCP
    store = STORES[store_name](tmp_path / "b")
    opt = make_optimizer(model, store, lr=1.0, kind=kind)   # other lr: it comes from DCP too
    sched = warmup(opt)
    state = {"model": model.state_dict(), "optim": StateStoreStateful(opt),
             "sched": sched.state_dict()}
    dcp.load(state, checkpoint_id=ckpt)
    sched.load_state_dict(state["sched"])
    _train(model, opt, sched, batches[SAVE_AT:])
    assert opt.param_groups[0]["lr"] == lr_full
    assert_same_params(full, params_of(model))
    store.close()


def test_dcp_state_dict_is_file_backed_on_disk_store(tmp_path):
    """On NVMeStore the state dict's tensors are mapped from a file, not held in RAM, and a
    parameter without states yet still has its (zero, step 0) entry."""
    model = tiny_llama()
    store = ss.NVMeStore(str(tmp_path / "s"), budget_bytes=1 << 20)
    opt = make_optimizer(model, store)
    b = token_batches(1)[0]
    model(input_ids=b, labels=b).loss.backward()
    model.lm_head.weight.grad = None                    # lm_head gets no step
    opt.step()
    sd = StateStoreStateful(opt).state_dict()
    assert float(sd["state"]["lm_head.weight"]["step"]) == 0
    assert float(sd["state"]["model.norm.weight"]["step"]) == 1
    t = sd["state"]["model.norm.weight"]["exp_avg"]
    assert torch.equal(t, store.get(ss.StateKey("model.norm.weight", "exp_avg")))
    assert not t.untyped_storage().resizable()          # mapped, not an allocation of its own
    store.close()
