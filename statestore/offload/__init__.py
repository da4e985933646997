"""Parameter offload: a model's parameters kept in a :class:`~statestore.StateStore`.

::

    handle = statestore.offload_parameters(model, store, prefetch=2)
    opt = HybridAdam(model.named_parameters(), state_store=opt_store)
    for batch in data:
        model(batch).loss.backward()
        opt.step(); opt.zero_grad()
    handle.save_checkpoint("ckpt/step100", opt_store)   # parameters + optimizer states
    handle.close()                                       # every parameter back in memory

Every parameter's data lives in ``store`` under the key ``(name, "param")`` (``name``: the
parameter's name in ``model.named_parameters()``); it is fetched before a module's forward
and again before its backward and released after, ``prefetch`` modules being read ahead
through the store's pipeline. See ``docs/offload.md`` for the mechanics and the memory
bound.
"""
from ._handle import PARAM_STATE, OffloadHandle, offload_parameters

__all__ = ["offload_parameters", "OffloadHandle", "PARAM_STATE"]
