"""PyTorch Lightning: fit, checkpoint at an epoch's end, resume with ckpt_path= bit for bit,
with the StateStoreCheckpoint callback (the store's checkpoint beside the .ckpt) and without
it (Lightning's torch.save of state_dict()), on a disk store and a resident one."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("lightning")
pytest.importorskip("transformers")

import lightning as L  # noqa: E402
from helpers.integration import (STORES, TokenDataset, assert_same_params, make_optimizer,  # noqa: E402
                                 params_of, tiny_llama, warmup)

from statestore.integrations.lightning import StateStoreCheckpoint  # noqa: E402

EPOCHS = 2
pytestmark = [pytest.mark.filterwarnings("ignore:.*treespec"),
              pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")]


class TinyLM(L.LightningModule):
    def __init__(self, store, kind="hybrid"):
        super().__init__()
        self.model = tiny_llama()
        self.store, self.kind = store, kind

    def training_step(self, batch, _):
        return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

    def configure_optimizers(self):
        opt = make_optimizer(self.model, self.store, kind=self.kind)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup(opt), "interval": "step"}}


def _fit(tmp_path, store_name, tag, integration, epochs, ckpt_path=None, kind="hybrid"):
    from lightning.pytorch.callbacks import ModelCheckpoint
    store = STORES[store_name](tmp_path / f"store-{tag}")
    module = TinyLM(store, kind)
    callbacks = [ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), save_top_k=-1,
                                 every_n_epochs=1, save_on_train_epoch_end=True)]
    if integration:
        callbacks.append(StateStoreCheckpoint())
    trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        accumulate_grad_batches=2, gradient_clip_val=1.0, callbacks=callbacks,
                        num_sanity_val_steps=0)
    data = torch.utils.data.DataLoader(TokenDataset(12), batch_size=2, shuffle=False)
    trainer.fit(module, data, ckpt_path=ckpt_path)
    out = params_of(module.model)
    lr = module.optimizers().param_groups[0]["lr"]
    store.close()
    return out, lr


@pytest.mark.parametrize("store_name,integration,kind", [
    (s, i, "hybrid") for s in STORES for i in (True, False)] + [("nvme", True, "adafactor")])
def test_lightning_resume_bit_for_bit(tmp_path, store_name, integration, kind):
    full, lr_full = _fit(tmp_path, store_name, "full", integration, EPOCHS, kind=kind)
    ckpts = sorted(os.listdir(tmp_path / "ckpts"))
    first = next(n for n in ckpts if n.startswith("epoch=0") and n.endswith(".ckpt"))
    saved = torch.load(tmp_path / "ckpts" / first, weights_only=False)
    if integration:
        stem = first[:-len(".ckpt")]
        assert (tmp_path / "ckpts" / f"{stem}.statestore").is_dir()
        assert saved["optimizer_states"][0]["state"] == {}
    else:
        assert saved["optimizer_states"][0]["state"]
    resumed, lr_resumed = _fit(tmp_path, store_name, "resumed", integration, EPOCHS,
                               ckpt_path=str(tmp_path / "ckpts" / first), kind=kind)
    assert lr_resumed == lr_full
    assert_same_params(full, resumed)


def test_lightning_removes_store_checkpoint_with_ckpt(tmp_path):
    """save_top_k=1: an older .ckpt removed by ModelCheckpoint takes its .statestore along."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    store = STORES["nvme"](tmp_path / "store")
    module = TinyLM(store)
    trainer = L.Trainer(max_epochs=3, accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), save_top_k=1,
                                                   monitor="step", mode="max"),
                                   StateStoreCheckpoint()])
    trainer.fit(module, torch.utils.data.DataLoader(TokenDataset(4), batch_size=2))
    names = sorted(os.listdir(tmp_path / "ckpts"))
    assert len([n for n in names if n.endswith(".ckpt")]) == 1
    assert len([n for n in names if n.endswith(".statestore")]) == 1
    assert names[0][:-len(".ckpt")] + ".statestore" in names or \
        names[1][:-len(".ckpt")] + ".statestore" in names
    store.close()
