"""``fully_shard(dp_mesh_dims=...)`` over a full SPMD mesh, against torch's on the same model.

torchtitan's ``full_dtensor`` backend: one mesh for everything, every parameter a
``DTensor`` on it (``Replicate()`` on the data-parallel dimensions, column/row
sharded on ``tp``), the batch a ``DTensor`` sharded over the data-parallel
dimensions, and ``fully_shard(..., mesh=mesh, dp_mesh_dims=...)`` per block and on
the root. Losses, full gradients and full parameters after each of 3 AdamW steps
are compared bit for bit with torch 2.13's ``fully_shard``; so are the sharded
parameters' meshes and placements, and the errors for what both refuse.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.fully_shard._common import step_and_record
from tests.fully_shard._dtensor_parity import differences, layout, state_dict_differences
from tests.ranks import run_ranks

STEPS = 3
IN, HIDDEN = 8, 10  # HIDDEN / tp = 5 rows per tp piece: uneven over 2 dp ranks

KEEP = {"reshard_after_forward": False}
BF16 = {"bf16": True}
OFFLOAD = {"offload": True}
# name -> (mesh shape, mesh dim names, shard names, replicate names, options)
CASES: dict[int, dict[str, tuple[tuple[int, ...], tuple[str, ...], Any, Any, dict[str, Any]]]] = {
    1: {"dp1": ((1,), ("dp_shard",), "dp_shard", None, {})},
    2: {
        "dp2": ((2,), ("dp_shard",), "dp_shard", None, {}),
        "dp2_keep": ((2,), ("dp_shard",), "dp_shard", None, KEEP),
        "dp2_bf16": ((2,), ("dp_shard",), "dp_shard", None, BF16),
        "dp1_tp2": ((1, 2), ("dp_shard", "tp"), "dp_shard", None, {}),
    },
    4: {
        "dp2_tp2": ((2, 2), ("dp_shard", "tp"), "dp_shard", None, {}),
        "dp2_tp2_bf16": ((2, 2), ("dp_shard", "tp"), "dp_shard", None, BF16),
        "dp2_tp2_offload": ((2, 2), ("dp_shard", "tp"), "dp_shard", None, OFFLOAD),
        "tp2_dp2": ((2, 2), ("tp", "dp_shard"), "dp_shard", None, {}),
        "hsdp2x2": ((2, 2), ("dp_replicate", "dp_shard"), "dp_shard", "dp_replicate", {}),
        "flat_dp_cp": ((2, 2), ("dp_shard", "cp"), ("dp_shard", "cp"), None, {}),
    },
}

# Bit for bit, except where 4 ranks sum one gradient element: gloo's reduce-scatter (torch's)
# and ours add the 4 contributions in different orders (last-bit differences).
TOLERANCE = {"flat_dp_cp": 1e-6}


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(IN, HIDDEN)
        self.down = nn.Linear(HIDDEN, IN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _distribute(model: nn.Module, mesh: Any) -> None:
    """Every parameter a DTensor on the whole mesh: ``up`` column-, ``down`` row-sharded
    over ``tp`` (when the mesh has it), ``Replicate()`` elsewhere."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    names = mesh.mesh_dim_names
    for module_name, module in model.named_modules():
        for name, p in list(module.named_parameters(recurse=False)):
            placements: list[Any] = [Replicate()] * mesh.ndim
            if "tp" in names:
                tp_cut = None
                if module_name.endswith("up"):
                    tp_cut = Shard(0)
                elif module_name.endswith("down") and name == "weight":
                    tp_cut = Shard(1)
                if tp_cut is not None:
                    placements[names.index("tp")] = tp_cut
            setattr(module, name, nn.Parameter(distribute_tensor(p.detach(), mesh, placements)))


def _dp_placements(mesh: Any, shard_names: Any, replicate_names: Any) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    dp = {shard_names} if isinstance(shard_names, str) else set(shard_names)
    dp |= {replicate_names} if isinstance(replicate_names, str) else set(replicate_names or ())
    return [Shard(0) if n in dp else Replicate() for n in mesh.mesh_dim_names]


_MESHES: dict[tuple[Any, ...], Any] = {}


def _build(impl: str, case: tuple[Any, ...]) -> tuple[nn.Module, Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    if impl == "torch":
        import torch.distributed.fsdp as api
    else:
        import fsdp as api  # type: ignore[no-redef]
    shape, names, shard, replicate, options = case
    # One mesh object per layout for both runs: DTensor's sharding cache hands out the
    # equal mesh of an earlier op, and torch's fully_shard insists on the very object.
    mesh = _MESHES.get((shape, names))
    if mesh is None:
        mesh = _MESHES[shape, names] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block())
    _distribute(model, mesh)
    kwargs: dict[str, Any] = {"dp_mesh_dims": api.DataParallelMeshDims(shard, replicate)}
    if options.get("bf16"):
        kwargs["mp_policy"] = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    if options.get("offload"):
        kwargs["offload_policy"] = api.CPUOffloadPolicy(pin_memory=False)
    for block in model:
        reshard = options.get("reshard_after_forward", True)
        api.fully_shard(block, mesh=mesh, reshard_after_forward=reshard, **kwargs)
    api.fully_shard(model, mesh=mesh, **kwargs)
    return model, mesh, _dp_placements(mesh, shard, replicate)


