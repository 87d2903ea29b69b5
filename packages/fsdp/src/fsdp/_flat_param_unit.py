"""The life of one FlatParameter: its sharded, gathered and gradient storage.

One FSDP instance manages at most one :class:`FlatParamUnit`. The unit owns
every tensor that belongs to its parameters and the transitions between their
forms (:class:`ShardState`); the FSDP state (``_fsdp_state.py``) decides *when*
to call them from its hooks, and the collectives (``_collectives.py``) do the
communication.

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
- ``_padded_unsharded``: the all-gather output, ``padded_numel`` elements in
  the compute dtype (``MixedPrecision.param_dtype``) on the compute device.
  Its storage is freed (resized to 0 bytes) while the unit is SHARDED and
  reallocated before each all-gather; see [Note: storage resizing and autograd].
- ``_compute_param``: the autograd leaf that forward and backward use, a
  ``full_numel`` alias of ``_padded_unsharded[:full_numel]``. The modules'
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
the views, ``_compute_param`` and ``_padded_unsharded`` all share, never on
the tensors: the same view objects simply point at refilled memory.

Writing the all-gather into ``_padded_unsharded`` must not bump the version
counter that autograd checks on the saved views (it would report "modified by
an inplace operation"). ``_compute_param`` gets its storage through ``.data``
assignment, which keeps its own version counter instead of sharing
``_padded_unsharded``'s, and its views share ``_compute_param``'s; the
all-gather only bumps ``_padded_unsharded``'s.
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
from fsdp._collectives import (
    PendingCollective,
    all_gather_into,
    all_reduce_inplace,
    gradient_divide_factors,
    reduce_scatter_into,
)
from fsdp._device import pins_host_memory
from fsdp._orig_params import OrigParams
from fsdp._streams import Stream, Streams, streams_for

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


@dataclass
class PendingReduce:
    """A gradient reduction in flight; :meth:`FlatParamUnit.finish_reduce_grad` completes it.

    A hybrid-sharded unit reduces in two collectives: ``collective`` is the
    reduce-scatter until :meth:`FlatParamUnit.start_replica_reduce` replaces
    it by the all-reduce across replicas (``replicate_group`` is then None).
    """

    unit: FlatParamUnit
    collective: PendingCollective
    output: Tensor  # 1D: the reduced gradient (sharded, or full for NO_SHARD), reduce dtype
    postdivide: float  # divide ``output`` by this after the collective (1.0: nothing)
    replicate_group: Any = None  # the all-reduce still to issue after ``collective``
    padded: Tensor | None = None  # the unit's reusable padded gradient, if this reads it
    # On CUDA: the post-backward stream's event after ``output`` is final (reduced, divided,
    # cast, and under CPUOffload copied to the host); None on the CPU ([Note: stream ordering])
    event: Any = None

    @property
    def has_next_stage(self) -> bool:
        """Whether a collective across replicas still has to be issued."""
        return self.replicate_group is not None


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
    _padded_unsharded: Tensor | None  # 1D [padded_numel] compute dtype; None when aliased
    # 1D [padded_numel] reduce dtype: the reduce-scatter's input, reused every backward;
    # storage allocated only while a reduction reads it ([Note: gradient padding])
    _padded_grad: Tensor | None
    _pinned: bool  # CPUOffload on CUDA: host shard and gradients pinned, copies non-blocking
    _host_grad_event: Any  # a non-blocking copy into flat_param.grad not yet waited for
    streams: Streams  # the device's streams; a no-op on the CPU ([Note: stream ordering])
    _gathered_event: Any  # the unshard stream's event after the gather (streams enabled)
    _compute_param: Tensor  # 1D [full_numel] compute dtype, autograd leaf
    _pending_unshard: PendingCollective | None  # the all-gather while UNSHARDING
    _placeholders: list[Tensor]  # meta tensors, one per original parameter
    _divide: tuple[float, float]  # (pre, post) gradient division factors
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
        self._pinned = config.offload_params and pins_host_memory(config.compute_device)
        if self._pinned:
            # Page-locked, so the host-to-device copy at each unshard is asynchronous.
            flat.data = flat.data.pin_memory()
        self._padded_grad = None
        self._host_grad_event = None
        self.streams = streams_for(config.compute_device)
        self._gathered_event = None
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
        self._pending_unshard = None
        self._divide = gradient_divide_factors(config.world_size * config.replicate_size)
        if self.aliased:
            self._padded_unsharded = None
            self._compute_param = flat
        else:
            padded = torch.empty(
                self.layout.padded_numel, dtype=self.compute_dtype, device=config.compute_device
            )
            compute = torch.empty(0, dtype=self.compute_dtype, device=config.compute_device)
            # .data assignment: see [Note: storage resizing and autograd] for why not a view.
            compute.data = unpad_flat(padded, self.layout)
            compute.requires_grad_(requires_grad)
            self._padded_unsharded = padded
            self._compute_param = compute
            _free_storage(padded)
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
        if self._padded_unsharded is None:
            return extra
        return int(self._padded_unsharded.untyped_storage().nbytes()) + extra

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
        padded = self._padded_unsharded
        assert padded is not None
        streams = self.streams
        if not streams.enabled:
            self._pending_unshard = self._gather_into(padded)
        else:  # see [Note: stream ordering] (unshard, steps 1-2)
            streams.wait_stream(Stream.UNSHARD, Stream.COMPUTE)
            with streams.use(Stream.UNSHARD):
                self._gather_into(padded).wait()  # the unshard stream waits, not the CPU
                self._gathered_event = streams.record_event(Stream.UNSHARD)
            self._pending_unshard = PendingCollective(None)
        self.state = ShardState.UNSHARDING

    def _gather_into(self, padded: Tensor) -> PendingCollective:
        """Allocate ``padded``'s storage and fill it with every rank's shard (issued)."""
        _alloc_storage(padded, self.layout.padded_numel)
        if not self.config.shard:
            # cast and/or host-to-device copy
            padded.copy_(self.flat_param.detach(), non_blocking=self._pinned)
            return PendingCollective(None)
        return all_gather_into(padded, self._all_gather_input(padded), self.config.group)

    def _all_gather_input(self, padded: Tensor) -> Tensor:
        """This rank's chunk, on the compute device, in the compute dtype.

        The shard itself when it already is both; otherwise the cast and/or
        host-to-device copy goes straight into this rank's slot of the gathered
        buffer, and the all-gather runs in place (its input is part of its
        output, which NCCL and gloo both allow): no per-unshard cast buffer.
        """
        shard = self.flat_param.detach()
        if not self.config.offload_params and shard.dtype == self.compute_dtype:
            return shard
        start, end = self.layout.bounds(self.config.rank)
        slot = padded[start:end]
        slot.copy_(shard, non_blocking=self._pinned)
        return slot

    def wait_for_unshard(self) -> None:
        """Finish the gather (UNSHARDING -> UNSHARDED); the unit must not be SHARDED."""
        if self.frozen_part is not None:
            self.frozen_part.wait_for_unshard()
        if self.state is ShardState.UNSHARDING:
            assert self._pending_unshard is not None
            self._pending_unshard.wait()
            self._pending_unshard = None
            if self.streams.enabled:  # [Note: stream ordering] (unshard, step 3)
                self.streams.wait_event(Stream.COMPUTE, self._gathered_event)
                self._gathered_event = None
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
        if self._padded_unsharded is not None:
            # [Note: stream ordering] (unshard, step 4): reused only after the compute
            # stream's reads queued so far.
            self.streams.record_stream(self._padded_unsharded, Stream.COMPUTE)
            _free_storage(self._padded_unsharded)
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
        ``NO_SHARD`` units all-reduce it. Averaging over ranks is split into a
        pre- and post-division (:func:`~fsdp._collectives.gradient_divide_factors`).
        A registered communication hook replaces the collective and the
        division and runs synchronously (``hook_casts``: the hook handles low
        precision itself, so the gradient is not cast to the reduce dtype).
        Call :meth:`finish_reduce_grad` on the result.

        On CUDA everything from the pre-division to the copy to the host runs
        on the post-backward stream (see [Note: stream ordering]); a
        communication hook runs on the current stream, as the caller's code.
        """
        streams = self.streams
        if not streams.enabled or comm_hook is not None:
            return self._issue_reduce(comm_hook, comm_hook_state, hook_casts)
        grad = self.flat_param.grad if self.aliased else self._compute_param.grad
        if grad is None or (self.aliased and self.config.world_size == 1):
            return None  # nothing to reduce: .grad is final as it is
        # [Note: stream ordering] (gradient reduction, steps 1-3)
        streams.wait_stream(Stream.POST_BACKWARD, Stream.COMPUTE)
        with streams.use(Stream.POST_BACKWARD):
            streams.record_stream(grad, Stream.POST_BACKWARD)
            reduce = self._issue_reduce(None, None, False)
            assert reduce is not None
            self.start_replica_reduce(reduce)
            reduce.collective.wait()  # the post-backward stream waits, not the CPU
            self._release_padded_grad(reduce.padded)
            reduce.padded = None
            reduce.output = self._final_grad(reduce.output, reduce.postdivide)
            reduce.postdivide = 1.0
            reduce.event = streams.record_event(Stream.POST_BACKWARD)
        return reduce

    def _issue_reduce(
        self, comm_hook: Callable[..., Any] | None, comm_hook_state: object, hook_casts: bool
    ) -> PendingReduce | None:
        """:meth:`reduce_grad` on the current stream."""
        cfg = self.config
        pre, post = self._divide
        if self.aliased:
            grad = self.flat_param.grad
            if grad is None or (cfg.world_size == 1 and comm_hook is None):
                return None
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
                return PendingReduce(self, PendingCollective(None), grad, 1.0)
            _div_(grad, pre)
            pending = all_reduce_inplace(grad, cfg.group, cfg.world_size)
            return PendingReduce(self, pending, grad, post)
        grad = self._compute_param.grad
        if grad is None:
            return None
        self._compute_param.grad = None
        if not cfg.shard:
            if grad.dtype != self.reduce_dtype and not hook_casts:
                grad = grad.to(self.reduce_dtype)
            if comm_hook is not None:
                comm_hook(comm_hook_state, grad)
                return PendingReduce(self, PendingCollective(None), grad, 1.0)
            if cfg.world_size == 1:
                return PendingReduce(self, PendingCollective(None), grad, 1.0)
            _div_(grad, pre)
            pending = all_reduce_inplace(grad, cfg.group, cfg.world_size)
            return PendingReduce(self, pending, grad, post)
        padded = self._padded_gradient(grad, grad.dtype if hook_casts else self.reduce_dtype)
        reused = padded if padded is self._padded_grad else None
        output = torch.empty(self.layout.shard_numel, dtype=padded.dtype, device=padded.device)
        if comm_hook is not None:
            comm_hook(comm_hook_state, padded, output)
            self._release_padded_grad(reused)
            return PendingReduce(self, PendingCollective(None), output, 1.0)
        _div_(padded, pre)
        pending = reduce_scatter_into(output, padded, cfg.group)
        return PendingReduce(self, pending, output, post, cfg.replicate_group, reused)

    def _padded_gradient(self, grad: Tensor, dtype: torch.dtype) -> Tensor:
        """The reduce-scatter's input: ``grad`` padded to ``padded_numel`` in ``dtype``.

        [Note: gradient padding]
        ``grad`` itself when it already is both (no copy); otherwise one copy,
        which casts and pads at once, into ``_padded_grad``: the same tensor
        every backward, whose storage exists only while a reduction reads it
        (allocated here, freed by :meth:`_release_padded_grad` once the
        reduce-scatter has completed), so the memory between backward passes
        is what it was, and on CUDA the block comes back from the caching
        allocator. Only the padding tail (under ``world_size`` elements) is
        zeroed. If a reduction of this unit still reads it (reentrant
        activation checkpointing reduces twice in one backward), this one gets
        a buffer of its own instead of overwriting it.
        """
        layout = self.layout
        if layout.padded_numel == grad.numel() and grad.dtype == dtype:
            return grad
        buf = self._padded_grad
        if buf is None or buf.dtype != dtype:
            buf = torch.empty(layout.padded_numel, dtype=dtype, device=grad.device)
            _free_storage(buf)
            self._padded_grad = buf
        if buf.untyped_storage().nbytes() != 0:  # in flight: see the docstring
            buf = torch.empty(layout.padded_numel, dtype=dtype, device=grad.device)
        else:
            _alloc_storage(buf, layout.padded_numel)
        buf[: layout.full_numel].copy_(grad)
        buf[layout.full_numel :].zero_()
        return buf

    def _release_padded_grad(self, padded: Tensor | None) -> None:
        """Free the reusable padded gradient once no collective reads it any more."""
        if padded is not None and padded is self._padded_grad:
            _free_storage(padded)

    def start_replica_reduce(self, reduce: PendingReduce) -> None:
        """Hybrid sharding: wait for the reduce-scatter, issue the all-reduce across replicas.

        Split from :meth:`reduce_grad` so that the reduce-scatter overlaps
        computation before anyone waits for it (see [Note: reductions in
        flight] in ``_root_context.py``); a no-op for other reductions.
        """
        if reduce.replicate_group is None:
            return
        reduce.collective.wait()
        self._release_padded_grad(reduce.padded)
        reduce.padded = None
        reduce.collective = all_reduce_inplace(
            reduce.output, reduce.replicate_group, self.config.replicate_size
        )
        reduce.replicate_group = None

    def finish_reduce_grad(self, reduce: PendingReduce) -> None:
        """Wait for a reduction and accumulate its result into ``flat_param.grad``.

        The result is cast back to the parameter dtype (unless
        ``keep_low_precision_grads``), copied to the CPU under offload, and
        added to any gradient already there (gradient accumulation).
        """
        if reduce.event is not None:  # [Note: stream ordering] (gradient reduction, step 4)
            self.streams.wait_event(Stream.COMPUTE, reduce.event)
            self.streams.record_stream(reduce.output, Stream.COMPUTE)
            # Under offload the CPU reads the host copy: it waits on the event first.
            host_event = reduce.event if self.config.offload_params else None
            self._accumulate_grad(reduce.output, host_event)
            return
        self.start_replica_reduce(reduce)
        reduce.collective.wait()
        self._release_padded_grad(reduce.padded)
        reduce.padded = None
        out = self._final_grad(reduce.output, reduce.postdivide)
        # A pinned copy on this path: a communication hook's reduction on CUDA.
        event = self.streams.record_event(Stream.COMPUTE) if self._pinned else None
        self._accumulate_grad(out, event)

    def _final_grad(self, out: Tensor, postdivide: float) -> Tensor:
        """The reduced gradient as ``flat_param.grad`` holds it: divided, in the
        parameter dtype (unless ``keep_low_precision_grads``), on the host under
        offload (pinned and not yet waited for on CUDA)."""
        _div_(out, postdivide)
        if out.dtype != self.orig_dtype and not self.config.keep_low_precision_grads:
            out = out.to(self.orig_dtype)
        if self.config.offload_params:
            host = torch.empty(
                out.shape, dtype=out.dtype, device=self.flat_param.device, pin_memory=self._pinned
            )
            host.copy_(out, non_blocking=self._pinned)
            out = host
        return out

    def _accumulate_grad(self, out: Tensor, event: Any) -> None:
        """``out`` into ``flat_param.grad``; ``event``: a non-blocking copy into ``out``
        (host memory) still to complete, see [Note: stream ordering]."""
        flat = self.flat_param
        if flat.grad is not None or self._host_grad_event is not None:
            self.wait_for_host_grad()  # the CPU is about to read .grad
        if event is not None and flat.grad is not None:
            self.streams.synchronize(event)  # ... and out
            event = None
        if flat.grad is None:
            self._host_grad_event = event  # waited for before anyone reads .grad
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
        end of backward (``RootContext.finish_reductions``), and before
        accumulating into it. A no-op without ``CPUOffload`` on CUDA.
        """
        if self._host_grad_event is not None:
            self.streams.synchronize(self._host_grad_event)
            self._host_grad_event = None

    def wait_for_host_copies(self) -> None:
        """At the end of backward under ``CPUOffload`` on CUDA: the CPU waits for the
        compute stream, which by then has waited on every gather (whose host-to-device
        copies read the pinned shard) and every reduction (whose copies wrote the host
        gradient) of this backward, before the optimizer writes the shard and reads
        ``.grad`` on the CPU; see [Note: stream ordering], step 5."""
        self.wait_for_host_grad()
        if self.config.offload_params and self.streams.enabled:
            self.streams.synchronize(self.streams.record_event(Stream.COMPUTE))

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


def _div_(t: Tensor, factor: float) -> None:
    if factor != 1.0:
        t.div_(factor)


def _free_storage(t: Tensor) -> None:
    storage = t.untyped_storage()
    if storage.nbytes() != 0:
        storage.resize_(0)


def _alloc_storage(t: Tensor, numel: int) -> None:
    storage = t.untyped_storage()
    nbytes = numel * t.element_size()
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)
