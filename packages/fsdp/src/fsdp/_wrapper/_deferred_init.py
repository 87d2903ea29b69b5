"""Deferred initialisation: materialise a meta-device module one unit at a time.

A model too large for one rank's memory is built on the ``meta`` device
(shapes only, no storage) and wrapped with an auto-wrap policy. Each FSDP
unit is built bottom-up (inner units first, see ``wrap.py``), and each one
materialises only *its own* modules just before flattening and sharding them:
real storage exists for one unit's unsharded parameters at a time, plus the
shards of the units already built.

[Note: materialisation order]
The modules a unit materialises are those of its subtree that no nested FSDP
instance or ignored module owns, visited breadth-first from the wrapped module
(torch's FSDP order, so the same seed gives the same values as torch's).
Without ``param_init_fn`` each module that directly holds parameters or buffers
is moved with ``to_empty(recurse=False)`` and its ``reset_parameters()`` is
called, which by contract initialises only that module's own states. With
``param_init_fn`` it is called on every such module (all of them, whether or
not it holds states directly) and must materialise what it needs.

``to_empty`` replaces each meta parameter by a new ``Parameter``, which would
silently untie parameters shared between modules (tied embeddings): each
module would get its own copy. After materialising, every group of names that
shared one meta parameter is tied again to the first name's new parameter
(module order), as the model was built. A parameter tied to modules of other
units (marked by the root's auto-wrap, see [Note: tied parameters] in
``_init.py``) is materialised by the first unit that holds one of its uses
and replaces the meta parameter at every use; a later unit keeps that
parameter when it materialises its own modules.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fsdp._wrapper._agreement import check_broadcast_agrees
from fsdp._wrapper._process_groups import ProcessGroups

__all__ = [
    "broadcast_module_states",
    "has_meta_states",
    "materialize_unit",
    "modules_to_materialize",
]

IGNORED = "_fsdp_ignored"  # set on every module in an ignored subtree (see _ignored.py)
TIED = "_fsdp_tied"  # on a parameter used in several places, while wrapping (see _init.py)
_BROADCAST_BUCKET_BYTES = 250 * 2**20  # one broadcast per this many bytes of same-dtype states


def modules_to_materialize(
    module: nn.Module, is_fsdp: Callable[[nn.Module], bool]
) -> list[nn.Module]:
    """``module`` and its descendants outside nested units and ignored modules, breadth-first."""
    out: list[nn.Module] = []
    seen = {id(module)}
    queue = deque([module])
    while queue:
        m = queue.popleft()
        out.append(m)
        for child in m.children():
            if id(child) in seen or is_fsdp(child) or child.__dict__.get(IGNORED):
                continue
            seen.add(id(child))
            queue.append(child)
    return out


def _own_states(module: nn.Module) -> list[Tensor]:
    return [
        *(p for p in module._parameters.values() if p is not None),
        *(b for b in module._buffers.values() if b is not None),
    ]


def has_meta_states(modules: Iterable[nn.Module], ignored_params: frozenset[nn.Parameter]) -> bool:
    """Whether any of ``modules`` directly holds a meta parameter or buffer (ignored ones aside)."""
    return any(
        t.is_meta
        for m in modules
        for t in _own_states(m)
        if not (isinstance(t, nn.Parameter) and t in ignored_params)
    )


def _describe(module: nn.Module, root: nn.Module) -> str:
    for name, m in root.named_modules():
        if m is module:
            return f"{name or '<root>'!r} ({type(module).__name__})"
    return f"a {type(module).__name__}"


def materialize_unit(
    root: nn.Module,
    modules: list[nn.Module],
    *,
    param_init_fn: Callable[[nn.Module], None] | None,
    device: torch.device,
) -> None:
    """Give ``modules`` (one unit's, from :func:`modules_to_materialize`) real storage.

    See [Note: materialisation order]. Raises if a module with meta states
    has no ``reset_parameters`` (and no ``param_init_fn`` was given), or if
    ``param_init_fn`` left anything on the meta device.
    """
    # Which (module, name) pairs share one parameter, to tie them again afterwards.
    tied: dict[int, list[tuple[nn.Module, str]]] = {}
    marks: dict[int, Any] = {}  # id(meta parameter) -> its TIED mark (tied across units)
    # Tied to another unit that materialised it already: the parameter and its data
    # (to_empty may swap a real parameter's .data in place, and reset() re-initialise it).
    real: dict[tuple[int, str], tuple[nn.Parameter, Tensor]] = {}
    for m in modules:
        for name, p in m._parameters.items():
            if p is not None:
                tied.setdefault(id(p), []).append((m, name))
                if TIED in p.__dict__:
                    marks[id(p)] = p.__dict__[TIED]
                if not p.is_meta and TIED in p.__dict__:
                    real[(id(m), name)] = (p, p.data)
    with torch.no_grad():
        if param_init_fn is not None:
            if not callable(param_init_fn):
                raise TypeError(
                    f"param_init_fn must be a callable (module) -> None, got {param_init_fn!r}"
                )
            for m in modules:
                param_init_fn(m)
        else:
            for m in modules:
                if not any(t.is_meta for t in _own_states(m)):
                    continue
                reset = getattr(m, "reset_parameters", None)
                if not callable(reset):
                    raise ValueError(
                        f"module {_describe(m, root)} has parameters or buffers on the meta "
                        f"device but no reset_parameters() method, so FSDP cannot initialise "
                        f"it. Add reset_parameters() to {type(m).__name__} (initialising only "
                        "its own parameters and buffers) or pass param_init_fn="
                    )
                m.to_empty(device=device, recurse=False)
                reset()
    for m in modules:  # a module's reset must not replace what another unit materialised
        for name in list(m._parameters):
            kept = real.get((id(m), name))
            if kept is not None:
                kept[0].data = kept[1]
                m._parameters[name] = kept[0]
    for old_id, owners in tied.items():
        first_module, first_name = owners[0]
        first = first_module._parameters[first_name]
        assert first is not None
        for m, name in owners[1:]:
            if m._parameters.get(name) is not first:
                m._parameters[name] = first
        mark = marks.get(old_id)
        if mark is not None and first.__dict__.get(TIED) is not mark:
            # Tied to modules of other units too: they share the new parameter (and its mark).
            first.__dict__[TIED] = mark
            for m, name in mark.sites:
                m._parameters[name] = first
    left = [
        f"{_describe(m, root)}.{name}"
        for m in modules
        for name, t in [*m._parameters.items(), *m._buffers.items()]
        if t is not None and t.is_meta
    ]
    if left:
        how = (
            "param_init_fn did not materialise them; it must give real storage to the "
            "parameters and buffers of the module it is called with, e.g. "
            "module.to_empty(device=..., recurse=False) then initialise them"
            if param_init_fn is not None
            else "reset_parameters() left them there"
        )
        raise ValueError(
            f"after deferred initialisation {left[:6]} are still on the meta device: {how}"
        )


def _broadcast(tensors: list[Tensor], group: Any) -> None:
    """Broadcast ``tensors`` from the group's first rank, in buckets of one dtype and device."""
    bucket: list[Tensor] = []
    size = 0

    def flush() -> None:
        nonlocal size
        if not bucket:
            return
        direct = len(bucket) == 1 and bucket[0].is_contiguous()
        flat = bucket[0] if direct else torch.cat([t.reshape(-1) for t in bucket])
        dist.broadcast(flat, group=group, group_src=0)
        if not direct:
            offset = 0
            for t in bucket:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
        bucket.clear()
        size = 0

    for t in tensors:
        if bucket and (
            t.dtype != bucket[0].dtype
            or t.device != bucket[0].device
            or size + t.nbytes > _BROADCAST_BUCKET_BYTES
        ):
            flush()
        bucket.append(t)
        size += t.nbytes
    flush()


@torch.no_grad()
def broadcast_module_states(
    params: list[nn.Parameter], buffers: list[Tensor], groups: ProcessGroups
) -> None:
    """Give every rank the parameters and buffers of the first rank (``sync_module_states``).

    Hybrid sharding broadcasts across the replicate group first, then inside
    each shard group, so that the first rank's values reach every shard group
    (the reverse order would spread uninitialised values from the other shard
    groups' first ranks).
    """
    tensors = [t.detach() for t in [*params, *buffers] if t.numel() > 0]
    if not tensors:
        return
    used = [
        group
        for group, size in (
            (groups.replicate_group, groups.replicate_size),
            (groups.shard_group, groups.shard_size),
        )
        if group is not None and size > 1
    ]
    check_broadcast_agrees(tensors, used)  # [Note: agreement step] in flatparam
    if groups.replicate_group is not None and groups.replicate_size > 1:
        _broadcast(tensors, groups.replicate_group)
    if groups.shard_size > 1:
        _broadcast(tensors, groups.shard_group)
