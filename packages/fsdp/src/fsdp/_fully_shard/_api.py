"""``fully_shard``, ``FSDPModule``, ``UnshardHandle`` and ``register_fsdp_forward_method``.

torch 2.13's FSDP2 contract on our runtime: ``fully_shard(module)`` shards the
parameters of ``module`` (those not already managed by a nested call) as
``DTensor`` s and makes ``module`` an instance of a class derived from both
:class:`FSDPModule` and its own class, so ``isinstance`` holds for both and the
``FSDPModule`` methods are available on it.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Any, NoReturn, cast, overload

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from fsdp._fully_shard import _composable
from fsdp._fully_shard._extensions import has_extension, is_extension_param
from fsdp._fully_shard._mesh import (
    InvalidArgumentError,
    default_mesh,
    mesh_device,
    mesh_info,
    post_forward_info,
    where,
)
from fsdp._fully_shard._param import ParamSite, ShardedParam
from fsdp._fully_shard._param_group import OWNER, GroupState, ParamGroup
from fsdp._fully_shard._param_mesh import PlacementResolver
from fsdp._fully_shard._policies import (
    MixedPrecisionPolicy,
    OffloadPolicy,
    to_mp_policy,
    to_offload_policy,
)
from fsdp._fully_shard._spmd import spmd_mesh
from fsdp._fully_shard._state import ORPHAN, FullyShardState, state_of
from fsdp._fully_shard._tensor_parallel import check_dtensor_param
from fsdp._runtime._host_memory import release_freed_host_memory
from fsdp._runtime._quantize import QuantizedCommPolicy, to_comm_policy

__all__ = [
    "FSDPModule",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]

_FSDP_CLASSES: dict[type, type] = {}  # original class -> FSDP<original class>


@overload
def fully_shard(
    module: nn.Module,
    *,
    mesh: Any = None,
    reshard_after_forward: bool | int | None = None,
    shard_across_replicas: bool = False,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: Any = None,
    comm_policy: QuantizedCommPolicy | None = None,
) -> FSDPModule: ...


@overload
def fully_shard(
    module: list[nn.Module],
    *,
    mesh: Any = None,
    reshard_after_forward: bool | int | None = None,
    shard_across_replicas: bool = False,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: Any = None,
    comm_policy: QuantizedCommPolicy | None = None,
) -> list[FSDPModule]: ...


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: Any = None,
    reshard_after_forward: bool | int | None = None,
    shard_across_replicas: bool = False,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 (frozen, as torch's)
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: Any = None,
    comm_policy: QuantizedCommPolicy | None = None,
) -> FSDPModule | list[FSDPModule]:
    """Shard ``module``'s parameters across the data-parallel ranks of ``mesh``.

    The parameters of ``module`` not already managed by a ``fully_shard`` call
    on a submodule (so apply it bottom-up: each block, then the root) become
    ``DTensor`` s sharded on dim 0 (or the ``Shard(dim)`` that
    ``shard_placement_fn`` returns for a parameter), each rank holding its
    ``torch.chunk`` piece; they form one group, gathered in one all-gather
    before the module's forward and freed after it, gathered again for its
    backward, with the gradients reduce-scattered in one collective per group.

    Args:
        module: the module to shard; its class becomes a subclass of
            :class:`FSDPModule` and its own class. A list of modules shards
            them as one group: one all-gather before the first of them runs,
            freed after the last (torchtitan's ``fully_shard([model.norm,
            model.output])``); see [Note: several modules, one group].
        mesh: the data-parallel ``DeviceMesh``: 1-D shards over all its ranks,
            2-D ``(replicate, shard)`` (``mesh_dim_names`` required) shards inside
            each row and replicates across rows (HSDP). Default: a 1-D mesh over
            the default process group (initialised if need be).
        reshard_after_forward: ``True`` frees the gathered parameters after
            forward and gathers them again in backward; ``False`` keeps them to
            the backward; an int ``n`` (a divisor of the shard group's size)
            keeps a shard over ``n`` ranks between forward and backward, so
            backward gathers over fewer ranks; ``None``: ``True``, except
            ``False`` for the root (whose backward comes right after its forward).
        shard_across_replicas: ours, not torch's. With a 2-D mesh, shard what the
            optimizer steps over all its ranks as on the mesh flattened (the parameters
            are ``DTensor`` s with ``(Shard(d),)`` there; master weights, gradients and
            optimizer state 1/world each), while forward and backward gather inside a
            replica as HSDP does: gradients are reduce-scattered inside the replica, then
            across replicas, and the next forward all-gathers the updated shards across
            replicas into each rank's shard of its replica, HSDP's traffic across them;
            see [Note: sharding across replicas]. ``False``: HSDP (or plain sharding).
        shard_placement_fn: returns the ``Shard(dim)`` to cut a parameter along
            (``None``: dim 0); a dim other than 0 must divide evenly.
        mp_policy: parameter, reduction and output dtypes
            (:class:`MixedPrecisionPolicy`).
        offload_policy: :class:`CPUOffloadPolicy` keeps sharded parameters,
            gradients and optimizer state on the host.
        ignored_params: parameters left alone: not sharded, not moved, their
            gradients not reduced.
        dp_mesh_dims: a :class:`DataParallelMeshDims`: ``mesh`` is then the full
            SPMD mesh the parameters are already ``DTensor`` s on (``Replicate()``
            on the named dimensions), and ``fully_shard`` shards over its ``shard``
            dimension(s) and replicates across its ``replicate`` ones; see
            [Note: full-SPMD meshes] in ``_spmd.py``.
        comm_policy: an extension torch's ``fully_shard`` lacks:
            :class:`~fsdp.QuantizedCommPolicy` gathers this group's parameters
            as int8 blocks and reduce-scatters its gradients as int8 or bf16
            blocks, for slow links; the sharded parameters stay exact. Applies
            to this call's group only (pass it to every call). ``None``: exact.

    Returns:
        ``module`` itself, now an :class:`FSDPModule` (the list, for a list).
    """
    modules = _root_modules(module)
    for m in modules:
        _check_module(m)
    mp = to_mp_policy(mp_policy)
    offload = to_offload_policy(offload_policy)
    comm = to_comm_policy(comm_policy)
    if mesh is None:
        mesh = default_mesh()
    spmd = None if dp_mesh_dims is None else spmd_mesh(mesh, dp_mesh_dims)
    if spmd is not None and shard_across_replicas:
        raise NotImplementedError(
            f"{where()}: fully_shard(shard_across_replicas=True) with dp_mesh_dims (a full "
            "SPMD mesh) is not supported by this implementation; pass the 2-D (replicate, "
            "shard) data-parallel mesh itself, or shard_across_replicas=False"
        )
    info = mesh_info(mesh, shard_across_replicas) if spmd is None else spmd.dp
    device = mesh_device(mesh)
    auto = reshard_after_forward is None
    if spmd is not None and type(reshard_after_forward) is int:
        raise NotImplementedError(
            "reshard_after_forward as int is not yet supported with SPMD mesh "
            "(dp_mesh_dims): pass True or False"
        )
    post_forward = post_forward_info(True if auto else reshard_after_forward, info)  # type: ignore[arg-type]
    ignored = set(ignored_params or ())
    managed = _managed_modules(modules, ignored)
    params = _adopt_tied(modules, _managed_params(managed, ignored, spmd=spmd is not None), ignored)
    _move_to_device(managed, params, ignored, device)
    group = None
    if params:
        sites = _sites(modules, params)
        resolver = PlacementResolver(shard_placement_fn, info, spmd)
        sharded = [_sharded_param(site, p, resolver) for site, p in zip(sites, params, strict=True)]
        group = ParamGroup(
            modules,
            sharded,
            params,
            mesh=info,
            post_forward=post_forward,
            device=device,
            mp=mp,
            offload=offload,
            comm_policy=comm,
        )
    state = FullyShardState(
        modules, group, mesh=info, device=device, mp=mp, auto_reshard_after_forward=auto
    )
    _composable.register(modules, fully_shard, state)  # [Note: torch's composable registry]
    release_freed_host_memory()  # the originals' memory: see [Note: construction RSS]
    for m in managed:
        m.__dict__["_is_fsdp_managed_module"] = True  # as torch's, for Dynamo's checks
        m.__dict__["_fsdp_use_orig_params"] = True
    for m in modules:
        m.__class__ = _fsdp_class(type(m))
    if isinstance(module, nn.Module):
        return cast(FSDPModule, module)
    return cast(list[FSDPModule], module)


def _root_modules(module: Any) -> tuple[nn.Module, ...]:
    """The modules one call shards: ``module``, or those of a list that no other module
    of the list contains (each once, in the list's order)."""
    if isinstance(module, nn.Module):
        return (module,)
    if not isinstance(module, (list, tuple)):
        raise TypeError(
            f"fully_shard needs an nn.Module or a list of them, got {type(module).__name__}"
        )
    given = list(module)
    bad = [type(m).__name__ for m in given if not isinstance(m, nn.Module)]
    if bad or not given:
        raise TypeError(
            "fully_shard needs an nn.Module or a non-empty list of nn.Modules, got a list "
            f"holding {bad or 'nothing'}"
        )
    inside: set[int] = set()
    for m in given:
        inside.update(id(sub) for sub in m.modules() if sub is not m)
    roots: list[nn.Module] = []
    for m in given:
        if id(m) not in inside and all(m is not r for r in roots):
            roots.append(m)
    return tuple(roots)


def _check_module(module: nn.Module) -> None:
    """A module ``fully_shard`` can take."""
    if (
        isinstance(module, (nn.ModuleList, nn.ModuleDict))
        and type(module).forward is nn.Module.forward
    ):
        raise ValueError(
            f"fully_shard does not support containers that do not implement forward: {module}"
        )
    if state_of(module) is not None or _composable.is_fully_sharded(module):
        raise InvalidArgumentError(
            "Each distinct composable distributed API can only be applied to a module once. "
            f"fully_shard was already applied to this {type(module).__name__}: apply it once "
            "per module (inner modules first, then the outer ones)"
        )
    # Own attributes only: a CheckpointWrapper around an FSDP1 instance forwards both.
    if module.__dict__.get("_fsdp_state") is not None or "_fsdp_wrapped_module" in module._modules:
        raise ValueError(
            "fully_shard cannot be applied to a FullyShardedDataParallel instance: use one of "
            "the two APIs for a model (FSDP1's wrapper or FSDP2's fully_shard)"
        )


def _managed_modules(roots: tuple[nn.Module, ...], ignored: set[nn.Parameter]) -> list[nn.Module]:
    """``roots`` and their submodules not inside a nested ``fully_shard`` module
    (post-order), without those that hold only ignored parameters and no buffers."""
    out: list[nn.Module] = []
    seen: set[int] = set()

    def visit(m: nn.Module) -> None:
        seen.add(id(m))
        for child in m.children():
            if id(child) in seen or state_of(child) is not None:
                continue
            if _composable.is_replicated(child):  # torch's replicate() owns it, as in torch's
                continue
            visit(child)
        out.append(m)

    for root in roots:
        if id(root) not in seen:
            visit(root)
    if not ignored:
        return out
    keep = []
    for m in out:
        params = [p for p in m.parameters(recurse=True) if p not in ignored]
        buffers = list(m.buffers(recurse=True))
        if any(m is r for r in roots) or params or buffers:
            keep.append(m)
    return keep


def _submodules(roots: tuple[nn.Module, ...]) -> list[nn.Module]:
    """Every module under ``roots`` (themselves included), each once."""
    out: list[nn.Module] = []
    seen: set[int] = set()
    for root in roots:
        for m in root.modules():
            if id(m) not in seen:
                seen.add(id(m))
                out.append(m)
    return out


def _managed_params(
    modules: Iterable[nn.Module], ignored: set[nn.Parameter], *, spmd: bool = False
) -> list[nn.Parameter]:
    params: list[nn.Parameter] = []
    seen: set[int] = set()
    for m in modules:
        for name, p in m.named_parameters(recurse=False):
            if p in ignored or id(p) in seen:
                continue
            seen.add(id(p))
            if p.dim() == 0:
                raise ValueError(
                    "fully_shard doesn't support scalar parameters. "
                    f"Change {name} to a 1D tensor with numel equal to 1."
                )
            has_extension(p)  # both methods or neither: [Note: all-gather extensions]
            if isinstance(p, DTensor) and is_extension_param(p._local_tensor):
                raise NotImplementedError(
                    f"parameter {name!r} is a DTensor (tensor parallelism) whose local tensor "
                    f"is a {type(p._local_tensor).__name__} (an all-gather extension or tensor "
                    "subclass): not supported by this implementation; use extensions on "
                    "plain (not tensor-parallel) parameters, or plain local tensors"
                )
            if isinstance(p, DTensor) and not spmd:
                check_dtensor_param(name, p)  # tensor parallelism: see _tensor_parallel.py
            if not p.is_contiguous():
                raise NotImplementedError(
                    f"FSDP does not support non-contiguous parameters yet: {name} "
                    f"{p.shape=} {p.stride()=}; make it contiguous (param.data = "
                    "param.data.contiguous()) before fully_shard"
                )
            if getattr(p, "_fsdp_flattened", False):
                raise ValueError(
                    f"parameter {name!r} is already managed by a FullyShardedDataParallel unit: "
                    "use one of the two APIs for a model"
                )
            params.append(p)
    return params


def _adopt_tied(
    roots: tuple[nn.Module, ...], params: list[nn.Parameter], ignored: set[nn.Parameter]
) -> list[nn.Parameter]:
    """Resolve parameters tied to ones another call sharded; see [Note: tied parameters
    across fully_shard calls] in ``_param_group.py``.

    A parameter a nested call inside ``roots`` owns comes to this call; one owned
    by a call outside ``roots`` (a sibling) is released by it and left to a common
    parent: it is marked orphan with the modules that use it, and the first
    later call whose subtree holds all of those modules takes it.
    """
    subs = _submodules(roots)
    inside = {id(m) for m in subs}
    out: list[nn.Parameter] = []
    orphaned: set[int] = set()
    for p in params:
        owner_ref = p.__dict__.get(OWNER)
        owner = owner_ref() if owner_ref is not None else None
        if owner is None:
            out.append(p)
            continue
        users = [m for m in subs if any(q is p for q in m._parameters.values())]
        users += owner.users_of(p)
        owner.release(p)
        if all(id(m) in inside for m in users):
            out.append(p)
        else:
            p.__dict__[ORPHAN] = [weakref.ref(m) for m in users]
            orphaned.add(id(p))
    taken = {id(p) for p in out}
    for sub in subs:
        for q in sub._parameters.values():
            if q is None or id(q) in taken or id(q) in orphaned or q in ignored:
                continue
            refs = q.__dict__.get(ORPHAN)
            if refs is None:
                continue
            if all((m := r()) is None or id(m) in inside for r in refs):
                del q.__dict__[ORPHAN]
                taken.add(id(q))
                out.append(q)
    return out


def _move_to_device(
    modules: Iterable[nn.Module],
    params: list[nn.Parameter],
    ignored: set[nn.Parameter],
    device: torch.device,
) -> None:
    """Parameters and buffers to the mesh's device (meta ones stay, for deferred init)."""
    with torch.no_grad():
        for p in params:
            if p.device != device and not p.is_meta:
                p.data = p.data.to(device)
        for m in modules:
            for name, b in m._buffers.items():
                if b is not None and b.device != device and not b.is_meta:
                    m._buffers[name] = b.to(device)


def _sites(roots: tuple[nn.Module, ...], params: list[nn.Parameter]) -> list[ParamSite]:
    """Where each parameter is registered, tied names included (shared modules too)."""
    wanted = {id(p) for p in params}
    sites: dict[int, ParamSite] = {}
    subs = [sub for root in roots for _, sub in root.named_modules(remove_duplicate=False)]
    for sub in subs:
        for name, p in sub._parameters.items():
            if p is None or id(p) not in wanted:
                continue
            site = sites.get(id(p))
            if site is None:
                sites[id(p)] = ParamSite(sub, name)
            elif not (site.module is sub and site.name == name) and (sub, name) not in [
                (m, n) for m, n in site.shared
            ]:
                site.shared.append((sub, name))
    return [sites[id(p)] for p in params]


def _sharded_param(
    site: ParamSite,
    param: nn.Parameter,
    resolver: PlacementResolver,
) -> ShardedParam:
    """The sharded form of ``param``: a plain parameter is cut over dp as it is, a
    ``DTensor`` one by its tp-local tensor ([Note: fully_shard over tensor parallelism],
    [Note: full-SPMD meshes]), over its own mesh if ``shard_placement_fn`` gives one
    ([Note: parameters on their own mesh])."""
    requested, info, spmd = resolver.resolve(site.name, param)
    own_mesh = info is not resolver.info
    if resolver.info.across is not None and (isinstance(param, DTensor) or own_mesh):
        raise NotImplementedError(
            f"{where()}: fully_shard(shard_across_replicas=True) shards plain parameters on "
            f"the call's own mesh only, but {site.name!r} is a DTensor (tensor parallelism) "
            "or shard_placement_fn gave it a mesh of its own; not supported by this "
            "implementation: use shard_across_replicas=False for such modules"
        )
    if spmd is not None:
        spmd.check_param(site.name, param)
        assert isinstance(param, DTensor)
        spec = spmd.spec(param)
        local_shape = param._local_tensor.shape
        shard = _placement(requested, param, local_shape, info.shard_size)
        mesh, placements = spmd.sharded_form(spec, shard)
        return ShardedParam(
            site, local_shape, shard, info=info, mesh=mesh, placements=placements, tp=spec
        )
    if not isinstance(param, DTensor):
        shard = _placement(requested, param, param.shape, info.shard_size)
        return ShardedParam(
            site, param.shape, shard, info=info, mesh=info.mesh, placements=info.placements(shard)
        )
    composer = resolver.composer(info)
    tp = composer.spec(param)
    local_shape = param._local_tensor.shape
    shard = _placement(requested, param, local_shape, info.shard_size)
    mesh, placements = composer.sharded_form(site.name, tp, shard)
    return ShardedParam(
        site, local_shape, shard, info=info, mesh=mesh, placements=placements, tp=tp
    )


def _placement(
    placement: Any,
    param: nn.Parameter,
    shape: torch.Size,
    shards: int,
) -> Shard:
    """The ``Shard(dim)`` to cut ``param`` along (``placement`` from ``shard_placement_fn``,
    ``None``: dim 0), checked against ``shape``, what is cut (the parameter's, or a
    tensor-parallel parameter's local one)."""
    if placement is None:
        return Shard(0)
    if not isinstance(placement, Shard) or type(placement) is not Shard:
        raise NotImplementedError(
            f"shard_placement_fn returned {placement!r}: only a Shard(dim) (or None for dim 0) "
            "is supported as a placement by this implementation"
        )
    ndim = len(shape)
    dim = placement.dim + ndim if placement.dim < 0 else placement.dim
    if not 0 <= dim < ndim:
        raise InvalidArgumentError(
            f"Shard dim {placement.dim} is invalid for {ndim}D tensor: "
            f"{tuple(param.shape)}; return a dim the parameter has from shard_placement_fn "
            "(or None for dim 0)"
        )
    if dim > 0 and shape[dim] % shards != 0:
        raise NotImplementedError(
            f"FSDP does not support uneven sharding on dim {dim}: {tuple(shape)} "
            f"(world size: {shards}); a chunk along a dimension other than 0 must be even, so "
            "cut this parameter along dim 0 (return None) or along a dim that divides"
        )
    return Shard(dim)


def _fsdp_class(cls: type) -> type:
    """``FSDP<cls>``: derived from :class:`FSDPModule` and ``cls``, made once per class."""
    made = _FSDP_CLASSES.get(cls)
    if made is None:
        made = type(
            f"FSDP{cls.__name__}",
            (FSDPModule, cls),
            {"__deepcopy__": _no_deepcopy, "forward": _guarded_forward(cls.forward)},  # type: ignore[attr-defined]
        )
        _FSDP_CLASSES[cls] = made
    return made


def _no_deepcopy(*args: Any, **kwargs: Any) -> NoReturn:
    raise AssertionError(
        "FSDP does not support deepcopy. Please use state dict for serialization: copy "
        "model.state_dict() (DTensor shards) or build a new model and fully_shard it."
    )


def _guarded_forward(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` that refuses to run on sharded parameters (called directly, not
    through ``module(...)``, whose hooks gather them). Keeps ``forward``'s signature for
    tools that read it (``inspect.signature``)."""

    @functools.wraps(forward)
    def guarded(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        state = state_of(self)
        group = state.group if state is not None else None
        if group is not None and group.state is not GroupState.UNSHARDED:
            raise RuntimeError(
                f"{type(self).__name__}.forward() was called directly on a fully_shard module "
                "whose parameters are sharded (DTensor shards, not the full tensors), so it "
                "cannot compute. Call the module itself (module(*args)), which gathers the "
                "parameters through its hooks, or register the method with "
                f"fsdp.register_fsdp_forward_method(module, 'forward') (for another method "
                "called instead of forward, register that one)."
            )
        return forward(self, *args, **kwargs)

    return guarded


class FSDPModule:
    """Mixin of every ``fully_shard`` module: the methods users call on it.

    ``fully_shard(module)`` changes ``module``'s class to ``FSDP<Class>``, derived
    from this class and ``Class``. None of these methods is recursive unless its
    ``recurse`` argument says so.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Build the original class: e.g. nn.Sequential slicing builds a new
        # container of its own type, which must not be an FSDP module.
        orig: Any = cls.__mro__[2]
        self = orig.__new__(orig)
        self.__init__(*args, **kwargs)
        return self

    def _fully_shard_state(self) -> FullyShardState:
        state = state_of(cast(nn.Module, self))
        if state is None:
            raise AssertionError(f"No FSDP state found on {type(self).__name__}")
        return state

    def _fsdp_modules(self, recurse: bool) -> list[FSDPModule]:
        root = cast(nn.Module, self)
        modules = list(root.modules()) if recurse else [root]
        return [m for m in modules if isinstance(m, FSDPModule)]

    def _groups(self, recurse: bool) -> list[ParamGroup]:
        groups: list[ParamGroup] = []  # a group of several modules once
        for m in self._fsdp_modules(recurse):
            g = m._fully_shard_state().group
            if g is not None and all(g is not seen for seen in groups):
                groups.append(g)
        return groups

    def reshard(self) -> None:
        """Free the unsharded parameters (if gathered) and register the sharded ones."""
        group = self._fully_shard_state().group
        if group is not None:
            group.reshard()

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather the parameters (in ``param_dtype``), registering the unsharded ones.

        With ``async_op=True`` returns a :class:`UnshardHandle` whose ``wait()``
        completes it (the module's pre-forward also does); else waits and
        returns ``None``.
        """
        group = self._fully_shard_state().group
        if group is not None:
            group.sync()
            group.unshard()
        handle = _UnshardHandle(group)
        if async_op:
            return handle
        handle.wait()
        return None

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last before the optimizer step (set False for all
        but the last micro-batch): the last one forgets the recorded backward order.

        Every backward completes its gradient reductions, so ``.grad`` is whole after
        any backward: torch's on CUDA leaves them on the reduction stream after a
        backward that is not the last, and an optimizer step after such a backward
        (the flag left ``False`` by mistake) would read gradients still being
        written; on the CPU, where the stack runs, waiting costs nothing that could
        overlap with the step."""
        state = self._fully_shard_state()
        state.lazy_init()
        state._iteration().is_last_backward = is_last_backward

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """Whether backward reduces gradients (both collectives under HSDP). ``False``:
        gradients accumulate on the unsharded parameters instead (FSDP1's ``no_sync``)."""
        for group in self._groups(recurse):
            group.reduce_grads = requires_gradient_sync
            group.all_reduce_grads = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: whether to all-reduce across replicas (``False``: reduce-scatter only, the
        partial sums accumulate until a backward with the all-reduce)."""
        for group in self._groups(recurse):
            group.all_reduce_grads = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Change ``reshard_after_forward`` (a bool) at run time, e.g. ``True`` for the root."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}"
            )
        for m in self._fsdp_modules(recurse):
            state = m._fully_shard_state()
            state.auto_reshard_after_forward = False
            if state.group is not None:
                state.group.set_post_forward(post_forward_info(reshard_after_forward, state.mesh))

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """Whether to free the gathered parameters after backward (``False`` saves the
        next forward's all-gather during gradient accumulation, at the cost of memory)."""
        for group in self._groups(recurse):
            group.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Gather these modules' parameters right after this module's (in forward),
        instead of the default issue-ahead of the next module."""
        _check_fsdp_modules(modules)
        self._fully_shard_state().forward_prefetch = [m._fully_shard_state() for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Gather these modules' parameters when this module's backward starts, instead of
        the default (the module whose backward comes next)."""
        _check_fsdp_modules(modules)
        self._fully_shard_state().backward_prefetch = [m._fully_shard_state() for m in modules]

    def set_post_optim_event(self, event: Any) -> None:
        """Accepted for torch's API: our gathers already wait for the compute stream, so an
        event recorded after the optimizer step adds no ordering (see the README)."""
        state = self._fully_shard_state()
        state.lazy_init()
        state._iteration().post_optim_event = event

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by ``factor`` instead of the data-parallel size."""
        for group in self._groups(recurse=False):
            group.gradient_divide_factor = float(factor)
            group.update_reduction()

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated name of :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None], *, stream: Any = None
    ) -> None:
        """Call ``hook(reduced)`` on each reduced gradient shard (after the reduce-scatter,
        or after the all-reduce across replicas under HSDP), in place, before the cast back."""
        for group in self._groups(recurse=False):
            if stream is not None and group.mesh.replicate_size > 1:
                raise ValueError("stream cannot be set when using native HSDP")
            group.all_reduce_hook = hook if stream is None else _on_stream(hook, stream)
            group.update_reduction()

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether backward needs the parameters gathered (``False`` for a module whose
        backward does not read its parameters, e.g. an embedding)."""
        for group in self._groups(recurse=False):
            group.unshard_in_backward = unshard_in_backward

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """Give parameters that got no gradient in a backward a zero gradient too (our
        reductions always have every rank's full layout, so ranks never mismatch)."""
        for group in self._groups(recurse):
            group.reduce_scatter_unused_params = reduce_scatter_unused_params

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted for torch's API: our collectives always sum and divide separately."""

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """How many gradient reductions may be in flight at once (default 1)."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}"
            )
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        state = self._fully_shard_state()
        state.lazy_init()
        state._context().max_reductions_in_flight = max_input_buffers

    def reset_iter_state(self) -> None:
        """After ``forward()`` or ``backward()`` raised: reshard everything and drop the
        failed iteration's gradient reductions, so the next iteration starts clean. Call it
        on the root module."""
        self._fully_shard_state().reset_iteration()

    def _unsupported(self, name: str) -> NoReturn:
        raise NotImplementedError(
            f"FSDPModule.{name} is not supported by this implementation (see the fsdp README, "
            "'fully_shard: what is left out'); the default collectives and memory are used"
        )

    def set_custom_all_gather(self, comm: Any) -> None:
        """Not supported: custom all-gather implementations."""
        self._unsupported("set_custom_all_gather")

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Not supported: custom reduce-scatter implementations."""
        self._unsupported("set_custom_reduce_scatter")

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Not supported: collective buffers from the process group's allocator."""
        self._unsupported("set_allocate_memory_from_process_group_for_comm")

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Not supported: symmetric-memory collective buffers."""
        self._unsupported("set_symm_mem_for_comm")

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        """Not supported: a second process group for the reduce-scatters."""
        self._unsupported("set_separate_reduce_scatter_group")

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # Module moves (to, to_empty, float, ...) act on the registered parameters: the
        # sharded ones, which afterwards go back into the group's region.
        self.reshard()
        out = super()._apply(*args, **kwargs)  # type: ignore[misc]
        group = self._fully_shard_state().group
        if group is not None:
            group.sync()
        return out


def _on_stream(hook: Callable[[torch.Tensor], None], stream: Any) -> Callable[[torch.Tensor], None]:
    """``hook`` run with ``stream`` current (after the stream waited for the current one)."""

    def run(output: torch.Tensor) -> None:
        module: Any = torch.get_device_module(output.device)
        stream.wait_stream(module.current_stream())
        with module.stream(stream):
            hook(output)
        module.current_stream().wait_stream(stream)

    return run


class UnshardHandle:
    """Wait on an :meth:`FSDPModule.unshard` issued with ``async_op=True``."""

    def wait(self) -> None:
        """Complete the gather: the unsharded parameters are registered and usable."""


class _UnshardHandle(UnshardHandle):
    def __init__(self, group: ParamGroup | None) -> None:
        self._group = group

    def wait(self) -> None:
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` run ``fully_shard``'s forward hooks around it.

    For a method called instead of ``forward`` (``generate``, an encoder's
    ``encode``): it gathers the parameters before and reshards after, as a
    call of the module does. A no-op for a module that is not an ``FSDPModule``.
    """
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module)} does not have a method {method_name}")
    method = getattr(module, method_name)
    state = module._fully_shard_state()

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = state._pre_forward(cast(nn.Module, module), args, kwargs)
        out = method(*args, **kwargs)
        return state._post_forward(cast(nn.Module, module), args, out)

    setattr(module, method_name, wrapped)


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Accepted for torch's API (pipeline stages sharing CUDA streams): every module
    on a device already shares one unshard and one post-backward stream here."""
    _check_fsdp_modules(modules)


def _check_fsdp_modules(modules: Iterable[Any]) -> None:
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(f"Expects FSDPModule but got {type(m)}: {m}")
