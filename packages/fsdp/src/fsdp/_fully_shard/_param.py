"""The life of one parameter under ``fully_shard``: its ``DTensor`` shard and its unsharded leaf.

[Note: fully_shard parameter forms]
A parameter ``p`` of a group keeps two ``nn.Parameter`` objects for its whole life:

- ``sharded``: an ``nn.Parameter`` wrapping a ``DTensor`` with placement
  ``Shard(dim)`` (``(Replicate(), Shard(dim))`` under HSDP; with tensor
  parallelism the placements of [Note: fully_shard over tensor parallelism] in
  ``_tensor_parallel.py``) whose local tensor is a view into its part's
  *region*, this rank's packed shard of the group ([Note: chunk layout] in
  flatparam). It is what ``parameters()``, ``state_dict()`` and the optimizer
  see between uses; an in-place optimizer step writes the region, which the
  next all-gather sends as it is. Its ``.grad`` is a ``DTensor`` of the same
  placements, a view into the reduced gradient shard.
- ``unsharded``: an ``nn.Parameter`` of the full shape (for a tensor-parallel
  parameter a ``DTensor`` on its tp mesh whose local tensor is its full tp
  piece), in the compute dtype, the autograd leaf forward and backward use
  while the group is gathered. Its data is the prefix of ``buf``, a 1-D buffer
  with the padding rows of every chunk ([Note: chunk layout]), filled by the
  copy-out after each all-gather; ``buf``'s storage is freed between uses and
  reallocated, so the same leaf (and the views autograd saved of it) serve
  every forward and backward ([Note: storage resizing and autograd] in
  ``_wrapper/_flat_param_unit.py``). A plain leaf gets its data by ``.data``
  assignment and a ``DTensor`` leaf is a wrapper of its own, so either way its
  version counter is its own and the copy-out (a write into ``buf``) does not
  look like an in-place change of a tensor saved for backward.

What ``fully_shard`` cuts (``shape``, the layout's entry) is the parameter
itself, or for a tensor-parallel one its tp-local tensor.

A parameter with all-gather extensions (or of a tensor subclass) is the
exception to both forms ([Note: all-gather extensions] in ``_extensions.py``):
its local tensor is its own padded chunk (the subclass), not a view into a
region, and its unsharded leaf is what its ``fsdp_post_all_gather`` built from
the gathered outputs (no ``buf``).

The module's attribute (and every other module's that shares the parameter)
holds ``sharded`` or ``unsharded`` by the group's state, swapped in the
modules' ``_parameters`` directly.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard

from fsdp._fully_shard._mesh import MeshInfo
from fsdp._fully_shard._tensor_parallel import TensorParallelSpec, wrap_local

__all__ = ["ParamSite", "ShardedParam", "local_object", "local_tensor", "set_local_tensor"]


@dataclass
class ParamSite:
    """Where a parameter is registered: a module and a name, and its other (tied) names."""

    module: nn.Module
    name: str  # unprefixed, e.g. "weight"
    shared: list[tuple[nn.Module, str]] = field(default_factory=list)

    def set(self, param: nn.Parameter) -> None:
        """Register ``param`` at every site (without ``nn.Module.__setattr__``'s checks)."""
        for module, name in [(self.module, self.name), *self.shared]:
            if type(module).__setattr__ is nn.Module.__setattr__:
                module._parameters[name] = param
            else:  # a module with its own __setattr__ sees the swap
                setattr(module, name, param)

    def get(self) -> nn.Parameter | None:
        """What the first site holds now."""
        return self.module._parameters.get(self.name)


class ShardedParam:
    """One parameter's sharded ``DTensor`` and unsharded leaf; see [Note: fully_shard parameter
    forms]. The part that holds it owns the region and the gathered buffers."""

    site: ParamSite
    fqn: str  # name under the root module, for messages (set at lazy initialisation)
    shape: torch.Size  # what is cut: the full shape, or a tp parameter's local shape
    placement: Shard  # the dim it is cut along (over dp)
    info: MeshInfo  # the data-parallel groups it is cut over (its part's)
    mesh: DeviceMesh  # of the sharded DTensor: the dp mesh, or dp joined to tp
    placements: tuple[Placement, ...]  # of the sharded DTensor on ``mesh``
    tp: TensorParallelSpec | None  # a tensor-parallel parameter's unsharded form
    sharded: nn.Parameter  # DTensor; local tensor a view into the part's region
    unsharded: nn.Parameter | None  # full-shaped leaf; created at the first gather
    buf: Tensor | None  # 1-D padded storage of ``unsharded`` (compute dtype); freed between uses
    accumulated_grad: Tensor | None  # reduce dtype, tp-local; kept across unsynced backwards
    orig: weakref.ref[Tensor] | None  # the original parameter (for ties across calls)

    def __init__(
        self,
        site: ParamSite,
        shape: torch.Size,
        placement: Shard,
        *,
        info: MeshInfo,
        mesh: DeviceMesh,
        placements: tuple[Placement, ...],
        tp: TensorParallelSpec | None = None,
    ) -> None:
        self.site = site
        self.info = info
        self.fqn = site.name
        self.shape = shape
        self.placement = placement
        self.mesh = mesh
        self.placements = placements
        self.tp = tp
        self.unsharded = None
        self.buf = None
        self.accumulated_grad = None
        self.orig = None

    @property
    def global_shape(self) -> torch.Size:
        """The parameter's shape as the user sees it (a tp parameter's global shape)."""
        return self.shape if self.tp is None else self.tp.shape

    def make_sharded(self, local: Tensor, requires_grad: bool) -> None:
        """Wrap ``local`` (a view into the region) as the sharded ``DTensor`` parameter."""
        self.sharded = nn.Parameter(self.to_dtensor(local), requires_grad=requires_grad)

    def to_dtensor(self, local: Tensor) -> DTensor:
        """A sharded ``DTensor`` of this parameter whose local tensor shares ``local``'s memory
        (the parameter, or its gradient)."""
        shape = self.global_shape
        return wrap_local(local, self.mesh, self.placements, shape, _contiguous_stride(shape))

    def unsharded_leaf(self, buf: Tensor, full: Tensor) -> nn.Parameter:
        """The unsharded leaf with data ``full`` (a view of ``buf``); made when ``buf`` is."""
        self.buf = buf
        if self.tp is not None:
            leaf = nn.Parameter(self.tp.to_dtensor(full))  # its own wrapper: see the note
            self.unsharded = leaf
            return leaf
        plain = self.unsharded
        if plain is None or plain.dtype != full.dtype or plain.device != full.device:
            plain = nn.Parameter(torch.empty(0, dtype=full.dtype, device=full.device))
            self.unsharded = plain
        plain.data = full  # its own version counter: see the note
        return plain

    def local_grad(self, grad: Tensor) -> Tensor:
        """The unsharded gradient as the tensor the dp reduction takes (its tp-local part)."""
        return grad if self.tp is None else self.tp.local_grad(grad)


def local_tensor(p: Tensor) -> Tensor:
    """``p``'s local tensor (the tensor itself, not an autograd view)."""
    with torch.no_grad():
        return p.to_local() if isinstance(p, DTensor) else p


def local_object(p: Tensor) -> Tensor:
    """``p``'s local tensor object itself (``to_local()`` returns another object): where
    methods set on it live ([Note: all-gather extensions] in ``_extensions.py``)."""
    return p._local_tensor if isinstance(p, DTensor) else p


def set_local_tensor(p: DTensor, local: Tensor) -> None:
    """Point ``p``'s local tensor at ``local`` (same shape), keeping the object.

    The optimizer and the user hold the parameter object, so after a module
    move (``to_empty``, ``to``) or ``load_state_dict(assign=True)`` left its
    local tensor outside the region, the region's view is put back into the
    same object. ``DTensor`` has no public setter for this; the attribute is
    the one its own constructor sets.
    """
    p._local_tensor = local


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride: list[int] = []
    running = 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))
