"""Peak bytes of the tensors a piece of code allocates, on any device (the CPU included).

torch keeps allocator statistics for CUDA only. LiveTensorBytes counts instead: under it
(a TorchDispatchMode) every tensor an operation returns in new storage (not a view of, nor
written into, one of the operation's inputs) is counted once while that storage lives, and
uncounted when torch frees it, so `peak` is the most storage alive at once among what the
code allocated (its inputs not included). The backward
pass of code run under it is counted too: autograd carries the mode into its engine.
Measurement only: it costs a Python call per operation.

    with LiveTensorBytes() as memory:
        loss = f(x); loss.backward()
    memory.peak
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeGuard

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorBytes(TorchDispatchMode):
    """Live and peak storage bytes of the tensors allocated under it (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}

    def __torch_dispatch__(
        self,
        func: Callable[..., Any],
        types: Collection[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        inputs = {_pointer(t) for t in tree_flatten((args, kwargs))[0] if _is_tensor(t)}
        for tensor in tree_flatten(output)[0]:
            if _is_tensor(tensor) and _pointer(tensor) not in inputs:
                self._count(tensor.untyped_storage())
        return output

    def _count(self, storage: torch.UntypedStorage) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self._sizes:
            return
        self._sizes[key] = size
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)


def _is_tensor(value: object) -> TypeGuard[torch.Tensor]:
    return isinstance(value, torch.Tensor)


def _pointer(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()
