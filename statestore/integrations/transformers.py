"""HF transformers ``Trainer``: the optimizer's states checkpoint through
:meth:`StateStore.save_checkpoint` into ``checkpoint-N/statestore/``.

What a user writes (the only change from a plain ``Trainer``)::

    from statestore.integrations.transformers import StateStoreTrainer
    trainer = StateStoreTrainer(model=model, args=args, train_dataset=ds,
                                state_store=ss.NVMeStore("/nvme/run1"))
    trainer.train(resume_from_checkpoint=...)                  # as usual

``state_store=`` builds ``HybridAdam`` on that store from the ``TrainingArguments``
(``learning_rate``, ``adam_beta1``/``adam_beta2``, ``adam_epsilon``, ``weight_decay`` on the
Trainer's decay group, ``get_decay_parameter_names``, and 0 on the rest), keyed by parameter
names, and the Trainer builds its scheduler on it as usual. Or pass your own:
``optimizers=(HybridAdam(..., state_store=store), scheduler)``, or
``optimizer_cls_and_kwargs=(HybridAdam, {"state_store": store, ...})`` (also named groups).
A ``Trainer`` subclass of your own mixes it in first:
``class MyTrainer(StateStoreTrainerMixin, Seq2SeqTrainer)``.

Saving ``checkpoint-N`` writes the store's checkpoint to ``checkpoint-N/statestore/`` (for an
``NVMeStore`` on the same filesystem the state files are hard-linked: no state bytes are
copied) and the scheduler to ``scheduler.pt`` as the Trainer does; no ``optimizer.pt``.
Resuming from a folder with ``statestore/`` loads it into the optimizer's store, which restores
the optimizer's step counts and hyperparameters; a folder saved by a plain ``Trainer``
(``optimizer.pt``) still loads the torch way. Without a statestore optimizer (none given, a
torch optimizer, one without a store) the Trainer says so: an error where nothing was given,
a warning otherwise, as the run then checkpoints the Trainer's way (``optimizer.pt``).
DeepSpeed, FSDP, XLA or SageMaker runs take the Trainer's own path.
"""
from __future__ import annotations

import os
import warnings

import torch

from ..errors import StateStoreValueError
from ._common import find_store_optimizer, load_into, require

_transformers = require("transformers", "transformers", "statestore.integrations.transformers")
from transformers import Trainer  # noqa: E402

__all__ = ["StateStoreTrainerMixin", "StateStoreTrainer", "STATESTORE_DIRNAME"]

#: The sub-folder of ``checkpoint-N`` that holds the store's checkpoint.
STATESTORE_DIRNAME = "statestore"
SCHEDULER_NAME = "scheduler.pt"


#: ``TrainingArguments.optim`` values whose optimizer is AdamW with the arguments' betas and
#: epsilon: what ``state_store=`` builds ``HybridAdam`` for
ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused", "adamw_hf")

_WHAT_TO_PASS = ("pass state_store=ss.NVMeStore(...) (or another store: the Trainer then "
                 "builds HybridAdam from the TrainingArguments on it), "
                 "optimizers=(HybridAdam(model.named_parameters(), ..., state_store=store), "
                 "scheduler), or optimizer_cls_and_kwargs=(HybridAdam, {'state_store': store})")


def _optim_name(args) -> str:
    return str(getattr(args.optim, "value", args.optim))


class StateStoreTrainerMixin:
    """Mix into a ``transformers.Trainer`` (before it in the bases) to checkpoint a
    statestore optimizer through ``save_checkpoint``; ``state_store=`` builds that optimizer
    from the ``TrainingArguments``. See the module docstring."""

    def __init__(self, *args, state_store=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.state_store = state_store
        given = (self.optimizer is not None
                 or getattr(self, "optimizer_cls_and_kwargs", None) is not None)
        if state_store is not None:
            if given:
                raise StateStoreValueError(
                    f"{type(self).__name__}: pass either state_store= (the Trainer builds "
                    f"HybridAdam on it) or an optimizer (optimizers= / "
                    f"optimizer_cls_and_kwargs=), not both")
            self._check_optim_args()
        elif not given and not getattr(self, "is_deepspeed_enabled", False):
            raise StateStoreValueError(
                f"{type(self).__name__} needs a statestore optimizer, or it trains with "
                f"torch's AdamW and checkpoints optimizer.pt like a plain Trainer: "
                f"{_WHAT_TO_PASS}")
        elif self.optimizer is not None:
            self._warn_without_store(self.optimizer)

    def _check_optim_args(self) -> None:
        optim = _optim_name(self.args)
        if optim not in ADAMW_OPTIMS:
            raise StateStoreValueError(
                f"{type(self).__name__}(state_store=...) builds HybridAdam (AdamW) from the "
                f"TrainingArguments, and optim={optim!r} is not AdamW: use optim='adamw_torch' "
                f"(one of {', '.join(ADAMW_OPTIMS)}), or pass the optimizer yourself: "
                f"optimizers=(opt, scheduler)")
        if self.args.optim_args:
            raise StateStoreValueError(
                f"{type(self).__name__}(state_store=...): optim_args={self.args.optim_args!r} "
                f"cannot be mapped to HybridAdam's arguments: leave optim_args unset, or pass "
                f"optimizer_cls_and_kwargs=(HybridAdam, {{'state_store': store, ...}})")

    def _warn_without_store(self, optimizer) -> None:
        opt = find_store_optimizer(optimizer)
        if opt is not None and opt.state_store is not None:
            return
        what = (f"{type(opt).__name__} without state_store= (its states sit next to the "
                f"parameters)" if opt is not None else
                f"{type(optimizer).__module__}.{type(optimizer).__name__}, not a statestore "
                f"optimizer")
        warnings.warn(f"{type(self).__name__} got {what}: it trains and checkpoints as a "
                      f"plain Trainer (optimizer.pt); {_WHAT_TO_PASS}", UserWarning, stacklevel=3)

    def _named_groups(self, model, weight_decay: float):
        """The Trainer's two groups (``get_decay_parameter_names``: ``weight_decay`` on the
        decay group, 0 on the rest), trainable parameters only, with their names
        (``param_names``) so that the checkpoint is keyed by names; empty groups left out."""
        decay = set(self.get_decay_parameter_names(model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = []
        for members, wd in (([(n, p) for n, p in named if n in decay], weight_decay),
                            ([(n, p) for n, p in named if n not in decay], 0.0)):
            if members:
                groups.append({"params": [p for _, p in members],
                               "param_names": [n for n, _ in members], "weight_decay": wd})
        return groups

    def create_optimizer(self, *args, **kwargs):
        built = self.optimizer is None
        if built:
            from ..optim import CPUAdam, HybridAdam
            model = kwargs.get("model", args[0] if args else None)
            model = self.model if model is None else model
            if self.state_store is not None:
                a = self.args
                self.optimizer = HybridAdam(
                    self._named_groups(model, a.weight_decay), lr=a.learning_rate,
                    betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_epsilon,
                    state_store=self.state_store)
            elif getattr(self, "optimizer_cls_and_kwargs", None) is not None:
                cls, opt_kwargs = self.optimizer_cls_and_kwargs
                # the Trainer's groups and the kwargs as given, as the Trainer would build it,
                # but named
                if isinstance(cls, type) and issubclass(cls, (CPUAdam, HybridAdam)):
                    self.optimizer = cls(self._named_groups(model, self.args.weight_decay),
                                         **opt_kwargs)
        optimizer = super().create_optimizer(*args, **kwargs)
        if built and self.state_store is None:
            self._warn_without_store(optimizer)
        return optimizer

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
