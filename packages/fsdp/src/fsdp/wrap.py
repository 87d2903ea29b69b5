"""Which submodules become their own FSDP units: auto-wrap policies and ``wrap()``.

Mirrors ``torch.distributed.fsdp.wrap``. A policy is either a :class:`_Policy`
object (:class:`ModuleWrapPolicy`, :class:`CustomPolicy`), which picks the
modules to wrap in one pass, or a callable
``policy(module=..., recurse=..., nonwrapped_numel=...) -> bool`` that is asked
twice per module during a depth-first walk: with ``recurse=True`` whether to
descend into the module's children, and with ``recurse=False`` (after the
children were wrapped) whether to wrap the module itself, where
``nonwrapped_numel`` counts its parameters not yet in a unit. Wrapping happens
bottom-up, so inner units exist before the outer ones flatten what is left.
The root module is never wrapped by the policy: the FSDP constructor that was
given the policy wraps it.
"""

from __future__ import annotations

import contextlib
import copy
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Iterable
from typing import Any

import torch
from torch import nn

__all__ = [
    "CustomPolicy",
    "ModuleWrapPolicy",
    "always_wrap_policy",
    "enable_wrap",
    "lambda_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
]


class _Policy(ABC):
    """A policy that selects, in one pass, the modules to wrap and their arguments."""

    @abstractmethod
    def _run_policy(
        self,
        root_module: nn.Module,
        ignored_modules: set[nn.Module],
        root_kwargs: dict[str, Any],
    ) -> dict[nn.Module, dict[str, Any]]:
        """Map each module to wrap to the constructor arguments for its unit."""


def _walk(
    root: nn.Module, ignored: set[nn.Module] | frozenset[nn.Module]
) -> Generator[nn.Module, None, None]:
    """Every module of ``root``'s tree, pre-order, skipping ignored subtrees."""
    stack = [root]
    while stack:
        m = stack.pop()
        if m in ignored:
            continue
        yield m
        stack.extend(reversed([c for c in m.children()]))


class ModuleWrapPolicy(_Policy):
    """Wrap every module that is an instance of one of ``module_classes``.

    The usual choice for transformers: pass the block class, and each block
    becomes one unit (one all-gather per block).
    """

    def __init__(self, module_classes: Iterable[type[nn.Module]]) -> None:
        classes = set(module_classes)
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad:
            raise TypeError(f"ModuleWrapPolicy needs nn.Module subclasses, got {bad!r}")
        self._module_classes = classes
        self._module_classes_str = str(classes)

    def _run_policy(
        self,
        root_module: nn.Module,
        ignored_modules: set[nn.Module],
        root_kwargs: dict[str, Any],
    ) -> dict[nn.Module, dict[str, Any]]:
        classes = tuple(self._module_classes)
        return {
            m: copy.copy(root_kwargs)
            for m in _walk(root_module, ignored_modules)
            if isinstance(m, classes)
        }

    def __call__(self, module: nn.Module, recurse: bool, *args: Any, **kwargs: Any) -> bool:
        """The same policy in callable form (for ``_or_policy`` and older code)."""
        return _module_wrap_policy(module, recurse, 0, self._module_classes)

    def __repr__(self) -> str:
        return super().__repr__() + f"({self._module_classes_str})"


