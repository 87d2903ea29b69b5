"""One ``fully_shard`` call's parameters: gathered together, reduced together.

A :class:`ParamGroup` holds the parameters of the modules one ``fully_shard``
call manages, split into :class:`GroupPart` s by dtype and ``requires_grad``:
each part is one :class:`~flatparam.ChunkLayout` and one
:class:`~fsdp._runtime._sharded_storage.ShardedStorage`, so each part is one
all-gather and (if trainable) one reduce-scatter. Usually there is one part;
frozen parameters get a part of their own so they cost no gradient bytes and
take no part in the reduction, and parameters of another dtype (a bf16 buffer
promoted to a parameter, an int8 table) one each, where torch's FSDP2 packs
them into one all-gather of bytes. Parameters with all-gather extensions (or
of a tensor subclass) form parts of their own, whose gather is the
extension's ([Note: all-gather extensions] in ``_extensions.py``).

[Note: group states]
The group's parameters are in one :class:`GroupState` at a time, and the group
moves them between states with :meth:`ParamGroup.unshard`,
:meth:`ParamGroup.wait_for_unshard` and :meth:`ParamGroup.reshard`; the hooks
in ``_state.py`` decide when. A gather issued ahead of the module's forward
(or by ``FSDPModule.unshard(async_op=True)``) leaves the group UNSHARDING
until its pre-forward waits for it.

[Note: stale gathers]
A gathered copy is only as new as the sharded data it was gathered from. Two
knobs keep a gather past an optimizer step: ``set_reshard_after_backward(False)``
(with ``reshard_after_forward=False`` or on the root) keeps the unsharded
parameters into the next forward, and an ``unshard()`` by hand may come before
``optimizer.step()``. torch's FSDP2 then computes the next forward with the
old values, silently. Each part remembers the sum of the version counters of its
sharded region, its sharded ``DTensor`` parameters and their local tensors (an
in-place update through any of them moves one; counters only grow) when its
gather was issued; :meth:`ParamGroup.is_stale` compares, and the pre-forward
gathers again instead of using stale values.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Sequence
from enum import Enum, auto
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from flatparam import ChunkLayout
from fsdp._fully_shard._extensions import ExtensionGather, has_extension, is_extension_param
from fsdp._fully_shard._mesh import MeshInfo, post_forward_info
from fsdp._fully_shard._param import (
    ShardedParam,
    local_object,
    local_tensor,
    set_local_tensor,
)
from fsdp._fully_shard._policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from fsdp._runtime._collectives import gradient_divide_factors
from fsdp._runtime._device import pins_host_memory
from fsdp._runtime._quantize import QuantizedCommPolicy
from fsdp._runtime._sharded_storage import (
    PendingReduce,
    ShardedStorage,
    alloc_storage,
    free_storage,
)

__all__ = ["OWNER", "GroupPart", "GroupState", "ParamGroup"]

OWNER = "_fsdp_fully_shard_owner"
"""On an original parameter a group sharded: a weak reference to that group."""


class GroupState(Enum):
    """Which form a group's parameters are in; see [Note: group states]."""

    SHARDED = auto()
    """The modules hold the sharded ``DTensor`` parameters; nothing gathered exists."""
    UNSHARDING = auto()
    """An all-gather is issued and not yet waited for; the modules still hold the
    sharded parameters."""
    UNSHARDED = auto()
    """The modules hold the unsharded leaves, filled from the gathered data."""
    SHARDED_POST_FORWARD = auto()
    """``reshard_after_forward=n``: the modules hold the sharded parameters and each
    part keeps a copy of its chunk over ``n`` ranks, gathered from there in backward."""


