"""When a ``fully_shard`` module gathers, frees and reduces: its hooks.

:class:`FullyShardState` is the run-time half of one ``fully_shard`` call (the
module it was applied to holds it). It registers a forward pre-hook and a
forward hook on the module, a hook on every output tensor for the backward,
and an autograd function on the inputs whose backward runs once the module's
gradients are computed; the root (the first module whose forward runs, which
must contain all the others) also runs the end-of-backward callback. The
shared runtime does the rest: :class:`~fsdp._runtime._root_context.RootContext`
(order of units, rate limiter, reductions in flight) and each group's
storages.

[Note: one fully_shard step]
For a module ``m`` with a group (``reshard_after_forward=True`` unless noted):
1. ``m`` pre-forward: the root's first pre-forward of an iteration runs its
   lazy initialisation (once) and moves inputs to the device; inputs are cast
   (``MixedPrecisionPolicy``); the group's all-gather is issued unless it was
   issued ahead, waited for, and copied out into the unsharded leaves, which
   the modules now hold; the inputs pass through an autograd function whose
   backward is ``m``'s post-backward; the gather of the module whose forward
   comes next is issued ahead (or of those ``set_modules_to_forward_prefetch``
   named), see [Note: issue-ahead] in ``_runtime/_root_context.py``.
2. ``m`` post-forward: the group reshards (to the smaller group for an int
   ``reshard_after_forward``; not at all for the root or ``False``); every
   output tensor that requires grad gets ``m``'s pre-backward hook; outputs
   are cast to ``output_dtype``.
3. ``m`` pre-backward (the first output hook to fire): the root's
   end-of-backward callback is queued; the group gathers again if it was
   resharded, and the module whose backward comes next (the reverse of the
   order in which forwards finished, or ``set_modules_to_backward_prefetch``)
   gathers ahead.
4. ``m`` post-backward (the inputs' autograd function): the unsharded
   gradients are taken off the leaves, the group reshards
   (``set_reshard_after_backward``), and each trainable part's gradient
   reduction is issued, asynchronously (not under
   ``set_requires_gradient_sync(False)``, where the gradients stay on the
   leaves).
5. end of backward (the root's callback): post-backward for groups whose
   inputs needed no gradient (the root, with token ids as input), every
   state back to IDLE; every reduction is completed, so each sharded
   parameter's ``.grad`` holds its averaged gradient shard as a ``DTensor``
   (the last backward, ``set_is_last_backward``, also forgets the recorded
   backward order).

[Note: several modules, one group]
``fully_shard([a, b])`` gives ``a`` and ``b`` one state and one group (torchtitan
groups the final norm with the output projection: two small modules, one
all-gather). Each module gets the hooks; a pass of the group starts at the
pre-forward of whichever module runs first (which does step 1 once: the root's
work, the post-backward routing of its inputs, issue-ahead) and ends at the
post-forward of the last of them still to run (step 2). The other modules'
pre-forwards only cast their inputs (and gather, had something resharded the
group in between) and their post-forwards only cast their outputs. A forward
of the root in which some module of a group never ran (a chunked loss: the
model's forward stops before the output projection, which the loss then calls
on each chunk) completes that group's pass at the root's post-forward, on the
root's output. A module of the group called on its own afterwards starts a new
pass that no post-forward ends; each such call routes its inputs through the
post-backward again once the previous call's backward ran, so every chunk's
gradient is reduced, and the root's end of backward puts everything back to
idle.
"""

from __future__ import annotations

from collections.abc import Iterator
from enum import Enum, auto
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.distributed._composable_state import _State

from fsdp._fully_shard._mesh import MeshInfo
from fsdp._fully_shard._param_group import GroupState, ParamGroup
from fsdp._fully_shard._policies import MixedPrecisionPolicy
from fsdp._fully_shard._saved_params import SavedParamsWatch
from fsdp._runtime._agreement import check_agree
from fsdp._runtime._collective_failure import in_phase
from fsdp._runtime._common import (
    apply_to_tensors,
    cast_floating_tensors,
    clean_fqn,
    eager_only,
    hook_grad_outputs,
    move_tensors_to_device,
)
from fsdp._runtime._root_context import RateLimiter, RootContext
from fsdp._runtime._sharded_storage import ShardedStorage

