"""The life of one FlatParameter: its sharded, gathered and gradient storage.

One FSDP instance manages at most one :class:`FlatParamUnit`. The unit owns
every tensor that belongs to its parameters and the transitions between their
forms (:class:`ShardState`); the FSDP state (``_fsdp_state.py``) decides *when*
to call them from its hooks, and the shared runtime's
:class:`~fsdp._runtime._sharded_storage.ShardedStorage` gathers the shard and
reduces the gradient ([Note: sharded storage]).

[Note: storage forms]
For a unit whose parameters are ``p_0 .. p_{n-1}`` (``full_numel`` elements in
all, laid out as in [Note: flat parameter views] of flatparam) over
``world_size`` ranks with the :class:`~flatparam.ShardLayout` ``layout``:

- ``flat_param``: the FlatParameter registered on the FSDP instance as
  ``_flat_param``; what ``parameters()`` yields and the optimizer steps. It
  always holds this rank's chunk of the padded flat tensor::

      flat_param == padded[layout.bounds(rank)[0] : layout.bounds(rank)[1]]   # 1D, shard_numel

  in the original dtype, on the compute device (or on the CPU with
  ``CPUOffload(offload_params=True)``). Its ``.grad`` is only ever the reduced
  sharded gradient, laid out the same way. It is never swapped for the
  unsharded data (unlike torch's FSDP), so its shape, dtype and device never
  change under the optimizer.
- ``storage.gathered``: the all-gather output, ``padded_numel`` elements in
  the compute dtype (``MixedPrecision.param_dtype``) on the compute device.
  Its storage is freed (resized to 0 bytes) while the unit is SHARDED and
  reallocated before each all-gather; see [Note: storage resizing and autograd].
- ``_compute_param``: the autograd leaf that forward and backward use, a
  ``full_numel`` alias of ``storage.gathered[:full_numel]``. The modules'
  parameter attributes are views of it (``FlatParameter.get_param_views``), so
  every use of a parameter in forward sends its gradient into
  ``_compute_param.grad`` (1D, ``full_numel``, compute dtype).
- ``_placeholders``: between uses the modules' parameter attributes hold
  ``meta`` tensors of the right shape and dtype: printing a model works, while
  computing with an ungathered parameter fails loudly instead of reading freed
  memory. Use ``summon_full_params`` to see real values. With
  ``use_orig_params=True`` there are no placeholders: the modules keep the
  original parameters, views of ``flat_param`` (``orig``, see [Note: original
  parameter views] in ``_orig_params.py``), and the gathered views shadow them
  only while the unit is unsharded.

[Note: frozen part]
A unit never puts trainable and frozen parameters in one flat tensor, because
the gradient is laid out like the flat tensor: with a mix, every rank would
hold (and reduce) gradient bytes for frozen elements too, which is what
FSDP1 does (``use_orig_params=True`` with 3/4 of a unit frozen keeps 4x the
gradient it needs; with ``False`` it refuses the mix). Instead, when a unit's
parameters mix ``requires_grad`` (a LoRA adapter inside the Linear it
adapts), ``_init.build_unit`` makes two FlatParamUnits with one config: the
*main* unit holds the trainable parameters, and its ``frozen_part`` holds the
frozen ones, each flattened, padded and sharded on its own (so the main
unit's gradient is exactly ``ceil(trainable_numel / world_size)`` elements
per rank). The FSDP state only ever talks to the main unit: its state
transitions (``unshard``, ``wait_for_unshard``, ``use_unsharded_views``,
``reshard``) carry the frozen part along, one extra all-gather per unit and
no reduction. Code that reads a unit's flat tensors and metadata (summon,
state dicts, ckpt) iterates :meth:`FlatParamUnit.parts`. A unit that is all
frozen or all trainable has no frozen part, as before. With
``use_orig_params=True`` nothing visible changes: the original parameters
keep their names and objects. With ``False`` the FSDP instance registers the
frozen part's FlatParameter as ``_flat_param_frozen`` next to ``_flat_param``
(``requires_grad=False``, so optimizers skip it); FULL and SHARDED state dicts
keep the original keys, a LOCAL one has both flat keys.

When nothing needs gathering or casting (``NO_SHARD`` or one rank, no mixed
precision, no offload) the unit is *aliased*: ``_compute_param`` is
``flat_param`` itself, no extra storage exists, gradients accumulate straight
into ``flat_param.grad`` and are all-reduced in place, as in DDP.

[Note: storage resizing and autograd]
Autograd saves, for backward, the parameter views a forward used. FULL_SHARD
frees the gathered data after the forward and gathers it again before the
backward, so the saved views must see the new data. They do because freeing
and reallocating act on the *storage* (``untyped_storage().resize_``), which
the views, ``_compute_param`` and ``storage.gathered`` all share, never on
the tensors: the same view objects simply point at refilled memory.

Writing the all-gather into ``storage.gathered`` must not bump the version
counter that autograd checks on the saved views (it would report "modified by
an inplace operation"). ``_compute_param`` gets its storage through ``.data``
assignment, which keeps its own version counter instead of sharing
``storage.gathered``'s, and its views share ``_compute_param``'s; the
all-gather only bumps ``storage.gathered``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from flatparam import (
    FlatParameter,
    ParamInfo,
    ShardLayout,
    SharedParamInfo,
    shard_flat,
    unpad_flat,
)
from fsdp._runtime._collectives import all_gather_into, gradient_divide_factors
from fsdp._runtime._device import pins_host_memory
from fsdp._runtime._quantize import QuantizedCommPolicy
from fsdp._runtime._replica_shard import ReplicaGroups
from fsdp._runtime._sharded_storage import (
    PendingReduce,
    ShardedStorage,
    alloc_storage,
    free_storage,
)
from fsdp._wrapper._orig_params import OrigParams

__all__ = ["FlatParamUnit", "PendingReduce", "ShardState", "UnitConfig"]


class ShardState(Enum):
    """Which form the unit's parameters are in (see [Note: storage forms])."""

    SHARDED = auto()
    """Only ``flat_param`` (this rank's chunk) exists; gathered storage is freed
    and the modules hold meta placeholders."""
    UNSHARDING = auto()
    """The all-gather into the gathered storage is issued but not waited for:
    nobody may read the gathered data or free it yet."""
    UNSHARDED = auto()
    """The gathered storage holds every rank's data; the modules hold views of
    ``_compute_param``."""