class CustomPolicy(_Policy):
    """Wrap the modules for which ``lambda_fn`` says so, optionally with their own arguments.

    ``lambda_fn(module)`` returns ``False`` (do not wrap), ``True`` (wrap with
    the root's arguments) or a dict of constructor arguments that override the
    root's for this unit, e.g. ``{"sharding_strategy": ShardingStrategy.NO_SHARD}``.
    """

    def __init__(self, lambda_fn: Callable[[nn.Module], bool | dict[str, Any]]) -> None:
        if not callable(lambda_fn):
            raise TypeError(f"CustomPolicy needs a callable, got {lambda_fn!r}")
        self._lambda_fn = lambda_fn

    def _run_policy(
        self,
        root_module: nn.Module,
        ignored_modules: set[nn.Module],
        root_kwargs: dict[str, Any],
    ) -> dict[nn.Module, dict[str, Any]]:
        out: dict[nn.Module, dict[str, Any]] = {}
        for m in _walk(root_module, ignored_modules):
            res = self._lambda_fn(m)
            if not isinstance(res, (bool, dict)):
                raise ValueError(
                    f"CustomPolicy's lambda_fn must return a bool or a dict of FSDP arguments, "
                    f"got {res!r} for {type(m).__name__}"
                )
            if not res:
                continue
            kwargs = copy.copy(root_kwargs)
            if isinstance(res, dict):
                kwargs.update(res)
            out[m] = kwargs
        return out


def always_wrap_policy(*args: Any, **kwargs: Any) -> bool:
    """Wrap every module (each module with parameters becomes its own unit)."""
    return True


def _module_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    module_classes: Iterable[type[nn.Module]],
) -> bool:
    if recurse:
        return True
    return isinstance(module, tuple(module_classes))


def lambda_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    lambda_fn: Callable[[nn.Module], bool],
) -> bool:
    """Wrap the modules for which ``lambda_fn(module)`` is true (bind it with ``partial``)."""
    if recurse:
        return True
    return bool(lambda_fn(module))


def transformer_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    transformer_layer_cls: Iterable[type[nn.Module]],
) -> bool:
    """Wrap instances of ``transformer_layer_cls`` (bind it with ``partial``).

    Equivalent to :class:`ModuleWrapPolicy` in callable form; kept for scripts
    written for torch's FSDP.
    """
    return _module_wrap_policy(module, recurse, nonwrapped_numel, transformer_layer_cls)


def _wrap_module_cls_individually(
    module: nn.Module,
    module_classes: Iterable[type[nn.Module]],
    recurse: bool,
    *args: Any,
    **kwargs: Any,
) -> bool:
    if recurse:
        return True
    return isinstance(module, tuple(module_classes))


def _or_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    policies: list[Callable[..., bool]],
) -> bool:
    """Wrap if any of ``policies`` says so."""
    return any(
        policy(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel)
        for policy in policies
    )


def size_based_auto_wrap_policy(  # noqa: PLR0917 (torch's signature)
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    min_num_params: int = int(1e8),
    force_leaf_modules: set[type[nn.Module]] | None = None,
    exclude_wrap_modules: set[type[nn.Module]] | None = None,
) -> bool:
    """Wrap a module once its not-yet-wrapped parameters reach ``min_num_params``.

    Bind ``min_num_params`` with ``functools.partial``. Never descends into
    ``force_leaf_modules`` (default: ``nn.MultiheadAttention``, whose forward
    reads its parameters directly) and never wraps ``exclude_wrap_modules``
    (default: containers, which have no forward of their own).
    """
    if force_leaf_modules is None:
        force_leaf_modules = size_based_auto_wrap_policy.FORCE_LEAF_MODULES  # type: ignore[attr-defined]
    if exclude_wrap_modules is None:
        exclude_wrap_modules = size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES  # type: ignore[attr-defined]
    is_large = nonwrapped_numel >= min_num_params
    if recurse:
        return is_large and not isinstance(module, tuple(force_leaf_modules))
    return is_large and not isinstance(module, tuple(exclude_wrap_modules))


size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}  # type: ignore[attr-defined]
size_based_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}  # type: ignore[attr-defined]


# --- enable_wrap / wrap -------------------------------------------------------------------------


class _WrapContext:
    """The arguments of the innermost ``enable_wrap`` (only one may be active)."""

    active: bool = False
    wrapper_cls: Callable[..., nn.Module] | None = None
    kwargs: dict[str, Any] = {}  # noqa: RUF012  (class-level context, reset on exit)


