"""All-gather extensions: a parameter whose tensor decides what its all-gather sends.

[Note: all-gather extensions]
torch's FSDP2 contract lets a parameter's tensor (a subclass such as torchao's
float8 weight or ``NF4Tensor``, or any tensor given the two methods) replace
what ``fully_shard`` gathers for it:

- ``fsdp_pre_all_gather(mesh)`` or ``fsdp_pre_all_gather(mesh, outer_size,
  outer_stride, module, mp_policy)`` (both signatures, told apart by their
  number of parameters) is called on the sharded parameter's *local* tensor
  before each gather and returns ``(all_gather_inputs, metadata)``: one or more
  tensors, each of its own dtype and shape (float8 data, a scale), that every
  rank sends instead of its chunk. ``mesh`` is the 1-D mesh the parameter is
  sharded over (the shard dim of an HSDP mesh); ``outer_size`` and
  ``outer_stride`` the full parameter's. A parameter cut unevenly must give
  inputs of the padded chunk's shape on every rank, so all ranks send as much.
- ``fsdp_post_all_gather(outputs, metadata, param_dtype)`` is called after the
  first gather with one output per input (every rank's input concatenated
  along dim 0) and returns ``(unsharded, tensors_to_free)``: the tensor the
  module computes with, and the tensors whose memory is freed between uses.
  Later gathers write into the same output tensors (their storage freed after
  each use and allocated again, so views of them survive, as for plain
  parameters) and call ``fsdp_post_all_gather(..., out=unsharded)`` to refresh
  the unsharded tensor in place.

The methods are looked up on the local tensor at every gather (``hasattr``, as
torch does), so methods set on a local tensor object after ``fully_shard``
(after ``to_empty`` too) take effect at the next gather. The group's gather
carries the inputs' bytes: every input of every extension parameter of a part
packed into one buffer, in the inputs' dtype when they share one and as bytes
(``uint8``) when they do not, so a float8 weight costs one byte per element.

A part of extension parameters keeps no region: each parameter keeps its own
local tensor (its subclass, padded to the chunk's rows like torch's, so a
method set on it stays) and the part's storage serves only the gradient
reduction, which is a plain one: gradients are plain tensors of the compute
dtype, reduced like every other part's. A parameter of a tensor subclass
without the methods is gathered as its own values (the subclass copied into
the plain buffer) and computes as a plain tensor, as in torch's.
"""

from __future__ import annotations

import inspect
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from flatparam import ChunkLayout
from fsdp._fully_shard._mesh import MeshInfo, where
from fsdp._fully_shard._param import ShardedParam, local_object, set_local_tensor
from fsdp._runtime._agreement import check_agree
from fsdp._runtime._collectives import PendingCollective, all_gather_into
from fsdp._runtime._sharded_storage import alloc_storage, free_storage

__all__ = ["ExtensionGather", "has_extension", "is_extension_param"]

PRE = "fsdp_pre_all_gather"
POST = "fsdp_post_all_gather"


def has_extension(t: Tensor) -> bool:
    """Whether ``t`` defines the all-gather extension (both methods; one alone is refused)."""
    pre, post = hasattr(t, PRE), hasattr(t, POST)
    if pre != post:
        raise AssertionError(
            f"Both {PRE} and {POST} should be defined if using all-gather extensions: "
            f"{type(t).__name__} of shape {tuple(t.shape)} has only "
            f"{PRE if pre else POST} ({where()}); define the other one too (or neither)"
        )
    return pre


def is_extension_param(p: Tensor) -> bool:
    """Whether ``fully_shard`` keeps ``p`` out of a region: a tensor with the extension
    methods, or of a tensor subclass (whose methods may come later, on its local tensor)."""
    if isinstance(p, DTensor):
        return False
    # nn.Parameter(subclass instance) keeps the subclass's type; a Parameter subclass of
    # its own holds plain data.
    kind = type(p)
    return has_extension(p) or not (kind is torch.Tensor or issubclass(kind, nn.Parameter))


@dataclass
class _Gathered:
    """One extension parameter's tensors between its gathers (see the note)."""

    padded: Tensor  # the local tensor with its padding rows; the DTensor's local narrows it
    local: Tensor  # the DTensor's local tensor as this part last set or adopted it
    outputs: list[Tensor] = field(default_factory=list)  # 1-D all-gather outputs, kept
    to_free: tuple[Tensor, ...] = ()  # what fsdp_post_all_gather asked to free between uses
    metadata: Any = None  # fsdp_pre_all_gather's, for the post call of the same gather
    sizes: list[torch.Size] = field(default_factory=list)  # the inputs' shapes (ND)
    dtypes: list[torch.dtype] = field(default_factory=list)  # the inputs' dtypes
    uses_hooks: bool = False  # the gather in flight went through the methods