__all__ = ["STATE_ATTR", "FullyShardState", "Phase", "state_of"]

STATE_ATTR = "_fsdp_fully_shard_state"
"""Attribute (in the module's ``__dict__``) under which a module holds its state."""

ORPHAN = "_fsdp_fully_shard_orphan"
"""On an original parameter tied across two sibling calls, released by one and not yet
taken by a common parent (see [Note: tied parameters across fully_shard calls])."""

_GATHERABLE = (GroupState.SHARDED, GroupState.SHARDED_POST_FORWARD)


def state_of(module: nn.Module) -> FullyShardState | None:
    """The ``fully_shard`` state of ``module``, if ``fully_shard`` was applied to it."""
    state = module.__dict__.get(STATE_ATTR)
    return state if isinstance(state, FullyShardState) else None


class Phase(Enum):
    """What a ``fully_shard`` module (or its group) is doing, by torch's names."""

    IDLE = auto()
    """Between forward and backward passes, or before/after them."""
    FORWARD = auto()
    """Inside the module's forward (pre-forward to post-forward)."""
    PRE_BACKWARD = auto()
    """The module's backward has started (its parameters are gathered for it)."""
    POST_BACKWARD = auto()
    """The group's gradients have been handed to the reduction."""


class IterationContext:
    """Per-iteration state that every module under one root shares."""

    def __init__(self) -> None:
        self.forward_root: FullyShardState | None = None  # runs this iteration's root work
        self.is_last_backward = True  # finish the reductions at the end of backward
        self.post_optim_event: Any = None  # accepted, see FSDPModule.set_post_optim_event