@dataclass(frozen=True)
class UnitConfig:
    """How one unit is sharded and computed; fixed at construction."""

    group: Any  # dist.ProcessGroup the unit is sharded over
    rank: int  # this rank in ``group``
    world_size: int  # ranks in ``group``
    shard: bool  # split the flat parameter over the group (False: NO_SHARD)
    reshard_after_forward: bool  # free the gathered parameters after forward (FULL_SHARD)
    compute_device: torch.device  # where forward/backward run
    param_dtype: torch.dtype | None  # MixedPrecision.param_dtype
    reduce_dtype: torch.dtype | None  # MixedPrecision.reduce_dtype
    keep_low_precision_grads: bool
    offload_params: bool  # CPUOffload.offload_params
    # Hybrid sharding: the group of this rank's replicas (same shard in other shard groups);
    # see [Note: hybrid gradient reduction] in _process_groups.py. None: no replication.
    replicate_group: Any = None
    replicate_size: int = 1
    use_orig_params: bool = False  # keep the original parameters as views (OrigParams)
    comm_policy: QuantizedCommPolicy | None = None  # quantized gathers and reductions
    # HYBRID_SHARD_ACROSS_REPLICAS: ``group`` is the world group and these route the
    # collectives ([Note: sharding across replicas] in _runtime/_replica_shard.py).
    across: ReplicaGroups | None = None


