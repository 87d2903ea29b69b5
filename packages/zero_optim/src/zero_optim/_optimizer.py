"""``ZeroRedundancyOptimizer``: an optimizer whose state is sharded across ranks.

[Note: the wrapper and the local optimizer]
The wrapper is a ``torch.optim.Optimizer`` whose ``param_groups`` hold *every*
parameter: that is what users, LR schedulers and ``zero_grad()`` see and edit.
Each rank also owns a *local optimizer*, an instance of ``optimizer_class``
over only the parameters the partition gives it, with one (possibly empty)
group per wrapper group. All optimizer state lives in the local optimizer, so a
rank holds the state of its share only; the wrapper's own ``state`` stays empty.

Hyperparameters flow both ways around every step: the wrapper's groups are
copied into the local groups before it (so an LR scheduler's edits take effect)
and back after it (so anything the local optimizer changes, and its defaults
for keys the user did not pass, show up on the wrapper). ``"params"`` is never
copied.

[Note: uneven inputs]
Under ``torch.distributed.algorithms.join.Join`` a rank that has run out of
inputs keeps shadowing the others' collectives. DDP's join hook shadows the
gradient all-reduce but discards its result, so the joined rank's ``.grad`` is
stale, yet it still owns a shard that must be stepped with this iteration's
gradients. Inside a Join context (from ``join_hook()``, which ``Join`` calls
when it is built, to the hook's ``post_hook``, which it calls on exit) every
step therefore starts with one small all-reduce of "who has joined"; if anyone
has, a rank still training sends each joined rank the reduced gradients of the
parameters it owns (``send_grads_to_joined``). With that, the model after an uneven run equals
DDP with the plain optimizer under Join, rather than depending on stale
gradients.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.futures import Future
from torch.optim import Optimizer

from flatparam import named_backend_failures
from zero_optim._agreement import check_ranks_agree, zero_fingerprint
from zero_optim._broadcast import ShardBroadcaster
from zero_optim._buckets import ParamBuckets
from zero_optim._collectives import gather_to, send_grads_to_joined
from zero_optim._overlap import BackwardPhase, HookKind, OverlapState, reduced_gradients
from zero_optim._owner_reduce import OwnerReducer
from zero_optim._partition import Partition, sorted_greedy_partition
from zero_optim._state_dict import (
    check_full_state_dict,
    check_state_shapes,
    cpu_copy,
    full_state_dict,
    local_state_dict,
    owned_global_indices,
)

if TYPE_CHECKING:
    from torch._C._distributed_c10d import GradBucket  # torch.distributed.GradBucket

__all__ = ["ZeroRedundancyOptimizer"]

logger = logging.getLogger(__name__)

# Optimizers whose update is not a per-parameter function of that parameter's
# gradient and state, so the bucket-by-bucket step of overlap_with_ddp would
# change their results.
_NOT_PER_PARAMETER = {
    torch.optim.LBFGS: "it re-evaluates the whole model through a closure and keeps "
    "one state for all parameters",
    torch.optim.SparseAdam: "it needs sparse gradients, which DDP buckets never hold",
}


class ZeroRedundancyOptimizer(Optimizer, Joinable):
    """Wraps any ``torch.optim`` optimizer and shards its state across the ranks.

    With ``N`` ranks each rank keeps the optimizer state of about ``1 / N`` of
    the parameters: every parameter is owned by exactly one rank, which steps
    it and then broadcasts the new values to the others, so all replicas stay
    identical, as with the plain optimizer under DDP. Use it in place of
    ``torch.distributed.optim.ZeroRedundancyOptimizer``; the arguments, methods
    and state-dict format are the same.

    Args:
        params: an iterable of tensors, or of dicts defining parameter groups
            (each with a ``"params"`` key), as for any ``torch.optim`` optimizer.
        optimizer_class: the ``torch.optim.Optimizer`` subclass to run on each
            rank's share, e.g. ``torch.optim.AdamW``.
        process_group: the group to shard over (default: the world group).
        parameters_as_bucket_view: pack each rank's parameters into one
            contiguous bucket per device, so the post-step broadcast is one
            collective per rank with no copy; ``param.data`` then views the
            bucket. Without it ``param.data`` is left alone and each updated
            parameter is broadcast in place, small ones packed together through
            a few reusable buffers (see [Note: bounded broadcast]).
        overlap_with_ddp: step inside DDP's backward pass, bucket by bucket;
            requires registering ``hook_with_zero_step`` or
            ``hook_with_zero_step_interleaved`` on the DDP model, and then
            ``step()`` must not be called. Every iteration updates the
            parameters, the first ones included.
        **defaults: forwarded to ``optimizer_class`` (``lr=...``, ...).

    The partition (which rank owns which parameter) is sorted-greedy by size,
    group by group, identical on every rank and identical to torch's; inspect
    it through :attr:`partition`, :attr:`param_to_rank` or
    :attr:`params_per_rank`.
    """

    # the local optimizer over this rank's share; see [Note: the wrapper and the local optimizer]
    optim: Optimizer
    process_group: dist.ProcessGroup
    world_size: int
    rank: int  # rank in process_group
    global_rank: int  # rank in the default (world) group
    parameters_as_bucket_view: bool
    initialized: bool  # False while Optimizer.__init__ adds the initial groups

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        optimizer_class: type[Optimizer],
        process_group: dist.ProcessGroup | None = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        **defaults: Any,
    ) -> None:
        param_groups = _checked_param_groups(params)
        _check_optimizer_class(optimizer_class, overlap_with_ddp)
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "ZeroRedundancyOptimizer needs torch.distributed: call "
                "torch.distributed.init_process_group(...) before constructing it"
            )
        self.initialized = False
        Optimizer.__init__(self, param_groups, defaults)
        Joinable.__init__(self)
        group = process_group if process_group is not None else dist.group.WORLD
        assert isinstance(group, dist.ProcessGroup)
        self.process_group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.global_rank = dist.get_global_rank(group, self.rank)
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self._overlap_with_ddp = overlap_with_ddp
        self._overlap = OverlapState() if overlap_with_ddp else None
        self._optimizer_class = optimizer_class
        self._optim_defaults = defaults
        self._all_params: list[Tensor] = [p for g in self.param_groups for p in g["params"]]
        self._default_device = self._all_params[0].device
        self._trainable = self._trainable_mask()
        self._buckets = ParamBuckets()
        self._broadcaster = ShardBroadcaster(group, self.rank)
        self._owner_reducer = OwnerReducer()  # the to-owners hook's reduces
        self._consolidated: dict[int, Any] | None = None  # global index -> state, on `to` only
        # inside a Join context: from join_hook() (Join.__init__) to its post_hook (Join.__exit__)
        self._in_join = False

        self._repartition()
        self._check_ranks_agree(defaults)
        local_groups = self._local_param_groups()
        try:
            self.optim = optimizer_class(local_groups, **defaults)
        except TypeError as e:
            raise TypeError(
                f"{optimizer_class.__name__} rejected the keyword arguments "
                f"{sorted(defaults)} forwarded by ZeroRedundancyOptimizer: {e}"
            ) from e
        _copy_hyperparameters(self.optim.param_groups, self.param_groups)
        self._rebuild_buckets()
        self.initialized = True

    # ------------------------------------------------------------------ step

    def step(  # type: ignore[override]
        self, closure: Callable[[], float] | None = None, **kwargs: Any
    ) -> float | None:
        """Step this rank's share of the parameters, then share the results.

        Gradients must already be reduced across ranks (DDP does that). Extra
        keyword arguments go to the local optimizer's ``step``. Returns what the
        local optimizer returns (the closure's loss, if any).
        """
        if self._overlap is not None:
            self._step_called_with_overlap()
            return None
        Join.notify_join_context(self)
        if self._in_join and self._join_config.enable:  # see [Note: uneven inputs]
            self._send_grads_to_joined(joined=False)
        self._begin_local_step()
        loss = self.optim.step(**kwargs) if closure is None else self.optim.step(closure, **kwargs)
        self._end_local_step()
        with self._failures("broadcast", "the updated parameters", "optimizer step"):
            self._broadcast_all_shards()
        return loss

    def _check_ranks_agree(self, defaults: Mapping[str, Any]) -> None:
        """[Note: agreement step] in flatparam: every rank built the same optimizer."""
        options = {
            "parameters_as_bucket_view": self.parameters_as_bucket_view,
            "overlap_with_ddp": self._overlap_with_ddp,
            "world_size": self.world_size,
        }
        fingerprint = zero_fingerprint(
            self.param_groups, self._optimizer_class, defaults, self._params_per_rank, options
        )
        check_ranks_agree(fingerprint, self.process_group, self.rank, self._default_device)

    def _failures(self, operation: str, target: str, phase: str) -> AbstractContextManager[None]:
        """Name a backend failure of the collectives inside (rank, what, phase)."""
        return named_backend_failures(self.rank, operation, target, phase)

    def _begin_local_step(self) -> None:
        trainable = self._trainable_mask()
        if trainable != self._trainable:
            self._trainable = trainable
            self._rebuild_buckets()
        _copy_hyperparameters(self.param_groups, self.optim.param_groups)

    def _end_local_step(self) -> None:
        _copy_hyperparameters(self.optim.param_groups, self.param_groups)

    def _broadcast_all_shards(self) -> None:
        """Every owner broadcasts its updated parameters, in rank order; returns once all landed.

        In place or through bounded staging buffers, never a copy of a whole
        shard: see [Note: bounded broadcast] in ``_broadcast.py``.
        """
        for owner in range(self.world_size):
            if self.parameters_as_bucket_view:
                tensors = self._buckets.tensors_of(owner)
            else:
                tensors = [p for p in self._params_per_rank[owner] if p.requires_grad]
            self._broadcaster.start(tensors, owner)
        self._broadcaster.finish()

    def _send_grads_to_joined(self, joined: bool) -> None:
        trainable = [[p for p in ps if p.requires_grad] for ps in self._params_per_rank]
        with self._failures("broadcast", "gradients for joined ranks", "optimizer step"):
            send_grads_to_joined(
                trainable, joined, self.rank, self.process_group, self._default_device
            )

    # ------------------------------------------------- overlap with DDP

    def _step_called_with_overlap(self) -> None:
        assert self._overlap is not None
        if self._overlap.kind is None:
            raise RuntimeError(
                "this ZeroRedundancyOptimizer was built with overlap_with_ddp=True, so it "
                "steps inside DDP's backward pass, but no hook drives it: register one with "
                "ddp_model.register_comm_hook(None, hook_with_zero_step(allreduce_hook, "
                "ddp_model, zero)) (both from zero_optim / torch's default_hooks), or build "
                "the optimizer with overlap_with_ddp=False"
            )
        if not self._overlap.user_step_warned:
            self._overlap.user_step_warned = True
            logger.warning(
                "step() does nothing with overlap_with_ddp=True: the DDP hook already "
                "stepped during backward; remove the call from the training loop"
            )

    def _attach_hook(self, kind: HookKind) -> None:
        """Record that a DDP hook of ``kind`` drives this optimizer (called by the hooks)."""
        if self._overlap is None:
            raise ValueError(
                "ZeroRedundancyOptimizer must be constructed with overlap_with_ddp=True "
                "to be driven by a DDP hook"
            )
        if self._overlap.kind is not None:
            raise RuntimeError(
                "a DDP hook already drives this ZeroRedundancyOptimizer; build one "
                "optimizer per DDP model and register one hook"
            )
        self._overlap.kind = kind

    def _on_ddp_bucket(self, bucket: GradBucket, fut: Future[object]) -> None:
        """Called by the hook for each bucket; see [Note: overlapping the step with DDP]."""
        state = self._overlap
        assert state is not None and state.kind is not None
        if state.phase is BackwardPhase.IDLE:
            state.begin_pass()
            self._begin_local_step()
        state.pending.append((bucket, fut))
        interleaved = state.kind in (HookKind.INTERLEAVED, HookKind.TO_OWNERS)
        keep = 0 if bucket.is_last() else (1 if interleaved else None)
        while keep is not None and len(state.pending) > keep:
            self._step_ddp_bucket(*state.pending.popleft())
        if bucket.is_last():
            self._broadcaster.finish()
            self._end_local_step()
            state.end_pass()

    def _step_ddp_bucket(self, bucket: GradBucket, fut: Future[object]) -> None:
        grads = reduced_gradients(bucket, fut)
        if self._overlap is not None and self._overlap.kind is HookKind.TO_OWNERS:
            self._owner_reducer.release_oldest()  # see [Note: packed owner reduces]
        params = bucket.parameters()
        owners = [self._owner_of(p) for p in params]
        mine = [(p, g) for p, g, o in zip(params, grads, owners, strict=True) if o == self.rank]
        self._step_only(mine)
        for owner in range(self.world_size):
            share = [p for p, o in zip(params, owners, strict=True) if o == owner]
            self._broadcaster.start(share, owner)

    def _reduce_ddp_bucket_to_owners(self, bucket: GradBucket) -> Future[Tensor]:
        """The to-owners hook's reduction of one bucket, then the usual per-bucket step.

        See [Note: reduce to owners] in ``_owner_reduce.py``.
        """
        fut = self._owner_reducer.start(bucket, self._owner_of, self.rank, self.process_group)
        self._on_ddp_bucket(bucket, fut)  # type: ignore[arg-type]
        return fut

    def _owner_of(self, param: Tensor) -> int:
        owner = self._param_to_rank_map.get(param)
        if owner is None:
            raise RuntimeError(
                f"DDP reduced a parameter of shape {tuple(param.shape)} that was not given "
                "to this ZeroRedundancyOptimizer: build it from ddp_model.parameters()"
            )
        return owner

    def _step_only(self, params_and_grads: Sequence[tuple[Tensor, Tensor]]) -> None:
        """Step only these (owned) parameters, with these gradients.

        The local optimizer's groups are narrowed to the given parameters for
        one ``step()``; see [Note: overlapping the step with DDP].
        """
        if not params_and_grads:
            return
        subset = {p for p, _ in params_and_grads}
        saved_grads = [p.grad for p, _ in params_and_grads]
        full_groups = self.optim.param_groups
        narrowed = [{**g, "params": [p for p in g["params"] if p in subset]} for g in full_groups]
        for p, g in params_and_grads:
            p.grad = g
        self.optim.param_groups = [g for g in narrowed if g["params"]]
        try:
            self.optim.step()
        finally:
            self.optim.param_groups = full_groups
            for (p, _), saved in zip(params_and_grads, saved_grads, strict=True):
                p.grad = saved
        for small, full in zip(narrowed, full_groups, strict=True):
            _copy_hyperparameters([small], [full])

    # ------------------------------------------------------ param groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group, on every rank (it repartitions).

        The new parameters are spread over the ranks; existing parameters keep
        their owner and their optimizer state (see [Note: sorted-greedy
        partition]). Call it on all ranks with the same group, or the ranks'
        partitions, and so their collectives, diverge.
        """
        if not self.initialized:  # Optimizer.__init__ adding the initial groups
            super().add_param_group(param_group)
            return
        if "params" not in param_group:
            raise ValueError(
                "a parameter group must have a 'params' key listing its tensors, "
                "e.g. {'params': layer.parameters(), 'lr': 0.1}"
            )
        ps = param_group["params"]
        new_params = [ps] if isinstance(ps, Tensor) else list(ps)
        _check_same_dense_type(self._all_params + new_params)
        super().add_param_group({**param_group, "params": new_params})
        self._all_params += new_params
        self._trainable = self._trainable_mask()
        old = self._partition
        self._repartition()
        assert self._partition.owners[: old.num_groups] == old.owners
        self.optim.add_param_group(self._local_param_groups()[-1])
        _copy_hyperparameters(self.optim.param_groups, self.param_groups)
        self._rebuild_buckets()

    def _repartition(self) -> None:
        sizes = [[p.numel() for p in g["params"]] for g in self.param_groups]
        self._partition = sorted_greedy_partition(sizes, self.world_size)
        groups = [g["params"] for g in self.param_groups]
        self._params_per_rank = [
            [groups[g][i] for g, i in self._partition.owned(r)] for r in range(self.world_size)
        ]
        self._param_to_rank_map = {
            p: r for r, params in enumerate(self._params_per_rank) for p in params
        }

    def _local_param_groups(self) -> list[dict[str, Any]]:
        local = []
        for group, members in zip(self.param_groups, self._partition.members, strict=True):
            entry = {k: v for k, v in group.items() if k != "params"}
            entry["params"] = [group["params"][i] for i in members[self.rank]]
            local.append(entry)
        return local

    def _trainable_mask(self) -> tuple[bool, ...]:
        return tuple(p.requires_grad for p in self._all_params)

    def _rebuild_buckets(self) -> None:
        if self.parameters_as_bucket_view:
            self._buckets.build(self._params_per_rank)

    # --------------------------------------------------- partition views

    @property
    def partition(self) -> Partition:
        """Which rank owns which parameter, by (group, index in group)."""
        return self._partition

    @property
    def param_to_rank(self) -> Mapping[Tensor, int]:
        """Read-only map from each parameter to the rank that owns and steps it."""
        return MappingProxyType(self._param_to_rank_map)

    @property
    def params_per_rank(self) -> tuple[tuple[Tensor, ...], ...]:
        """``params_per_rank[r]``: the parameters rank ``r`` owns, in its local order."""
        return tuple(tuple(ps) for ps in self._params_per_rank)

    def _partition_parameters(
        self, params_per_rank: list[list[Tensor]] | None = None
    ) -> list[list[dict[str, Any]]]:
        """Per rank, its parameter groups (torch's view of the partition).

        Kept for code written against torch's optimizer; prefer :attr:`partition`.
        """
        if params_per_rank is not None:
            raise NotImplementedError(
                "a manual partition (params_per_rank) is not supported; the "
                "sorted-greedy partition is always used"
            )
        out: list[list[dict[str, Any]]] = []
        for rank in range(self.world_size):
            rank_groups = []
            for group, members in zip(self.param_groups, self._partition.members, strict=True):
                entry = dict(group)
                entry["params"] = [group["params"][i] for i in members[rank]]
                rank_groups.append(entry)
            out.append(rank_groups)
        return out

    @property
    def _param_to_rank(self) -> dict[Tensor, int]:
        """torch's name for :attr:`param_to_rank` (a copy)."""
        return dict(self._param_to_rank_map)

    @property
    def _index_to_param(self) -> list[Tensor]:
        """Parameters by their index in the full state dict."""
        return list(self._all_params)

    @property
    def _param_to_index(self) -> dict[Tensor, int]:
        """Each parameter's index in the full state dict."""
        return {p: i for i, p in enumerate(self._all_params)}

    # -------------------------------------------------------- state dict

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collect the whole optimizer state on rank ``to`` (a rank of the group).

        Collective: call it on every rank. Afterwards :meth:`state_dict` works
        on rank ``to``; it returns a snapshot taken now (copied to the CPU).
        """
        if not 0 <= to < self.world_size:
            raise ValueError(
                f"consolidate_state_dict(to={to}): `to` must be a rank of the process "
                f"group, 0..{self.world_size - 1}"
            )
        _copy_hyperparameters(self.param_groups, self.optim.param_groups)
        group_lengths = [len(g["params"]) for g in self.param_groups]
        global_ids = owned_global_indices(self._partition, self.rank, group_lengths)
        local = self.optim.state_dict()["state"]
        mine = {global_ids[i]: cpu_copy(v) for i, v in local.items()}
        with self._failures("gather", "the optimizer state", "consolidate_state_dict"):
            gathered = gather_to(
                mine,
                to,
                self.rank,
                self.world_size,
                self.process_group,
                device=self._default_device,
            )
        if self.rank == to:
            self._consolidated = {k: v for part in gathered for k, v in part.items()}
        else:
            self._consolidated = None

    def state_dict(self) -> dict[str, Any]:
        """The full optimizer state, in ``torch.optim.Optimizer.state_dict()`` layout.

        Only on the rank that :meth:`consolidate_state_dict` targeted, and as of
        that call; the parameter groups are the current ones. Any optimizer
        over the same parameter groups (ours at any world size, torch's plain
        or ZeRO) can load it.
        """
        if self._consolidated is None:
            raise RuntimeError(
                f"rank {self.rank} holds no consolidated optimizer state: call "
                f"consolidate_state_dict(to={self.rank}) on all ranks before state_dict()"
            )
        return full_state_dict(self._consolidated, self.param_groups)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a full optimizer state dict, saved at any world size.

        Call it on every rank with the same full state dict; each rank keeps the
        state of the parameters it owns. ``state_dict`` is not modified and
        shares no memory with the optimizer afterwards.
        """
        group_lengths = [len(g["params"]) for g in self.param_groups]
        check_full_state_dict(state_dict, group_lengths)
        check_state_shapes(state_dict, self._all_params)
        local = local_state_dict(state_dict, self._partition, self.rank, group_lengths)
        local["state"] = cpu_copy(local["state"])
        self.optim.load_state_dict(local)
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            _copy_hyperparameters([saved], [group])

    # -------------------------------------------------------------- join

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook that lets this optimizer train under ``Join`` with uneven inputs.

        A rank that has run out of inputs still steps the parameters it owns
        (with gradients sent by a rank still training, see [Note: uneven
        inputs]) and takes part in the broadcasts. No keyword arguments are used.
        """
        if self._overlap is not None:
            raise RuntimeError(
                "Join with uneven inputs is not supported with overlap_with_ddp=True: the "
                "step runs inside DDP's backward pass, which a joined rank does not run; "
                "build the optimizer with overlap_with_ddp=False to use Join"
            )
        return _ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        """The device of the first parameter; Join puts its flags there."""
        return self._default_device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        """The process group the optimizer shards over."""
        return self.process_group

    def _step_as_joined(self) -> None:
        """A joined rank's mirror of :meth:`step`: same collectives, same local update."""
        self._send_grads_to_joined(joined=True)
        self._begin_local_step()
        self.optim.step()
        self._end_local_step()
        with self._failures("broadcast", "the updated parameters", "optimizer step (joined)"):
            self._broadcast_all_shards()


class _ZeroJoinHook(JoinHook):
    """Runs a joined rank's share of each step the other ranks still take."""

    def __init__(self, zero: ZeroRedundancyOptimizer) -> None:
        self._zero = zero
        zero._in_join = True

    def main_hook(self) -> None:
        """Shadow one :meth:`ZeroRedundancyOptimizer.step` of the ranks still training."""
        self._zero._step_as_joined()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank has joined: steps no longer need to look for joined ranks."""
        self._zero._in_join = False


# ---------------------------------------------------------------- checks


def _checked_param_groups(params: Any) -> list[dict[str, Any]] | list[Tensor]:
    """``params`` as a list, after the checks torch's optimizer does late or not at all."""
    if isinstance(params, Tensor):
        raise TypeError(
            "params must be an iterable of Tensors or of parameter-group dicts, but got "
            f"a single {torch.typename(params)}: pass [tensor] or model.parameters()"
        )
    try:
        items = list(params)
    except TypeError as e:
        raise TypeError(
            "params must be an iterable of Tensors or of parameter-group dicts, but got "
            f"{type(params).__name__}"
        ) from e
    if all(isinstance(x, Tensor) for x in items):
        tensors: list[Tensor] = items
        groups: list[dict[str, Any]] | list[Tensor] = tensors
    elif all(isinstance(x, dict) for x in items):
        for i, group in enumerate(items):
            if "params" not in group:
                raise ValueError(
                    f"parameter group {i} has no 'params' key: each group must list its "
                    "tensors, e.g. {'params': layer.parameters(), 'lr': 0.1}"
                )
            ps = group["params"]
            items[i] = {**group, "params": [ps] if isinstance(ps, Tensor) else list(ps)}
        tensors = [p for g in items for p in g["params"]]
        groups = items
    else:
        kinds = sorted({type(x).__name__ for x in items})
        raise TypeError(
            "params must be an iterable of Tensors or of parameter-group dicts, not a mix "
            f"(got {kinds})"
        )
    if not tensors:
        raise ValueError(
            "ZeroRedundancyOptimizer got an empty parameter list: pass the model's "
            "parameters (was the iterator already consumed?)"
        )
    _check_same_dense_type(tensors)
    return groups


def _check_same_dense_type(params: Sequence[Tensor]) -> None:
    for p in params:
        if not isinstance(p, Tensor):
            raise TypeError(f"parameter groups may only hold Tensors, got {type(p).__name__}")
        if p.layout != torch.strided:
            raise ValueError(
                f"ZeroRedundancyOptimizer needs dense parameters, but got a {p.layout} "
                f"tensor of shape {tuple(p.shape)}; keep sparse parameters in a separate "
                "optimizer"
            )
    first = torch.typename(params[0])
    for p in params[1:]:
        if torch.typename(p) != first:
            raise ValueError(
                "ZeroRedundancyOptimizer needs all parameters of one dense type, but got both "
                f"{first} and {torch.typename(p)}; cast the model to one dtype and device "
                "type (or use one optimizer per type)"
            )


def _check_optimizer_class(optimizer_class: Any, overlap_with_ddp: bool) -> None:
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
        module = getattr(optimizer_class, "__module__", "") or ""
        hint = (
            "; torch's functional optimizers are not needed here, pass the torch.optim "
            "class (e.g. torch.optim.Adam) instead"
            if module.startswith("torch.distributed.optim")
            else ""
        )
        raise TypeError(
            "optimizer_class must be a torch.optim.Optimizer subclass such as "
            f"torch.optim.AdamW, got {optimizer_class!r}{hint}"
        )
    if overlap_with_ddp:
        for cls, why in _NOT_PER_PARAMETER.items():
            if issubclass(optimizer_class, cls):
                raise ValueError(
                    f"{optimizer_class.__name__} cannot be used with overlap_with_ddp=True: "
                    f"{why}. The overlapped step updates parameters bucket by bucket; use "
                    "overlap_with_ddp=False with this optimizer"
                )


def _copy_hyperparameters(src: Sequence[Mapping[str, Any]], dst: Sequence[dict[str, Any]]) -> None:
    """Copy every key but ``"params"`` from each group of ``src`` to the same group of ``dst``."""
    assert len(src) == len(dst), (len(src), len(dst))
    for s, d in zip(src, dst, strict=True):
        for key, value in s.items():
            if key != "params":
                d[key] = value
