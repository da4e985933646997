"""``HookHandles`` (statestore/_hook_handles.py): the one way offload, the optimizers and CUDA
staging remove the hooks they registered."""
import torch

from statestore._hook_handles import HookHandles


class _Failing:
    removed = 0

    def remove(self):
        _Failing.removed += 1
        raise RuntimeError("hook dictionary already gone")


def test_every_hook_removed_once_even_when_one_fails():
    p = torch.nn.Parameter(torch.zeros(3))
    calls = []
    hooks = HookHandles()
    hooks.add(p.register_hook(lambda g: calls.append("a")))
    hooks.add(_Failing())
    hooks.add(p.register_hook(lambda g: calls.append("b")))
    assert len(hooks) == 3
    hooks.remove_all()
    assert len(hooks) == 0 and _Failing.removed == 1
    p.sum().backward()
    assert calls == []          # both torch hooks are gone, the failing one did not stop that
    hooks.remove_all()          # idempotent: nothing is removed twice
    assert _Failing.removed == 1