class FlatParamUnit:
    """One FlatParameter with its gathered form, gradient reduction and views.

    Built from the original parameters of the modules the unit covers; it
    flattens and shards them (with flatparam), removes them from their modules
    and from then on provides the parameters to those modules only as views of
    gathered data during forward and backward.
    """

    flat_param: FlatParameter  # 1D [shard_numel] orig dtype (see [Note: storage forms])
    layout: ShardLayout  # over config.world_size if sharded, else over 1 rank
    config: UnitConfig
    state: ShardState
    orig_dtype: torch.dtype  # dtype of the original parameters and of flat_param
    compute_dtype: torch.dtype  # dtype of the gathered parameters
    reduce_dtype: torch.dtype  # dtype of the gradient reduction
    aliased: bool  # _compute_param is flat_param (nothing to gather or cast)
    # Gather and reduce of flat_param ([Note: sharded storage]); its gathered buffer is
    # never allocated when the unit is aliased.
    storage: ShardedStorage
    _compute_param: Tensor  # 1D [full_numel] compute dtype, autograd leaf
    _placeholders: list[Tensor]  # meta tensors, one per original parameter
    orig: OrigParams | None  # the original parameters under use_orig_params, else None
    frozen_part: FlatParamUnit | None  # the frozen parameters of a mixed unit ([Note: frozen part])

    def __init__(
        self,
        infos: Sequence[ParamInfo],
        params: Sequence[nn.Parameter],
        shared_infos: Sequence[SharedParamInfo],
        config: UnitConfig,
    ) -> None:
        if len(infos) != len(params) or not params:
            raise ValueError("FlatParamUnit needs one ParamInfo per parameter, at least one")
        self.config = config
        requires_grad = params[0].requires_grad
        self.frozen_part = None
        if any(p.requires_grad != requires_grad for p in params):
            raise ValueError(
                "FlatParamUnit needs parameters that are all trainable or all frozen; "
                "build the frozen ones as the main unit's frozen_part (see [Note: frozen part])"
            )
        if config.use_orig_params:
            flat = FlatParameter([p.detach() for p in params], requires_grad=requires_grad)
        else:
            flat = FlatParameter(list(params), requires_grad=requires_grad)
        flat._param_infos = list(infos)
        flat._shared_param_infos = list(shared_infos)
        self.orig_dtype = flat.dtype
        self.compute_dtype = config.param_dtype or self.orig_dtype
        if config.param_dtype is not None and config.reduce_dtype is None:
            self.reduce_dtype = config.param_dtype
        else:
            self.reduce_dtype = config.reduce_dtype or self.orig_dtype
        shard_world = config.world_size if config.shard else 1
        rank = config.rank if config.shard else 0
        self.layout = flat.layout_for(shard_world)
        if config.shard:
            flat.apply_shard_layout(self.layout, rank)
        sharded_data = shard_flat(flat.detach(), self.layout, rank) if config.shard else flat.data
        param_device = torch.device("cpu") if config.offload_params else config.compute_device
        flat.data = sharded_data.to(param_device)
        pinned = config.offload_params and pins_host_memory(config.compute_device)
        if pinned:
            # Page-locked, so the host-to-device copy at each unshard is asynchronous.
            flat.data = flat.data.pin_memory()
        self.storage = ShardedStorage(
            flat,
            padded_numel=self.layout.padded_numel,
            sharded=config.shard,
            group=config.group,
            rank=rank,
            world_size=config.world_size,
            compute_device=config.compute_device,
            compute_dtype=self.compute_dtype,
            offload=config.offload_params,
            pinned=pinned,
            replicate_group=config.replicate_group,
            replicate_size=config.replicate_size,
            divide=gradient_divide_factors(config.world_size * config.replicate_size),
            keep_low_precision_grads=config.keep_low_precision_grads,
            comm_policy=config.comm_policy,
            across=config.across,
        )
        self.flat_param = flat
        self._placeholders = [
            torch.empty(p.shape, dtype=self.compute_dtype, device="meta") for p in params
        ]
        self.orig = None
        if config.use_orig_params:
            # The modules keep the originals, now views of flat_param.
            self.orig = OrigParams(
                flat, params, infos, layout=self.layout, rank=rank, sharded=config.shard
            )
            for p in params:
                p._fsdp_orig_param = True  # type: ignore[attr-defined]  # _init.collect_unit_params
                p._fsdp_flattened = True  # type: ignore[attr-defined]  # wrap.py: not counted again
        else:
            # The modules no longer own the originals: from now on they see views or placeholders.
            for info in infos:
                info.module._parameters.pop(info.param_name, None)
            for shared in shared_infos:
                shared.module._parameters.pop(shared.param_name, None)
            for p in params:
                p._fsdp_replaced = True  # type: ignore[attr-defined]  # see _init.install_optimizer_check
        flat._fsdp_flattened = True  # type: ignore[attr-defined]  # wrap.py: not counted again
        self.aliased = (
            not config.shard and self.compute_dtype == self.orig_dtype and not config.offload_params
        )
        if self.aliased:
            self._compute_param = flat
        else:
            compute = torch.empty(0, dtype=self.compute_dtype, device=config.compute_device)
            gathered = self.storage.gathered
            alloc_storage(gathered, self.layout.padded_numel)  # a view needs room, once
            # .data assignment: see [Note: storage resizing and autograd] for why not a view.
            compute.data = unpad_flat(gathered, self.layout)
            compute.requires_grad_(requires_grad)
            self._compute_param = compute
            free_storage(gathered)
        self.state = ShardState.SHARDED
        self._use_placeholders()

    # --- introspection --------------------------------------------------------------------

    @property
    def compute_param(self) -> Tensor:
        """The autograd leaf of forward/backward (1D, ``full_numel``); [Note: storage forms]."""
        return self._compute_param

    @property
    def requires_grad(self) -> bool:
        """Whether the unit's main parameters are trainable (all or none, by construction)."""
        return self.flat_param.requires_grad

    def parts(self) -> list[FlatParamUnit]:
        """This unit and its frozen part if it has one (see [Note: frozen part])."""
        return [self] if self.frozen_part is None else [self, self.frozen_part]

    def attach_frozen_part(self, frozen: FlatParamUnit) -> None:
        """Make ``frozen`` (a unit of frozen parameters) follow this unit's transitions."""
        if not self.requires_grad or frozen.requires_grad or frozen.frozen_part is not None:
            raise ValueError("attach_frozen_part: need a trainable unit and a frozen one")
        if frozen.config != self.config:
            raise ValueError("attach_frozen_part: both parts must share one UnitConfig")
        self.frozen_part = frozen

    def unsharded_storage_bytes(self) -> int:
        """Bytes of gathered parameter storage this unit holds right now (0 when SHARDED)."""
        extra = 0 if self.frozen_part is None else self.frozen_part.unsharded_storage_bytes()
        return self.storage.gathered_bytes + extra

    def iter_param_infos(self) -> Sequence[ParamInfo]:
        """Where each original parameter lived (module, name), in flat order."""
        return self.flat_param._param_infos

    # --- SHARDED -> UNSHARDING -> UNSHARDED -> SHARDED ------------------------------------

    def unshard(self) -> None:
        """Start gathering the parameters (SHARDED -> UNSHARDING); no-op otherwise.

        Returns as soon as the all-gather is issued; :meth:`wait_for_unshard`
        must run before the gathered data is used.
        """
        if self.state is not ShardState.SHARDED:
            return
        if self.frozen_part is not None:
            self.frozen_part.unshard()
        if self.aliased:
            self.state = ShardState.UNSHARDED
            return
        self.storage.start_gather()  # [Note: stream ordering] (unshard, steps 1-2)
        self.state = ShardState.UNSHARDING

    def wait_for_unshard(self) -> None:
        """Finish the gather (UNSHARDING -> UNSHARDED); the unit must not be SHARDED."""
        if self.frozen_part is not None:
            self.frozen_part.wait_for_unshard()
        if self.state is ShardState.UNSHARDING:
            self.storage.finish_gather()  # [Note: stream ordering] (unshard, step 3)
            self.state = ShardState.UNSHARDED
        if self.state is not ShardState.UNSHARDED:
            raise AssertionError(
                f"wait_for_unshard in state {self.state.name}; call unshard() first"
            )

    def use_unsharded_views(self) -> None:
        """Point every original parameter attribute at its view of ``_compute_param``.

        Made afresh at every forward (and pre-backward) so that views created
        with gradients enabled carry autograd history to ``_compute_param``.
        """
        if self.state is not ShardState.UNSHARDED:
            raise AssertionError(f"use_unsharded_views in state {self.state.name}")
        if self.frozen_part is not None:
            self.frozen_part.use_unsharded_views()
        flat = self.flat_param
        data = None if self.aliased else self._compute_param
        views = list(flat.get_param_views(external_data=data))
        for info, view in zip(flat._param_infos, views, strict=True):
            info.module.__dict__[info.param_name] = view
        if flat._shared_param_infos:
            by_module = {
                (id(i.module), i.param_name): v
                for i, v in zip(flat._param_infos, views, strict=True)
            }
            for s in flat._shared_param_infos:
                s.module.__dict__[s.param_name] = by_module[(id(s.prim_module), s.prim_param_name)]

    def _use_placeholders(self) -> None:
        flat = self.flat_param
        if self.orig is not None:
            # Drop the gathered views: module.<name> is the original parameter again.
            for info in flat._param_infos:
                info.module.__dict__.pop(info.param_name, None)
            for s in flat._shared_param_infos:
                s.module.__dict__.pop(s.param_name, None)
            return
        for info, ph in zip(flat._param_infos, self._placeholders, strict=True):
            info.module.__dict__[info.param_name] = ph
        if flat._shared_param_infos:
            by_module = {
                (id(i.module), i.param_name): ph
                for i, ph in zip(flat._param_infos, self._placeholders, strict=True)
            }
            for s in flat._shared_param_infos:
                s.module.__dict__[s.param_name] = by_module[(id(s.prim_module), s.prim_param_name)]

    def reshard(self) -> None:
        """Free the gathered parameters (-> SHARDED); waits for an in-flight gather first."""
        if self.frozen_part is not None:
            self.frozen_part.reshard()
        if self.state is ShardState.SHARDED:
            return
        if self.state is ShardState.UNSHARDING:
            self.wait_for_unshard()  # never free memory a collective is writing into
        self._use_placeholders()
        if not self.aliased:
            # [Note: stream ordering] (unshard, step 4): reused only after the compute
            # stream's reads queued so far.
            self.storage.free_gathered()
        self.state = ShardState.SHARDED

    # --- gradients -------------------------------------------------------------------------

    def has_unreduced_grad(self) -> bool:
        """Whether backward left a gradient on ``_compute_param`` (not yet reduced)."""
        if self.aliased:
            return self.flat_param.grad is not None
        return self._compute_param.grad is not None

    def reduce_grad(
        self,
        comm_hook: Callable[..., Any] | None = None,
        comm_hook_state: object = None,
        hook_casts: bool = False,
    ) -> PendingReduce | None:
        """Start reducing the gradient backward produced; ``None`` if there is none.

        Sharded units reduce-scatter the padded full gradient into a new shard;
        ``NO_SHARD`` units all-reduce it; either through the unit's
        :class:`~fsdp._runtime._sharded_storage.ShardedStorage`, which splits
        the average over ranks into a pre- and a post-division
        (:func:`~fsdp._runtime._collectives.gradient_divide_factors`) and on
        CUDA runs everything from the padding copy to the copy to the host on
        the post-backward stream (see [Note: stream ordering]). A registered
        communication hook replaces the collective and the division and runs
        synchronously on the current stream, as the caller's code
        (``hook_casts``: the hook handles low precision itself, so the
        gradient is not cast to the reduce dtype). Call
        :meth:`finish_reduce_grad` on the result.
        """
        cfg = self.config
        if self.aliased:
            flat_grad = self.flat_param.grad
            if flat_grad is None or (cfg.world_size == 1 and comm_hook is None):
                return None  # nothing to reduce: .grad is final as it is
            grad = flat_grad
            # Off the parameter while it is reduced: reentrant activation checkpointing
            # can fire this hook again in the same backward, and autograd must then
            # accumulate into a fresh ``.grad``, not into the tensor being all-reduced
            # (a race on the device, and a second all-reduce of the first sum).
            # finish_reduce_grad puts it back (the same tensor) or adds it. A later pass
            # may accumulate into a result already put back: that part is the same
            # average on every rank, which averaging again leaves as it is.
            self.flat_param.grad = None
            if comm_hook is not None:
                comm_hook(comm_hook_state, grad)
                return self.storage.hook_reduce(self, grad)
            return self.storage.reduce(self, lambda: grad, record=(grad,))
        compute_grad = self._compute_param.grad
        if compute_grad is None:
            return None
        grad = compute_grad
        self._compute_param.grad = None
        dtype = grad.dtype if hook_casts else self.reduce_dtype
        if comm_hook is not None:
            if not cfg.shard:
                grad = grad.to(dtype)
                comm_hook(comm_hook_state, grad)
                return self.storage.hook_reduce(self, grad)
            padded = self._padded_gradient(grad, dtype)
            output = torch.empty(self.layout.shard_numel, dtype=padded.dtype, device=padded.device)
            comm_hook(comm_hook_state, padded, output)
            self.storage.release_padded_grad(padded)
            return self.storage.hook_reduce(self, output)
        if not cfg.shard:
            return self.storage.reduce(self, lambda: grad.to(dtype), record=(grad,))
        return self.storage.reduce(self, lambda: self._padded_gradient(grad, dtype), record=(grad,))

    def _padded_gradient(self, grad: Tensor, dtype: torch.dtype) -> Tensor:
        """The reduce-scatter's input: ``grad`` padded to ``padded_numel`` in ``dtype``.

        ``grad`` itself when it already is both (no copy); otherwise one copy,
        which casts and pads at once, into the storage's reusable padded
        gradient ([Note: gradient padding] in ``_sharded_storage.py``). Only the
        padding tail (under ``world_size`` elements) is zeroed.
        """
        layout = self.layout
        if layout.padded_numel == grad.numel() and grad.dtype == dtype:
            return grad
        buf = self.storage.padded_grad(dtype)
        buf[: layout.full_numel].copy_(grad)
        buf[layout.full_numel :].zero_()
        return buf

    def start_replica_reduce(self, reduce: PendingReduce) -> None:
        """Hybrid sharding: issue the all-reduce across replicas (see ``ShardedStorage``)."""
        self.storage.start_replica_reduce(reduce)

    def finish_reduce_grad(self, reduce: PendingReduce) -> None:
        """Wait for a reduction and accumulate its result into ``flat_param.grad``.

        The result is cast back to the parameter dtype (unless
        ``keep_low_precision_grads``), copied to the CPU under offload, and
        added to any gradient already there (gradient accumulation).
        """
        out, event = self.storage.finish(reduce)
        self._accumulate_grad(out, event)

    def _accumulate_grad(self, out: Tensor, event: Any) -> None:
        """``out`` into ``flat_param.grad``; ``event``: a non-blocking copy into ``out``
        (host memory) still to complete, see [Note: stream ordering]."""
        flat = self.flat_param
        storage = self.storage
        storage.wait_for_host_grad()  # the CPU is about to read (or replace) .grad
        if event is not None and flat.grad is not None:
            storage.synchronize(event)  # ... and out
            event = None
        if flat.grad is None:
            storage.defer_host_event(event)  # waited for before anyone reads .grad
            if out.dtype == flat.dtype:
                flat.grad = out
            else:  # keep_low_precision_grads: .grad's dtype may differ only via .data
                flat.grad = torch.empty_like(flat)
                flat.grad.data = out
        else:
            flat.grad.add_(out)

    def wait_for_host_grad(self) -> None:
        """Block the CPU until a non-blocking copy into the host ``.grad`` has landed.

        Called before the CPU reads an offloaded gradient: by the root at the
        end of backward (``RootContext.finish_reductions``). A no-op without
        ``CPUOffload`` on CUDA.
        """
        self.storage.wait_for_host_grad()

    def wait_for_host_copies(self) -> None:
        """End of backward under ``CPUOffload`` on CUDA; see ``ShardedStorage``."""
        self.storage.wait_for_host_copies()

    # --- full parameters outside forward/backward (summon_full_params) ---------------------

    def gather_full_precision(self) -> Tensor:
        """A new 1D ``full_numel`` tensor of the full parameters in the original dtype.

        Synchronous; used outside forward/backward (``summon_full_params``,
        ``state_dict``). For an unsharded unit it is ``flat_param``'s own data,
        so writes to it persist, as torch's FSDP documents for ``NO_SHARD``.
        """
        flat = self.flat_param.detach()
        if not self.config.shard:
            return flat
        padded = torch.empty(
            self.layout.padded_numel, dtype=flat.dtype, device=self.config.compute_device
        )
        all_gather_into(padded, flat.to(self.config.compute_device), self.config.group).wait()
        return unpad_flat(padded, self.layout)

    def gather_full_grad(self) -> Tensor | None:
        """A new 1D ``full_numel`` tensor of the full gradient, or ``None`` if there is none.

        Collective (every rank takes part, also those without a gradient,
        which contribute zeros). For ``summon_full_params(with_grads=True)``.
        """
        flat = self.flat_param
        grad = flat.grad
        has = torch.tensor([0 if grad is None else 1], device=self.config.compute_device)
        if self.config.shard:
            dist.all_reduce(has, op=dist.ReduceOp.MAX, group=self.config.group)
        if not bool(has.item()):
            return None
        dtype = flat.dtype if grad is None else grad.dtype
        local = grad if grad is not None else torch.zeros_like(flat, dtype=dtype)
        if not self.config.shard:
            return local.detach()
        padded = torch.empty(
            self.layout.padded_numel, dtype=dtype, device=self.config.compute_device
        )
        all_gather_into(
            padded, local.detach().to(self.config.compute_device), self.config.group
        ).wait()
        return unpad_flat(padded, self.layout)

    def write_back_grad(self, full_grad: Tensor) -> None:
        """Copy this rank's chunk of ``full_grad`` (1D, ``full_numel``) into ``flat_param.grad``."""
        flat = self.flat_param
        if not self.config.shard:
            local = full_grad
        else:
            local = shard_flat(full_grad, self.layout, self.config.rank)
        if flat.grad is None:
            flat.grad = local.detach().clone().to(flat.device)
        elif local.data_ptr() != flat.grad.data_ptr():
            flat.grad.copy_(local)

    def write_back(self, full: Tensor) -> None:
        """Copy this rank's chunk of ``full`` (1D, ``full_numel``) into ``flat_param``."""
        self.storage.drop_replica_shard()  # every rank writes back: gather it again
        if not self.config.shard:
            if full.data_ptr() != self.flat_param.data_ptr():
                self.flat_param.data.copy_(full)
            return
        shard = shard_flat(full.to(self.flat_param.dtype), self.layout, self.config.rank)
        self.flat_param.data.copy_(shard)

    def register_full_params(
        self, full: Tensor, full_grad: Tensor | None = None, with_grads: bool = False
    ) -> list[nn.Parameter]:
        """Register the original parameters on their modules as views of ``full``.

        Between this and :meth:`unregister_full_params` the modules look as
        before wrapping (``named_parameters`` lists the originals by name).
        Under ``use_orig_params`` the original objects themselves take the
        full views (``full_grad``: and their gradients, for ``with_grads``).
        """
        flat = self.flat_param
        if self.orig is not None:
            self._use_placeholders()  # drop any gathered views shadowing the originals
            self.orig.use_full_data(full)
            if full_grad is not None or with_grads:
                self.orig.use_full_grads(full_grad)
            return list(self.orig.params)
        params: list[nn.Parameter] = []
        for info, view in zip(
            flat._param_infos, flat.get_param_views(external_data=full), strict=True
        ):
            p = nn.Parameter(view, requires_grad=flat.requires_grad)
            info.module.__dict__.pop(info.param_name, None)
            info.module._parameters[info.param_name] = p
            params.append(p)
        by_module = {
            (id(i.module), i.param_name): p for i, p in zip(flat._param_infos, params, strict=True)
        }
        for s in flat._shared_param_infos:
            s.module.__dict__.pop(s.param_name, None)
            s.module._parameters[s.param_name] = by_module[(id(s.prim_module), s.prim_param_name)]
        return params

    def unregister_full_params(self) -> None:
        """Undo :meth:`register_full_params`: placeholders (or live views) again."""
        flat = self.flat_param
        if self.orig is not None:
            self.orig.use_local_data()
            self.orig.use_local_grads()
            if self.state is ShardState.UNSHARDED:
                self.use_unsharded_views()
            return
        for info in flat._param_infos:
            info.module._parameters.pop(info.param_name, None)
        for s in flat._shared_param_infos:
            s.module._parameters.pop(s.param_name, None)
        if self.state is ShardState.UNSHARDED:
            self.use_unsharded_views()
        else:
            self._use_placeholders()