class FullyShardState(_State):
    """Hooks and phase of one ``fully_shard`` call; see [Note: one fully_shard step] and
    [Note: several modules, one group]. A ``_State`` of torch's composable APIs, which
    find it through the module ([Note: torch's composable registry] in ``_composable.py``)."""

    modules: tuple[nn.Module, ...]  # the modules fully_shard was applied to (usually one)
    module: nn.Module  # the first of them
    group: ParamGroup | None  # None when it manages no parameters
    mesh: MeshInfo
    device: torch.device
    mp: MixedPrecisionPolicy
    auto_reshard_after_forward: bool  # reshard_after_forward was None: the root keeps them
    is_root: bool | None  # None until the lazy initialisation
    ctx: RootContext[FullyShardState] | None  # shared with the whole tree after lazy init
    iteration: IterationContext | None
    phase: Phase  # the module's
    group_phase: Phase  # the group's (a module used twice reduces twice)
    forward_prefetch: list[FullyShardState] | None  # set_modules_to_forward_prefetch
    backward_prefetch: list[FullyShardState] | None  # set_modules_to_backward_prefetch
    _expects_backward: bool  # the last forward hooked outputs for backward
    _to_run: list[nn.Module]  # modules of the group whose forward is still to come
    # set_unshard_in_backward(False): whether the last forward saved the parameters
    _watch: SavedParamsWatch | None
    _saved_params: bool

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        group: ParamGroup | None,
        *,
        mesh: MeshInfo,
        device: torch.device,
        mp: MixedPrecisionPolicy,
        auto_reshard_after_forward: bool,
    ) -> None:
        self.modules = modules
        self.module = modules[0]
        self.group = group
        self.mesh = mesh
        self.device = device
        self.mp = mp
        self.auto_reshard_after_forward = auto_reshard_after_forward
        self.is_root = None
        self.ctx = None
        self.iteration = None
        self.phase = Phase.IDLE
        self.group_phase = Phase.IDLE
        self.forward_prefetch = None
        self.backward_prefetch = None
        self._expects_backward = False
        self._to_run = []
        self._watch = None
        self._saved_params = False
        for module in modules:
            module.__dict__[STATE_ATTR] = self
        if len(modules) == 1:
            self._handles = [
                modules[0].register_forward_pre_hook(
                    self._pre_forward, prepend=True, with_kwargs=True
                ),
                modules[0].register_forward_hook(self._post_forward, prepend=False),
            ]
        else:
            self._handles = [
                h
                for module in modules
                for h in (
                    module.register_forward_pre_hook(
                        self._group_pre_forward, prepend=True, with_kwargs=True
                    ),
                    module.register_forward_hook(self._group_post_forward, prepend=False),
                )
            ]
        if group is not None:
            for m in {p.site.module for p in group.params}:
                m.register_state_dict_pre_hook(self._reshard_for_state_dict)
                m._register_load_state_dict_pre_hook(self._reshard_for_state_dict)
                m.register_load_state_dict_post_hook(self._resync_after_load)

    def __repr__(self) -> str:
        names = ", ".join(type(m).__name__ for m in self.modules)
        return f"FullyShardState({names} at {id(self):#x})"

    # --- lazy initialisation ----------------------------------------------------------------

    def lazy_init(self) -> None:
        """Make this state the root of every ``fully_shard`` state in its module's tree.

        Runs at the first forward. Checks what can only be checked once the
        user finished applying ``fully_shard`` (materialised parameters, no
        parameter in two groups) and that every rank built the same model.
        """
        if self.is_root is not None:
            return
        if len(self.modules) > 1:
            raise RuntimeError(
                f"FSDP requires a single root module but got {list(self.modules)}: the "
                "modules of one fully_shard([...]) call ran forward outside any module that "
                "contains them. Apply fully_shard to a module that contains them all (the "
                "root model: fully_shard(model) after the inner calls) and run it."
            )
        states: list[FullyShardState] = []
        for name, module in self.module.named_modules():
            state = state_of(module)
            if state is None or state in states:
                continue
            if state is not self and state.is_root is not None:
                raise RuntimeError(
                    f"FSDP state has already been lazily initialized for {name}\n"
                    "FSDP requires running forward through the root module first: the module "
                    f"{name!r} ran forward on its own before this one "
                    f"({type(self.module).__name__}), which contains it. Run forward through "
                    "the outermost fully_shard module first (or apply fully_shard to the "
                    "outer module only after running the inner one alone)."
                )
            states.append(state)
        _check_no_orphans(self.module)
        self.is_root = True
        for state in states[1:]:
            state.is_root = False
        names = {id(m): n for n, m in self.module.named_modules()}
        fqns = {id(p): n for n, p in self.module.named_parameters(remove_duplicate=False)}
        seen: dict[int, str] = {}
        for state in states:
            group = state.group
            if group is None:
                continue
            group.fqn = clean_fqn(names.get(id(state.module), "") + ".").rstrip(".") or "<root>"
            for p in group.params:
                p.fqn = fqns.get(id(p.sharded), p.site.name)
                if id(p.sharded) in seen:
                    raise ValueError(
                        f"Parameter '{p.fqn}' is shared with a parameter already managed by "
                        "another FSDP group: each group would train its own copy. For "
                        "shared/tied parameters, use fully_shard([module_a, module_b]) to place "
                        "them in the same FSDP group, or apply fully_shard to a module that "
                        "contains both uses."
                    )
                seen[id(p.sharded)] = p.fqn
            group.sync()
            _check_materialized(group)
        if self.auto_reshard_after_forward and self.group is not None:
            self.group.set_post_forward(None)  # the root's backward needs them at once
        _check_states_agree(states)
        ctx: RootContext[FullyShardState] = RootContext(
            states, RateLimiter(self.device, enabled=True), lambda: _storages(states)
        )
        iteration = IterationContext()
        for state in states:
            state.ctx = ctx
            state.iteration = iteration

    def _context(self) -> RootContext[FullyShardState]:
        if self.ctx is None:
            raise AssertionError("fully_shard runtime used before lazy initialisation")
        return self.ctx

    def _iteration(self) -> IterationContext:
        if self.iteration is None:
            raise AssertionError("fully_shard runtime used before lazy initialisation")
        return self.iteration

    # --- forward ----------------------------------------------------------------------------

    @eager_only
    @in_phase("forward")
    def _pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        group = self.group
        if self.phase is Phase.PRE_BACKWARD:
            # Activation checkpointing re-runs the forward inside the backward: the
            # parameters must be (and stay) gathered for it.
            if group is not None and not group.is_unsharded:
                group.unshard()
                group.wait_for_unshard()
            return self._cast_inputs(args, kwargs)
        # A group of several modules enters its forward once per pass (the first of
        # its modules to run); the others only gather (if resharded between) and cast.
        first = self.phase is not Phase.FORWARD
        self.phase = Phase.FORWARD
        if first:
            args, kwargs = self._root_pre_forward(args, kwargs)
        args, kwargs = self._cast_inputs(args, kwargs)
        ctx = self._context()
        ahead = ctx.exec_order.forward_step(self) if first else None
        if ctx.forward_ahead is self:
            ctx.forward_ahead = None  # issued ahead by the module before: its turn now
        if group is not None:
            if group.is_stale():
                self._discard_gather()  # [Note: stale gathers] in _param_group.py
            if group.state in _GATHERABLE:
                ctx.limiter.throttle()
                group.unshard()
            group.wait_for_unshard()
            if self.group_phase is not Phase.FORWARD:
                # Once per pass of the group (again after a backward of its own, as a
                # module of the group called alone per loss chunk does).
                self.group_phase = Phase.FORWARD
                args, kwargs = self._register_post_backward(args, kwargs)
        if not first:
            return args, kwargs
        self._saved_params = False
        if group is not None and not group.unshard_in_backward and torch.is_grad_enabled():
            ptrs = {p.buf.untyped_storage().data_ptr() for p in group.params if p.buf is not None}
            self._watch = SavedParamsWatch(ptrs).__enter__()
        if self.forward_prefetch is not None:
            for target in self.forward_prefetch:
                target._prefetch()
        else:
            self._issue_ahead(ahead)
        return args, kwargs

    def _group_pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Pre-forward of one module of a group of several ([Note: several modules, one
        group])."""
        if not self._to_run:
            self._to_run = list(self.modules)
        return self._pre_forward(module, args, kwargs)

    def _group_post_forward(self, module: nn.Module, inputs: Any, output: Any) -> Any:
        """Post-forward of one module of a group of several: the group's post-forward
        runs when the last of its modules still to run has run."""
        if any(m is module for m in self._to_run):
            self._to_run = [m for m in self._to_run if m is not module]
            if not self._to_run:
                return self._post_forward(module, inputs, output)
        return self._cast_output(output)

    def _root_pre_forward(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        self.lazy_init()
        iteration = self._iteration()
        if iteration.forward_root is not None:
            return args, kwargs
        iteration.forward_root = self
        iteration.post_optim_event = None  # our gathers wait for the compute stream anyway
        ctx = self._context()
        ctx.exec_order.start_forward()
        ctx.forward_ahead = None
        ctx.start_refreshes()
        if self.device.type != "cpu":
            args, kwargs = move_tensors_to_device(self.device, args, kwargs)
        return args, kwargs

    def _cast_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        mp = self.mp
        if not mp.cast_forward_inputs or mp.param_dtype is None:
            return args, kwargs
        out: tuple[tuple[Any, ...], dict[str, Any]] = cast_floating_tensors(
            mp.param_dtype, args, kwargs
        )
        return out

    def _cast_output(self, output: Any) -> Any:
        dtype = self.mp.output_dtype
        if dtype is None:
            return output
        args, _ = cast_floating_tensors(dtype, (output,), {})
        return args[0]

    @eager_only
    @in_phase("forward")
    def _post_forward(self, module: nn.Module, inputs: Any, output: Any) -> Any:
        if self.phase is Phase.PRE_BACKWARD:
            return self._cast_output(output)  # recomputation inside backward: keep gathered
        output = self._complete_forward(output)
        iteration = self._iteration()
        if iteration.forward_root is self:
            for state in reversed(self._context().states):
                if state is not self and state._to_run:
                    output = state._cast_output(state._complete_forward(output))
            # Only the root's forwards set the order (not a module called on its own).
            self._context().exec_order.end_forward(
                record=torch.is_grad_enabled() and bool(self.is_root)
            )
            self._free_forward_ahead()
            iteration.forward_root = None
        return self._cast_output(output)

    def _complete_forward(self, output: Any) -> Any:
        """The group's forward is over: reshard, hook ``output`` for the backward."""
        if self._watch is not None:
            self._watch.__exit__()
            self._saved_params, self._watch = self._watch.saw_params, None
        ctx = self._context()
        group = self.group
        if group is not None and group.post_forward is not None and group.is_unsharded:
            group.reshard(after_forward=True)
            ctx.limiter.record_free()
        if torch.is_grad_enabled():
            ctx.exec_order.record_post_forward(self)
        output = self._register_pre_backward(output)
        self.phase = Phase.IDLE
        if self.group_phase is Phase.FORWARD:
            self.group_phase = Phase.IDLE
        self._to_run = []
        return output

    def _issue_ahead(self, target: FullyShardState | None) -> None:
        """Start the gather of the module whose forward comes next ([Note: issue-ahead])."""
        if target is None or target.group is None:
            return
        if target.group.state not in _GATHERABLE:
            return
        self._context().issue_ahead(target, target.group.unshard)

    def _free_forward_ahead(self) -> None:
        """End of the iteration's forward: free a module issued ahead whose forward did not run."""
        ctx = self._context()
        target = ctx.take_forward_ahead()
        if target is None or target.group is None:
            return
        if target.group.state is GroupState.UNSHARDING:
            target._discard_gather()

    def _discard_gather(self) -> None:
        """Drop what this group gathered (or is gathering) without using it."""
        group = self.group
        assert group is not None
        if group.state is GroupState.SHARDED:
            return
        group.reshard()
        if self.ctx is not None:
            self.ctx.limiter.record_free()

    def _prefetch(self) -> None:
        """Issue this module's gather now (explicit prefetching)."""
        group = self.group
        if group is None or group.state not in (
            GroupState.SHARDED,
            GroupState.SHARDED_POST_FORWARD,
        ):
            return
        if self.ctx is not None:
            self.ctx.limiter.throttle()
        group.unshard()

    # --- backward ---------------------------------------------------------------------------

    def _register_post_backward(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Route the inputs that require grad through :class:`_PostBackward`."""
        if not torch.is_grad_enabled():
            return args, kwargs
        found: list[Tensor] = []

        def collect(t: Tensor) -> Tensor:
            if t.requires_grad:
                found.append(t)
            return t

        apply_to_tensors(collect, (args, kwargs))
        if not found:
            return args, kwargs
        outputs = _PostBackward.apply(self, *found)  # type: ignore[no-untyped-call]
        routed: Iterator[Tensor] = iter(cast(tuple[Tensor, ...], outputs))

        def replace(t: Tensor) -> Tensor:
            return next(routed) if t.requires_grad else t

        new_args, new_kwargs = apply_to_tensors(replace, (args, kwargs))
        return new_args, new_kwargs

    def _register_pre_backward(self, output: Any) -> Any:
        registered = False
        if torch.is_grad_enabled():
            output, registered = hook_grad_outputs(output, self._pre_backward)
        self._expects_backward = registered
        return output

    def _queue_final_callback(self) -> None:
        ctx = self._context()
        ctx.queue_end_of_backward(ctx.states[0]._finalize_backward)

    @eager_only
    @in_phase("backward")
    def _pre_backward(self, grad: Tensor) -> None:
        self._queue_final_callback()
        if self.phase is Phase.PRE_BACKWARD and self.group_phase is Phase.PRE_BACKWARD:
            return
        self.phase = Phase.PRE_BACKWARD
        self.group_phase = Phase.PRE_BACKWARD
        group = self.group
        ctx = self._context()
        if group is not None and not group.unshard_in_backward and self._saved_params:
            raise ValueError(
                f"set_unshard_in_backward(False) on the fully_shard module {group.fqn!r}, but "
                "its forward saved its parameters for the backward (autograd needs them to "
                "compute gradients: a Linear, a norm), and they are not gathered again. Keep "
                "set_unshard_in_backward(True) (the default) for it: only a module whose "
                "backward reads no parameters (an embedding) can skip the gather."
            )
        if group is not None and group.unshard_in_backward:
            if not group.is_unsharded:
                ctx.limiter.throttle()
                group.unshard()
            group.wait_for_unshard()
        if self.backward_prefetch is not None:
            for target in self.backward_prefetch:
                target._prefetch()
            return
        following = ctx.exec_order.next_backward(self)
        if (
            following is not None
            and following.group is not None
            and following.group.unshard_in_backward
            and following._expects_backward
            and following.phase is not Phase.PRE_BACKWARD
        ):
            following._prefetch()

    @in_phase("post-backward")
    def _post_backward(self) -> None:
        """The module's gradients are computed: reshard and start the reductions."""
        group = self.group
        if group is None:
            return
        self.group_phase = Phase.POST_BACKWARD
        was_unsharded = group.state is not GroupState.SHARDED
        pending = group.post_backward_reduce()
        ctx = self._context()
        if was_unsharded and group.state is GroupState.SHARDED:
            ctx.limiter.record_free()
        for reduce in pending:
            ctx.push_reduction(reduce)

    @eager_only
    @in_phase("post-backward")
    def _finalize_backward(self) -> None:
        """Root, once per backward: reductions of groups the hooks missed, states back to IDLE."""
        ctx = self._context()
        iteration = self._iteration()
        iteration.forward_root = None
        for state in ctx.states:
            if state.group is not None and state.group_phase is not Phase.POST_BACKWARD:
                state._post_backward()
            if state.group is not None and state.group.state is GroupState.UNSHARDING:
                # A prefetch that no backward used (it named a module whose backward had
                # already run, or will not run): its gather is dropped, never copied out.
                state._discard_gather()
            state._back_to_idle()
        # Every backward completes its reductions: one that is not the last may still be
        # followed by an optimizer step or a read of .grad (see set_is_last_backward).
        ctx.finish_reductions()
        if iteration.is_last_backward:
            ctx.exec_order.end_backward()
        ctx.callback_queued = False

    def _back_to_idle(self) -> None:
        self.phase = Phase.IDLE
        self.group_phase = Phase.IDLE
        self._expects_backward = False
        self._to_run = []

    # --- state dicts ------------------------------------------------------------------------

    def _reshard_for_state_dict(self, *args: Any, **kwargs: Any) -> None:
        """Before ``state_dict`` / ``load_state_dict``: the sharded parameters are registered."""
        if self.group is not None:
            self.group.reshard()

    def _resync_after_load(self, *args: Any, **kwargs: Any) -> None:
        """After ``load_state_dict``: take in parameters ``assign=True`` replaced; gather the
        replica shards again ([Note: sharding across replicas]: every rank loads)."""
        if self.group is not None:
            self.group.sync()
            for storage in self.group.storages:
                storage.drop_replica_shard()

    # --- recovery ---------------------------------------------------------------------------

    def reset_iteration(self) -> None:
        """After an exception in forward or backward: drop the iteration, reshard everything."""
        if self.is_root is False:
            raise RuntimeError(
                "reset_iter_state must be called on the root FSDP module (the module the "
                "outermost fully_shard was applied to, whose forward ran first)"
            )
        ctx = self.ctx
        if ctx is None:
            return
        ctx.drop_reductions()
        for state in ctx.states:
            if state.group is not None:
                state.group.reshard()
                for part in state.group.parts:
                    part.partial = None
            state._back_to_idle()
        ctx.forward_ahead = None
        ctx.callback_queued = False
        ctx.exec_order.end_backward()
        self._iteration().forward_root = None


class _PostBackward(torch.autograd.Function):
    """Identity on a module's inputs whose backward runs the module's post-backward.

    Autograd computes a module's parameter gradients in the same nodes as the
    gradients of its inputs (and accumulates leaf gradients before it moves
    on), so when the inputs' gradients arrive here, the module's gradients are
    complete.
    """

    @staticmethod
    def forward(ctx: Any, state: FullyShardState, *inputs: Tensor) -> tuple[Tensor, ...]:
        ctx.state = state
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        ctx.state._post_backward()
        return (None, *grads)


def _storages(states: list[FullyShardState]) -> list[ShardedStorage]:
    return [s for state in states if state.group is not None for s in state.group.storages]


def _check_materialized(group: ParamGroup) -> None:
    on_meta = [p.fqn for p in group.params if p.sharded.device.type == "meta"]
    if on_meta:
        raise RuntimeError(
            "FSDP parameters should be materialized from meta device before training, but the "
            f"following were still on meta device: {on_meta}\nFor example, call "
            "module.to_empty(device) to materialize to device and call "
            "module.reset_parameters() on each module to initialize values."
        )
    if group.offload_to_cpu:
        off = [(p.fqn, str(p.sharded.device)) for p in group.params if not _on_cpu(p.sharded)]
        if off:
            raise RuntimeError(
                "FSDP parameters should be materialized on CPU when enabling CPU offloading. "
                'For example, load a CPU state dict or call module.to_empty(device="cpu"). '
                f"Found following parameters on non-CPU device: {off}\n"
            )


def _check_no_orphans(root: nn.Module) -> None:
    uses: dict[int, list[str]] = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        if p.__dict__.get(ORPHAN):
            uses.setdefault(id(p), []).append(name)
    if uses:
        names = next(iter(uses.values()))
        raise ValueError(
            f"parameter {names[0]!r} is also used as {', '.join(map(repr, names[1:]))}, in "
            "modules of different fully_shard calls, and no fully_shard call contains them "
            "all: its copies would train apart. Apply fully_shard to a module that contains "
            "every use (usually the root model: fully_shard(model) after the blocks), which "
            "then owns it."
        )


def _check_states_agree(states: list[FullyShardState]) -> None:
    """The agreement step ([Note: agreement step]): every rank applied the same fully_shard."""
    root = states[0]
    groups = [root.mesh.shard_group, root.mesh.replicate_group]
    fingerprint: dict[str, str] = {
        "mesh shape": str(tuple(root.mesh.mesh.shape)),
        "number of fully_shard modules": str(len(states)),
    }
    for i, state in enumerate(states):
        group = state.group
        if group is None:
            fingerprint[f"module {i}"] = f"{type(state.module).__name__}, no parameters"
            continue
        params = ", ".join(
            f"{p.fqn} {tuple(p.shape)} {str(p.sharded.dtype).removeprefix('torch.')}"
            f"{'' if p.sharded.requires_grad else ' frozen'}"
            for p in group.params
        )
        if len(params) > 160:
            params = params[:157] + "..."
        fingerprint[f"module {i} ({group.fqn!r})"] = params
        fingerprint[f"module {i} ({group.fqn!r}) options"] = (
            f"mp_policy={state.mp}, offload={'cpu' if group.offload_to_cpu else 'none'}, "
            f"reshard_after_forward={_reshard_name(group)}, comm_policy={group.comm_policy}"
        )
    check_agree(
        "fully_shard lazy init",
        fingerprint,
        groups,
        device=root.device,
        where="fully_shard (first forward, lazy initialisation)",
        fixes={
            "number of fully_shard": "Build the same model on every rank and apply fully_shard "
            "to the same modules.",
            "module ": "Build the same model on every rank (same sizes, dtypes and "
            "requires_grad) and pass the same fully_shard arguments.",
        },
        default_fix="Pass the same mesh and fully_shard arguments on every rank.",
    )


def _on_cpu(t: Tensor) -> bool:
    return t.device.type == "cpu"


def _reshard_name(group: ParamGroup) -> str:
    info = group.post_forward
    if info is None:
        return "False"
    return "True" if info is group.mesh else str(info.shard_size)