@contextlib.contextmanager
def enable_wrap(
    *, wrapper_cls: Callable[..., nn.Module], **wrapper_kwargs: Any
) -> Generator[None, None, None]:
    """Make :func:`wrap` wrap modules with ``wrapper_cls(module, **wrapper_kwargs)``.

    Lets model code mark its units (``self.block = wrap(Block())``) while the
    training script decides the wrapper and its arguments::

        with enable_wrap(wrapper_cls=FullyShardedDataParallel, sharding_strategy=...):
            model = build_model()  # calls wrap() on the parts to shard
    """
    if _WrapContext.active:
        raise NotImplementedError(
            "enable_wrap() is already active; nested enable_wrap contexts are not supported"
        )
    if wrapper_cls is None:
        raise ValueError("enable_wrap needs wrapper_cls, e.g. wrapper_cls=FullyShardedDataParallel")
    _WrapContext.active = True
    _WrapContext.wrapper_cls = wrapper_cls
    _WrapContext.kwargs = dict(wrapper_kwargs)
    try:
        yield
    finally:
        _WrapContext.active = False
        _WrapContext.wrapper_cls = None
        _WrapContext.kwargs = {}


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """Wrap ``module`` inside :func:`enable_wrap` (its arguments, then ``wrap_overrides``).

    Outside an ``enable_wrap`` context it returns ``module`` unchanged, so
    model code that calls it also runs unsharded.
    """
    if not _WrapContext.active:
        return module
    assert _WrapContext.wrapper_cls is not None
    return _wrap(module, _WrapContext.wrapper_cls, **{**_WrapContext.kwargs, **wrap_overrides})


def _wrap(module: nn.Module, wrapper_cls: Callable[..., nn.Module], **kwargs: Any) -> nn.Module:
    overrides = getattr(module, "_wrap_overrides", None)
    if overrides:
        kwargs = {**kwargs, **overrides}
    return wrapper_cls(module, **kwargs)


# --- the auto-wrap driver (used by the FSDP constructor) -----------------------------------------


def _is_flattened(p: nn.Parameter) -> bool:
    # Our FlatParameters (and torch's) carry _fsdp_flattened; they are in a unit already.
    return bool(getattr(p, "_fsdp_flattened", False))


def _recursive_wrap(
    module: nn.Module,
    auto_wrap_policy: Callable[..., bool],
    *,
    wrapper_cls: Callable[..., nn.Module],
    ignored_modules: set[nn.Module],
    ignored_params: set[nn.Parameter],
    only_wrap_children: bool,
    kwargs: dict[str, Any],
) -> tuple[nn.Module, int]:
    """Depth-first wrap driven by a callable policy; returns (module, numel wrapped)."""
    nonwrapped_numel = sum(
        p.numel() for p in module.parameters() if p not in ignored_params and not _is_flattened(p)
    )
    if not auto_wrap_policy(module=module, recurse=True, nonwrapped_numel=nonwrapped_numel):
        return module, 0
    total_wrapped = 0
    for name, child in module.named_children():
        if child in ignored_modules:
            continue
        wrapped_child, numel = _recursive_wrap(
            child,
            auto_wrap_policy,
            wrapper_cls=wrapper_cls,
            ignored_modules=ignored_modules,
            ignored_params=ignored_params,
            only_wrap_children=False,
            kwargs=kwargs,
        )
        setattr(module, name, wrapped_child)
        total_wrapped += numel
    remainder = nonwrapped_numel - total_wrapped
    if not only_wrap_children and auto_wrap_policy(
        module=module, recurse=False, nonwrapped_numel=remainder
    ):
        return _wrap(module, wrapper_cls, **kwargs), nonwrapped_numel
    return module, total_wrapped


def _post_order_apply(
    root: nn.Module,
    targets: dict[nn.Module, dict[str, Any]],
    wrapper_cls: Callable[..., nn.Module],
) -> None:
    """Wrap every target module below ``root``, children before parents."""

    def visit(module: nn.Module) -> None:
        for name, child in list(module.named_children()):
            visit(child)
            if child in targets and child is not root:
                setattr(module, name, wrapper_cls(child, **targets[child]))

    visit(root)


