"""When each FSDP instance gathers, frees and reduces: its forward/backward hooks.

:class:`FSDPState` is the run-time half of one ``FullyShardedDataParallel``
instance (the public class in ``fully_sharded_data_parallel.py`` holds one and
forwards to it). It owns the instance's :class:`TrainingState` and decides,
from the hooks below, when its :class:`~fsdp._wrapper._flat_param_unit.FlatParamUnit`
changes form. The root instance additionally creates the shared
:class:`~fsdp._runtime._root_context.RootContext` and runs the end-of-backward callback.

[Note: one training step]
For a unit ``u`` with parameters (FULL_SHARD unless noted):
1. root pre-forward (root only): lazy init, inputs to the compute device and
   cast for mixed precision.
2. ``u`` pre-forward: all-gather (unless already gathered or issued ahead),
   wait, set the modules' parameter views; issue the all-gather of the unit
   whose forward comes next (see [Note: issue-ahead] in ``_root_context.py``).
3. ``u`` post-forward: register a pre-backward hook on every output tensor
   that requires grad; free the gathered parameters unless ``u`` is the root
   or SHARD_GRAD_OP (they are used by the backward right away / kept until it).
   Without a backward to come (no grad mode, no output requiring grad) free
   them in any case, and the root frees every unit. The root also keeps
   this forward's order for the next one and frees a unit issued ahead
   whose forward did not run.
4. ``u`` pre-backward (first output hook to fire): queue the root's
   end-of-backward callback if nobody has, gather again if freed,
   BACKWARD_PRE-prefetch the next unit in backward order.
5. ``u`` post-backward (a post-accumulate-grad hook on ``u``'s compute
   parameter, so it runs once all of ``u``'s gradient is summed): free the
   gathered parameters, BACKWARD_POST-prefetch, and issue the asynchronous
   reduce-scatter of the gradient (not inside ``no_sync()``).
6. end of backward (root callback, once per backward): complete every
   reduction, free whatever is still gathered (unused or frozen units), and
   reset every instance to IDLE; ``.grad`` of each FlatParameter now holds the
   averaged sharded gradient.
Under ``use_orig_params=True`` step 2 first takes in what the user changed on
the original parameters (replaced ``.data``, ``.grad`` set to ``None`` by
``zero_grad``), step 4 again for the gradients, and step 6 points the original
parameters' ``.grad`` at the new sharded gradient (see [Note: original
parameter views] in ``_orig_params.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from fsdp._runtime._collective_failure import in_phase
from fsdp._runtime._common import (
    TrainingState,
    TrainingStateError,
    cast_floating_tensors,
    eager_only,
    hook_grad_outputs,
    move_tensors_to_device,
)
from fsdp._runtime._root_context import RateLimiter, RootContext
from fsdp._wrapper._agreement import check_ranks_agree
from fsdp._wrapper._flat_param_unit import FlatParamUnit, ShardState
from fsdp.api import BackwardPrefetch, MixedPrecision

__all__ = ["FSDPState", "get_fsdp_state"]


def get_fsdp_state(module: nn.Module) -> FSDPState | None:
    """The FSDP state of ``module`` if it is an FSDP instance, else ``None``."""
    state = module.__dict__.get("_fsdp_state")
    return state if isinstance(state, FSDPState) else None


class FSDPState:
    """Hooks and training state of one FSDP instance (see [Note: one training step])."""

    module: nn.Module  # the FSDP instance this state belongs to
    unit: FlatParamUnit | None  # None when the instance manages no parameters
    training_state: TrainingState
    is_root: bool | None  # None until the lazy initialisation at the first forward
    parent: FSDPState | None  # the nearest enclosing FSDP instance, set when it is built
    ctx: RootContext[FSDPState] | None  # shared with the whole tree; set by the root's lazy init
    sync_gradients: bool  # False inside no_sync()
    compute_device: torch.device
    mixed_precision: MixedPrecision
    backward_prefetch: BackwardPrefetch | None
    forward_prefetch: bool
    limit_all_gathers: bool
    issue_ahead: bool  # gather the next unit in forward order before this one computes
    comm_hook: Callable[..., Any] | None
    comm_hook_state: object
    comm_hook_casts: bool  # the hook communicates in low precision itself
    # Buffers this instance cast for mixed precision: (module, name) -> original dtype.
    buffer_orig_dtypes: dict[tuple[nn.Module, str], torch.dtype]
    _ran_pre_backward: bool  # the pre-backward work ran in the current backward
    _expects_backward: bool  # the last forward registered pre-backward hooks
    _post_backward_handle: RemovableHandle | None

    def __init__(
        self,
        module: nn.Module,
        unit: FlatParamUnit | None,
        *,
        compute_device: torch.device,
        mixed_precision: MixedPrecision,
        backward_prefetch: BackwardPrefetch | None,
        forward_prefetch: bool,
        limit_all_gathers: bool,
    ) -> None:
        self.module = module
        self.unit = unit
        self.training_state = TrainingState.IDLE
        self.is_root = None
        self.parent = None
        self.ctx = None
        self.sync_gradients = True
        self.compute_device = compute_device
        self.mixed_precision = mixed_precision
        self.backward_prefetch = backward_prefetch
        self.forward_prefetch = forward_prefetch
        self.limit_all_gathers = limit_all_gathers
        # See [Note: issue-ahead]: the default reproduces the overlap FSDP1 gets from
        # CUDA's run-ahead, on the CPU and on CUDA (where our gathers wait for compute).
        self.issue_ahead = forward_prefetch or limit_all_gathers
        self.comm_hook = None
        self.comm_hook_state = None
        self.comm_hook_casts = False
        self.buffer_orig_dtypes = {}
        self._ran_pre_backward = False
        self._expects_backward = False
        self._post_backward_handle = None
        if unit is not None and unit.requires_grad:
            self._post_backward_handle = unit.compute_param.register_post_accumulate_grad_hook(
                self._post_backward
            )

    def __repr__(self) -> str:
        inner = self.module._modules.get("_fsdp_wrapped_module")
        return f"FSDPState({type(inner).__name__} at {id(self):#x})"

    # --- state checks -------------------------------------------------------------------------

    def assert_state(self, allowed: TrainingState | tuple[TrainingState, ...], what: str) -> None:
        """Raise a clear error if ``what`` is attempted in the wrong training state."""
        allowed_t = (allowed,) if isinstance(allowed, TrainingState) else allowed
        if self.training_state not in allowed_t:
            hint = {
                TrainingState.FORWARD_BACKWARD: "it is running inside a forward or backward pass; "
                "call it between training steps",
                TrainingState.SUMMON_FULL_PARAMS: "it is running inside summon_full_params() "
                "(or apply()/state_dict()); exit that context first",
                TrainingState.IDLE: "it is idle",
            }[self.training_state]
            raise TrainingStateError(
                f"{what} needs the FSDP instance in state "
                f"{' or '.join(s.name for s in allowed_t)}, but {hint} (expected to be in "
                f"states {[s.name for s in allowed_t]} but current state is "
                f"{self.training_state.name}, in torch's words)"
            )

    # --- lazy initialisation ----------------------------------------------------------------

    def lazy_init(self) -> None:
        """Make this instance the root of its tree unless a root already claimed it.

        Runs at the first forward (or ``no_sync``/``clip_grad_norm_``/...):
        every FSDP instance below becomes non-root and shares the root's
        :class:`RootContext`; buffers get their mixed-precision dtype.
        """
        if self.is_root is not None:
            return
        if self.parent is not None:  # only the outermost instance can be the root
            top = self.parent
            while top.parent is not None:
                top = top.parent
            top.lazy_init()
            return
        states = [s for m in self.module.modules() if (s := get_fsdp_state(m)) is not None]
        for s in states[1:]:
            if s.is_root:
                raise RuntimeError(
                    "An FSDP instance nested in this one already ran as a root (its forward "
                    "was called on its own before the outer one's). Run forwards only through "
                    "the outermost FSDP instance, or wrap the outer model before using it."
                )
        kinds = {s.unit.orig is not None for s in states if s.unit is not None}
        if len(kinds) > 1:
            raise ValueError(
                "the FSDP instances of this model mix use_orig_params=True and False (Expects "
                f"one homogeneous value for _use_orig_params but got {sorted(kinds)}); pass the "
                "same use_orig_params to every instance (auto_wrap_policy does that for you)"
            )
        check_ranks_agree(states)  # [Note: agreement step] in flatparam
        self.is_root = True
        limiter = RateLimiter(self.compute_device, self.limit_all_gathers)
        storages = [part.storage for s in states if s.unit is not None for part in s.unit.parts()]
        ctx = RootContext(states, limiter, lambda: storages)
        for s in states:
            s.ctx = ctx
            if s is not self:
                s.is_root = False
            s._cast_buffers()

    def _cast_buffers(self) -> None:
        """Cast the buffers this instance owns to ``MixedPrecision.buffer_dtype``."""
        dtype = self.mixed_precision.buffer_dtype
        if dtype is None:
            return
        for module, name, buf in _owned_buffers(self.module):
            if torch.is_floating_point(buf) and buf.dtype != dtype:
                self.buffer_orig_dtypes[(module, name)] = buf.dtype
                buf.data = buf.data.to(dtype)

    def _context(self) -> RootContext[FSDPState]:
        ctx = self.ctx
        if ctx is None:
            raise AssertionError("FSDP runtime used before lazy initialisation")
        return ctx

    # --- forward -----------------------------------------------------------------------------

    @eager_only
    @in_phase("forward")
    def root_pre_forward(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """Root-only work before any unit's forward (step 1 of [Note: one training step])."""
        self.lazy_init()
        if not self.is_root:
            return args, kwargs
        ctx = self._context()
        ctx.finish_reductions()  # a backward without its callback (never expected; cheap)
        ctx.start_refreshes()
        if self.compute_device.type != "cpu":
            args, kwargs = move_tensors_to_device(self.compute_device, args, kwargs)
        mp = self.mixed_precision
        if mp.param_dtype is not None and mp.cast_root_forward_inputs:
            args, kwargs = cast_floating_tensors(mp.param_dtype, args, kwargs)
        return args, kwargs

    def is_recomputing(self) -> bool:
        """Whether a forward now is activation checkpointing re-running this unit.

        [Note: recomputation] A forward of a unit whose backward has started
        (its pre-backward ran) can only be a checkpoint wrapper around the unit
        recomputing it for that backward. The parameters are gathered already
        and must stay gathered until the unit's post-backward, so the forward
        hooks neither record, prefetch, hook outputs nor free. (With the
        checkpoint's default early stop the recomputation usually ends before
        the post-forward hook; without it, the hook runs.)
        """
        return self._ran_pre_backward and self.training_state is TrainingState.FORWARD_BACKWARD

    @eager_only
    @in_phase("forward")
    def pre_forward(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """Gather this unit's parameters for its forward (step 2)."""
        self.assert_state((TrainingState.IDLE, TrainingState.FORWARD_BACKWARD), "forward")
        if self.is_recomputing():
            return self._recompute_pre_forward(args, kwargs)
        ctx = self._context()
        self.training_state = TrainingState.FORWARD_BACKWARD
        if self.is_root:
            ctx.exec_order.start_forward()
            ctx.forward_ahead = None
        ahead = ctx.exec_order.forward_step(self)
        if ctx.forward_ahead is self:
            ctx.forward_ahead = None  # issued ahead by the unit before: its turn now
        unit = self.unit
        if unit is not None:
            for part in unit.parts():  # a frozen part too ([Note: frozen part])
                if part.orig is not None:
                    part.orig.sync_data()
            if unit.orig is not None:
                unit.orig.sync_grads()
            if unit.state is ShardState.SHARDED:
                ctx.limiter.throttle()
                unit.unshard()
            unit.wait_for_unshard()
            unit.use_unsharded_views()
            mp = self.mixed_precision
            if mp.cast_forward_inputs and mp.param_dtype is not None:
                args, kwargs = cast_floating_tensors(mp.param_dtype, args, kwargs)
        if self.issue_ahead:
            self._issue_ahead(ahead)
        return args, kwargs

    def _recompute_pre_forward(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """See [Note: recomputation]: fresh views of the still-gathered parameters."""
        unit = self.unit
        if unit is not None:
            if unit.state is ShardState.SHARDED:  # never expected: gather again to be safe
                unit.unshard()
            unit.wait_for_unshard()
            unit.use_unsharded_views()
            mp = self.mixed_precision
            if mp.cast_forward_inputs and mp.param_dtype is not None:
                args, kwargs = cast_floating_tensors(mp.param_dtype, args, kwargs)
        return args, kwargs

    @eager_only
    @in_phase("forward")
    def post_forward(self, output: Any) -> Any:
        """Free or keep the parameters, hook the outputs for backward (step 3)."""
        if self.is_recomputing():
            return output  # see [Note: recomputation]
        ctx = self._context()
        registered = False
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled:
            ctx.exec_order.record_post_forward(self)
            output, registered = self._register_pre_backward_hooks(output)
        unit = self.unit
        if unit is not None and unit.state is not ShardState.SHARDED:
            free = not registered or (unit.config.reshard_after_forward and not self.is_root)
            if free:
                unit.reshard()
                ctx.limiter.record_free()
        self._expects_backward = registered
        self.training_state = TrainingState.IDLE
        if self.is_root:
            ctx.exec_order.end_forward(record=grad_enabled)
            self._free_forward_ahead()
            if not registered:
                # No backward will come: free every unit, prefetched ones included.
                self._reshard_all(keep_no_sync=False)
        return output

    def _register_pre_backward_hooks(self, output: Any) -> tuple[Any, bool]:
        output, registered = hook_grad_outputs(output, self._pre_backward)
        if registered:
            self._ran_pre_backward = False
        return output, registered

    def _issue_ahead(self, target: FSDPState | None) -> None:
        """Start the gather of the unit whose forward comes next ([Note: issue-ahead])."""
        if target is None or target.unit is None or target.unit.state is not ShardState.SHARDED:
            return
        self._context().issue_ahead(target, target.unit.unshard)

    def _free_forward_ahead(self) -> None:
        """Root, end of forward: free a unit issued ahead whose forward did not run."""
        ctx = self._context()
        target = ctx.take_forward_ahead()
        if target is None or target.unit is None or target.unit.state is ShardState.SHARDED:
            return
        target.unit.reshard()  # waits for its gather first
        if not target.unit.aliased:
            ctx.limiter.record_free()

    def _prefetch_backward(self, target: FSDPState | None) -> None:
        """Start ``target``'s gather early (backward prefetch)."""
        if target is None or target.unit is None:
            return
        if target.unit.state is not ShardState.SHARDED:
            return
        if not target._expects_backward or target._ran_pre_backward:
            return  # its backward will not run (again) in this pass: do not waste memory
        ctx = self._context()
        ctx.limiter.throttle()
        target.unit.unshard()

    # --- backward ----------------------------------------------------------------------------

    def _queue_final_callback(self) -> None:
        ctx = self._context()
        ctx.queue_end_of_backward(ctx.states[0]._finalize_backward)

    @in_phase("backward")
    def _pre_backward(self, grad: Tensor) -> None:
        """Gather this unit's parameters before its gradient computation (step 4)."""
        self._queue_final_callback()
        if self._ran_pre_backward:
            return
        self.assert_state(
            (TrainingState.IDLE, TrainingState.FORWARD_BACKWARD), "backward through FSDP"
        )
        self._ran_pre_backward = True
        self.training_state = TrainingState.FORWARD_BACKWARD
        unit = self.unit
        if unit is None:
            return
        if unit.orig is not None:
            unit.orig.sync_grads()  # zero_grad() between forward and backward
        ctx = self._context()
        if unit.state is ShardState.SHARDED:
            ctx.limiter.throttle()
            unit.unshard()
        unit.wait_for_unshard()
        # Views with autograd history, for modules re-run by activation checkpointing
        # inside the unit (the engine runs this hook with gradients disabled).
        with torch.enable_grad():
            unit.use_unsharded_views()
        if self.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
            self._prefetch_backward(ctx.exec_order.next_backward(self))

    @in_phase("post-backward")
    def _post_backward(self, param: Tensor) -> None:
        """Free the parameters and start the gradient reduction (step 5)."""
        unit = self.unit
        assert unit is not None
        grad = param.grad
        if grad is not None and grad.requires_grad:
            raise RuntimeError(
                "FSDP does not support gradients of gradients: backward(create_graph=True) "
                "produced a gradient that requires grad. Use torch.autograd.grad outside FSDP "
                "or run the double backward on an unwrapped model."
            )
        self._queue_final_callback()
        self.training_state = TrainingState.FORWARD_BACKWARD
        ctx = self._context()
        # SHARD_GRAD_OP keeps its parameters gathered through no_sync() iterations.
        keep = (
            not self.sync_gradients and unit.config.shard and not unit.config.reshard_after_forward
        )
        if unit.state is not ShardState.SHARDED and not unit.aliased and not keep:
            unit.reshard()
            ctx.limiter.record_free()
        if self.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            self._prefetch_backward(ctx.exec_order.next_backward(self))
        if not self.sync_gradients:
            return
        pending = unit.reduce_grad(self.comm_hook, self.comm_hook_state, self.comm_hook_casts)
        if pending is not None:
            ctx.push_reduction(pending)

    @in_phase("post-backward")
    def _finalize_backward(self) -> None:
        """Root, once per backward: complete reductions, free, reset (step 6)."""
        ctx = self._context()
        ctx.finish_reductions()
        self._reshard_all(keep_no_sync=True)
        for s in ctx.states:
            if s.unit is not None and s.unit.orig is not None and s.sync_gradients:
                s.unit.orig.sync_grads()  # units the backward did not reach
                s.unit.orig.use_local_grads()
            s.training_state = TrainingState.IDLE
            s._ran_pre_backward = False
            s._expects_backward = False
        ctx.callback_queued = False
        ctx.exec_order.end_backward()

    def _reshard_all(self, keep_no_sync: bool) -> None:
        """Free every unit of the tree that should not stay gathered."""
        ctx = self._context()
        for s in ctx.states:
            unit = s.unit
            if unit is None or unit.state is ShardState.SHARDED:
                continue
            unit.wait_for_unshard()
            # SHARD_GRAD_OP keeps its parameters across no_sync() iterations.
            keep = (
                keep_no_sync
                and not s.sync_gradients
                and unit.config.shard
                and not unit.config.reshard_after_forward
            )
            if not keep:
                unit.reshard()
                if not unit.aliased:
                    ctx.limiter.record_free()


def _owned_buffers(fsdp_module: nn.Module) -> list[tuple[nn.Module, str, Tensor]]:
    """Buffers in ``fsdp_module``'s subtree that no nested FSDP instance owns nor ignores."""
    out: list[tuple[nn.Module, str, Tensor]] = []
    stack: list[nn.Module] = [fsdp_module]
    while stack:
        m = stack.pop()
        for name, buf in m._buffers.items():
            if buf is not None:
                out.append((m, name, buf))
        for child in m._modules.values():
            # Ignored modules (see _ignored.py) keep their buffers' dtype.
            ignored = child is not None and child.__dict__.get("_fsdp_ignored", False)
            if child is not None and get_fsdp_state(child) is None and not ignored:
                stack.append(child)
    return out
