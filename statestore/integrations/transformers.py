"""HF transformers ``Trainer``: the optimizer's states checkpoint through
:meth:`StateStore.save_checkpoint` into ``checkpoint-N/statestore/``.

What a user writes (the only change from a plain ``Trainer``)::

    from statestore.integrations.transformers import StateStoreTrainer
    trainer = StateStoreTrainer(model=model, args=args, train_dataset=ds,
                                optimizers=(opt, scheduler))   # opt: HybridAdam(..., state_store=store)
    trainer.train(resume_from_checkpoint=...)                  # as usual

or, for a ``Trainer`` subclass of your own, ``class MyTrainer(StateStoreTrainerMixin, Seq2SeqTrainer)``.
The Trainer may also build the optimizer itself:
``args.optim`` untouched and ``optimizer_cls_and_kwargs=(HybridAdam, {"state_store": store, "lr": ...})``.

Saving ``checkpoint-N`` writes the store's checkpoint to ``checkpoint-N/statestore/`` (for an
``NVMeStore`` on the same filesystem the state files are hard-linked: no state bytes are
copied) and the scheduler to ``scheduler.pt`` as the Trainer does; no ``optimizer.pt``.
Resuming from a folder with ``statestore/`` loads it into the optimizer's store, which restores
the optimizer's step counts and hyperparameters; a folder saved by a plain ``Trainer``
(``optimizer.pt``) still loads the torch way. Optimizers that are not statestore optimizers
with a ``state_store``, and DeepSpeed, FSDP, XLA or SageMaker runs, take the Trainer's own path.
"""
from __future__ import annotations

import os
import warnings

import torch

from ._common import find_store_optimizer, load_into, require

_transformers = require("transformers", "transformers", "statestore.integrations.transformers")
from transformers import Trainer  # noqa: E402

__all__ = ["StateStoreTrainerMixin", "StateStoreTrainer", "STATESTORE_DIRNAME"]

#: The sub-folder of ``checkpoint-N`` that holds the store's checkpoint.
STATESTORE_DIRNAME = "statestore"
SCHEDULER_NAME = "scheduler.pt"


class StateStoreTrainerMixin:
    """Mix into a ``transformers.Trainer`` (before it in the bases) to checkpoint a
    statestore optimizer through ``save_checkpoint``. See the module docstring."""

    def _statestore_optimizer(self):
        """Our optimizer when this run's checkpoint goes through the store, else None."""
        opt = find_store_optimizer(getattr(self, "optimizer", None))
        if opt is None or opt.state_store is None:
            return None
        if getattr(self, "is_deepspeed_enabled", False) or getattr(self, "is_fsdp_enabled", False):
            return None
        from transformers.utils import is_sagemaker_mp_enabled, is_torch_xla_available
        if is_torch_xla_available() or is_sagemaker_mp_enabled():
            return None
        return opt

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        opt = self._statestore_optimizer()
        if opt is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        # A store sharded over a process group saves collectively (every rank); otherwise the
        # process that saves the Trainer's files saves it.
        if opt.process_group is not None or self.args.should_save:
            opt.state_store.save_checkpoint(os.path.join(output_dir, STATESTORE_DIRNAME))
        if self.args.should_save and self.lr_scheduler is not None:
            with warnings.catch_warnings(record=True) as caught:
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
            for w in caught:        # torch's "please also save the optimizer" warning aside
                if "optimizer" not in str(w.message):
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        opt = self._statestore_optimizer()
        path = None if checkpoint is None else os.path.join(checkpoint, STATESTORE_DIRNAME)
        if opt is None or path is None or not os.path.isdir(path):
            return super()._load_optimizer_and_scheduler(checkpoint)
        load_into(opt, path)
        sched = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(sched):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                self.lr_scheduler.load_state_dict(torch.load(sched, weights_only=True))


class StateStoreTrainer(StateStoreTrainerMixin, Trainer):
    """``transformers.Trainer`` whose checkpoints save a statestore optimizer through
    :meth:`StateStore.save_checkpoint` (``checkpoint-N/statestore/``) and restore it on
    ``resume_from_checkpoint``."""
