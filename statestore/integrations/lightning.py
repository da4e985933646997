"""PyTorch Lightning: a ``Callback`` that saves each statestore optimizer's states as a
statestore checkpoint beside Lightning's ``.ckpt`` file and restores them on ``ckpt_path=``.

What a user writes::

    from statestore.integrations.lightning import StateStoreCheckpoint
    trainer = lightning.Trainer(..., callbacks=[ModelCheckpoint(...), StateStoreCheckpoint()])
    trainer.fit(module, ckpt_path=...)       # as usual

with ``configure_optimizers`` returning a ``CPUAdam``/``HybridAdam`` built with a
``state_store``. Saving ``epoch=1-step=6.ckpt`` first writes the store's checkpoint to
``epoch=1-step=6.statestore/`` in the same folder (``.statestore-1/``... for further
optimizers), then the ``.ckpt``, whose ``optimizer_states`` entry holds only the param groups
and that folder's name; removing a ``.ckpt`` (``save_top_k``) removes its folder too.
Resuming loads the folder into the optimizer's store, which restores its step counts and
hyperparameters; the states are never moved to the device (they stay in the store). Other
optimizers, and checkpoints saved without the callback, take Lightning's own path.

While a ``fit``/``validate``... runs, the callback wraps ``trainer.strategy.checkpoint_io`` and
the strategy's ``save_checkpoint``/``optimizer_state``/``load_optimizer_state_dict``;
``teardown`` puts them back. The store's checkpoint is saved from the strategy's
``save_checkpoint``, which every rank calls (Lightning's ``CheckpointIO`` runs on global rank 0
only): by rank 0 alone, or, for an optimizer sharded over a ``process_group``, by every rank
(``save_checkpoint`` is then a collective writing one checkpoint; it was called on rank 0 only
before, and waited for the other ranks for ever). Resuming loads it on every rank, each taking
its own shard.
"""
from __future__ import annotations

import os
import shutil
from typing import Any, Dict, Optional

from ..errors import StateStoreError
from ._common import (STATESTORE_KEY, find_store_optimizer, is_light_state_dict,
                      light_state_dict, load_into, require, resolve)

require("lightning", "lightning", "statestore.integrations.lightning")
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

__all__ = ["StateStoreCheckpoint"]


def _store_optimizer(optimizer):
    opt = find_store_optimizer(optimizer)
    return opt if opt is not None and opt.state_store is not None else None


def _folder(ckpt_path: str, i: int) -> str:
    stem = os.path.splitext(os.path.basename(str(ckpt_path)))[0]
    return f"{stem}.statestore" if i == 0 else f"{stem}.statestore-{i}"


class _StoreCheckpointIO(CheckpointIO):
    """Delegates to Lightning's checkpoint IO, saving the stores' checkpoints beside each
    ``.ckpt`` before it and removing them with it."""

    def __init__(self, inner: CheckpointIO, callback: "StateStoreCheckpoint"):
        self.inner = inner
        self.callback = callback

    def save_checkpoint(self, checkpoint: Dict[str, Any], path, storage_options=None) -> None:
        # the stores were saved by the strategy's save_checkpoint (_save_stores), on every rank
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def load_checkpoint(self, path, *args, **kwargs):
        self.callback._loaded_from = str(path)
        return self.inner.load_checkpoint(path, *args, **kwargs)

    def remove_checkpoint(self, path) -> None:
        self.inner.remove_checkpoint(path)
        folder = os.path.dirname(str(path))
        stem = _folder(path, 0)
        if os.path.isdir(folder):
            for name in os.listdir(folder):
                if name == stem or name.startswith(stem + "-"):
                    shutil.rmtree(os.path.join(folder, name), ignore_errors=True)

    def teardown(self) -> None:
        self.inner.teardown()


def _save_stores(strategy, checkpoint: Dict[str, Any], path) -> None:
    """Save the store of each statestore optimizer beside ``path`` (called on every rank):
    a sharded store collectively on every rank, any other on global rank 0, which writes the
    ``.ckpt``."""
    for i, st in enumerate(checkpoint.get("optimizer_states") or []):
        if not is_light_state_dict(st):
            continue
        opt = _store_optimizer(strategy.optimizers[i])
        name = _folder(path, i)
        if opt.process_group is not None or strategy.is_global_zero:
            opt.state_store.save_checkpoint(os.path.join(os.path.dirname(str(path)), name))
        st[STATESTORE_KEY]["checkpoint"] = name


class StateStoreCheckpoint(Callback):
    """Save statestore optimizers' states through :meth:`StateStore.save_checkpoint` beside
    Lightning's checkpoints and restore them from there (see the module docstring)."""

    def __init__(self) -> None:
        self._trainer = None
        self._loaded_from: Optional[str] = None
        self._saved: Optional[tuple] = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self._saved is not None:
            return
        strategy = trainer.strategy
        self._trainer = trainer
        inner_io = strategy.checkpoint_io
        optimizer_state = strategy.optimizer_state
        save_checkpoint = strategy.save_checkpoint
        load_optimizer_state_dict = strategy.load_optimizer_state_dict
        self._saved = (strategy, inner_io)

        def light_optimizer_state(optimizer):
            opt = _store_optimizer(optimizer)
            if opt is None:
                return optimizer_state(optimizer)
            return light_state_dict(opt)        # the folder's name is set when saved

        def load_light(checkpoint):
            states = checkpoint.get("optimizer_states") or []
            if not any(is_light_state_dict(s) for s in states):
                return load_optimizer_state_dict(checkpoint)
            base = os.path.dirname(self._loaded_from) if self._loaded_from else None
            for optimizer, st in zip(strategy.optimizers, states):
                opt = _store_optimizer(optimizer)
                if not is_light_state_dict(st):
                    optimizer.load_state_dict(st)
                    continue
                if opt is None:
                    raise StateStoreError(f"checkpoint {self._loaded_from!r} keeps this "
                                          f"optimizer's states in a statestore checkpoint, but "
                                          f"{type(optimizer).__name__} is not a statestore "
                                          f"optimizer with a state_store")
                load_into(opt, resolve(base, st[STATESTORE_KEY]["checkpoint"]))

        def save_with_stores(checkpoint, filepath, storage_options=None):
            _save_stores(strategy, checkpoint, filepath)
            return save_checkpoint(checkpoint, filepath, storage_options=storage_options)

        strategy.checkpoint_io = _StoreCheckpointIO(inner_io, self)
        strategy.save_checkpoint = save_with_stores
        strategy.optimizer_state = light_optimizer_state
        strategy.load_optimizer_state_dict = load_light

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self._saved is None:
            return
        strategy, inner_io = self._saved
        strategy.checkpoint_io = inner_io
        for attr in ("save_checkpoint", "optimizer_state", "load_optimizer_state_dict"):
            strategy.__dict__.pop(attr, None)
        self._saved = None
        self._trainer = None
