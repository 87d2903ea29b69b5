"""Our fully_shard over tensor parallelism against torch's, on the same 2-D model.

torchtitan's recipe (:func:`tests.fully_shard._common.parallelize_tp`): one
``(dp, tp)`` mesh, ``parallelize_module(..., mesh["tp"], plan)`` with
``ColwiseParallel`` / ``RowwiseParallel``, then ``fully_shard(..., mesh=mesh["dp"])``
per block and on the root (which mixes tp parameters, the head, with plain ones).

Exactness: everything is compared bit for bit, and must be equal. Each
gradient element is reduced over at most 2 data-parallel ranks (a sum of two
numbers does not depend on their order), the tensor-parallel collectives are
DTensor's own in both runs, and the all-gathers only move bytes; so no
floating-point operation happens in another order than in torch's FSDP2, in
fp32 and with bf16 parameters alike.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.fsdp._common import batches, loss_fn
from tests.fully_shard._common import Case, build, dp_rank, full, run_cases
from tests.ranks import run_ranks

BF16 = torch.bfloat16
F32 = torch.float32

# dp=2 x tp=2 at 4 ranks (HSDP + TP: 2 replicas x 1 shard x 2 tp).
CASES_4: dict[str, Case] = {
    "tp": Case(tp=2),
    "tp_reshard_false": Case(tp=2, reshard_after_forward=False),
    "tp_reshard_true_root_too": Case(tp=2, reshard_after_forward=True),
    "tp_bf16": Case(tp=2, mp=(BF16, None)),
    "tp_bf16_reduce_fp32": Case(tp=2, mp=(BF16, F32)),
    "tp_bf16_reshard_false": Case(tp=2, mp=(BF16, None), reshard_after_forward=False),
    "tp_shard_diff_dim": Case(tp=2, shard_diff_dim=True),
    "tp_accumulate": Case(tp=2, accumulate=2),
    "tp_cpu_offload": Case(tp=2, offload=True),
    "tp_meta_init": Case(tp=2, meta=True),  # parallelised and sharded on meta, then init
    "hsdp_tp": Case(tp=2, mesh_2d=True),
    # torchtitan's fully_shard([norm, output]): a plain and a tp module in one group.
    "tp_norm_head_grouped": Case(tp=2, group_head=True),
}
# dp=1 x tp=2 and dp=2 x tp=1 at 2 ranks.
CASES_2: dict[str, Case] = {
    "tp": Case(tp=2),
    "tp_bf16_reshard_false": Case(tp=2, mp=(BF16, None), reshard_after_forward=False),
    "tp1": Case(tp=1),
    "tp1_bf16": Case(tp=1, mp=(BF16, None)),
}
CASES = {2: CASES_2, 4: CASES_4}


def _train_rank(world_size: int) -> dict[str, tuple[bool, float]]:
    return run_cases(CASES[world_size])


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_training_matches_torch_bit_for_bit(world_size: int) -> None:
    """Losses, full gradients and full parameters after each of 3 AdamW steps."""
    results = run_ranks(_train_rank, world_size, world_size, timeout=280)
    for rank, per_case in enumerate(results):
        assert sorted(per_case) == sorted(CASES[world_size])
        for name, (equal, worst) in per_case.items():
            assert equal, f"rank {rank}, {name}: differs from torch's by up to {worst:.3g}"


# --- layouts: parameters, gradients, optimizer state, state dict ---------------------------


def _describe(t: Any) -> tuple[Any, ...]:
    """What a tensor is, as the user sees it: type, mesh, placements, shapes, dtype."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return (type(t).__name__, tuple(t.shape), t.dtype)
    mesh = t.device_mesh
    return (
        "DTensor",
        mesh.mesh.tolist(),
        mesh.mesh_dim_names,
        repr(t.placements),  # _StridedShard's repr carries its split_factor
        tuple(t.shape),
        t.stride(),
        tuple(t.to_local().shape),
        t.dtype,
        t.requires_grad,
    )