class GroupPart:
    """Parameters of one dtype and one ``requires_grad`` within a group: one layout,
    one storage (see the module docstring)."""

    group: ParamGroup
    params: list[ShardedParam]
    trainable: bool
    mesh: MeshInfo  # the groups this part is cut over: the group's, or its parameters' own
    orig_dtype: torch.dtype
    compute_dtype: torch.dtype  # of the gathered and unsharded parameters
    reduce_dtype: torch.dtype  # of the gradient reduction
    layout: ChunkLayout  # over the shard group
    storage: ShardedStorage  # shard = this rank's region
    # reshard_after_forward=n: the layout over n ranks and its storage, whose shard is a copy
    # of this rank's chunk over those n ranks between forward and backward.
    post_layout: ChunkLayout | None
    post_storage: ShardedStorage | None
    # Reduce-scattered gradients not yet all-reduced across replicas (set_requires_all_reduce).
    partial: Tensor | None
    gathered_version: int  # data_version() when its last gather was issued
    # A part of extension parameters: its gather ([Note: all-gather extensions]); the
    # storage then only reduces gradients, and its shard is an empty placeholder.
    extension: ExtensionGather | None
    # This rank's views of the region ``sync`` last compared with: (region, its data
    # pointer, the views); see ``sync``.
    _synced_views: tuple[Tensor, int, list[Tensor]] | None

    def __init__(
        self,
        group: ParamGroup,
        params: list[ShardedParam],
        trainable: bool,
        *,
        extension: bool = False,
    ) -> None:
        self.group = group
        self.params = params
        self.trainable = trainable
        self.mesh = params[0].info if params else group.mesh
        self.partial = None
        self.post_layout = None
        self.post_storage = None
        self.gathered_version = -1
        self.extension = None
        self._synced_views = None
        if extension:
            self.extension = ExtensionGather(
                params,
                ChunkLayout.build([], self.mesh.shard_size),
                self.mesh,
                device=group.device,
                mp_policy=group.mp,
                offload=group.offload_to_cpu,
            )

    # --- construction and re-synchronisation ------------------------------------------------

    def drop(self, indices: Collection[int]) -> None:
        """Remove the parameters at ``indices`` (see [Note: tied parameters across fully_shard
        calls], and extensions set on a local tensor later, ``ParamGroup.adopt_extensions``):
        the others move into a new region, each with its own local chunk; the removed ones'
        local tensors stay as they are (views of the old region)."""
        keep = [p for i, p in enumerate(self.params) if i not in indices]
        if not keep:
            self.params = []
            return
        layout = ChunkLayout.build(
            [p.shape for p in keep], self.mesh.shard_size, [p.placement.dim for p in keep]
        )
        if self.extension is not None:
            self.params = self.extension.params = keep
            self.extension.drop(indices, layout)
            self.layout = layout
            self._make_storage(self._placeholder(self.storage.shard))
            return
        old_views = self.layout.local_views(self.storage.shard, self.mesh.shard_rank)
        kept_views = [v for i, v in enumerate(old_views) if i not in indices]
        self.params = keep
        self.layout = layout
        region = self._new_region(self.storage.shard)
        new_views = self.layout.local_views(region, self.mesh.shard_rank)
        with torch.no_grad():
            for p, old, new in zip(keep, kept_views, new_views, strict=True):
                if region.device.type != "meta":
                    new.copy_(old)
                set_local_tensor(cast(DTensor, p.sharded), new)
        self._make_storage(region)

    def build(self, tensors: Sequence[Tensor], requires_grad: Sequence[bool]) -> None:
        """Shard ``tensors`` (the original parameters' data: for a tensor-parallel one its
        local tensor) into a new region and wrap each chunk as the sharded ``DTensor``
        parameter."""
        self.orig_dtype = tensors[0].dtype
        self.layout = ChunkLayout.build(
            [p.shape for p in self.params],
            self.mesh.shard_size,
            [p.placement.dim for p in self.params],
        )
        ext = self.extension
        if ext is not None:
            ext.layout = self.layout
            device = self._region_device(tensors[0])
            locals_ = ext.build(tensors, self.mesh.shard_rank, device)
            self._make_storage(self._placeholder(tensors[0]))
            for p, local, rg in zip(self.params, locals_, requires_grad, strict=True):
                p.make_sharded(local, rg)
                p.site.set(p.sharded)
            return
        region = self._new_region(tensors[0])
        if region.device.type != "meta":
            self.layout.shard([t.detach() for t in tensors], self.mesh.shard_rank, out=region)
        self._make_storage(region)
        views = self.layout.local_views(region, self.mesh.shard_rank)
        for p, view, rg in zip(self.params, views, requires_grad, strict=True):
            p.make_sharded(view, rg)
            p.site.set(p.sharded)

    def adopt(self, locals_: Sequence[Tensor], padded: Sequence[Tensor]) -> None:
        """Take parameters whose local tensors (``locals_``, each a prefix of ``padded``, its
        chunk with the padding rows) stay as they are: an extension part's parameters moved
        out of a region (``ParamGroup.adopt_extensions``)."""
        ext = self.extension
        assert ext is not None
        self.layout = ChunkLayout.build(
            [p.shape for p in self.params],
            self.mesh.shard_size,
            [p.placement.dim for p in self.params],
        )
        ext.layout = self.layout
        ext.adopt(locals_, padded)
        for p in self.params:
            p.unsharded = p.buf = None  # a leaf of the extension's making from now on
        self._make_storage(self._placeholder(padded[0]))

    def padded_local(self, i: int) -> Tensor:
        """Parameter ``i``'s slot in this rank's region, as its padded chunk."""
        layout = self.layout
        slot = self.storage.shard.narrow(0, layout.offset(i), layout.slot_numel(i))
        return slot.view(layout.padded_local_shape(i))

    def _region_device(self, like: Tensor) -> torch.device:
        """Where sharded data lives: the host under CPU offload, else the compute device
        (meta stays meta, for deferred initialisation)."""
        if like.device.type == "meta":
            return like.device
        return torch.device("cpu") if self.group.offload_to_cpu else self.group.device

    def _placeholder(self, like: Tensor) -> Tensor:
        """An extension part's storage shard: the region's dtype, size and device, no memory
        (the storage reads only those; the parameters keep their own local tensors)."""
        shard = torch.empty(self.layout.shard_numel, dtype=like.dtype, device=like.device)
        free_storage(shard)
        return shard

    def _new_region(self, like: Tensor) -> Tensor:
        g = self.group
        device = self._region_device(like)
        region = torch.zeros(self.layout.shard_numel, dtype=like.dtype, device=device)
        if g.pin_memory and device.type == "cpu" and pins_host_memory(g.device):
            region = region.pin_memory()
        return region

    def _make_storage(self, region: Tensor) -> None:
        g = self.group
        self.orig_dtype = region.dtype
        param_dtype = g.mp.param_dtype
        if param_dtype is None or not self.orig_dtype.is_floating_point:
            param_dtype = self.orig_dtype
        self.compute_dtype = param_dtype
        self.reduce_dtype = g.mp.reduce_dtype or param_dtype
        self.storage = self._storage(
            region, self.layout, self.mesh, offload=g.offload_to_cpu, comm_policy=g.comm_policy
        )
        if self.extension is not None:
            self.extension.compute_dtype = self.compute_dtype
        self.make_post_storage()
        self.update_reduction()

    def make_post_storage(self) -> None:
        """The storage of the copy kept between forward and backward under an int
        ``reshard_after_forward`` (none otherwise); its shard is allocated only then."""
        g = self.group
        info = g.post_forward_of(self.mesh)
        if info is None or info is self.mesh or self.extension is not None:
            # An extension part gathers its full shard again in backward (as torch's can).
            self.post_layout = self.post_storage = None
            return
        self.post_layout = ChunkLayout.build(self.layout.shapes, info.shard_size, self.layout.dims)
        post_region = torch.empty(
            self.post_layout.shard_numel, dtype=self.compute_dtype, device=g.device
        )
        free_storage(post_region)
        self.post_storage = self._storage(post_region, self.post_layout, info, offload=False)

    def _storage(
        self,
        region: Tensor,
        layout: ChunkLayout,
        info: MeshInfo,
        *,
        offload: bool,
        comm_policy: QuantizedCommPolicy | None = None,  # the post-forward copy's: exact
    ) -> ShardedStorage:
        g = self.group
        return ShardedStorage(
            region,
            padded_numel=layout.padded_numel,
            sharded=True,
            group=info.shard_group,
            rank=info.shard_rank,
            world_size=info.shard_size,
            compute_device=g.device,
            compute_dtype=self.compute_dtype,
            offload=offload,
            pinned=offload and g.pin_memory and pins_host_memory(g.device),
            replicate_group=info.replicate_group if info.replicate_size > 1 else None,
            replicate_size=info.replicate_size,
            record_streams=False,
            comm_policy=comm_policy,
            # An extension part's gather is the extension's, over ``info``'s (world) group.
            across=info.across if self.extension is None else None,
            # The replica shard follows what the stale gathers follow ([Note: sharding
            # across replicas] in _runtime/_replica_shard.py).
            data_version=self.data_version,
        )

    def update_reduction(self) -> None:
        """Set the storage's division and hook from the group's settings.

        Like torch's FSDP2: fp32 and bf16 gradients are averaged by the
        collective (the whole average after the sum, here: a post-division by
        the data-parallel size, or by ``set_gradient_divide_factor``'s factor),
        fp16 ones split the division around the sum (pre- and post-division)
        against overflow and underflow.
        """
        g = self.group
        size = self.mesh.shard_size * self.mesh.replicate_size
        factor = float(size) if g.gradient_divide_factor is None else g.gradient_divide_factor
        storage = self.storage
        averaged = self.reduce_dtype in (torch.float32, torch.bfloat16)
        if averaged:
            storage.divide = (1.0, factor)
        elif g.gradient_divide_factor is None:
            storage.divide = gradient_divide_factors(size)
        else:
            pre, _ = gradient_divide_factors(int(factor)) if factor.is_integer() else (1.0, 0.0)
            storage.divide = (pre, factor / pre)
        storage.post_reduce_hook = g.all_reduce_hook
        storage.hook_sees_average = averaged

    def sync(self) -> None:
        """Take back parameters something outside replaced; see ``ParamGroup.sync``."""
        current: list[nn.Parameter] = []
        for p in self.params:
            registered: Any = p.site.get()
            if isinstance(registered, DTensor) and registered is not p.sharded:
                # Replaced by _apply or load_state_dict(assign=True): adopt the new object.
                p.sharded = cast(nn.Parameter, registered)
                for module, name in p.site.shared:
                    module._parameters[name] = p.sharded
            current.append(p.sharded)
        if self.extension is not None:
            self.extension.sync(current, self.mesh.shard_rank)
            return
        # A load_state_dict runs this once per module of the group (each module's post
        # hook), so a sync that finds nothing changed must cost little: the local tensor
        # objects (no to_local dispatch), and the region's views kept while the region is
        # the same memory. A group of 100 parameters loaded module by module spent 2.7 ms
        # a sync rebuilding views (1.35 s of a 1.9 s ckpt load of 1,000 tensors).
        locals_ = [local_object(p) for p in current]
        if any(t.is_meta for t in locals_):
            return  # still to be materialised (to_empty); the lazy init checks
        region = self.storage.shard
        kept = self._synced_views
        if kept is None or kept[0] is not region or kept[1] != region.data_ptr():
            kept = (
                region,
                region.data_ptr(),
                self.layout.local_views(region, self.mesh.shard_rank),
            )
            self._synced_views = kept
        views = kept[2]
        same = (
            region.device.type != "meta"
            and all(t.dtype == region.dtype and t.device == region.device for t in locals_)
            and all(_same_memory(t, v) for t, v in zip(locals_, views, strict=True))
        )
        if same:
            return
        new_region = self._new_region(locals_[0])
        new_views = self.layout.local_views(new_region, self.mesh.shard_rank)
        with torch.no_grad():
            for param, t, view in zip(current, locals_, new_views, strict=True):
                view.copy_(t)
                set_local_tensor(cast(DTensor, param), view)
        for p in self.params:
            p.unsharded = None  # dtype or device may have changed: made again at the next gather
            p.buf = None
        self._make_storage(new_region)

    # --- gather -----------------------------------------------------------------------------

    def start_gather(self, post_forward: bool) -> None:
        """Issue this part's all-gather (from the post-forward copy if ``post_forward``)."""
        if not post_forward:
            self.gathered_version = self.data_version()
        if self.extension is not None:
            self.extension.start_gather()
            return
        storage = self.post_storage if post_forward else self.storage
        assert storage is not None
        storage.start_gather()

    def data_version(self) -> int:
        """Moves whenever the sharded data changes in place (see [Note: stale gathers])."""
        version = self.storage.shard._version
        for p in self.params:
            version += p.sharded._version + local_tensor(p.sharded)._version
        return version

    def finish_gather(self, post_forward: bool) -> None:
        """Wait, copy every parameter out of the gathered buffer, free it; register the
        unsharded leaves (see [Note: fully_shard parameter forms])."""
        if self.extension is not None:
            self.extension.finish_gather()
        else:
            self._copy_out(post_forward)
        for p in self.params:
            leaf = p.unsharded
            assert leaf is not None
            if leaf.requires_grad != p.sharded.requires_grad:
                leaf.requires_grad_(p.sharded.requires_grad)
            p.site.set(leaf)

    def _copy_out(self, post_forward: bool) -> None:
        storage = self.post_storage if post_forward else self.storage
        layout = self.post_layout if post_forward else self.layout
        assert storage is not None and layout is not None
        storage.finish_gather()
        outs = [self._alloc_buf(i, p, layout) for i, p in enumerate(self.params)]
        with torch.no_grad():
            layout.unpack_gathered(storage.gathered, outs)
        storage.free_gathered()
        if post_forward:
            free_storage(storage.shard)

    def _alloc_buf(self, i: int, p: ShardedParam, layout: ChunkLayout) -> Tensor:
        """Parameter ``i``'s padded unsharded storage, allocated; a view of the prefix the
        copy-out of ``layout`` fills."""
        need = max(
            layout.world_size * layout.slot_numel(i),
            self.layout.world_size * self.layout.slot_numel(i),
        )
        buf = p.buf
        if buf is None or buf.dtype != self.compute_dtype:
            buf = torch.empty(need, dtype=self.compute_dtype, device=self.group.device)
            p.unsharded_leaf(buf, self.layout.full_view(i, buf))
        else:
            alloc_storage(buf, need)
        return buf.narrow(0, 0, layout.world_size * layout.slot_numel(i))

    def free_unsharded(self) -> None:
        """Free every unsharded leaf's storage (the leaves stay, see the note)."""
        if self.extension is not None:
            self.extension.free()
            return
        for p in self.params:
            if p.buf is not None:
                free_storage(p.buf)

    def keep_post_forward(self) -> None:
        """Copy this rank's chunk over the post-forward ranks out of the unsharded leaves."""
        layout, storage = self.post_layout, self.post_storage
        assert layout is not None and storage is not None
        alloc_storage(storage.shard, layout.shard_numel)
        rank = self.group.post_forward_of(self.mesh).shard_rank  # type: ignore[union-attr]
        fulls = [self.layout.full_view(i, p.buf) for i, p in enumerate(self.params)]  # type: ignore[arg-type]
        layout.shard(fulls, rank, out=storage.shard)

    def unsharded_bytes(self) -> int:
        """Bytes of gathered and unsharded storage this part holds now."""
        if self.extension is not None:
            return self.extension.nbytes()
        total = self.storage.gathered_bytes
        for p in self.params:
            if p.buf is not None:
                total += int(p.buf.untyped_storage().nbytes())
        if self.post_storage is not None:
            total += self.post_storage.gathered_bytes
            total += int(self.post_storage.shard.untyped_storage().nbytes())
        return total

    # --- gradients --------------------------------------------------------------------------

    def collect_grads(self, unused: bool) -> tuple[list[Tensor | None], list[bool]] | None:
        """Take every parameter's unsharded gradient off its leaf; ``None`` if none has one.

        The mask says which parameters get a reduced gradient: those with a
        gradient here (or, with ``set_reduce_scatter_unused_params``, every
        trainable one).
        """
        grads: list[Tensor | None] = []
        mask: list[bool] = []
        for p in self.params:
            grad: Tensor | None = None
            if p.accumulated_grad is not None:
                grad, p.accumulated_grad = p.accumulated_grad, None
            elif p.unsharded is not None and p.unsharded.grad is not None:
                grad = p.local_grad(p.unsharded.grad)
                p.unsharded.grad = None
            grads.append(grad)
            mask.append(grad is not None or (unused and p.sharded.requires_grad))
        if not any(mask):
            return None
        return grads, mask

    def reduce(self, grads: list[Tensor | None], mask: list[bool]) -> PendingReduce:
        """Start the reduction of ``grads`` (one per parameter, None: zeros)."""
        g = self.group
        present = [t for t in grads if t is not None]

        def fill() -> Tensor:
            buf = self.storage.padded_grad(self.reduce_dtype)
            full = [
                t if t is not None else torch.zeros(shape, dtype=buf.dtype, device=buf.device)
                for t, shape in zip(grads, self.layout.shapes, strict=True)
            ]
            with torch.no_grad():
                self.layout.pack_full(full, buf)
            return buf

        # The partial sums wait for the reduction that all-reduces across replicas: one
        # without it (another set_requires_all_reduce(False) backward) adds its own sum
        # to them in accumulate() instead.
        partial = None
        if g.all_reduce_grads:
            partial, self.partial = self.partial, None
        return self.storage.reduce(
            _Reduction(self, mask),
            fill,
            keep_alive=present,
            replicate=g.all_reduce_grads,
            partial=partial,
        )

    def accumulate(self, reduce: PendingReduce, mask: list[bool]) -> None:
        """Finish ``reduce`` and add this rank's chunks into the sharded ``.grad`` s."""
        out, event = self.storage.finish(reduce)
        if not reduce.final:  # reduce-scattered only: kept until the all-reduce
            self.partial = out if self.partial is None else self.partial.add_(out)
            return
        storage = self.storage
        storage.wait_for_host_grad()  # an earlier copy into a gradient added to below
        taken = [p for p, take in zip(self.params, mask, strict=True) if take]
        if event is not None and any(p.sharded.grad is not None for p in taken):
            storage.synchronize(event)  # the CPU reads ``out`` now
            event = None
        views = self.layout.local_views(out, self.mesh.shard_rank)
        for p, view, take in zip(self.params, views, mask, strict=True):
            if not take:
                continue
            grad = p.sharded.grad
            if grad is None:
                p.sharded.grad = p.to_dtensor(view)
            else:
                with torch.no_grad():
                    local_tensor(grad).add_(view)
        storage.defer_host_event(event)  # a fresh host gradient: waited for at the end of backward

    def accumulate_unsynced(self) -> None:
        """After a backward without reduction: keep the gradient for the next one.

        In the reduce dtype when that differs from the compute dtype (fp32
        accumulation under bf16 compute), summed into what earlier unsynced
        backwards left.
        """
        for p in self.params:
            leaf = p.unsharded
            if leaf is None or leaf.grad is None:
                continue
            if p.accumulated_grad is not None:
                p.accumulated_grad += p.local_grad(leaf.grad)
                leaf.grad = None
            elif leaf.grad.dtype != self.reduce_dtype:
                p.accumulated_grad = p.local_grad(leaf.grad).to(self.reduce_dtype)
                leaf.grad = None

    def add_new_grads(self) -> None:
        """A synced backward after unsynced ones: this backward's gradient into the kept one."""
        for p in self.params:
            leaf = p.unsharded
            if p.accumulated_grad is not None and leaf is not None and leaf.grad is not None:
                p.accumulated_grad += p.local_grad(leaf.grad)
                leaf.grad = None


