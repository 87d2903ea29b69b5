"""Optimizer state of ``zero_optim.ZeroRedundancyOptimizer``, keyed by parameter FQNs.

Each parameter's state lives on the one rank that owns it (the ZeRO partition). The
FQN-keyed state dicts here have the layout of ``ckpt._wrappers.fsdp1_optim`` (the same as
``torch.optim`` with names for indices), so a checkpoint written by DDP + zero_optim
loads into an fsdp model and the other way round, at any world size:

* sharded: each rank returns the state of the parameters it owns, whole (plain
  tensors under keys no other rank has; DCP writes each once);
* full: everything, gathered to every rank or to rank 0 (``rank0_only``).

Loading takes either form, or fsdp's (``DTensor`` values are gathered, a collective
that every rank joins for every parameter in the same order), and each rank keeps
the state of the parameters it owns.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ckpt._wrappers.fqns import ddp_prefix, names_by_group, tied_names
from ckpt._wrappers.optim_dict_forms import check_form, check_groups, copy_value, rename_tied
from ckpt._wrappers.sharded_chunks import full_value
from zero_optim import ZeroRedundancyOptimizer

__all__ = ["load_zero_optim_state_dict", "zero_optim_state_dict"]


def _parts_one_owner_at_a_time(
    zero: ZeroRedundancyOptimizer, mine: dict[str, Any], rank0_only: bool
) -> list[dict[str, Any]] | None:
    """Every rank's ``mine`` in rank order, on rank 0 (``rank0_only``) or on every rank.

    One owner's part travels at a time (to rank 0, or broadcast from the owner), so a
    receiver's device holds one part in transit, never all ``world_size`` at once as
    with ``gather_object``; the bytes travel on the optimizer's device under NCCL (not
    the current device), on the CPU otherwise. Returns None on ranks that receive nothing.
    """
    pg, rank = zero.process_group, zero.rank
    nccl = str(dist.get_backend(pg)) == "nccl"
    via = zero.join_device if nccl else torch.device("cpu")
    parts: list[dict[str, Any]] = []
    for owner in range(zero.world_size):
        box: list[Any] = [mine if rank == owner else None]
        if not rank0_only:
            dist.broadcast_object_list(box, group=pg, group_src=owner, device=via)
        elif owner != 0 and rank == owner:
            dist.send_object_list(box, group=pg, group_dst=0, device=via)
        elif owner != 0 and rank == 0:
            dist.recv_object_list(box, group=pg, group_src=owner, device=via)
        parts.append(box[0])
    return parts if (rank == 0 or not rank0_only) else None


def zero_optim_state_dict(
    model: nn.Module,
    zero: ZeroRedundancyOptimizer,
    *,
    full: bool,
    rank0_only: bool = False,
    offload_to_cpu: bool = True,
    copy_tensors: bool = True,
) -> dict[str, Any]:
    """The FQN-keyed state of ``zero``: this rank's parameters, or all (``full``).

    ``full`` gathers every rank's part (a collective; with ``rank0_only`` only rank 0
    receives it and other ranks return ``{}``). ``copy_tensors=False`` (not with ``full``): the
    optimizer's own tensors, for a save that copies or writes them at once.
    """
    names = names_by_group(model, zero)
    device = torch.device("cpu") if (offload_to_cpu or full) else None
    by_reference = not copy_tensors and not full
    mine: dict[str, dict[str, Any]] = {}
    by_id = {
        id(p): n
        for group, row in zip(zero.param_groups, names, strict=True)
        for p, n in zip(group["params"], row, strict=True)
    }
    for p in zero.params_per_rank[zero.rank]:
        st = zero.optim.state.get(p)
        if st:
            mine[by_id[id(p)]] = (
                dict(st) if by_reference else {k: copy_value(v, device) for k, v in st.items()}
            )
    state = mine
    if full:
        parts = _parts_one_owner_at_a_time(zero, mine, rank0_only)
        if parts is None:
            return {}
        state = {k: v for part in parts for k, v in part.items()}
        order = [n for row in names for n in row]
        state = {n: state[n] for n in order if n in state}
    groups = []
    for param_group, row in zip(zero.param_groups, names, strict=True):
        entry = {k: copy.deepcopy(v) for k, v in param_group.items() if k != "params"}
        entry["params"] = list(row)
        groups.append(entry)
    return {"state": state, "param_groups": groups}


def load_zero_optim_state_dict(
    model: nn.Module, zero: ZeroRedundancyOptimizer, named: Mapping[str, Any]
) -> None:
    """Load an FQN-keyed optimizer state dict (full, sharded, or fsdp's) into ``zero``."""
    what = "load_zero_optim_state_dict"
    check_form(named, what)
    named = rename_tied(named, tied_names(model, ddp_prefix(model)), what)
    names = names_by_group(model, zero)
    check_groups(named, names, what)
    saved_groups = named["param_groups"]
    owned = {id(p) for p in zero.params_per_rank[zero.rank]}
    state: dict[int, Any] = {}
    index = 0
    for group, row in zip(zero.param_groups, names, strict=True):
        for p, name in zip(group["params"], row, strict=True):
            saved = named["state"].get(name)
            if saved is not None:
                # Every rank gathers every DTensor (a collective), keeps only its own.
                values = {
                    k: full_value(v) if isinstance(v, Tensor) else v for k, v in saved.items()
                }
                if id(p) in owned:
                    for k, v in values.items():
                        if isinstance(v, Tensor) and v.dim() > 0 and v.shape != p.shape:
                            raise ValueError(
                                f"state {k!r} of {name} has shape {tuple(v.shape)}, the "
                                f"parameter has {tuple(p.shape)}"
                            )
                    state[index] = values
            index += 1
    groups = []
    start = 0
    for group, saved_group in zip(zero.param_groups, saved_groups, strict=True):
        entry = {k: v for k, v in saved_group.items() if k != "params"}
        entry["params"] = list(range(start, start + len(group["params"])))
        start += len(group["params"])
        groups.append(entry)
    zero.load_state_dict({"state": state, "param_groups": groups})
