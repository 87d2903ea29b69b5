"""What the DTensor-layout parity tests (full SPMD meshes, parameters on their own mesh)
compare between torch's ``fully_shard`` and ours: layouts, values and state dicts."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.fully_shard._common import full


def layout(p: Any) -> tuple[Any, ...]:
    """A sharded parameter's mesh (ranks, names), placements and local shape."""
    mesh = p.device_mesh
    return mesh.mesh.tolist(), mesh.mesh_dim_names, str(p.placements), tuple(p.to_local().shape)


def differences(ref: dict[str, list[Any]], ours: dict[str, list[Any]], tol: float) -> list[str]:
    """What differs between two records (``layout``, ``loss``, ``grads``, ``params``) by more
    than ``tol`` relative to the larger of 1 and the reference's largest magnitude (0: bit
    for bit)."""
    out = []
    if ref["layout"] != ours["layout"]:
        out.append(f"layouts: torch {ref['layout']} ours {ours['layout']}")
    pairs = zip(ref["loss"], ours["loss"], strict=True)
    worst = max(abs(a - b) / max(1.0, abs(a)) for a, b in pairs)
    if worst > tol or (tol == 0 and ref["loss"] != ours["loss"]):
        out.append(f"losses: torch {ref['loss']} ours {ours['loss']}")
    for key in ("grads", "params"):
        for step, (a, b) in enumerate(zip(ref[key], ours[key], strict=True)):
            assert sorted(a) == sorted(b), (key, sorted(a), sorted(b))
            for name in a:
                scale = max(1.0, a[name].abs().max().item())
                diff = (a[name] - b[name]).abs().max().item() / scale
                if diff > tol or (tol == 0 and not torch.equal(a[name], b[name])):
                    out.append(f"{key} {name} step {step}: up to {diff:.3g}")
    return out


def state_dict_differences(fresh: nn.Module, trained_torch: nn.Module) -> list[str]:
    """Load torch's trained sharded state dict into ``fresh`` (ours, untrained) as it is;
    the keys whose placements or values then differ."""
    theirs = trained_torch.state_dict()
    fresh.load_state_dict(theirs)
    out = []
    for key, value in fresh.state_dict().items():
        same = value.placements == theirs[key].placements
        if not (same and torch.equal(full(value), full(theirs[key]))):
            out.append(f"{key} differs after loading torch's state dict")
    return out
