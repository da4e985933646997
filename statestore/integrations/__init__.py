"""Checkpointing through :meth:`StateStore.save_checkpoint` from training frameworks.

Each framework has its own module, imported on demand (the framework itself is imported only
there; a missing framework raises ``ImportError`` with the ``pip install`` line):

- ``statestore.integrations.transformers``: ``StateStoreTrainer`` / ``StateStoreTrainerMixin``
- ``statestore.integrations.accelerate``: ``prepare(accelerator, ...)``, ``register(...)``
- ``statestore.integrations.lightning``: ``StateStoreCheckpoint`` (a ``Callback``)
- ``statestore.integrations.dcp``: ``StateStoreStateful`` (for ``torch.distributed.checkpoint``)

Without them every framework still resumes exactly through ``optimizer.state_dict()`` /
``load_state_dict()``; what they add is that the optimizer's states go to disk as a statestore
checkpoint (linked, atomic, in bounded RAM) instead of one ``torch.save`` of every state. See
``docs/integrations.md``.
"""
from ._common import (STATESTORE_KEY, find_store_optimizer, light_state_dict,  # noqa: F401
                      store_of)

__all__ = ["find_store_optimizer", "store_of", "light_state_dict", "STATESTORE_KEY"]
