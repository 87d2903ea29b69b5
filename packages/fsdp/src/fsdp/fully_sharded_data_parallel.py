"""The public module wrapper: ``FullyShardedDataParallel``.

Construction lives in ``_init.py`` (plus ``wrap.py`` for auto-wrapping), the
run-time hooks in ``_fsdp_state.py``, the parameter storage in
``_flat_param_unit.py``; this class holds the pieces, forwards to them and
documents the API, which follows torch's FSDP1 argument for argument.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_WRAPPED_MODULE,
    ActivationWrapper,
)

from fsdp._runtime._common import (
    FLAT_PARAM,
    FROZEN_FLAT_PARAM,
    FSDP_WRAPPED_MODULE,
    TrainingState,
    clean_fqn,
)
from fsdp._runtime._host_memory import release_freed_host_memory
from fsdp._runtime._quantize import QuantizedCommPolicy, to_comm_policy
from fsdp._wrapper import _grad_norm, _init
from fsdp._wrapper._deferred_init import has_meta_states, materialize_unit, modules_to_materialize
from fsdp._wrapper._fsdp_state import FSDPState, get_fsdp_state
from fsdp._wrapper._ignored import resolve_ignored
from fsdp._wrapper._process_groups import HYBRID_STRATEGIES, resolve_process_groups
from fsdp._wrapper._state_dict import ckpt_module, register_state_dict_hooks
from fsdp._wrapper._summon import summon_full_params as _summon_full_params
from fsdp._wrapper._summon import summon_unit
from fsdp._wrapper._torch_types import to_fsdp_policy, to_fsdp_type
from fsdp.api import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from fsdp.wrap import CustomPolicy, ModuleWrapPolicy, _auto_wrap

__all__ = ["FullyShardedDataParallel"]


class _CommHookError(RuntimeError, AssertionError):
    """A refused ``register_comm_hook``: torch's FSDP raises ``AssertionError``, ours raised
    ``RuntimeError``; both catch it."""


class FullyShardedDataParallel(nn.Module):
    """Shard a module's parameters, gradients and optimizer state across ranks.

    A drop-in for ``torch.distributed.fsdp.FullyShardedDataParallel`` (FSDP1).
    With ``use_orig_params=False`` (the default) the wrapped module's parameters (those not
    inside nested FSDP instances) are flattened into one ``FlatParameter`` per
    instance ("unit") and each rank keeps ``1/world_size`` of it. A unit's full
    parameters are all-gathered just before its forward and its backward and
    freed after them; its gradient is reduce-scattered, so after
    ``backward()`` each FlatParameter's ``.grad`` is the averaged gradient of
    this rank's shard, ready for any ``torch.optim`` optimizer::

        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)  # after wrapping!
        model(x).sum().backward()
        optim.step()

    The optimizer must be created *after* wrapping: wrapping replaces the
    module's parameters with the FlatParameters, and an optimizer built
    before holds the old ones (its first ``step()`` raises an error saying so).

    Between forward and backward and outside both, the wrapped modules'
    parameter attributes are not the original parameters: inside a unit's
    forward/backward they are views of the gathered data; otherwise they are
    ``meta`` tensors of the right shape. Use :meth:`summon_full_params` to read
    or change full parameters, and ``state_dict()`` (keys of the unwrapped
    model) to save them.

    Args:
        module: the module to wrap. Must not already be an FSDP instance.
        process_group: the group to shard over; ``None`` is the default group.
            For hybrid sharding, a pair ``(shard_group, replicate_group)``, or
            ``None`` to shard inside each node and replicate across nodes (the
            node size comes from the launcher's ``LOCAL_WORLD_SIZE``).
        sharding_strategy: :class:`ShardingStrategy`; ``None`` is
            ``FULL_SHARD``. At world size 1 every strategy behaves as
            ``NO_SHARD`` (nothing to communicate).
        cpu_offload: :class:`CPUOffload`; keep sharded parameters and
            gradients on the CPU.
        auto_wrap_policy: make submodules their own units: a
            :class:`~fsdp.wrap.ModuleWrapPolicy`, a :class:`~fsdp.wrap.CustomPolicy`
            or a callable ``(module, recurse, nonwrapped_numel) -> bool`` (see
            :mod:`fsdp.wrap`). Units created this way take this constructor's
            other arguments. Needed for overlap and for memory savings: a
            single unit gathers the whole model at once.
        backward_prefetch: :class:`BackwardPrefetch` or ``None``.
        mixed_precision: :class:`MixedPrecision`.
        ignored_modules: modules whose subtrees (parameters and buffers) this
            instance and the units it auto-wraps leave alone: not sharded, not
            moved, gradients not reduced (each rank keeps its own). Not FSDP
            instances. Prefer ``ignored_states``; pass only one of the two.
        param_init_fn: for a module built on the ``meta`` device: called on
            each module of a unit (breadth-first, skipping nested units and
            ignored modules) just before the unit is flattened and sharded; it
            must give the module's own parameters and buffers real storage
            (e.g. ``m.to_empty(device=d, recurse=False)`` then initialise).
            Without it, each module with meta states is ``to_empty``-ed onto
            the compute device and its ``reset_parameters()`` is called. Either
            way only one unit's unsharded parameters exist at a time, so a
            model larger than one rank's memory can be built. Parameters tied
            on the meta device stay tied.
        device_id: the compute device (an int is a CUDA index), where meta
            modules are materialised and the module is moved. Default: the
            module's device, or the current CUDA device for a CPU module when
            CUDA is available.
        sync_module_states: broadcast the first rank's parameters and buffers
            of each unit before sharding it, so that every rank starts from the
            same model (e.g. only rank 0 loaded a checkpoint, or ranks seeded
            differently). Under hybrid sharding across the replicate group
            first, then inside the shard group. Works on CPU (gloo) too.
        forward_prefetch: issue the next unit's all-gather (in the previous
            forward's order) before the current unit's forward computation,
            on every device. On the CPU the default does this already; see
            [Note: issue-ahead] in ``_root_context.py``.
        limit_all_gathers: at most two units' gathered parameters in flight
            (the one computing and one ahead): on CUDA by holding the CPU
            back (see [Note: rate limiter]); on the CPU, where the host does
            not run ahead of the computation, the forward issues the next
            unit's all-gather before the current unit computes, which is the
            overlap FSDP1 gets on CUDA. ``False`` on the CPU (with
            ``forward_prefetch=False``): each unit gathers on entry.
        use_orig_params: keep the original ``nn.Parameter`` objects, names
            and ``requires_grad`` flags (see ``_orig_params.py``):
            ``named_parameters()`` yields them under the unwrapped model's
            names (unlike FSDP1, without ``_fsdp_wrapped_module.`` prefixes),
            each a 1-D view of this rank's piece of the shard (possibly
            empty; full-shaped for ``NO_SHARD``/one rank), and after backward
            their ``.grad`` are views of the sharded gradient (``None`` for
            frozen or empty ones). So an optimizer may use per-parameter
            groups, units may mix frozen and trainable parameters, and an
            optimizer created before wrapping keeps working. Needed for
            ``torch.compile`` (the FSDP hooks run eagerly between compiled
            regions) and for ``summon_full_params(with_grads=True)``.
        ignored_states: parameters, or modules, to ignore (see
            ``ignored_modules``); all of one kind.
        device_mesh: a ``DeviceMesh`` instead of ``process_group``: 1-D for
            ``FULL_SHARD``/``SHARD_GRAD_OP``/``NO_SHARD`` (shard over its
            group), 2-D with dimensions ``(replicate, shard)`` for hybrid
            sharding, as torch's FSDP.
        comm_policy: an extension torch's FSDP lacks (keyword only):
            :class:`~fsdp.QuantizedCommPolicy` gathers the parameters as int8
            blocks and reduce-scatters the gradients as int8 or bf16 blocks,
            for slow links; the sharded parameters stay exact. Inner units
            built by ``auto_wrap_policy`` get it too. ``None``: exact.
    """

    _fsdp_state: FSDPState  # run-time hooks and training state
    _fsdp_wrapped_module: nn.Module
    process_group: Any  # dist.ProcessGroup the units are sharded over
    _inter_node_pg: Any  # hybrid sharding: the replicate group (torch's name); else None
    device_mesh: Any  # the DeviceMesh passed in, if any
    _device_mesh: Any  # the DeviceMesh the groups came from (passed in or built), if any
    _ignored_modules: set[nn.Module]  # every module of the ignored subtrees
    _ignored_params: set[nn.Parameter]  # parameters left unsharded and unreduced
    rank: int  # this rank in process_group
    world_size: int  # ranks in process_group (the shard group under hybrid sharding)
    sharding_strategy: ShardingStrategy  # NO_SHARD when world_size == 1
    cpu_offload: CPUOffload
    mixed_precision: MixedPrecision
    backward_prefetch: BackwardPrefetch | None
    forward_prefetch: bool
    limit_all_gathers: bool
    compute_device: torch.device
    _use_orig_params: bool
    comm_policy: QuantizedCommPolicy | None  # quantized communication (ours only), or None
    # Selected by ckpt.state_dict_type; see [Note: state-dict types live in ckpt].
    _state_dict_type: StateDictType
    _state_dict_config: StateDictConfig
    _optim_state_dict_config: OptimStateDictConfig

    def __init__(  # noqa: PLR0917 (torch's FSDP signature)
        self,
        module: nn.Module,
        process_group: Any = None,
        sharding_strategy: ShardingStrategy | None = None,
        cpu_offload: CPUOffload | None = None,
        auto_wrap_policy: Callable[..., bool] | ModuleWrapPolicy | CustomPolicy | None = None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: MixedPrecision | None = None,
        ignored_modules: Iterable[nn.Module] | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        device_id: int | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states: Iterable[nn.Parameter] | Iterable[nn.Module] | None = None,
        device_mesh: Any = None,
        *,
        comm_policy: QuantizedCommPolicy | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"FullyShardedDataParallel wraps an nn.Module, got {type(module).__name__}"
            )
        if _is_fsdp(module):
            raise ValueError(
                "this module is already wrapped by FullyShardedDataParallel; wrap each module "
                "once (nest FSDP instances by wrapping inner modules first)"
            )
        # torch's option types and policies become ours here; see [Note: torch option types].
        if sharding_strategy is not None:
            sharding_strategy = to_fsdp_type(
                sharding_strategy, ShardingStrategy, "sharding_strategy"
            )
        strategy = ShardingStrategy.FULL_SHARD if sharding_strategy is None else sharding_strategy
        if mixed_precision is not None:
            mixed_precision = to_fsdp_type(mixed_precision, MixedPrecision, "mixed_precision")
        if cpu_offload is not None:
            cpu_offload = to_fsdp_type(cpu_offload, CPUOffload, "cpu_offload")
        user_mixed_precision = mixed_precision
        cpu_offload = CPUOffload() if cpu_offload is None else cpu_offload
        mixed_precision = MixedPrecision() if mixed_precision is None else mixed_precision
        if backward_prefetch is not None:
            backward_prefetch = to_fsdp_type(
                backward_prefetch, BackwardPrefetch, "backward_prefetch"
            )
        auto_wrap_policy = to_fsdp_policy(auto_wrap_policy)
        comm_policy = to_comm_policy(comm_policy)
        if param_init_fn is not None and not callable(param_init_fn):
            raise ValueError(  # torch's type and words for this mistake
                f"Expected {param_init_fn!r} to be callable but got {type(param_init_fn)}: "
                "param_init_fn must be a callable (module) -> None"
            )
        device_id = _init.normalize_device_id(device_id)
        ignored = resolve_ignored(module, ignored_modules, ignored_states, _is_fsdp)
        groups = resolve_process_groups(process_group, device_mesh, strategy)
        _init.install_optimizer_check()

        tied: list[nn.Parameter] = []
        if auto_wrap_policy is not None:
            root_kwargs: dict[str, Any] = {
                "process_group": process_group,
                "sharding_strategy": sharding_strategy,
                "cpu_offload": cpu_offload,
                "backward_prefetch": backward_prefetch,
                # The user's own (None if not given): as torch's FSDP, batch norm gets its own
                # unit only when mixed precision was asked for.
                "mixed_precision": user_mixed_precision,
                "param_init_fn": param_init_fn,
                "device_id": device_id,
                "sync_module_states": sync_module_states,
                "forward_prefetch": forward_prefetch,
                "limit_all_gathers": limit_all_gathers,
                "ignored_states": ignored.for_children,
                "device_mesh": device_mesh,
                "use_orig_params": use_orig_params,
                "comm_policy": comm_policy,
            }
            if strategy in HYBRID_STRATEGIES and device_mesh is None:
                # Every unit shares the root's groups (also those built automatically).
                root_kwargs["process_group"] = groups.hybrid_pair
            # A parameter used at several places goes to the innermost unit that contains
            # all its uses, whatever units the policy makes (see [Note: tied parameters]).
            tied = _init.mark_tied_params(module, _is_fsdp, ignored.params)
            try:
                _auto_wrap(
                    module,
                    auto_wrap_policy,
                    root_kwargs=root_kwargs,
                    wrapper_cls=FullyShardedDataParallel,
                    is_wrapped=_is_fsdp,
                    ignored_modules=ignored.modules,
                    ignored_params=ignored.params,
                )
            except _init.SharedParameterError as e:
                _init.clear_tied_marks(module, tied)
                raise e.in_model(module) from None
            except BaseException:
                _init.clear_tied_marks(module, tied)
                raise

        # Deferred initialisation: this unit's own modules, now that inner units are built.
        own_modules = modules_to_materialize(module, _is_fsdp)
        if has_meta_states(own_modules, ignored.params):
            materialize_unit(
                module,
                own_modules,
                param_init_fn=param_init_fn,
                device=_init.resolve_compute_device([], [], device_id),
            )
        collected = _init.collect_unit_params(module, _is_fsdp, ignored.params)
        buffers = _init.owned_buffers(module, _is_fsdp)
        compute_device = _init.resolve_compute_device(collected[1], buffers, device_id)
        if groups.shard_size == 1 and strategy is not ShardingStrategy.NO_SHARD:
            # As torch's FSDP, with its warning (code may filter on it): nothing to shard over.
            warnings.warn(
                f"FSDP is switching to use `NO_SHARD` instead of {strategy} since the world "
                "size is 1.",
                UserWarning,
                stacklevel=2,
            )
            strategy = ShardingStrategy.NO_SHARD
        unit = _init.build_unit(
            collected,
            groups=groups,
            strategy=strategy,
            compute_device=compute_device,
            mixed_precision=mixed_precision,
            cpu_offload=cpu_offload,
            sync_module_states=sync_module_states,
            use_orig_params=use_orig_params,
            comm_policy=comm_policy,
        )
        del collected  # the original parameters: free them before the enclosing unit is built
        release_freed_host_memory()  # see [Note: construction RSS]
        if auto_wrap_policy is not None:  # this constructor marked them
            _init.clear_tied_marks(module, tied)
        self._fsdp_wrapped_module = module
        if unit is not None and not use_orig_params:
            self.register_parameter(FLAT_PARAM, unit.flat_param)
            if unit.frozen_part is not None:  # see [Note: frozen part]
                self.register_parameter(FROZEN_FLAT_PARAM, unit.frozen_part.flat_param)
        self._fsdp_state = FSDPState(
            self,
            unit,
            compute_device=compute_device,
            mixed_precision=mixed_precision,
            backward_prefetch=backward_prefetch,
            forward_prefetch=forward_prefetch,
            limit_all_gathers=limit_all_gathers,
        )
        for m in module.modules():
            inner = get_fsdp_state(m)
            if inner is not None and inner.parent is None:
                inner.parent = self._fsdp_state
        self.process_group = groups.shard_group
        self._inter_node_pg = groups.replicate_group
        self.device_mesh = device_mesh
        self._device_mesh = groups.device_mesh
        self._ignored_modules = set(ignored.modules)
        self._ignored_params = set(ignored.params)
        self.rank = groups.shard_rank
        self.world_size = groups.shard_size
        self.sharding_strategy = strategy
        self.cpu_offload = cpu_offload
        self.mixed_precision = mixed_precision
        self.backward_prefetch = backward_prefetch
        self.forward_prefetch = forward_prefetch
        self.limit_all_gathers = limit_all_gathers
        self.compute_device = compute_device
        self._use_orig_params = bool(use_orig_params)
        self.comm_policy = comm_policy
        self._state_dict_type = StateDictType.FULL_STATE_DICT
        self._state_dict_config = FullStateDictConfig()
        self._optim_state_dict_config = FullOptimStateDictConfig()
        register_state_dict_hooks(self)

    # --- the wrapped module ----------------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The wrapped module (inside an activation-checkpoint wrapper, the module it wraps)."""
        wrapped = self._fsdp_wrapped_module
        if isinstance(wrapped, ActivationWrapper):
            inner: nn.Module = getattr(wrapped, _CHECKPOINT_WRAPPED_MODULE)
            return inner
        return wrapped

    @property
    def training_state(self) -> TrainingState:
        """What this instance is doing (idle, in forward/backward, summoned)."""
        return self._fsdp_state.training_state

    @property
    def _flat_param(self) -> nn.Parameter | None:
        unit = self._fsdp_state.unit
        return None if unit is None else unit.flat_param

    @property
    def _is_root(self) -> bool | None:
        return self._fsdp_state.is_root

    def __getattr__(self, name: str) -> Any:
        """Attributes the wrapper lacks come from the wrapped module (``model.config``)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == FSDP_WRAPPED_MODULE:
                raise
            return getattr(self._fsdp_wrapped_module, name)

    def __getitem__(self, key: int) -> Any:
        """Index into a wrapped ``nn.Sequential``/``nn.ModuleList``."""
        return self._fsdp_wrapped_module.__getitem__(key)  # type: ignore[operator]

    # --- forward ----------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module with this unit's parameters gathered around it."""
        state = self._fsdp_state
        with torch.autograd.profiler.record_function("FullyShardedDataParallel.forward"):
            args, kwargs = state.root_pre_forward(args, kwargs)
            args, kwargs = state.pre_forward(args, kwargs)
            output = self._fsdp_wrapped_module(*args, **kwargs)
            return state.post_forward(output)

    # --- tree-level queries -----------------------------------------------------------------------

    def check_is_root(self) -> bool:
        """Whether this instance is the root of its FSDP tree (runs lazy init if needed)."""
        self._fsdp_state.lazy_init()
        return bool(self._fsdp_state.is_root)

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[FullyShardedDataParallel]:
        """Every FSDP instance in ``module``'s tree (pre-order), or only the outermost ones."""
        out: list[FullyShardedDataParallel] = []
        stack: list[nn.Module] = [module]
        while stack:
            m = stack.pop()
            if isinstance(m, FullyShardedDataParallel):
                out.append(m)
                if root_only:
                    continue
            stack.extend(reversed([c for c in m._modules.values() if c is not None]))
        return out

    def apply(self, fn: Callable[[nn.Module], None]) -> FullyShardedDataParallel:
        """``nn.Module.apply`` with each unit's full parameters summoned while ``fn`` runs.

        So that initialisation functions (``module.apply(init_weights)``) see
        and write real, full parameters; each rank keeps its chunk of what
        ``fn`` wrote. Not from inside :meth:`summon_full_params`.
        """
        state = self._fsdp_state
        state.assert_state(TrainingState.IDLE, "FullyShardedDataParallel.apply")
        with summon_unit(state, writeback=True, rank0_only=False, offload_to_cpu=False):
            nn.Module.apply(self, fn)
        return self

    # --- full parameters --------------------------------------------------------------------

    @staticmethod
    @contextlib.contextmanager
    def summon_full_params(  # noqa: PLR0917 (torch's FSDP signature)
        module: nn.Module,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> Generator[None, None, None]:
        """Expose the full parameters of the FSDP instances in ``module`` inside the context.

        Inside, every unit's original parameters are registered on their
        modules as full tensors in their original (full) precision, and
        ``named_parameters()`` of an FSDP instance yields the unwrapped names.
        Every rank must enter (it is a collective). Not usable inside forward
        or backward, and forward/backward cannot run inside it.

        Args:
            module: an FSDP instance or any module containing them.
            recurse: summon nested FSDP instances too (else only the outermost).
            writeback: keep changes made to the full parameters (each rank
                writes back its own chunk). Unsharded units (``NO_SHARD``, one
                rank) keep changes regardless.
            rank0_only: materialise the full parameters on global rank 0 only
                (others keep their shards); requires ``writeback=False``.
            offload_to_cpu: put the full parameters on the CPU (sharded units
                only); best combined with ``rank0_only``.
            with_grads: also gather the gradients onto the original
                parameters' ``.grad`` (full-shaped); needs
                ``use_orig_params=True`` and ``offload_to_cpu=False``.
        """
        with _summon_full_params(
            module, recurse, writeback, rank0_only, offload_to_cpu, with_grads
        ):
            yield

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """``nn.Module.named_parameters``; unwrapped names inside :meth:`summon_full_params`.

        With ``use_orig_params=True`` always the unwrapped names (torch's FSDP1
        keeps its ``_fsdp_wrapped_module.`` prefixes outside the summon), so
        that parameter groups can be chosen by the names of the original model.
        """
        clean = (
            self._use_orig_params
            or self._fsdp_state.training_state is TrainingState.SUMMON_FULL_PARAMS
        )
        for name, p in super().named_parameters(*args, **kwargs):
            yield (clean_fqn(name) if clean else name), p

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """``nn.Module.named_buffers``; unwrapped names inside :meth:`summon_full_params`
        (always with ``use_orig_params=True``, as :meth:`named_parameters`)."""
        clean = (
            self._use_orig_params
            or self._fsdp_state.training_state is TrainingState.SUMMON_FULL_PARAMS
        )
        for name, b in super().named_buffers(*args, **kwargs):
            yield (clean_fqn(name) if clean else name), b

    # --- gradients ------------------------------------------------------------------------------

    def _require_root(self, what: str, torch_words: str) -> FSDPState:
        state = self._fsdp_state
        state.lazy_init()
        if not state.is_root:
            raise RuntimeError(
                f"{torch_words}: this FSDP instance is nested in another, and {what} acts on "
                "the whole tree; call it on the outermost FSDP instance"
            )
        state.assert_state(TrainingState.IDLE, what)
        return state

    @contextlib.contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Accumulate gradients locally, without communication, inside the context.

        Backward passes inside keep each unit's *unsharded* gradient (more
        memory); the first backward after the context reduces the sum. Call
        on the root instance; it applies to every nested one. With CPU
        offload the accumulated gradients stay on the compute device until
        that reduction.
        """
        state = self._require_root(
            "no_sync()",
            "`no_sync()` on inner FSDP instances is not supported. Please call `no_sync()` on "
            "root FSDP module.",
        )
        ctx = state.ctx
        assert ctx is not None
        previous = [(s, s.sync_gradients) for s in ctx.states]
        for s, _ in previous:
            s.sync_gradients = False
        try:
            yield
        finally:
            for s, flag in previous:
                s.sync_gradients = flag

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of the whole model by their total norm; return that norm.

        The norm is over all gradients viewed as one vector, although they are
        sharded over ranks (``torch.nn.utils.clip_grad_norm_`` would only see
        this rank's shards). Call on the root instance, on every rank (it
        communicates), after backward. Supports any p-norm and ``inf``.
        """
        state = self._require_root(
            "clip_grad_norm_()",
            "`clip_grad_norm_()` should only be called on the root FSDP instance",
        )
        ctx = state.ctx
        assert ctx is not None
        sharded: list[torch.Tensor] = []
        replicated: list[torch.Tensor] = []
        flat_ids: set[int] = set()
        all_no_shard = True
        for s in ctx.states:
            if s.unit is None:
                continue
            for unit in s.unit.parts():
                flat_ids.add(id(unit.flat_param))
                all_no_shard = all_no_shard and not unit.config.shard
                target = sharded if unit.config.shard else replicated
                if unit.orig is not None:
                    # The gradients the optimizer will step: the original parameters'
                    # (views of the flat gradient unless the user replaced them).
                    flat_ids.update(id(p) for p in unit.orig.params)
                    target.extend(p.grad for p in unit.orig.params if p.grad is not None)
                    continue
                grad = unit.flat_param.grad
                if grad is not None:
                    target.append(grad)
        if all_no_shard:
            return torch.nn.utils.clip_grad_norm_(list(self.parameters()), max_norm, norm_type)
        for p in self.parameters():
            if id(p) not in flat_ids and p.grad is not None:
                replicated.append(p.grad)
        result_device = (
            torch.device("cpu") if self.cpu_offload.offload_params else state.compute_device
        )
        return _grad_norm.clip_grad_norm_(
            sharded,
            replicated,
            max_norm,
            norm_type,
            group=self.process_group,
            device=state.compute_device,
            result_device=result_device,
        )

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """Replace the gradient reduction of every unit in the tree by ``hook``.

        ``hook(state, grad)`` for ``NO_SHARD`` units (reduce ``grad`` in place)
        and ``hook(state, padded_full_grad, sharded_grad_out)`` for sharded
        ones (fill ``sharded_grad_out``), e.g. the hooks in
        ``torch.distributed.algorithms._comm_hooks.default_hooks``. The hook
        does its own averaging. Register on the root, once, before the first
        forward.
        """
        root = self._fsdp_state
        root.lazy_init()
        if not root.is_root:  # torch's text exactly: its tests match it from ^ to $
            raise _CommHookError("register_comm_hook can only be called on a root instance.")
        if not callable(hook):
            raise ValueError(f"The communication hook must be callable but got {hook!r}")
        from torch.distributed.algorithms._comm_hooks import LOW_PRECISION_HOOKS

        ctx = root.ctx
        assert ctx is not None
        for s in ctx.states:
            if s.comm_hook is not None:
                raise _CommHookError(
                    "A communication hook is already registered (on this FSDP tree; register "
                    "one hook, once, on the root)"
                )
            if s.unit is not None and (
                s.unit.config.replicate_group is not None or s.unit.config.across is not None
            ):
                raise _CommHookError(
                    "Communication hook is not supported for hybrid strategies: "
                    f"{self.sharding_strategy} (HYBRID_SHARD and _HYBRID_SHARD_ZERO2, as in "
                    "torch's FSDP, and HYBRID_SHARD_ACROSS_REPLICAS): the hook would replace "
                    "only the reduce-scatter inside the shard group, not the reduction across "
                    "replicas. "
                    "Use FULL_SHARD/SHARD_GRAD_OP with a hook, or hybrid sharding without one"
                )
        for s in ctx.states:
            s.comm_hook = hook
            s.comm_hook_state = state
            s.comm_hook_casts = hook in LOW_PRECISION_HOOKS

    # --- state dicts (the ckpt package) ---------------------------------------------------------
    # The seed's static methods, delegating to ckpt (imported lazily: fsdp never needs it).
    # See ckpt's functions of the same names for the full documentation.

    @staticmethod
    def set_state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | None = None,
    ) -> StateDictSettings:
        """Select the state-dict type of every FSDP instance in ``module``; return the old one."""
        impl = ckpt_module("FullyShardedDataParallel.set_state_dict_type")
        settings: StateDictSettings = impl.set_state_dict_type(
            module, state_dict_type, state_dict_config, optim_state_dict_config
        )
        return settings

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings:
        """The state-dict settings of the FSDP instances in ``module`` (all must agree)."""
        impl = ckpt_module("FullyShardedDataParallel.get_state_dict_type")
        settings: StateDictSettings = impl.get_state_dict_type(module)
        return settings

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | None = None,
    ) -> Generator[None, None, None]:
        """:meth:`set_state_dict_type` inside the context, the previous setting after it."""
        impl = ckpt_module("FullyShardedDataParallel.state_dict_type")
        with impl.state_dict_type(
            module, state_dict_type, state_dict_config, optim_state_dict_config
        ):
            yield

    @staticmethod
    def optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any] | None = None,
        group: Any = None,
    ) -> dict[str, Any]:
        """The optimizer state keyed by parameter FQNs, full or sharded per the model's type."""
        return _ckpt_optim("optim_state_dict")(model, optim, optim_state_dict, group)

    @staticmethod
    def optim_state_dict_to_load(  # noqa: PLR0917 (torch's FSDP signature)
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any],
        is_named_optimizer: bool = False,
        load_directly: bool = False,
        group: Any = None,
    ) -> dict[str, Any]:
        """Turn an :meth:`optim_state_dict` result into what ``optim.load_state_dict`` takes."""
        return _ckpt_optim("optim_state_dict_to_load")(
            model, optim, optim_state_dict, is_named_optimizer, load_directly, group
        )

    @staticmethod
    def full_optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_input: Any = None,
        rank0_only: bool = True,
        group: Any = None,
    ) -> dict[str, Any]:
        """The full optimizer state keyed by FQNs (on rank 0 only by default)."""
        return _ckpt_optim("full_optim_state_dict")(model, optim, optim_input, rank0_only, group)

    @staticmethod
    def sharded_optim_state_dict(
        model: nn.Module, optim: torch.optim.Optimizer, group: Any = None
    ) -> dict[str, Any]:
        """The optimizer state keyed by FQNs with ``DTensor`` values sharded on dim 0."""
        return _ckpt_optim("sharded_optim_state_dict")(model, optim, group)

    @staticmethod
    def shard_full_optim_state_dict(
        full_optim_state_dict: dict[str, Any],
        model: nn.Module,
        optim_input: Any = None,
        optim: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        """This rank's flat optimizer state dict from a full one (no communication)."""
        return _ckpt_optim("shard_full_optim_state_dict")(
            full_optim_state_dict, model, optim_input, optim
        )

    @staticmethod
    def scatter_full_optim_state_dict(
        full_optim_state_dict: dict[str, Any] | None,
        model: nn.Module,
        optim_input: Any = None,
        optim: torch.optim.Optimizer | None = None,
        group: Any = None,
    ) -> dict[str, Any]:
        """Like :meth:`shard_full_optim_state_dict` with the full dict only on rank 0."""
        return _ckpt_optim("scatter_full_optim_state_dict")(
            full_optim_state_dict, model, optim_input, optim, group
        )

    @staticmethod
    def flatten_sharded_optim_state_dict(
        sharded_optim_state_dict: dict[str, Any],
        model: nn.Module,
        optim: torch.optim.Optimizer,
    ) -> dict[str, Any]:
        """This rank's flat optimizer state dict from a :meth:`sharded_optim_state_dict`."""
        return _ckpt_optim("flatten_sharded_optim_state_dict")(
            sharded_optim_state_dict, model, optim
        )

    @staticmethod
    def rekey_optim_state_dict(
        optim_state_dict: dict[str, Any],
        optim_state_key_type: OptimStateKeyType,
        model: nn.Module,
        optim_input: Any = None,
        optim: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        """Re-key a full optimizer state dict between parameter FQNs and integer ids."""
        return _ckpt_optim("rekey_optim_state_dict")(
            optim_state_dict, optim_state_key_type, model, optim_input, optim
        )


def _is_fsdp(module: nn.Module) -> bool:
    return get_fsdp_state(module) is not None


def _ckpt_optim(name: str) -> Callable[..., dict[str, Any]]:
    fn: Callable[..., dict[str, Any]] = getattr(
        ckpt_module(f"FullyShardedDataParallel.{name}"), name
    )
    return fn
