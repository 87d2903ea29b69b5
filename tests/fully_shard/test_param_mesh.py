"""Parameters sharded over a mesh of their own (``ShardPlacementResult``): expert parallelism.

torchtitan's MoE recipe on 4 ranks with expert parallelism 2: the routed experts are
``DTensor`` s on the ``ep`` mesh (each rank holds half of them), the block is sharded
with ``fully_shard(block, mesh=dp, shard_placement_fn=fn)`` where ``fn`` returns
``ShardPlacementResult(Shard(0), FSDPMeshInfo(edp_mesh))`` for the experts (cut over
the 2 ranks holding the same experts) and the dp mesh for the rest (cut over all 4).
Both implementations get the very same ``fn`` (torch's result and mesh-info types,
as torchtitan builds them); losses, full gradients and parameters after each of 3
AdamW steps and every sharded parameter's mesh and placements are compared with
torch's ``fully_shard``.
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
DIM, HIDDEN, EXPERTS = 8, 6, 4


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) / DIM**0.5)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) / HIDDEN**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        w1, w2 = self.w1, self.w2
        if isinstance(w1, DTensor):  # this rank's experts (expert parallelism)
            w1, w2 = w1.to_local(), w2.to_local()  # type: ignore[assignment]
        spmd = isinstance(x, DTensor)  # full SPMD: the tokens are a DTensor on the dense mesh
        local = x.to_local() if isinstance(x, DTensor) else x
        out = torch.zeros_like(local)
        for e in range(w1.shape[0]):
            out = out + torch.relu(local @ w1[e]) @ w2[e]
        if spmd:
            return DTensor.from_local(out, x.device_mesh, x.placements)  # type: ignore[attr-defined]
        return out


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.experts = _Experts()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.experts(self.norm(x)))


# name -> (ep degree, reshard_after_forward, bf16 parameters, mesh_info as a DeviceMesh)
CASES: dict[int, dict[str, tuple[int, bool, bool, bool]]] = {
    2: {
        "ep2_edp1": (2, True, False, False),
        "ep2_edp1_keep": (2, False, False, False),
        "ep2_edp1_bf16": (2, True, True, False),
    },
    4: {
        "ep2_edp2": (2, True, False, False),
        "ep2_edp2_keep": (2, False, False, False),
        "ep2_edp2_bf16": (2, True, True, False),
        "ep2_edp2_device_mesh": (2, True, False, True),
    },
}
# 4 ranks sum each non-expert gradient element: gloo's reduce-scatter (torch's) and ours add
# the terms in different orders (relative to the tensor's largest magnitude, at least 1).
# 2 ranks: bit for bit.
TOLERANCE = {2: 0.0, 4: 1e-6}

_MESHES: dict[Any, tuple[Any, Any, Any]] = {}


def _meshes(ep: int) -> tuple[Any, Any, Any]:
    """(dp mesh over every rank, edp mesh, ep mesh), all slices of one root, made once."""
    from torch.distributed.device_mesh import init_device_mesh

    if ep not in _MESHES:
        world = dist.get_world_size()
        root = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("edp", "ep"))
        _MESHES[ep] = (root["edp", "ep"]._flatten("dp"), root["edp"], root["ep"])
    return _MESHES[ep]


def _build(impl: str, case: tuple[int, bool, bool, bool]) -> nn.Module:
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        ShardPlacementResult,
    )
    from torch.distributed.tensor import Shard, distribute_tensor

    if impl == "torch":
        import torch.distributed.fsdp as api
    else:
        import fsdp as api  # type: ignore[no-redef]
    ep, reshard, bf16, device_mesh = case
    dp, edp, ep_mesh = _meshes(ep)
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block())
    kwargs: dict[str, Any] = {"mesh": dp}
    if bf16:
        # fp32 reduction: a bf16 sum over 4 ranks rounds differently in another order.
        kwargs["mp_policy"] = api.MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    dp_info = FSDPMeshInfo(mesh=dp, shard_mesh_dim=0)
    for block in model:
        experts = block.experts
        if ep > 1:
            for name in ("w1", "w2"):
                full = getattr(experts, name).detach()
                dt = distribute_tensor(full, ep_mesh, [Shard(0)])
                setattr(experts, name, nn.Parameter(dt))
        expert_params = set(experts.parameters())
        if device_mesh and impl == "ours":
            edp_info: Any = edp
            result: Any = api.ShardPlacementResult  # type: ignore[attr-defined]
        else:
            edp_info, result = FSDPMeshInfo(mesh=edp, shard_mesh_dim=0), ShardPlacementResult

        def fn(
            p: nn.Parameter, experts: Any = expert_params, e: Any = edp_info, r: Any = result
        ) -> Any:
            if p in experts:
                return r(placement=Shard(0), mesh_info=e)
            return ShardPlacementResult(placement=Shard(0), mesh_info=dp_info)

        api.fully_shard(block, reshard_after_forward=reshard, shard_placement_fn=fn, **kwargs)
    api.fully_shard(model, **kwargs)
    return model


# Full SPMD (torchtitan's full_dtensor with expert parallelism): every parameter a DTensor,
# the dense ones on a (dp_shard,) mesh, the experts on (efsdp, ep); the experts' mesh info
# made by torch's _get_mesh_info(sparse, DataParallelMeshDims(shard="efsdp")), as torchtitan.
SPMD_CASES: dict[int, dict[str, bool]] = {  # name -> reshard_after_forward
    2: {"spmd_ep2_edp1": True},
    4: {"spmd_ep2_edp2": True, "spmd_ep2_edp2_keep": False},
}


def _build_spmd(impl: str, reshard: bool) -> nn.Module:
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if impl == "torch":
        import torch.distributed.fsdp as api
    else:
        import fsdp as api  # type: ignore[no-redef]
    dense, sparse = _spmd_meshes()
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block())
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            expert = isinstance(module, _Experts)
            mesh, placements = (
                (sparse, [Replicate(), Shard(0)]) if expert else (dense, [Replicate()])
            )
            setattr(module, name, nn.Parameter(distribute_tensor(p.detach(), mesh, placements)))
    dims = api.DataParallelMeshDims(shard="dp_shard")
    edp_info = _get_mesh_info(sparse, api.DataParallelMeshDims(shard="efsdp"))
    for block in model:
        experts = set(block.experts.parameters())

        def fn(p: nn.Parameter, experts: Any = experts) -> Any:
            return ShardPlacementResult(Shard(0), edp_info) if p in experts else None

        api.fully_shard(
            block,
            mesh=dense,
            dp_mesh_dims=dims,
            reshard_after_forward=reshard,
            shard_placement_fn=fn,
        )
    api.fully_shard(model, mesh=dense, dp_mesh_dims=dims)
    return model


def _spmd_meshes() -> tuple[Any, Any]:
    """(dense (dp_shard,) mesh over every rank, sparse (efsdp, ep) mesh), made once."""
    from torch.distributed.device_mesh import init_device_mesh

    if "spmd" not in _MESHES:
        sparse = init_device_mesh(
            "cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("efsdp", "ep")
        )
        _MESHES["spmd"] = (sparse["efsdp", "ep"]._flatten("dp_shard"), sparse, None)
    dense, sparse, _ = _MESHES["spmd"]
    return dense, sparse


def _train(model: nn.Module, dense: Any = None) -> dict[str, list[Any]]:
    """Losses, full gradients and parameters of each step; with ``dense`` (full SPMD) the
    batch is a DTensor sharded over it."""
    from torch.distributed.tensor import Shard, distribute_tensor

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    record: dict[str, list[Any]] = {"loss": [], "grads": [], "params": []}
    record["layout"] = [{n: layout(p) for n, p in model.named_parameters()}]
    g = torch.Generator().manual_seed(100 + (0 if dense is not None else dist.get_rank()))
    for _ in range(STEPS):
        if dense is None:
            loss = model(torch.randn(4, DIM, generator=g)).pow(2).sum()
        else:
            x = distribute_tensor(
                torch.randn(4 * dense.size(), DIM, generator=g), dense, [Shard(0)]
            )
            loss = model(x).pow(2).sum().full_tensor()
        loss.backward()
        record["loss"].append(loss.item())
        step_and_record(model, opt, record)
    return record


def _rank(world_size: int) -> dict[str, list[str]]:
    out = {}
    for name, case in CASES[world_size].items():
        torch_model = _build("torch", case)
        ref = _train(torch_model)
        ours = _train(_build("ours", case))
        out[name] = differences(ref, ours, TOLERANCE[world_size])
        # torch's trained sharded state dict loads into a fresh model of ours as it is.
        out[name] += state_dict_differences(_build("ours", case), torch_model)
    for name, reshard in SPMD_CASES[world_size].items():
        dense = _spmd_meshes()[0]
        torch_model = _build_spmd("torch", reshard)
        ref = _train(torch_model, dense)
        ours = _train(_build_spmd("ours", reshard), dense)
        out[name] = differences(ref, ours, TOLERANCE[world_size])
        out[name] += state_dict_differences(_build_spmd("ours", reshard), torch_model)
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_expert_parallel_trains_equal_to_torchs(world_size: int) -> None:
    """Experts on their own (edp) mesh, the rest over dp, in one group per block: layouts,
    losses, gradients and parameters equal torch's (bit for bit at 2 ranks), resharded after
    forward or not, bf16 parameters, the mesh given as torch's FSDPMeshInfo or a DeviceMesh,
    and on full SPMD meshes (torchtitan's full_dtensor: experts on (efsdp, ep), the rest on
    (dp_shard,)); torch's trained state dict loads into ours."""
    for rank, per_case in enumerate(run_ranks(_rank, world_size, world_size, timeout=240)):
        assert sorted(per_case) == sorted([*CASES[world_size], *SPMD_CASES[world_size]])
        for name, found in per_case.items():
            assert not found, f"rank {rank}, {name}: {found}"


def _bad_rank() -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    import fsdp

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    messages = []
    for bad in (object(), "dp", fsdp.ShardPlacementResult(Shard(0), object())):
        try:
            fsdp.fully_shard(nn.Linear(4, 4), mesh=mesh, shard_placement_fn=lambda p, b=bad: b)
        except (ValueError, NotImplementedError) as exc:
            messages.append(f"{type(exc).__name__}: {exc}")
    return messages


def test_a_bad_result_is_named() -> None:
    """A ``shard_placement_fn`` result that is neither a ``Shard``, ``None`` nor a
    ``ShardPlacementResult``, or a result whose mesh info holds no mesh: a clear error."""
    messages, _ = run_ranks(_bad_rank, 2, timeout=60)
    assert len(messages) == 3, messages
    assert messages[0].startswith("ValueError: Invalid shard_placement_fn result"), messages[0]
    assert messages[1].startswith("ValueError: Invalid shard_placement_fn result"), messages[1]
    assert messages[2].startswith("NotImplementedError") and "DeviceMesh" in messages[2]
