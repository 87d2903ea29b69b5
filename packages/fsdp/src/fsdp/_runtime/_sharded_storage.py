"""One rank's shard of a padded 1-D buffer: its gathered form and its gradient reduction.

[Note: sharded storage]
Both front ends keep the parameters of one unit (``FullyShardedDataParallel``)
or one group (``fully_shard``) on a rank as one 1-D *shard* of ``shard_numel``
elements, and every rank's shard together is a padded buffer of
``padded_numel = chunks * shard_numel`` elements:

- the wrapper's unit flattens its parameters into one ``FlatParameter`` and
  cuts it into equal chunks (flatparam's ``ShardLayout``); the shard is this
  rank's chunk, the ``FlatParameter`` itself;
- ``fully_shard``'s group cuts each parameter along a dimension and packs this
  rank's chunks into one region (flatparam's ``ChunkLayout``); the shard is
  that region, and the ``DTensor`` parameters' local tensors are views of it.

Everything between the shard and the collectives is then one runtime,
:class:`ShardedStorage`:

- *gather*: every rank's shard into ``gathered`` (``padded_numel`` elements in
  the compute dtype), cast on the way (mixed precision) and copied from the
  host first (CPU offload): the cast or copy goes straight into this rank's
  slot of ``gathered`` and the all-gather runs in place, so no per-gather cast
  buffer exists. ``gathered`` keeps one tensor object whose storage is
  allocated before each gather and freed after use (views of it survive; see
  [Note: storage resizing and autograd] in ``_wrapper/_flat_param_unit.py``).
- *reduce*: a padded gradient of ``padded_numel`` elements, laid out as
  ``gathered`` is, is pre-divided, reduce-scattered into this rank's shard
  (all-reduced whole for an unsharded unit, ``NO_SHARD``), all-reduced
  across replicas for hybrid sharding, post-divided, cast back to the
  parameters' dtype and, under CPU offload, copied to the host. The padded
  gradient is a buffer reused across backward passes whose storage exists
  only while a reduction reads it ([Note: gradient padding]).
- *quantized* (opt-in, a ``QuantizedCommPolicy``): the gather moves the
  shard as int8 blocks and decodes them into ``gathered``, the reduce-scatter
  moves int8 (or bf16) chunks by an all-to-all and sums them in fp32
  (``_quantized_collectives.py``); everything around the collectives (the
  shard, ``gathered``, divisions, the all-reduce across replicas) is as above.
- *sharded across replicas* (``across``, [Note: sharding across replicas] in
  ``_replica_shard.py``): the shard is this rank's world shard; the gather
  reads the replica shard (gathered across replicas first) and runs one
  all-gather per replica row inside the shard group, the reduction one
  reduce-scatter per row and then a reduce-scatter across replicas in place of
  the all-reduce.

What lies between is the front end's: how the modules see gathered data
(views of ``gathered`` for the wrapper, a copy-out into per-parameter tensors
for ``fully_shard``), how the padded gradient is filled (a padding copy of one
flat gradient, or a pack of per-parameter gradients) and how the reduced shard
is accumulated into ``.grad``. The stream choreography on CUDA ([Note: stream
ordering] in ``_streams.py``) and the collectives' names in errors
(``_collective_failure.py``) are the same for both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from fsdp._runtime._collectives import (
    PendingCollective,
    all_gather_into,
    all_of,
    all_reduce_inplace,
    reduce_scatter_into,
)
from fsdp._runtime._quantize import QuantizedCommPolicy
from fsdp._runtime._quantized_collectives import (
    quantized_all_gather_into,
    quantized_reduce_scatter_into,
)
from fsdp._runtime._replica_shard import ReplicaGroups, ReplicaShard
from fsdp._runtime._streams import Stream, Streams, streams_for

__all__ = ["PendingReduce", "ReductionOwner", "ShardedStorage", "alloc_storage", "free_storage"]


class ReductionOwner(Protocol):
    """What completes a :class:`PendingReduce`: a unit or group (see ``RootContext``)."""

    def start_replica_reduce(self, reduce: PendingReduce) -> None:
        """Move a hybrid reduction on to its all-reduce across replicas."""

    def finish_reduce_grad(self, reduce: PendingReduce) -> None:
        """Wait for the reduction and accumulate its result into ``.grad``."""


@dataclass
class PendingReduce:
    """A gradient reduction in flight; its owner's ``finish_reduce_grad`` completes it.

    A hybrid-sharded reduction has two collectives: ``collective`` is the
    reduce-scatter until :meth:`ShardedStorage.start_replica_reduce` replaces
    it by the all-reduce across replicas (``replicate_group`` is then None).
    """

    owner: ReductionOwner
    collective: PendingCollective
    output: Tensor  # 1D: the reduced gradient (sharded, or whole when unsharded), reduce dtype
    postdivide: float  # divide ``output`` by this after the collective (1.0: nothing)
    replicate_group: Any = None  # the all-reduce still to issue after ``collective``
    padded: Tensor | None = None  # the storage's reusable padded gradient, if this reads it
    # On CUDA: the post-backward stream's event after ``output`` is final (reduced, divided,
    # cast, and under CPU offload copied to the host); None on the CPU ([Note: stream ordering])
    event: Any = None
    # Tensors a side stream reads that nobody else keeps alive until ``event`` (fully_shard's
    # per-parameter gradients): dropped when the compute stream has waited on it.
    keep_alive: tuple[Tensor, ...] = ()
    # Added to the reduce-scatter's output before the all-reduce across replicas (gradients
    # fully_shard reduce-scattered earlier without that all-reduce, set_requires_all_reduce).
    partial: Tensor | None = None
    final: bool = True  # False: leave ``output`` as the collective left it (a partial sum)

    @property
    def has_next_stage(self) -> bool:
        """Whether a collective across replicas still has to be issued."""
        return self.replicate_group is not None


class ShardedStorage:
    """Gather and reduce for one shard; see [Note: sharded storage].

    ``shard`` is read at every gather (``shard.detach()``), so an owner may
    replace the tensor (or its ``.data``) between gathers.
    """

    shard: Tensor  # 1D [shard_numel], the parameters' dtype, on the compute device or the host
    gathered: Tensor  # 1D [padded_numel] compute dtype; storage allocated only while gathered
    shard_numel: int
    padded_numel: int  # rows * world_size * shard_numel
    sharded: bool  # reduce by reduce-scatter (else: all-reduce of the whole buffer, NO_SHARD)
    group: Any  # the process group the shard is gathered over / the gradient reduced over
    rank: int  # this rank's index in ``group`` (its slot in ``gathered``)
    world_size: int  # ranks in ``group``
    # Sharded across replicas: ``group`` is the shard group, ``gathered`` has one row per
    # replica, each gathered (and its gradient reduced) by its own collective, and the
    # replica shard feeds them ([Note: sharding across replicas]). Else 1 and None.
    rows: int
    replica_shard: ReplicaShard | None
    compute_device: torch.device
    compute_dtype: torch.dtype
    offload: bool  # ``shard`` lives on the host (CPU offload)
    pinned: bool  # offload on CUDA: host memory pinned, copies non-blocking
    replicate_group: Any  # hybrid sharding: this rank's replicas, None without replication
    replicate_size: int
    divide: tuple[float, float]  # (pre, post) gradient division factors
    keep_low_precision_grads: bool  # leave the reduced gradient in the reduce dtype
    # Free with record_stream (the wrapper) or rely on each side stream waiting for the
    # compute stream before it allocates (fully_shard); see free_gathered and finish.
    record_streams: bool
    # Called with the reduced gradient before the cast back (fully_shard's
    # set_all_reduce_hook); after the post-division when ``hook_sees_average``.
    post_reduce_hook: Callable[[Tensor], None] | None
    hook_sees_average: bool
    streams: Streams  # the device's streams; a no-op on the CPU ([Note: stream ordering])
    # Quantized communication: the gather's and the reduce-scatter's wire format, None when
    # exact (no policy, nothing to quantize, or one rank: see QuantizedCommPolicy)
    quantized_weights: str | None
    quantized_gradients: str | None
    block_size: int
    _pending: PendingCollective | None  # the gather in flight
    _gathered_event: Any  # the unshard stream's event after the gather (streams enabled)
    _padded_grad: Tensor | None  # the reusable padded gradient ([Note: gradient padding])
    _host_grad_event: Any  # a non-blocking copy into a host gradient not yet waited for

    def __init__(
        self,
        shard: Tensor,
        *,
        padded_numel: int,
        sharded: bool,
        group: Any,
        rank: int,
        world_size: int,
        compute_device: torch.device,
        compute_dtype: torch.dtype,
        offload: bool,
        pinned: bool,
        replicate_group: Any = None,
        replicate_size: int = 1,
        divide: tuple[float, float] = (1.0, 1.0),
        keep_low_precision_grads: bool = False,
        record_streams: bool = True,
        comm_policy: QuantizedCommPolicy | None = None,
        across: ReplicaGroups | None = None,
        data_version: Callable[[], int] | None = None,
    ) -> None:
        """``group``, ``rank`` and ``world_size`` are those of the layout (with ``across``:
        the world group's; the collectives then run over ``across``'s two groups);
        ``data_version``: the shard's version counter to follow (``ReplicaShard.version``)."""
        self.shard = shard
        self.shard_numel = shard.numel()
        self.padded_numel = padded_numel
        self.sharded = sharded
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.rows = 1
        self.compute_device = compute_device
        self.compute_dtype = compute_dtype
        self.offload = offload
        self.pinned = pinned
        self.replicate_group = replicate_group
        self.replicate_size = replicate_size
        if across is not None and sharded:
            self.group, self.rank, self.world_size = (
                across.shard_group, across.shard_rank, across.shard_size
            )  # fmt: skip
            self.rows = across.replicate_size
            self.replicate_group, self.replicate_size = across.replicate_group, self.rows
        self.divide = divide
        self.keep_low_precision_grads = keep_low_precision_grads
        self.record_streams = record_streams
        self.post_reduce_hook = None
        self.hook_sees_average = False
        self.streams = streams_for(compute_device)
        moves = sharded and self.world_size > 1 and shard.numel() > 0
        moves = moves and shard.dtype.is_floating_point and comm_policy is not None
        self.quantized_weights = comm_policy.weights if moves and comm_policy else None
        self.quantized_gradients = comm_policy.gradients if moves and comm_policy else None
        self.block_size = comm_policy.block_size if comm_policy is not None else 0
        self.gathered = torch.empty(padded_numel, dtype=compute_dtype, device=compute_device)
        free_storage(self.gathered)
        self.replica_shard = None
        if across is not None and sharded:
            self.replica_shard = ReplicaShard(
                across,
                self.shard_numel,
                # The quantized gather encodes the master values, not a low-precision cast.
                dtype=shard.dtype if self.quantized_weights else compute_dtype,
                device=compute_device,
                pinned=pinned,
                version=data_version,
            )
        self._pending = None
        self._gathered_event = None
        self._padded_grad = None
        self._host_grad_event = None

    # --- gather ----------------------------------------------------------------------------

    @property
    def gathering(self) -> bool:
        """A gather is issued and not yet waited for: nobody may read or free ``gathered``."""
        return self._pending is not None

    @property
    def gathered_bytes(self) -> int:
        """Bytes of gathered storage held right now (0 when freed)."""
        return int(self.gathered.untyped_storage().nbytes())

    def start_gather(self) -> None:
        """Allocate ``gathered`` and issue the all-gather into it; returns at once.

        On CUDA the work runs on the unshard stream after the compute stream's
        work so far (the shard's last writer); see [Note: stream ordering].
        """
        if self._pending is not None:
            raise AssertionError("start_gather with a gather in flight; wait for it first")
        self.start_refresh()
        streams = self.streams
        if not streams.enabled:
            self._pending = self._gather()
            return
        streams.wait_stream(Stream.UNSHARD, Stream.COMPUTE)
        with streams.use(Stream.UNSHARD):
            self._gather().wait()  # the unshard stream waits, not the CPU
            self._gathered_event = streams.record_event(Stream.UNSHARD)
        self._pending = PendingCollective(None)

    def _gather(self) -> PendingCollective:
        alloc_storage(self.gathered, self.padded_numel)
        if self.replica_shard is not None:  # one all-gather per replica row
            inputs = self.replica_shard.ready(self.shard, self.streams)
            outputs = self.gathered.view(self.rows, -1)
            return all_of([self._gather_row(o, i) for o, i in zip(outputs, inputs, strict=True)])
        if self.quantized_weights is not None:
            # Encoded from the master shard itself (not a low-precision cast of it).
            shard = self.shard.detach().to(self.compute_device, non_blocking=self.pinned)
            return self._gather_row(self.gathered, shard)
        return all_gather_into(self.gathered, self._gather_input(), self.group)

    def _gather_row(self, output: Tensor, shard: Tensor) -> PendingCollective:
        """All-gather ``shard`` (on the compute device) over ``group`` into ``output``."""
        if self.quantized_weights is not None:
            return quantized_all_gather_into(
                output, shard, self.group, rank=self.rank, world_size=self.world_size,
                block_size=self.block_size,
            )  # fmt: skip
        return all_gather_into(output, shard, self.group)

    def start_refresh(self) -> None:
        """Sharded across replicas: issue the all-gather of the replica shard unless it is
        held ([Note: sharding across replicas]); a no-op otherwise. The root issues every
        unit's at its pre-forward, so they cross the slow link while forward computes."""
        if self.replica_shard is not None:
            self.replica_shard.start_refresh(self.shard, self.streams)

    def drop_replica_shard(self) -> None:
        """The front end wrote the shard itself (every rank does): gather it again."""
        if self.replica_shard is not None:
            self.replica_shard.drop()

    def _gather_input(self) -> Tensor:
        """This rank's shard on the compute device in the compute dtype.

        The shard itself when it already is both; otherwise the cast and/or
        host-to-device copy goes straight into this rank's slot of
        ``gathered`` and the all-gather runs in place (its input is part of
        its output, which NCCL and gloo both allow).
        """
        shard = self.shard.detach()
        if not self.offload and shard.dtype == self.compute_dtype:
            return shard
        slot_rank = self.rank if self.sharded else 0
        slot = self.gathered.narrow(0, slot_rank * self.shard_numel, self.shard_numel)
        slot.copy_(shard, non_blocking=self.pinned)
        return slot

    def finish_gather(self) -> None:
        """Wait for the gather in flight (no-op without one); ``gathered`` is then readable."""
        pending = self._pending
        if pending is None:
            return
        pending.wait()
        self._pending = None
        if self.streams.enabled:  # [Note: stream ordering] (unshard, step 3)
            self.streams.wait_event(Stream.COMPUTE, self._gathered_event)
            self._gathered_event = None

    def free_gathered(self) -> None:
        """Free ``gathered`` (after its gather, if one is in flight).

        The compute stream may still read it (views used by queued kernels, a
        copy-out): with ``record_streams`` it is freed after ``record_stream``
        on the compute stream ([Note: stream ordering], unshard step 4); without
        (``fully_shard``) it is freed at once, which is safe because the block
        goes back to the unshard stream's pool and that stream waits for the
        compute stream before every gather, so no later gather writes it before
        the reads queued now have run.
        """
        self.finish_gather()
        if self.record_streams:
            self.streams.record_stream(self.gathered, Stream.COMPUTE)
        free_storage(self.gathered)

    # --- reduce ----------------------------------------------------------------------------

    def padded_grad(self, dtype: torch.dtype) -> Tensor:
        """The reduction's input buffer: ``padded_numel`` elements of ``dtype``, allocated.

        [Note: gradient padding]
        The same tensor every backward, whose storage exists only while a
        reduction reads it (allocated here, freed once the collective has
        completed), so the memory between backward passes is what it was, and
        on CUDA the block comes back from the caching allocator. If a
        reduction of this storage still reads it (reentrant activation
        checkpointing reduces twice in one backward), a buffer of its own is
        returned instead of overwriting it. The caller fills every element.
        """
        buf = self._padded_grad
        if buf is None or buf.dtype != dtype:
            buf = torch.empty(self.padded_numel, dtype=dtype, device=self.compute_device)
            free_storage(buf)
            self._padded_grad = buf
        if buf.untyped_storage().nbytes() != 0:  # in flight: see the docstring
            return torch.empty(self.padded_numel, dtype=dtype, device=self.compute_device)
        alloc_storage(buf, self.padded_numel)
        return buf

    def release_padded_grad(self, padded: Tensor | None) -> None:
        """Free the reusable padded gradient once no collective reads it any more."""
        if padded is not None and padded is self._padded_grad:
            free_storage(padded)

    def reduce(
        self,
        owner: ReductionOwner,
        fill: Callable[[], Tensor],
        *,
        record: Sequence[Tensor] = (),
        keep_alive: Sequence[Tensor] = (),
        replicate: bool = True,
        partial: Tensor | None = None,
    ) -> PendingReduce:
        """Start reducing the gradient that ``fill()`` returns; complete with :meth:`finish`.

        ``fill`` returns the padded gradient (usually :meth:`padded_grad`
        filled, or a gradient that already has the padded size and dtype);
        on CUDA it runs on the post-backward stream after that stream waited
        for the compute stream. ``record``: gradients the caller drops now,
        which the post-backward stream reads (``record_stream``, the
        wrapper's way); ``keep_alive``: the same kept referenced until the
        compute stream has waited for the reduction instead (``fully_shard``'s
        way, no ``record_stream``). ``replicate=False`` skips the all-reduce
        across replicas and leaves the result a partial sum (not post-divided,
        not cast); ``partial`` is such an earlier result, added before the
        all-reduce.
        """
        streams = self.streams
        if not streams.enabled:
            return self._issue(owner, fill(), replicate, partial, tuple(keep_alive))
        # [Note: stream ordering] (gradient reduction, steps 1-3)
        streams.wait_stream(Stream.POST_BACKWARD, Stream.COMPUTE)
        with streams.use(Stream.POST_BACKWARD):
            for t in record:
                streams.record_stream(t, Stream.POST_BACKWARD)
            reduce = self._issue(owner, fill(), replicate, partial, tuple(keep_alive))
            self.start_replica_reduce(reduce)
            reduce.collective.wait()  # the post-backward stream waits, not the CPU
            self.release_padded_grad(reduce.padded)
            reduce.padded = None
            if reduce.final:
                reduce.output = self._final_grad(reduce.output, reduce.postdivide)
                reduce.postdivide = 1.0
            reduce.event = streams.record_event(Stream.POST_BACKWARD)
        return reduce

    def _issue(
        self,
        owner: ReductionOwner,
        padded: Tensor,
        replicate: bool,
        partial: Tensor | None,
        keep_alive: tuple[Tensor, ...],
    ) -> PendingReduce:
        pre, post = self.divide
        reused = padded if padded is self._padded_grad else None
        _div_(padded, pre)
        replicate_group = self.replicate_group if replicate else None
        if not self.sharded:
            pending = all_reduce_inplace(padded, self.group, self.world_size)
            return PendingReduce(
                owner, pending, padded, post, replicate_group, reused, keep_alive=keep_alive,
                partial=partial, final=replicate,
            )  # fmt: skip
        # One chunk per replica row: this rank's shard over the shard group, or (sharded
        # across replicas) its replica shard, reduce-scattered across replicas next.
        output = torch.empty(self.rows * self.shard_numel, dtype=padded.dtype, device=padded.device)
        if self.rows == 1:
            pending = self._reduce_row(output, padded)
        else:
            rows = zip(output.view(self.rows, -1), padded.view(self.rows, -1), strict=True)
            pending = all_of([self._reduce_row(o, p) for o, p in rows])
        return PendingReduce(
            owner, pending, output, post, replicate_group, reused, keep_alive=keep_alive,
            partial=partial, final=replicate,
        )  # fmt: skip

    def _reduce_row(self, output: Tensor, padded: Tensor) -> PendingCollective:
        """Reduce-scatter ``padded`` over ``group`` into ``output``."""
        if self.quantized_gradients is not None:
            return quantized_reduce_scatter_into(
                output, padded, self.group, rank=self.rank, world_size=self.world_size,
                mode=self.quantized_gradients, block_size=self.block_size,
            )  # fmt: skip
        return reduce_scatter_into(output, padded, self.group)

    def hook_reduce(self, owner: ReductionOwner, output: Tensor) -> PendingReduce:
        """A reduction a communication hook already did: ``output`` is final but for the
        cast back and the copy to the host."""
        return PendingReduce(owner, PendingCollective(None), output, 1.0)

    def start_replica_reduce(self, reduce: PendingReduce) -> None:
        """Hybrid sharding: wait for the reduce-scatter, issue the all-reduce across replicas
        (sharded across replicas: the reduce-scatter across replicas).

        Split from :meth:`reduce` so that the reduce-scatter overlaps
        computation before anyone waits for it (see [Note: reductions in
        flight] in ``_root_context.py``); a no-op for other reductions.
        """
        if reduce.replicate_group is None:
            return
        reduce.collective.wait()
        self.release_padded_grad(reduce.padded)
        reduce.padded = None
        if reduce.partial is not None:
            reduce.output.add_(reduce.partial)
            reduce.partial = None
        if self.replica_shard is None:
            reduce.collective = all_reduce_inplace(
                reduce.output, reduce.replicate_group, self.replicate_size
            )
        else:  # [Note: sharding across replicas]: into the world shard's gradient
            world = reduce.output.new_empty(self.shard_numel)
            reduce.collective = reduce_scatter_into(world, reduce.output, reduce.replicate_group)
            reduce.output = world
            self.replica_shard.drop()  # the optimizer may step next
        reduce.replicate_group = None

    def finish(self, reduce: PendingReduce) -> tuple[Tensor, Any]:
        """Wait for a reduction; its result and the event a host copy of it still needs.

        The result is this rank's shard of the averaged gradient, cast back to
        the parameters' dtype (unless ``keep_low_precision_grads``), on the
        host under CPU offload, or the raw partial sum of a reduction issued
        with ``replicate=False``. The event is not None when the CPU must
        wait for it (see :meth:`synchronize`) before reading the result.
        """
        if reduce.event is not None:  # [Note: stream ordering] (gradient reduction, step 4)
            self.streams.wait_event(Stream.COMPUTE, reduce.event)
            if self.record_streams:  # else: the post-backward stream waits before allocating
                self.streams.record_stream(reduce.output, Stream.COMPUTE)
            reduce.keep_alive = ()  # the post-backward stream is done with them
            # Under offload the CPU reads the host copy: it waits on the event first.
            return reduce.output, (reduce.event if self.offload else None)
        self.start_replica_reduce(reduce)
        reduce.collective.wait()
        reduce.keep_alive = ()
        self.release_padded_grad(reduce.padded)
        reduce.padded = None
        if not reduce.final:
            return reduce.output, None
        out = self._final_grad(reduce.output, reduce.postdivide)
        # A pinned copy on this path: a communication hook's reduction on CUDA.
        event = self.streams.record_event(Stream.COMPUTE) if self.pinned else None
        return out, event

    def _final_grad(self, out: Tensor, postdivide: float) -> Tensor:
        """The reduced gradient as ``.grad`` holds it: divided, in the parameters' dtype
        (unless ``keep_low_precision_grads``), on the host under offload (pinned and not
        yet waited for on CUDA)."""
        hook = self.post_reduce_hook
        if hook is not None and not self.hook_sees_average:
            hook(out)
        _div_(out, postdivide)
        if hook is not None and self.hook_sees_average:
            hook(out)
        dtype = self.shard.dtype
        if out.dtype != dtype and not self.keep_low_precision_grads:
            out = out.to(dtype)
        if self.offload:
            host = torch.empty(out.shape, dtype=out.dtype, device="cpu", pin_memory=self.pinned)
            host.copy_(out, non_blocking=self.pinned)
            out = host
        return out

    # --- host copies (CPU offload on CUDA) -------------------------------------------------

    def defer_host_event(self, event: Any) -> None:
        """A non-blocking copy into the host gradient that the CPU has not waited for."""
        self._host_grad_event = event

    def wait_for_host_grad(self) -> None:
        """Block the CPU until a non-blocking copy into the host gradient has landed.

        Called before the CPU reads an offloaded gradient: at the end of
        backward and before accumulating into it. A no-op without CPU offload
        on CUDA.
        """
        if self._host_grad_event is not None:
            self.streams.synchronize(self._host_grad_event)
            self._host_grad_event = None

    def synchronize(self, event: Any) -> None:
        """The CPU waits for ``event`` (a no-op for None)."""
        if event is not None:
            self.streams.synchronize(event)

    def wait_for_host_copies(self) -> None:
        """At the end of backward under CPU offload on CUDA: the CPU waits for the
        compute stream, which by then has waited on every gather (whose host-to-device
        copies read the pinned shard) and every reduction (whose copies wrote the host
        gradient) of this backward, before the optimizer writes the shard and reads
        ``.grad`` on the CPU; see [Note: stream ordering], step 5."""
        self.wait_for_host_grad()
        if self.offload and self.streams.enabled:
            self.streams.synchronize(self.streams.record_event(Stream.COMPUTE))


def _div_(t: Tensor, factor: float) -> None:
    if factor != 1.0:
        t.div_(factor)


def free_storage(t: Tensor) -> None:
    """Free ``t``'s storage (resize to 0 bytes); views of it stay valid objects."""
    storage = t.untyped_storage()
    if storage.nbytes() != 0:
        storage.resize_(0)


def alloc_storage(t: Tensor, numel: int) -> None:
    """Give ``t``'s storage room for ``numel`` elements again (see :func:`free_storage`)."""
    storage = t.untyped_storage()
    nbytes = numel * t.element_size()
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)