class _Reduction:
    """The owner of one part's reduction in flight (it remembers which gradients to set)."""

    def __init__(self, part: GroupPart, mask: list[bool]) -> None:
        self.part = part
        self.mask = mask

    def start_replica_reduce(self, reduce: PendingReduce) -> None:
        self.part.storage.start_replica_reduce(reduce)

    def finish_reduce_grad(self, reduce: PendingReduce) -> None:
        self.part.accumulate(reduce, self.mask)


class ParamGroup:
    """The parameters of one ``fully_shard`` call; see the module docstring."""

    modules: tuple[nn.Module, ...]
    params: list[ShardedParam]
    parts: list[GroupPart]
    mesh: MeshInfo
    post_forward: MeshInfo | None  # where parameters go after forward; None: kept unsharded
    device: torch.device  # compute device
    mp: MixedPrecisionPolicy
    comm_policy: QuantizedCommPolicy | None  # quantized gathers and reductions, or None
    offload_to_cpu: bool
    pin_memory: bool
    state: GroupState
    fqn: str  # the modules' names under the root, for messages
    # User settings (FSDPModule.set_*)
    reduce_grads: bool
    all_reduce_grads: bool
    reshard_after_backward: bool
    unshard_in_backward: bool
    reduce_scatter_unused_params: bool
    gradient_divide_factor: float | None
    all_reduce_hook: Callable[[Tensor], None] | None
    _gathering_post_forward: bool  # the gather in flight reads the post-forward copy

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        params: list[ShardedParam],
        tensors: list[nn.Parameter],
        *,
        mesh: MeshInfo,
        post_forward: MeshInfo | None,
        device: torch.device,
        mp: MixedPrecisionPolicy,
        offload: OffloadPolicy,
        comm_policy: QuantizedCommPolicy | None = None,
    ) -> None:
        self.modules = modules
        self.comm_policy = comm_policy
        self.params = params
        self.mesh = mesh
        self.post_forward = post_forward
        self.device = device
        self.mp = mp
        self.offload_to_cpu = isinstance(offload, CPUOffloadPolicy)
        self.pin_memory = isinstance(offload, CPUOffloadPolicy) and offload.pin_memory
        self.state = GroupState.SHARDED
        self.fqn = type(modules[0]).__name__
        self.reduce_grads = True
        self.all_reduce_grads = True
        self.reshard_after_backward = True
        self.unshard_in_backward = True
        self.reduce_scatter_unused_params = False
        self.gradient_divide_factor = None
        self.all_reduce_hook = None
        self._gathering_post_forward = False
        self.parts = []
        self._post_forward_by_mesh: dict[int, tuple[MeshInfo, MeshInfo | None]] = {}
        by_key: dict[tuple[torch.dtype, bool, bool, int], list[int]] = {}
        for i, t in enumerate(tensors):
            key = (t.dtype, t.requires_grad, is_extension_param(t), id(params[i].info))
            by_key.setdefault(key, []).append(i)
        for (_, trainable, extension, _), idx in by_key.items():
            part = GroupPart(self, [params[i] for i in idx], trainable, extension=extension)
            data = [local_tensor(tensors[i]) for i in idx]  # a tp parameter: its local piece
            part.build(data, [tensors[i].requires_grad for i in idx])
            self.parts.append(part)
        for p, t in zip(params, tensors, strict=True):
            p.orig = weakref.ref(t)
            t.__dict__[OWNER] = weakref.ref(self)

    def users_of(self, orig: nn.Parameter) -> list[nn.Module]:
        """The modules where this group registered the parameter whose original is ``orig``."""
        for p in self.params:
            if p.orig is not None and p.orig() is orig:
                return [p.site.module, *(m for m, _ in p.site.shared)]
        return []

    def release(self, orig: nn.Parameter) -> None:
        """Give up the parameter whose original tensor is ``orig`` (before any training).

        [Note: tied parameters across fully_shard calls]
        A parameter used by modules of two ``fully_shard`` calls (an embedding
        sharded on its own and tied to the head of the root) belongs to the
        innermost call whose modules contain all its uses, so that it is
        gathered whenever any of them computes and its gradient is summed from
        every use before it is reduced. Calls run bottom-up, so the inner call
        takes it first; when an enclosing call meets the same original tensor
        among its own modules' parameters, the inner group releases it here:
        every site gets the original tensor back (still the initial value:
        nothing has trained yet) and the other parameters of its part move to a
        region without it, each keeping its own rank-local chunk (a chunk does
        not depend on the other parameters of a layout, so no communication is
        needed). The enclosing call then shards it with its own parameters. A
        tie between two sibling calls (two blocks) is released by the second and
        taken by their parent; one that no enclosing call takes is refused at
        the first forward (``_state.py``).
        """
        for part in self.parts:
            for i, p in enumerate(part.params):
                if p.orig is not None and p.orig() is orig:
                    p.site.set(orig)
                    part.drop({i})
                    self.params.remove(p)
                    break
        self.parts = [part for part in self.parts if part.params]
        orig.__dict__.pop(OWNER, None)

    # --- settings ---------------------------------------------------------------------------

    def post_forward_of(self, mesh: MeshInfo) -> MeshInfo | None:
        """Where a part cut over ``mesh`` goes after forward: the group's setting applied to
        that mesh (a part on a parameter's own mesh: [Note: parameters on their own mesh])."""
        post = self.post_forward
        if mesh is self.mesh or post is None:
            return post
        if post is self.mesh:
            return mesh
        known = self._post_forward_by_mesh.get(id(mesh))
        if known is None or known[0] is not mesh:
            known = (mesh, post_forward_info(post.shard_size, mesh))
            self._post_forward_by_mesh[id(mesh)] = known
        return known[1]

    def set_post_forward(self, info: MeshInfo | None) -> None:
        """Change where parameters go after forward (``set_reshard_after_forward``)."""
        if self.state is GroupState.SHARDED_POST_FORWARD:
            self.reshard()
        self.post_forward = info
        self._post_forward_by_mesh.clear()
        for part in self.parts:
            part.make_post_storage()

    def update_reduction(self) -> None:
        """Apply a changed divide factor or all-reduce hook."""
        for part in self.parts:
            part.update_reduction()

    def sync(self) -> None:
        """Take in parameters replaced or moved from outside (``to_empty``, ``to``,
        ``load_state_dict(assign=True)``): their data goes back into the region and
        their local tensors become views of it again, as the all-gather needs."""
        if self.state is not GroupState.SHARDED:
            self.reshard()
        for part in self.parts:
            part.sync()

    # --- SHARDED -> UNSHARDING -> UNSHARDED -> SHARDED (or SHARDED_POST_FORWARD) -----------

    @property
    def is_unsharded(self) -> bool:
        return self.state is GroupState.UNSHARDED

    def is_stale(self) -> bool:
        """Whether a gather issued or held now predates an in-place change of the sharded
        parameters (see [Note: stale gathers])."""
        if self.state is GroupState.SHARDED:
            return False
        return any(part.data_version() != part.gathered_version for part in self.parts)

    def adopt_extensions(self) -> None:
        """Move parameters whose local tensors got the all-gather extension's methods after
        ``fully_shard`` (set on the local tensor object, as torch's tests do) out of their
        region into an extension part, keeping their local tensor objects; see [Note:
        all-gather extensions]."""
        for part in list(self.parts):
            if part.extension is not None:
                continue
            hooked = [
                i for i, p in enumerate(part.params) if has_extension(local_object(p.sharded))
            ]
            if not hooked:
                continue
            moved = [part.params[i] for i in hooked]
            locals_ = [local_object(p.sharded) for p in moved]
            padded = [part.padded_local(i) for i in hooked]
            part.drop(set(hooked))
            new = GroupPart(self, moved, part.trainable, extension=True)  # on part.mesh
            new.adopt(locals_, padded)
            self.parts.append(new)
        self.parts = [part for part in self.parts if part.params]

    def unshard(self) -> None:
        """Issue the all-gathers (-> UNSHARDING); no-op unless SHARDED or SHARDED_POST_FORWARD."""
        if self.state not in (GroupState.SHARDED, GroupState.SHARDED_POST_FORWARD):
            return
        if self.state is GroupState.SHARDED:
            self.adopt_extensions()
        post = self.state is GroupState.SHARDED_POST_FORWARD
        for part in self.parts:
            part.start_gather(post and part.post_storage is not None)
        self._gathering_post_forward = post
        self.state = GroupState.UNSHARDING

    def wait_for_unshard(self) -> None:
        """Finish the gathers and register the unsharded leaves (-> UNSHARDED)."""
        if self.state is not GroupState.UNSHARDING:
            return
        post = self._gathering_post_forward
        for part in self.parts:
            part.finish_gather(post and part.post_storage is not None)
        self._gathering_post_forward = False
        self.state = GroupState.UNSHARDED

    def reshard(self, after_forward: bool = False) -> None:
        """Free the unsharded parameters and register the sharded ones.

        ``after_forward`` with an int ``reshard_after_forward``: keep a copy of
        this rank's chunk over the smaller group first (SHARDED_POST_FORWARD).
        """
        if self.state is GroupState.UNSHARDING:
            self.wait_for_unshard()  # never free memory a collective is writing into
        if self.state is GroupState.SHARDED_POST_FORWARD and not after_forward:
            for part in self.parts:
                if part.post_storage is not None:
                    free_storage(part.post_storage.shard)
            self.state = GroupState.SHARDED
            return
        if self.state is not GroupState.UNSHARDED:
            return
        keep = after_forward and any(part.post_storage is not None for part in self.parts)
        for part in self.parts:
            if keep and part.post_storage is not None:
                part.keep_post_forward()
            part.free_unsharded()
            for p in part.params:
                p.site.set(p.sharded)
        self.state = GroupState.SHARDED_POST_FORWARD if keep else GroupState.SHARDED

    def unsharded_bytes(self) -> int:
        """Bytes of gathered and unsharded parameter storage held now (0 when SHARDED)."""
        return sum(part.unsharded_bytes() for part in self.parts)

    @property
    def storages(self) -> list[ShardedStorage]:
        """Every part's storage (for the end of backward)."""
        return [part.storage for part in self.parts]

    # --- gradients --------------------------------------------------------------------------

    def post_backward_reduce(self) -> list[PendingReduce]:
        """After this group's backward: reshard as set and start the reductions.

        Without gradient sync (``set_requires_gradient_sync(False)``) the
        gradients stay on the unsharded leaves (or accumulate in the reduce
        dtype) for the next backward, as torch's.
        """
        for part in self.parts:
            part.add_new_grads()
        if not self.reduce_grads:
            if self.reshard_after_backward:
                self.reshard()
            for part in self.parts:
                part.accumulate_unsynced()
            return []
        collected = [
            (part, part.collect_grads(self.reduce_scatter_unused_params))
            for part in self.parts
            if part.trainable
        ]
        if self.reshard_after_backward:
            self.reshard()
        return [part.reduce(*found) for part, found in collected if found is not None]


def _same_memory(t: Tensor, view: Tensor) -> bool:
    if t.numel() == 0 or view.numel() == 0:
        return t.shape == view.shape
    return t.data_ptr() == view.data_ptr() and t.shape == view.shape