def _train(model: nn.Module, mesh: Any, placements: list[Any]) -> dict[str, list[Any]]:
    from torch.distributed.tensor import distribute_tensor

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    record: dict[str, list[Any]] = {"loss": [], "grads": [], "params": [], "layout": []}
    record["layout"].append({n: layout(p) for n, p in model.named_parameters()})
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = distribute_tensor(torch.randn(8, IN, generator=g), mesh, placements)
        loss = model(x).pow(2).sum().full_tensor()
        loss.backward()
        record["loss"].append(loss.item())
        step_and_record(model, opt, record)
    return record


def _parity_rank(world_size: int) -> dict[str, list[str]]:
    out = {}
    for name, case in CASES[world_size].items():
        torch_model, mesh, placements = _build("torch", case)
        ref = _train(torch_model, mesh, placements)
        ours_model = _build("ours", case)[0]
        ours = _train(ours_model, mesh, placements)
        out[name] = differences(ref, ours, TOLERANCE.get(name, 0.0))
        # torch's trained sharded state dict loads into a fresh model of ours as it is.
        out[name] += state_dict_differences(_build("ours", case)[0], torch_model)
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_trains_equal_to_torchs(world_size: int) -> None:
    """dp only, dp x tp (both mesh orders: ``_StridedShard`` or not), HSDP and two
    flattened shard dimensions: layouts, losses, gradients and parameters bit for bit
    (within :data:`TOLERANCE` where 4 ranks sum each element), in fp32, with bf16
    parameters and with CPU offload; torch's trained state dict then loads into ours."""
    for rank, per_case in enumerate(run_ranks(_parity_rank, world_size, world_size, timeout=240)):
        assert sorted(per_case) == sorted(CASES[world_size])
        for name, found in per_case.items():
            assert not found, f"rank {rank}, {name}: {found}"


# --- what both refuse ------------------------------------------------------------------------


def _error(fn: Any) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as exc:  # the test compares what was raised
        return type(exc).__name__, str(exc)
    return None


def _refusals(impl: str) -> dict[str, tuple[str, str] | None]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if impl == "torch":
        from torch.distributed.fsdp import DataParallelMeshDims, fully_shard
    else:
        from fsdp import DataParallelMeshDims, fully_shard  # type: ignore[assignment]
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    other = init_device_mesh("cpu", (2,), mesh_dim_names=("other",))
    dims = DataParallelMeshDims(shard="dp_shard")

    def on(mesh_: Any, placements: Any = None) -> nn.Module:
        block = _Block()
        for module in (block.up, block.down):
            for name, p in list(module.named_parameters()):
                dt = distribute_tensor(p.detach(), mesh_, placements or [Replicate()])
                setattr(module, name, nn.Parameter(dt))
        return block

    out: dict[str, tuple[str, str] | None] = {}
    out["plain"] = _error(lambda: fully_shard(_Block(), mesh=mesh, dp_mesh_dims=dims))
    out["other_mesh"] = _error(lambda: fully_shard(on(other), mesh=mesh, dp_mesh_dims=dims))
    out["sharded_on_dp"] = _error(
        lambda: fully_shard(on(mesh, [Shard(0)]), mesh=mesh, dp_mesh_dims=dims)
    )
    out["unknown_name"] = _error(
        lambda: fully_shard(on(mesh), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="x"))
    )
    out["int_reshard"] = _error(
        lambda: fully_shard(on(mesh), mesh=mesh, dp_mesh_dims=dims, reshard_after_forward=2)
    )
    out["neither"] = _error(DataParallelMeshDims)
    return out


def _refusals_rank() -> dict[str, dict[str, tuple[str, str] | None]]:
    return {"torch": _refusals("torch"), "ours": _refusals("ours")}


def test_refuses_what_torchs_refuses_in_its_words() -> None:
    """A plain parameter, a parameter on another mesh object, one already sharded on the dp
    dimension, an unknown dimension name, an int ``reshard_after_forward`` and an empty
    ``DataParallelMeshDims``: the same exception type, torch's message first, then the fix."""
    (both, _) = run_ranks(_refusals_rank, 2, timeout=120)
    for case, theirs in both["torch"].items():
        ours = both["ours"][case]
        assert theirs is not None and ours is not None, (case, theirs, ours)
        assert ours[0] == theirs[0], (case, theirs, ours)
        assert ours[1].startswith(theirs[1].rstrip(".")), (case, theirs[1], ours[1])
        assert len(ours[1]) > len(theirs[1]), f"{case}: no fix named: {ours[1]}"


def test_replicate_only_is_refused_with_the_alternative() -> None:
    """``DataParallelMeshDims(replicate=...)`` alone (DDP on an SPMD mesh) is not ours yet:
    it raises at once, naming what works instead."""
    (message,) = run_ranks(_replicate_only_rank, 1, timeout=60)
    assert message.startswith("NotImplementedError") and "shard dimension" in message


def _replicate_only_rank() -> str:
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp import DataParallelMeshDims, fully_shard

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    block = _Block()
    _distribute(block, mesh)
    err = _error(
        lambda: fully_shard(block, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(replicate="dp"))
    )
    assert err is not None
    dist.barrier()
    return f"{err[0]}: {err[1]}"