def _layouts(impl: str, case: Case) -> dict[str, Any]:
    """Every layout the user can see, and the full values, for one implementation."""
    model = build(impl, case)
    out: dict[str, Any] = {
        "params": {n: _describe(p) for n, p in model.named_parameters()},
        "full": {n: full(p) for n, p in model.named_parameters()},
    }
    unsharded: dict[str, Any] = {}

    def record(name: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            unsharded[name] = {n: _describe(p) for n, p in module.named_parameters()}

        return hook

    handles = [
        model.blocks[0].fc1.register_forward_pre_hook(record("blocks.0.fc1")),  # type: ignore[index]
        model.blocks[0].fc2.register_forward_pre_hook(record("blocks.0.fc2")),  # type: ignore[index]
        model.head.register_forward_pre_hook(record("head")),
    ]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    x, y = batches(1, rank=dp_rank(case))[0]
    loss_fn(model(x), y).backward()
    for h in handles:
        h.remove()
    out["unsharded_in_forward"] = unsharded
    out["grads"] = {n: _describe(p.grad) for n, p in model.named_parameters()}
    opt.step()
    out["optim_state"] = {
        i: {k: _describe(v) for k, v in s.items()} for i, s in opt.state_dict()["state"].items()
    }
    sd = model.state_dict()
    out["state_dict_keys"] = list(sd)
    out["state_dict"] = {k: _describe(v) for k, v in sd.items()}
    out["state_dict_full"] = {k: full(v) for k, v in sd.items()}
    out["model"] = model
    return out


def _layout_rank(world_size: int, names: list[str]) -> dict[str, dict[str, bool | str]]:
    """Per case and aspect: equal to torch's (True), or what differed."""
    results: dict[str, dict[str, bool | str]] = {}
    for name in names:
        case = CASES[world_size][name]
        ref, ours = _layouts("torch", case), _layouts("ours", case)
        verdict: dict[str, bool | str] = {}
        for key in ("params", "unsharded_in_forward", "grads", "optim_state", "state_dict"):
            verdict[key] = True if ref[key] == ours[key] else f"{ref[key]!r} != {ours[key]!r}"
        verdict["state_dict_keys"] = ref["state_dict_keys"] == ours["state_dict_keys"]
        for key in ("full", "state_dict_full"):
            verdict[key] = all(torch.equal(ref[key][k], ours[key][k]) for k in ref[key])
        verdict["fc1_weight"] = ours["params"]["blocks.0.fc1.weight"][3]
        # Torch's sharded state dict (after its step) loads into ours as it is.
        ours["model"].load_state_dict(ref["model"].state_dict())
        verdict["load_torch_state_dict"] = all(
            torch.equal(full(a), full(b))
            for a, b in zip(ref["model"].parameters(), ours["model"].parameters(), strict=True)
        )
        results[name] = verdict
    return results


LAYOUT_CASES = {
    4: ["tp", "tp_bf16", "tp_shard_diff_dim", "hsdp_tp", "tp_norm_head_grouped"],
    2: ["tp", "tp1"],
}


# A column-wise weight's placements (torch's, which ours equal): where dp and tp both cut
# dim 0, the dp cut is a _StridedShard taken inside each of the tp pieces.
_STRIDED = "_StridedShard(dim=0, sf=2)"
FC1_WEIGHT = {
    (4, "tp"): f"({_STRIDED}, Shard(dim=0))",
    (4, "tp_bf16"): f"({_STRIDED}, Shard(dim=0))",
    (4, "tp_shard_diff_dim"): "(Shard(dim=1), Shard(dim=0))",
    (4, "hsdp_tp"): f"(Replicate(), {_STRIDED}, Shard(dim=0))",
    (4, "tp_norm_head_grouped"): f"({_STRIDED}, Shard(dim=0))",
    (2, "tp"): f"({_STRIDED}, Shard(dim=0))",
    (2, "tp1"): "(Shard(dim=0), Shard(dim=0))",
}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_layouts_equal_torchs(world_size: int) -> None:
    """At dp=2 x tp=2, HSDP 2x1 x tp 2, dp=1 x tp=2 and dp=2 x tp=1: each parameter's
    DTensor (mesh, placements with ``_StridedShard`` where dp and tp cut one dim, global
    and local shape, stride), what the tp modules see in forward (a tp DTensor),
    gradients, AdamW state and the state dict are described exactly as torch's, and
    hold the same values; torch's state dict loads into ours."""
    names = LAYOUT_CASES[world_size]
    results = run_ranks(_layout_rank, world_size, world_size, names, timeout=280)
    for rank, per_case in enumerate(results):
        assert sorted(per_case) == sorted(names)
        for name, verdict in per_case.items():
            for aspect, ok in verdict.items():
                if aspect == "fc1_weight":
                    assert ok == FC1_WEIGHT[world_size, name], (rank, name, ok)
                    continue
                assert ok is True, f"rank {rank}, {name}, {aspect}: {ok}"


# --- what we refuse, and how ----------------------------------------------------------------


def _catch(fn: Any) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as exc:  # the test compares what was raised
        return (type(exc).__name__, str(exc))
    return None


def _errors_rank() -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import DTensor, Partial
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    import fsdp

    out: dict[str, Any] = {}

    def colwise(mesh: Any) -> nn.Module:
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 4))
        parallelize_module(module, mesh, {"0": ColwiseParallel()})
        return module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    # A tp mesh from another root mesh: the same groups, another rank order.
    other = DeviceMesh("cpu", [[1, 0], [3, 2]], mesh_dim_names=("dp", "tp"))
    for impl, shard in (("torch", torch_fully_shard), ("ours", fsdp.fully_shard)):
        # fully_shard over the tp mesh itself, or over the whole (dp, tp) mesh.
        out[impl, "tp_mesh"] = _catch(lambda s=shard: s(colwise(mesh["tp"]), mesh=mesh["tp"]))
        out[impl, "root_mesh"] = _catch(lambda s=shard: s(colwise(mesh["tp"]), mesh=mesh))
        out[impl, "other_root"] = _catch(lambda s=shard: s(colwise(other["tp"]), mesh=mesh["dp"]))
    # A tp model whose dp mesh comes from a second init_device_mesh of the same shape is
    # the same mesh to DeviceMesh (same ranks in the same order): both accept it.
    twin = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out["twin_root"] = _catch(lambda: fsdp.fully_shard(colwise(twin["tp"]), mesh=mesh["dp"]))
    model = nn.Linear(4, 6)
    pending = DTensor.from_local(torch.ones(6, 4), mesh["tp"], [Partial()])
    model.weight = nn.Parameter(pending)  # a sum over tp still to be taken
    out["partial"] = _catch(lambda: fsdp.fully_shard(model, mesh=mesh["dp"]))
    dist.barrier()
    return out


