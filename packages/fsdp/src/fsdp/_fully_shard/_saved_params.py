"""Whether a module's forward saved its gathered parameters for the backward.

``set_unshard_in_backward(False)`` promises that a module's backward never reads
its parameters (an embedding's gradient needs only the indices), so the group
is not gathered again for the backward. A promise that does not hold (a Linear,
a LayerNorm) would let autograd read storage the reshard freed: torch's ends in
a C++ error about unallocated data, or reads whatever the storage holds next.
While such a module runs its forward, :class:`SavedParamsWatch` sits on top of
autograd's saved-tensor hooks and notes whether anything saved shares storage
with the group's unsharded parameters; the pre-backward then raises an error
that names the module instead. The watch hands every tensor on to the hooks
that were active before it (activation checkpointing's), so it changes nothing
else about what autograd saves.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["SavedParamsWatch"]


class SavedParamsWatch:
    """Saved-tensor hooks for one forward that set :attr:`saw_params` when autograd saves
    a tensor whose storage starts at one of ``data_ptrs``."""

    saw_params: bool

    def __init__(self, data_ptrs: set[int]) -> None:
        self.saw_params = False
        self._data_ptrs = data_ptrs
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def __enter__(self) -> SavedParamsWatch:
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        outer_pack, outer_unpack = outer if outer is not None else (None, None)

        def pack(t: Tensor) -> Any:
            if not self.saw_params and _storage_ptr(t) in self._data_ptrs:
                self.saw_params = True
            return outer_pack(t) if outer_pack is not None else t

        def unpack(packed: Any) -> Tensor:
            return outer_unpack(packed) if outer_unpack is not None else packed

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None


def _storage_ptr(t: Tensor) -> int:
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # a wrapper subclass without storage
        return -1