class ExtensionGather:
    """The gather of one part of extension parameters; see [Note: all-gather extensions].

    ``params`` are the part's parameters in its layout's order; ``compute_dtype``
    is the ``param_dtype`` the post-all-gather method receives.
    """

    params: list[ShardedParam]
    layout: ChunkLayout
    mesh: MeshInfo
    device: torch.device
    compute_dtype: torch.dtype
    mp_policy: Any  # the group's MixedPrecisionPolicy, passed to the 5-argument method
    offload: bool  # local tensors live on the host (CPU offload)
    _state: list[_Gathered]
    _shard_mesh: DeviceMesh  # the 1-D mesh the parameters are cut over
    _pending: PendingCollective | None
    _buffer: Tensor | None  # the gather's output while in flight
    _splits: list[int]  # elements of ``_buffer``'s dtype each input takes, per rank
    _agreed: bool  # the ranks' inputs were checked to match (see start_gather)

    def __init__(
        self,
        params: list[ShardedParam],
        layout: ChunkLayout,
        mesh: MeshInfo,
        *,
        device: torch.device,
        mp_policy: Any,
        offload: bool,
    ) -> None:
        self.params = params
        self.layout = layout
        self.mesh = mesh
        self.device = device
        self.mp_policy = mp_policy
        self.offload = offload
        self.compute_dtype = torch.float32
        self._state = []
        m = mesh.mesh
        names = m.mesh_dim_names
        self._shard_mesh = m if m.ndim == 1 or names is None else m[names[-1]]
        self._pending = None
        self._buffer = None
        self._splits = []
        self._agreed = False

    # --- the local tensors ------------------------------------------------------------------

    def build(self, tensors: Sequence[Tensor], rank: int, device: torch.device) -> list[Tensor]:
        """Cut ``tensors`` (full parameters) into this rank's padded chunks on ``device``;
        returns the local tensors (the chunks without padding) to wrap as ``DTensor`` s."""
        self._state = []
        locals_: list[Tensor] = []
        for i, t in enumerate(tensors):
            if self.layout.dims[i] != 0:
                raise NotImplementedError(
                    f"{self.params[i].fqn}: a parameter with all-gather extensions "
                    f"({type(t).__name__}) is cut along dim 0 only by this implementation; "
                    "return None (dim 0) from shard_placement_fn for it"
                )
            padded = t.new_zeros(self.layout.padded_local_shape(i), device=device)
            start, end = self.layout.rows(i, rank)
            if not t.is_meta and end > start:
                # torch.chunk, not narrow: a subclass may cut only at its chunk boundaries
                # (torchao's NF4Tensor), and these are torch.chunk's, as in torch's.
                chunk = torch.chunk(t.detach(), self.layout.world_size, dim=0)[rank]
                with torch.no_grad():
                    padded.narrow(0, 0, end - start).copy_(chunk)
            local = padded.narrow(0, 0, end - start)
            self._state.append(_Gathered(padded, local))
            locals_.append(local)
        return locals_

    def sync(self, current: Sequence[nn.Parameter], rank: int) -> None:
        """Take back local tensors replaced from outside (``to_empty``, ``to``,
        ``load_state_dict(assign=True)``): a local tensor of the padded shape becomes
        the padded tensor itself (so a method set on it stays), a shorter one is padded
        into a new tensor (as torch's does)."""
        for i, (param, st) in enumerate(zip(current, self._state, strict=True)):
            local = local_object(param)
            if local is st.local or local is st.padded or local.is_meta:
                continue
            start, end = self.layout.rows(i, rank)
            shape = self.layout.padded_local_shape(i)
            if tuple(local.shape) == shape:
                st.padded = st.local = local
                continue
            padded = local.new_zeros(shape)
            with torch.no_grad():
                padded.narrow(0, 0, end - start).copy_(local)
            st.padded, st.local = padded, padded.narrow(0, 0, end - start)
            set_local_tensor(param, st.local)  # type: ignore[arg-type]
        for st in self._state:  # dtype or device may have changed: made again
            st.outputs, st.to_free = [], ()
        for p in self.params:
            p.unsharded = None

    def adopt(self, locals_: Sequence[Tensor], padded: Sequence[Tensor]) -> None:
        """Take local tensors as they are, each a prefix of its ``padded`` chunk."""
        for i, p in enumerate(self.params):
            if self.layout.dims[i] != 0:
                raise NotImplementedError(
                    f"{p.fqn}: a parameter with all-gather extensions is cut along dim 0 "
                    "only by this implementation; return None (dim 0) from "
                    "shard_placement_fn for it"
                )
        self._state = [_Gathered(pad, local) for local, pad in zip(locals_, padded, strict=True)]
        self._agreed = False

    def drop(self, indices: Collection[int], layout: ChunkLayout) -> None:
        """Forget the parameters at ``indices`` (released to another group); ``layout`` is
        the rest's."""
        self._state = [st for i, st in enumerate(self._state) if i not in indices]
        self.layout = layout
        self._agreed = False

    # --- gather -----------------------------------------------------------------------------

    def start_gather(self) -> None:
        """Ask every parameter for its all-gather inputs and issue one gather of them all.

        The first gather checks first that every rank's inputs have the same shapes and
        dtypes (a method that pads on some ranks only would otherwise leave the others
        waiting in a gather of another size): one agreement step, after which each rank
        raises, the same error everywhere when they differ.
        """
        per_param: list[list[Tensor]] = []
        refused: dict[str, str] = {}
        for i, p in enumerate(self.params):
            try:
                per_param.append(self._inputs(i, p))
            except AssertionError as e:
                if self._agreed:
                    raise
                refused[p.fqn] = str(e)
                per_param.append([])
        if not self._agreed:
            self._agree(per_param, refused)
            if refused:
                raise AssertionError(next(iter(refused.values())))
            self._agreed = True
        for st in self._state:
            self._check_same_as_before(st)
        inputs = [t for ts in per_param for t in ts]
        dtypes = {t.dtype for t in inputs}
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.uint8
        flat = [_flat(t, dtype) for t in inputs]
        self._splits = [t.numel() for t in flat]
        total = sum(self._splits)
        ws, rank = self.mesh.shard_size, self.mesh.shard_rank
        buffer = torch.empty(total * ws, dtype=dtype, device=self.device)
        mine = buffer.narrow(0, rank * total, total)
        if flat:
            with torch.no_grad():
                torch.cat(flat, out=mine)
        self._buffer = buffer
        if dtype.itemsize == 1 and dtype not in (torch.uint8, torch.int8):
            # float8 goes as its bytes: the same data, and gloo has no float8 collectives.
            buffer, mine = buffer.view(torch.uint8), mine.view(torch.uint8)
        self._pending = all_gather_into(buffer, mine, self.mesh.shard_group)

    def _agree(self, per_param: list[list[Tensor]], refused: dict[str, str]) -> None:
        fingerprint = {
            # A refusal's text names this rank; the same refusal on every rank must agree.
            f"all-gather inputs of {p.fqn}": refused.get(p.fqn, "").replace(where(), "that rank")
            or str([(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in ts])
            for p, ts in zip(self.params, per_param, strict=True)
        }
        check_agree(
            "fully_shard all-gather extension",
            fingerprint,
            [self.mesh.shard_group],
            device=self.device,
            where="fully_shard (the first all-gather of parameters with all-gather extensions)",
            fixes={},
            default_fix="Return inputs of the same shapes and dtypes on every rank from "
            "fsdp_pre_all_gather (an unevenly sharded parameter's padded to the chunk's rows).",
        )

    def _check_same_as_before(self, st: _Gathered) -> None:
        if not st.outputs:
            return
        ws = self.mesh.shard_size
        wanted = [(ws * s.numel(), d) for s, d in zip(st.sizes, st.dtypes, strict=True)]
        if [(o.numel(), o.dtype) for o in st.outputs] != wanted:
            raise AssertionError(
                f"fsdp_pre_all_gather returned inputs of other sizes or dtypes than at the "
                f"first gather ({[(o.numel() // ws, o.dtype) for o in st.outputs]} per rank "
                f"then, {[(n // ws, d) for n, d in wanted]} now): the gathered outputs are "
                f"kept and reused, so return the same shapes and dtypes every time ({where()})"
            )

    def _inputs(self, i: int, p: ShardedParam) -> list[Tensor]:
        st = self._state[i]
        local = local_object(p.sharded)
        if self.offload:
            local = local.to(self.device, non_blocking=True)
        st.uses_hooks = has_extension(local)
        if not st.uses_hooks:
            padded = st.padded.to(self.device) if self.offload else st.padded
            st.sizes, st.dtypes = [padded.shape], [self.compute_dtype]
            return [padded.to(self.compute_dtype)]
        pre = getattr(local, PRE)
        n_args = len(inspect.signature(pre).parameters)
        if n_args == 1:
            inputs, st.metadata = pre(self._shard_mesh)
        elif n_args == 5:
            shape = p.global_shape
            inputs, st.metadata = pre(
                self._shard_mesh, shape, _contiguous_stride(shape), p.site.module, self.mp_policy
            )
        else:
            raise AssertionError(
                f"Invalid fsdp_pre_all_gather: {inspect.signature(pre)}\n"
                "Expects fsdp_pre_all_gather(self, mesh: DeviceMesh, outer_size: torch.Size, "
                "outer_stride: tuple[int, ...], module: nn.Module, mp_policy: "
                f"MixedPrecisionPolicy) (or the older (self, mesh)); {p.fqn}'s "
                f"{type(local).__name__} takes {n_args} arguments after self ({where()})"
            )
        if isinstance(inputs, Tensor):
            inputs = (inputs,)
        inputs = list(inputs)
        padded_shape = torch.Size(self.layout.padded_local_shape(i))
        uneven = p.shape[0] % self.layout.world_size != 0
        if uneven and any(t.shape != padded_shape for t in inputs):
            raise AssertionError(
                "When a parameter is unevenly sharded by FSDP "
                f"(orig size={tuple(p.shape)}, FSDP world size={self.layout.world_size}), "
                "fsdp_pre_all_gather must return all-gather inputs with the padded sharded "
                f"size {tuple(padded_shape)} but got {[tuple(t.shape) for t in inputs]} "
                f"({p.fqn}, rank {self.mesh.shard_rank}); pad the inputs to that size in "
                "fsdp_pre_all_gather (every rank sends as much)"
            )
        st.sizes = [t.shape for t in inputs]
        st.dtypes = [t.dtype for t in inputs]
        return inputs

    def finish_gather(self) -> None:
        """Wait, copy each input's gathered rows into its output and make each parameter's
        unsharded leaf (post-all-gather method: first time built, later refreshed)."""
        pending, buffer = self._pending, self._buffer
        assert pending is not None and buffer is not None
        pending.wait()
        self._pending = self._buffer = None
        ws = self.mesh.shard_size
        rows = buffer.view(ws, -1)
        outs: list[Tensor] = []
        for st in self._state:
            if not st.outputs:
                st.outputs = [
                    torch.empty(ws * s.numel(), dtype=dtype, device=self.device)
                    for s, dtype in zip(st.sizes, st.dtypes, strict=True)
                ]
            for out in st.outputs:
                alloc_storage(out, out.numel())
                view = out.view(ws, -1)
                outs.append(view if view.dtype == buffer.dtype else view.view(buffer.dtype))
        if outs:
            # Written in place under the leaves autograd may have saved: keep their versions.
            with torch.no_grad(), _unsafe_preserve_version_counter(tuple(outs)):
                torch.split_with_sizes_copy(rows, self._splits, dim=1, out=outs)
        for p, st in zip(self.params, self._state, strict=True):
            self._make_unsharded(p, st)

    def _make_unsharded(self, p: ShardedParam, st: _Gathered) -> None:
        outputs = tuple(o.view(-1, *s[1:]) for o, s in zip(st.outputs, st.sizes, strict=True))
        local = local_object(p.sharded)
        if p.unsharded is not None:
            if st.uses_hooks:
                for t in st.to_free:
                    alloc_storage(t, t.numel())
                getattr(local, POST)(outputs, st.metadata, self.compute_dtype, out=p.unsharded)
            st.metadata = None
            return
        if st.uses_hooks:
            unsharded, to_free = getattr(local, POST)(outputs, st.metadata, self.compute_dtype)
            st.to_free = tuple(to_free)
        else:
            unsharded = outputs[0]
        st.metadata = None
        shape = p.global_shape
        with torch.no_grad():
            full = torch.as_strided(unsharded, shape, _contiguous_stride(shape), 0)
        p.unsharded = nn.Parameter(full, requires_grad=p.sharded.requires_grad)

    def free(self) -> None:
        """Free every output and every tensor the post-all-gather method named."""
        for st in self._state:
            for t in (*st.outputs, *st.to_free):
                free_storage(t)

    def nbytes(self) -> int:
        """Bytes of gathered and unsharded storage held now."""
        seen: set[int] = set()
        total = 0
        for st in self._state:
            for t in (*st.outputs, *st.to_free):
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen and storage.nbytes():
                    seen.add(storage.data_ptr())
                    total += int(storage.nbytes())
        if self._buffer is not None:
            total += int(self._buffer.untyped_storage().nbytes())
        return total


def _flat(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` as a 1-D tensor of ``dtype`` (its bytes when ``dtype`` is uint8 and it is not)."""
    flat = t.reshape(-1)
    return flat if flat.dtype == dtype else flat.view(dtype)


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride: list[int] = []
    running = 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))
