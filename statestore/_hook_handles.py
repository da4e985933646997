"""``HookHandles``: the removable handles of the hooks one object registers on others
(``register_hook``, ``register_forward_pre_hook``, torch's global optimizer step hooks, ...),
kept together and removed the one way: parameter offload's module and parameter hooks
(``statestore/offload/``), the optimizers' backward hooks (``optim/base.py``) and CUDA
staging's (``optim/_staging.py``)."""
from __future__ import annotations

from typing import Any, List

__all__ = ["HookHandles"]


class HookHandles:
    """Handles (objects with ``remove()``, as torch's ``RemovableHandle``) removed together."""

    __slots__ = ("_handles",)

    def __init__(self) -> None:
        self._handles: List[Any] = []

    def add(self, handle: Any) -> Any:
        """Keep ``handle`` for :meth:`remove_all`; returns it."""
        self._handles.append(handle)
        return handle

    def __len__(self) -> int:
        return len(self._handles)

    def remove_all(self) -> None:
        """Remove every hook kept, each once, and forget them: an owner's ``close()`` and its
        ``__del__`` both call it. A handle whose removal raises is skipped (at interpreter
        exit a hook's dictionary may be gone already), the others are still removed."""
        handles, self._handles = self._handles, []
        for h in handles:
            try:
                h.remove()
            except Exception:       # noqa: BLE001 - see the docstring
                pass