def _cast_around_module(module: nn.Module) -> None:
    """Run ``module`` in fp32 inside a mixed-precision model: cast inputs up, outputs back."""
    from fsdp._runtime._common import apply_to_tensors

    state: dict[str, torch.dtype] = {}

    def cast_to(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
        def cast(t: torch.Tensor) -> torch.Tensor:
            if not torch.is_floating_point(t) or t.dtype == dtype:
                return t
            state.setdefault("input_dtype", t.dtype)
            return t.to(dtype)

        return cast

    def pre_hook(_m: nn.Module, args: Any) -> Any:
        state.clear()
        return apply_to_tensors(cast_to(torch.float32), args)

    def post_hook(_m: nn.Module, _args: Any, output: Any) -> Any:
        dtype = state.get("input_dtype")
        return output if dtype is None else apply_to_tensors(cast_to(dtype), output)

    module.register_forward_pre_hook(pre_hook)
    module.register_forward_hook(post_hook)


def _auto_wrap(
    root_module: nn.Module,
    policy: Callable[..., bool] | _Policy,
    *,
    root_kwargs: dict[str, Any],
    wrapper_cls: Callable[..., nn.Module],
    is_wrapped: Callable[[nn.Module], bool],
    ignored_modules: frozenset[nn.Module] = frozenset(),
    ignored_params: frozenset[nn.Parameter] = frozenset(),
) -> None:
    """Wrap ``root_module``'s submodules as ``policy`` says (the root itself excluded).

    With mixed precision, modules of ``MixedPrecision._module_classes_to_ignore``
    become their own units without mixed precision and run in fp32.
    """
    for name, m in root_module.named_modules():
        if is_wrapped(m):
            raise ValueError(
                "FSDP auto wrapping requires modules without FSDP applied, but "
                f"{name or 'the root'!r} ({type(m).__name__}) is already an FSDP instance; "
                "wrap it either by hand or by the policy, not both"
            )
    mp = root_kwargs.get("mixed_precision")
    overridden: list[type[nn.Module]] = []
    if mp is not None:
        ignore_classes = tuple(mp._module_classes_to_ignore)
        for m in _walk(root_module, ignored_modules):
            if ignore_classes and isinstance(m, ignore_classes) and m is not root_module:
                m._wrap_overrides = {"mixed_precision": None}
                _cast_around_module(m)
                overridden.append(type(m))
    if isinstance(policy, _Policy):
        kwargs = dict(root_kwargs, auto_wrap_policy=None)
        targets = policy._run_policy(root_module, set(ignored_modules), kwargs)
        for m in _walk(root_module, ignored_modules):
            overrides = getattr(m, "_wrap_overrides", None)
            if overrides and m is not root_module:
                targets[m] = {**targets.get(m, kwargs), **overrides}
        _post_order_apply(root_module, targets, wrapper_cls)
        return
    if not callable(policy):
        raise TypeError(
            f"auto_wrap_policy must be a ModuleWrapPolicy, a CustomPolicy or a callable "
            f"(module, recurse, nonwrapped_numel) -> bool, got {policy!r}"
        )
    if overridden:
        user_policy = policy

        def policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
            # As torch's: OR with "wrap those classes individually", which always recurses.
            individually = recurse or bool(getattr(module, "_wrap_overrides", None))
            return individually or user_policy(
                module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel
            )

    kwargs = {k: v for k, v in root_kwargs.items() if k != "auto_wrap_policy"}
    _recursive_wrap(
        root_module,
        policy,
        wrapper_cls=wrapper_cls,
        ignored_modules=set(ignored_modules),
        ignored_params=set(ignored_params),
        only_wrap_children=True,
        kwargs=kwargs,
    )