def test_errors_name_the_problem_and_the_fix() -> None:
    """Where torch's fully_shard raises (meshes that cannot be joined), ours raises too, a
    ``ValueError`` that is also the ``RuntimeError`` torch's raises, saying which mesh to
    pass. A ``Partial`` parameter (pending sums over tp), which torch's takes without a
    check, ours refuses up front, naming the redistribute that fixes it."""
    results = run_ranks(_errors_rank, 4, timeout=120)
    for r in results:
        for what in ("tp_mesh", "root_mesh", "other_root"):
            assert r["torch", what] is not None and r["torch", what][0] == "RuntimeError", r
        name, msg = r["ours", "tp_mesh"]
        assert name == "MeshCompositionError", msg
        assert "shares ranks" in msg and "mesh=mesh['dp']" in msg, msg
        name, msg = r["ours", "root_mesh"]
        assert name == "MeshCompositionError", msg
        assert "shares ranks" in msg and "mesh=mesh['dp']" in msg, msg
        name, msg = r["ours", "other_root"]
        assert name == "MeshCompositionError", msg
        assert "different root mesh" in msg and "init_device_mesh" in msg, msg
        assert r["twin_root"] is None, r["twin_root"]
        name, msg = r["partial"]
        assert name == "ValueError" and "Partial" in msg and "redistribute" in msg, msg


def _error_types_rank() -> list[bool]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    import fsdp

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    module = nn.Linear(4, 6)
    parallelize_module(module, mesh["tp"], ColwiseParallel())
    caught = []
    for kind in (ValueError, RuntimeError):
        try:
            fsdp.fully_shard(module, mesh=mesh["tp"])
        except kind:
            caught.append(True)
    return caught


def test_mesh_composition_error_is_caught_as_torchs_runtime_error() -> None:
    assert run_ranks(_error_types_rank, 2, timeout=60) == [[True, True]] * 2


def _int_reshard_rank() -> tuple[str, str] | None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    import fsdp

    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    module = nn.Linear(4, 8)
    parallelize_module(module, mesh["tp"], ColwiseParallel())
    return _catch(lambda: fsdp.fully_shard(module, mesh=mesh["dp"], reshard_after_forward=2))


def test_int_reshard_after_forward_on_a_dp_slice_is_refused() -> None:
    """dp=4 x tp=2: resharding to 2 ranks after forward would need groups made from each
    dp slice's own ranks, a collective sequence that differs on the two tp ranks (torch's
    fully_shard hangs in it); ours refuses before making any group."""
    for r in run_ranks(_int_reshard_rank, 8, timeout=120):
        assert r is not None and r[0] == "NotImplementedError", r
        assert "slice of a larger mesh" in r[1] and "reshard_after_forward=True or False" in r[1]
