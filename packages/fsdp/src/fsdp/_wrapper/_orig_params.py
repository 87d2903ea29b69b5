"""The original parameters under ``use_orig_params=True``: views into the flat parameter.

With ``use_orig_params=False`` the optimizer steps each unit's FlatParameter
and the original ``nn.Parameter`` objects are gone. With ``True`` the
original objects stay registered on their modules (same identity, same
names, same ``requires_grad``) and :class:`OrigParams` keeps their data and
gradients pointing into the unit's flat tensors, so an optimizer built on
them (with per-parameter groups) updates the shard FSDP gathers from.

[Note: original parameter views]
For a sharded unit, parameter ``i`` owns the piece
``flat_param[a_i : b_i]`` of this rank's chunk (``flatparam.ShardLayout.pieces``;
``a_i == b_i`` when the chunk holds none of it), and::

    p_i.data == flat_param.detach()[a_i : b_i]               # 1D, b_i - a_i elements
    p_i.grad == flat_param.grad[a_i : b_i]                    # after backward; None if empty/frozen

For an unsharded unit (``NO_SHARD``, one rank) the whole parameter is local
and both keep the original shape: ``flat[off_i : off_i + numel_i].view(shape_i)``.

``flat_param``'s storage never changes after construction (see [Note:
storage forms] in ``_flat_param_unit.py``), so the data views are made once;
an in-place optimizer update through ``p_i`` is an update of the shard.
Forward and backward never read ``p_i``: the modules see views of the
gathered compute parameter, put in the module's ``__dict__``, which Python
attribute lookup consults before ``nn.Module.__getattr__`` reaches
``_parameters``; dropping the ``__dict__`` entry when the unit reshards makes
``module.weight`` the original (sharded) parameter again.

Gradients are views of ``flat_param.grad``, remade when that tensor is
replaced. Between steps the user owns them: ``optimizer.zero_grad()`` sets them
to ``None`` (or zeroes them in place), a user may assign new ones. Before the
flat gradient is read or accumulated into again, :meth:`OrigParams.sync_grads`
makes it agree with them: all ``None`` drops ``flat_param.grad`` (no stale
gradient survives ``zero_grad``), some ``None`` zeroes those pieces, a
foreign tensor is copied in. In the same way :meth:`OrigParams.sync_data`
copies back a parameter whose ``.data`` was replaced by a new tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from flatparam import ParamInfo, ShardLayout, SharedParamInfo

__all__ = ["OrigParams"]


class OrigParams:
    """The original parameters of one unit and their views into its flat tensors.

    See [Note: original parameter views].
    """

    params: list[nn.Parameter]  # in flat order, one per ParamInfo
    infos: list[ParamInfo]  # where each lives (module, name)
    _bounds: list[tuple[int, int]]  # [a_i, b_i) of p_i's piece in flat_param (local data)
    _shapes: list[torch.Size]  # shape of p_i's local view: (b_i - a_i,) or the original
    _local: list[int]  # indices of the parameters with a non-empty local piece
    _trainable: list[int]  # indices in _local whose parameter requires grad
    _data_ptrs: list[int]  # expected data_ptr of p_i for i in _local
    _grad_views: list[Tensor | None]  # what this class last assigned to p_i.grad
    _grad_source: Tensor | None  # the flat gradient _grad_views were made from

    def __init__(
        self,
        flat_param: nn.Parameter,
        params: Sequence[nn.Parameter],
        infos: Sequence[ParamInfo],
        *,
        layout: ShardLayout,
        rank: int,
        sharded: bool,
    ) -> None:
        self.params = list(params)
        self.infos = list(infos)
        self._flat = flat_param
        n = len(self.params)
        self._bounds = [(0, 0)] * n
        self._shapes = [torch.Size([0])] * n
        if sharded:
            for piece in layout.pieces(rank):
                i = piece.param_index
                self._bounds[i] = (piece.shard_offset, piece.shard_offset + piece.numel)
                self._shapes[i] = torch.Size([piece.numel])
        else:
            for i, p in enumerate(self.params):
                self._bounds[i] = layout.param_bounds(i)
                self._shapes[i] = p.shape
        self._local = [i for i in range(n) if self._bounds[i][1] > self._bounds[i][0]]
        self._trainable = [i for i in self._local if self.params[i].requires_grad]
        self._data_ptrs = []
        self._grad_views = [None] * n
        self._grad_source = None
        self.use_local_data()
        for p in self.params:
            p.grad = None

    # --- data ---------------------------------------------------------------------------------

    def _local_view(self, flat: Tensor, i: int) -> Tensor:
        a, b = self._bounds[i]
        return flat[a:b].view(self._shapes[i])

    def use_local_data(self) -> None:
        """Point every parameter's ``.data`` at its piece of ``flat_param`` (empty if none)."""
        flat = self._flat.detach()
        empty = flat.new_empty(0)
        for i, p in enumerate(self.params):
            a, b = self._bounds[i]
            p.data = self._local_view(flat, i) if b > a else empty
        self._data_ptrs = [self.params[i].data_ptr() for i in self._local]

    def use_full_data(self, full: Tensor) -> None:
        """Point every parameter's ``.data`` at its full-shaped view of ``full`` (1D, full_numel).

        For ``summon_full_params``; :meth:`use_local_data` undoes it.
        """
        offset = 0
        for p, shape in zip(self.params, self._full_shapes(), strict=True):
            numel = shape.numel()
            p.data = full[offset : offset + numel].view(shape)
            offset += numel

    def _full_shapes(self) -> list[torch.Size]:
        flat = self._flat
        shapes: list[torch.Size] = flat._param_shapes  # type: ignore[attr-defined]
        return shapes

    def sync_data(self) -> None:
        """Copy back into ``flat_param`` any parameter whose ``.data`` was replaced.

        An in-place update lands in the shard by itself; ``p.data = new``
        (a new tensor of the same local shape) does not, so it is copied in
        and the view restored. A parameter object replaced on its module
        cannot be followed and is an error.
        """
        for i, info in enumerate(self.infos):
            registered = info.module._parameters.get(info.param_name)
            if registered is not self.params[i]:
                name = f"{info.module_name}.{info.param_name}".lstrip(".")
                raise RuntimeError(
                    f"parameter {name!r} was replaced on its module after FSDP wrapped it "
                    "(use_orig_params=True keeps the original Parameter objects and their "
                    "storage). Change its values in place instead, e.g. with torch.no_grad(): "
                    "module.weight.copy_(new), or inside summon_full_params()"
                )
        flat = self._flat.detach()
        for k, i in enumerate(self._local):
            p = self.params[i]
            if p.data_ptr() == self._data_ptrs[k]:
                continue
            if p.shape != self._shapes[i]:
                raise RuntimeError(
                    f"parameter {self._name(i)!r} was given data of shape {tuple(p.shape)}, "
                    f"but under use_orig_params=True it holds this rank's piece of shape "
                    f"{tuple(self._shapes[i])}; change full parameters inside "
                    "summon_full_params() instead"
                )
            with torch.no_grad():
                view = self._local_view(flat, i)
                view.copy_(p.detach().reshape(view.shape))
            p.data = view
            self._data_ptrs[k] = p.data_ptr()

    def _name(self, i: int) -> str:
        info = self.infos[i]
        return f"{info.module_name}.{info.param_name}" if info.module_name else info.param_name

    # --- registration ---------------------------------------------------------------------

    def deregister(self, shared: Sequence[SharedParamInfo]) -> None:
        """Take the original parameters off their modules (``shared``: their aliases too).

        For code written against the FlatParameter (the ckpt package's
        state-dict types): between this and :meth:`register` the unit looks as
        under ``use_orig_params=False``. Their data stays a view of the shard.
        """
        for info in self.infos:
            info.module._parameters.pop(info.param_name, None)
        for s in shared:
            s.module._parameters.pop(s.param_name, None)

    def register(self, shared: Sequence[SharedParamInfo]) -> None:
        """Undo :meth:`deregister`."""
        for info, p in zip(self.infos, self.params, strict=True):
            info.module._parameters[info.param_name] = p
        by_module = {
            (id(i.module), i.param_name): p for i, p in zip(self.infos, self.params, strict=True)
        }
        for s in shared:
            s.module._parameters[s.param_name] = by_module[(id(s.prim_module), s.prim_param_name)]

    # --- gradients ----------------------------------------------------------------------------

    def sync_grads(self) -> None:
        """Make ``flat_param.grad`` agree with the parameters' ``.grad`` (user changes).

        Cheap when nothing changed (one identity check per parameter). See
        [Note: original parameter views] for what each change means.
        """
        views = self._grad_views
        params = self.params
        changed = [i for i in self._trainable if params[i].grad is not views[i]]
        if not changed:
            return
        flat = self._flat
        if all(params[i].grad is None for i in self._trainable):
            flat.grad = None
            self._grad_views = [None] * len(params)
            self._grad_source = None
            return
        with torch.no_grad():
            flat_grad = flat.grad
            if flat_grad is None:
                flat_grad = torch.zeros_like(flat)
                flat.grad = flat_grad
                self._grad_source = flat_grad
            for i in changed:
                g = params[i].grad
                view = self._local_view(flat_grad, i)
                if g is None:
                    view.zero_()  # a None gradient contributes nothing; it stays None
                    views[i] = None
                    continue
                if g.shape != view.shape:
                    raise RuntimeError(
                        f"the gradient of parameter {self._name(i)!r} has shape "
                        f"{tuple(g.shape)}, but under use_orig_params=True it must match the "
                        f"parameter's local piece {tuple(view.shape)}"
                    )
                view.copy_(g)
                self._assign_grad(i, view)

    def _assign_grad(self, i: int, view: Tensor) -> None:
        p = self.params[i]
        if view.dtype == p.dtype:
            p.grad = view
        else:  # keep_low_precision_grads: .grad may differ in dtype only via .data
            if p.grad is None or p.grad.shape != p.shape:
                p.grad = torch.empty_like(p)
            assert p.grad is not None
            p.grad.data = view
        self._grad_views[i] = p.grad

    def use_local_grads(self) -> None:
        """Point the trainable parameters' ``.grad`` at their pieces of ``flat_param.grad``.

        Called after each backward: ``None`` for frozen parameters, for those
        with no local piece, and for all of them when ``flat_param.grad`` is
        ``None``. A no-op when every view already points at the current flat
        gradient.
        """
        flat_grad = self._flat.grad
        params = self.params
        views = self._grad_views
        if flat_grad is not None and flat_grad is self._grad_source:
            missing = [i for i in self._trainable if views[i] is None]
            for i in missing:
                self._assign_grad(i, self._local_view(flat_grad, i))
            return
        for i in range(len(params)):
            views[i] = None
        if flat_grad is not None:
            for i in self._trainable:
                self._assign_grad(i, self._local_view(flat_grad, i))
        for i, p in enumerate(params):
            if views[i] is None and p.grad is not None:
                p.grad = None
        self._grad_source = flat_grad

    def use_full_grads(self, full_grad: Tensor | None) -> None:
        """Full-shaped gradient views of ``full_grad`` (summon with ``with_grads``)."""
        offset = 0
        for i, (p, shape) in enumerate(zip(self.params, self._full_shapes(), strict=True)):
            numel = shape.numel()
            if full_grad is None or not p.requires_grad:
                p.grad = None
            else:
                view = full_grad[offset : offset + numel].view(shape)
                if view.dtype == p.dtype:
                    p.grad = view
                else:
                    p.grad = torch.empty_like(p)
                    p.grad.data = view
            self._grad_views[i] = p.grad
            offset += numel
        self._grad_source = None  # the next use_local_grads remakes the local views
