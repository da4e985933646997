"""accelerate: ``prepare`` that leaves a statestore optimizer's states in their store, and
``save_state``/``load_state`` that checkpoint them through :meth:`StateStore.save_checkpoint`.

What a user writes::

    from statestore.integrations import accelerate as ss_accelerate
    model, opt, sched, data = ss_accelerate.prepare(accelerator, model, opt, sched, data)
    ...
    accelerator.save_state("ckpt/step100")      # optimizer -> ckpt/step100/statestore/
    accelerator.load_state("ckpt/step100")      # restores states, step counts, hyperparameters

``prepare`` is ``accelerator.prepare`` except for statestore optimizers: accelerate's own
``prepare`` round-trips an optimizer's ``state_dict()`` through ``load_state_dict()`` to move
its states to the device; here they stay where the store keeps them (the update kernels read
them there). The returned optimizer is an ``AcceleratedOptimizer``; the store is
``opt.optimizer.state_store`` (or ``opt.state_store``).

``save_state(dir)`` then writes the store's checkpoint to ``dir/statestore/``
(``statestore_1/``... for further optimizers) and, in ``optimizer.bin``, only the param groups
and the name of that folder; ``load_state(dir)`` loads it back into the store. Optimizers
prepared by plain ``accelerator.prepare`` keep accelerate's ``torch.save`` path, which resumes
exactly too.
"""
from __future__ import annotations

import os
import weakref
from typing import Any, List, Optional

from ._common import (find_store_optimizer, is_light_state_dict, light_state_dict, load_into,
                      require, resolve, STATESTORE_KEY)

require("accelerate", "accelerate", "statestore.integrations.accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402

__all__ = ["prepare", "register", "StateStoreAcceleratedOptimizer"]


class StateStoreAcceleratedOptimizer(AcceleratedOptimizer):
    """accelerate's optimizer wrapper around a statestore optimizer: no device placement of
    the states, and ``save_state``/``load_state`` through the store's checkpoint (once
    :func:`register` ed). ``state_dict()`` outside ``save_state`` is the optimizer's own."""

    #: accelerate's mark of an object it has prepared: ``accelerator.prepare`` keeps this
    #: wrapper as it is (it is made for accelerate, with the states left in their store)
    _is_accelerate_prepared = True

    def __init__(self, optimizer, scaler=None):
        super().__init__(optimizer, device_placement=False, scaler=scaler)
        self._statestore_dir: Optional[str] = None     # set by the save_state pre-hook
        self._statestore_load_base: Optional[str] = None  # set by the load_state pre-hook

    @property
    def state_store(self):
        return self.optimizer.state_store

    def state_dict(self):
        name, self._statestore_dir = self._statestore_dir, None
        if name is None:
            return super().state_dict()
        return light_state_dict(self.optimizer, name)

    def load_state_dict(self, state_dict):
        if not is_light_state_dict(state_dict):
            return super().load_state_dict(state_dict)
        base, self._statestore_load_base = self._statestore_load_base, None
        load_into(self.optimizer, resolve(base, state_dict[STATESTORE_KEY]["checkpoint"]))


# accelerator -> the optimizers registered on it, in order (a side table: statestore sets no
# attribute on accelerate's objects; weak, so an accelerator is not kept alive by it)
_registered: "weakref.WeakKeyDictionary[Accelerator, List[StateStoreAcceleratedOptimizer]]" = \
    weakref.WeakKeyDictionary()


def _dirname(i: int) -> str:
    return "statestore" if i == 0 else f"statestore_{i}"


def register(accelerator: "Accelerator", *optimizers: StateStoreAcceleratedOptimizer) -> None:
    """Hook ``accelerator.save_state``/``load_state`` so that ``optimizers`` (returned by
    :func:`prepare`, which calls this itself) checkpoint through their store."""
    state = _registered.get(accelerator)
    if state is None:
        state = _registered[accelerator] = []

        def save_hook(models, weights, output_dir):
            for i, opt in enumerate(state):
                inner = opt.optimizer
                name = _dirname(i)
                # A store sharded over a process group saves collectively (every rank);
                # otherwise the main process, which writes accelerate's files, saves it.
                if inner.process_group is not None or accelerator.is_main_process:
                    inner.state_store.save_checkpoint(os.path.join(str(output_dir), name))
                opt._statestore_dir = name

        def load_hook(models, input_dir):
            for opt in state:
                opt._statestore_load_base = str(input_dir)

        accelerator.register_save_state_pre_hook(save_hook)
        accelerator.register_load_state_pre_hook(load_hook)
    for opt in optimizers:
        if not isinstance(opt, StateStoreAcceleratedOptimizer):
            raise TypeError(f"register: expected an optimizer returned by "
                            f"statestore.integrations.accelerate.prepare, got {type(opt).__name__}")
        if opt not in state:
            state.append(opt)


def prepare(accelerator: "Accelerator", *objects: Any, device_placement: Optional[List[bool]] = None):
    """``accelerator.prepare(*objects)``, with every statestore optimizer that has a
    ``state_store`` wrapped without copying its states and registered for
    ``save_state``/``load_state`` (see the module docstring). Returns what
    ``accelerator.prepare`` returns."""
    objs, ours = [], []
    for obj in objects:
        opt = find_store_optimizer(obj) if not isinstance(obj, AcceleratedOptimizer) else None
        if opt is not None and opt is obj and opt.state_store is not None:
            wrapped = StateStoreAcceleratedOptimizer(opt, scaler=accelerator.scaler)
            ours.append(wrapped)
            objs.append(wrapped)
        else:
            objs.append(obj)
    out = accelerator.prepare(*objs, device_placement=device_placement)
    register(accelerator, *ours)
    return out
