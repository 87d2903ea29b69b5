"""Building and training the same model with torch's ``fully_shard`` and ours (inside ranks).

Each case builds the fsdp tests' ``Net`` (odd sizes: every parameter needs
padding at 2 and 4 ranks and some ranks hold empty chunks) plus a parameter
whose dim 0 is 1, applies ``fully_shard`` per block and then to the root, and
trains it with AdamW on per-rank data, recording after each step the loss, every
full gradient (before the step) and every full parameter (after it).

With ``Case.tp`` the model is first tensor-parallelised over that many ranks
(torchtitan's 2-D recipe, :func:`parallelize_tp`) and ``fully_shard`` gets the
data-parallel slice of a ``(dp, tp)`` mesh; every rank of a tp group then sees
the same data (that of its dp rank).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tests.fsdp._common import Net, batches, loss_fn

STEPS = 3


class TinyNet(Net):
    """``Net`` plus a parameter with a dim 0 smaller than every world size above 1."""

    def __init__(self) -> None:
        super().__init__(n_blocks=3)
        self.gate = nn.Parameter(torch.randn(1, 6))

    def forward(self, idx: Tensor) -> Tensor:
        return super().forward(idx) * torch.sigmoid(self.gate.sum())


@dataclasses.dataclass(frozen=True)
class Case:
    """One configuration: fully_shard's arguments and the training loop's."""

    reshard_after_forward: bool | int | None = None
    mesh_2d: bool = False  # HSDP on a (2, world/2) mesh
    across: bool = False  # ours only: shard_across_replicas=True on that mesh
    mp: tuple[torch.dtype | None, torch.dtype | None] | None = None  # (param, reduce)
    offload: bool = False
    frozen: bool = False  # emb and every LayerNorm frozen
    accumulate: int = 1  # micro-batches; all but the last without gradient sync
    all_reduce_only: bool = False  # accumulate with set_requires_all_reduce (HSDP)
    clip: float | None = None
    meta: bool = False  # built on the meta device, to_empty + reset_parameters
    ignore_head_bias: bool = False
    shard_dim1: bool = False  # 2-D parameters whose dim 1 divides cut along dim 1
    # Tensor parallelism over this many ranks (0: none): a (world/tp dp, tp) mesh, or
    # with mesh_2d a (2 replicate, world/(2 tp) shard, tp) one (HSDP + TP).
    tp: int = 0
    shard_diff_dim: bool = False  # tp: cut 2-D weights over dp along the dim tp does not
    group_head: bool = False  # fully_shard([ln_f, head]) as one group (torchtitan's)
    min_world: int = 1
    # Largest difference allowed at 4 ranks, where the two sum the four gradients in
    # different orders: an ulp of fp32 over three steps; bf16 reductions round each
    # partial sum to 8 bits, and a gradient element whose sign that flips moves AdamW's
    # update by up to 2 * lr.
    tolerance_4: float = 1e-5


def build(impl: str, case: Case) -> nn.Module:
    """The model with ``impl``'s (``"torch"`` or ``"ours"``) fully_shard applied."""
    if impl == "torch":
        import torch.distributed.fsdp as api
    else:
        import fsdp as api  # type: ignore[no-redef]
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    net = TPTinyNet if case.tp else TinyNet
    with torch.device("meta") if case.meta else contextlib.nullcontext():
        model = net()
    if case.frozen:
        model.emb.requires_grad_(False)
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.requires_grad_(False)
    ws = dist.get_world_size()
    if case.tp:
        mesh = parallelize_tp(model, case.tp, case.mesh_2d)
    elif case.mesh_2d:
        mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (ws,))
    kwargs: dict[str, Any] = {"mesh": mesh}
    if case.reshard_after_forward is not None:
        kwargs["reshard_after_forward"] = case.reshard_after_forward
    if case.mp is not None:
        kwargs["mp_policy"] = api.MixedPrecisionPolicy(
            param_dtype=case.mp[0], reduce_dtype=case.mp[1]
        )
    if case.offload:
        kwargs["offload_policy"] = api.CPUOffloadPolicy(pin_memory=False)
    if case.across and impl == "ours":
        kwargs["shard_across_replicas"] = True
    if case.shard_dim1:
        kwargs["shard_placement_fn"] = _dim1_placement
    if case.shard_diff_dim:
        kwargs["shard_placement_fn"] = _other_dim_than_tp
    for block in model.blocks:
        api.fully_shard(block, **kwargs)
    if case.group_head:
        api.fully_shard([model.ln_f, model.head], **kwargs)
    ignored = {model.head.bias} if case.ignore_head_bias else None
    api.fully_shard(model, ignored_params=ignored, **kwargs)
    if case.meta:
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        with torch.no_grad():
            for m in model.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()  # DTensor init ops: each rank's local shards
            model.gate.fill_(0.5)
            model.scale.fill_(0.75)
    return model


class TPTinyNet(TinyNet):
    """``TinyNet`` whose blocks' hidden size (10) divides by 1 and 2 tp ranks.

    torch's ``ColwiseParallel`` -> ``RowwiseParallel`` pair passes the hidden
    activation as local tensors and infers its global size from them, so the
    hidden size must divide by the tp size; the dp cuts of the tp pieces
    (5 rows over 2 ranks, and the head's 7 and 6 rows) stay uneven.
    """

    def __init__(self) -> None:
        super().__init__()
        for block in self.blocks:
            block.fc1 = nn.Linear(block.fc1.in_features, 10)
            block.fc2 = nn.Linear(10, block.fc2.out_features)


def parallelize_tp(model: nn.Module, tp: int, hsdp: bool) -> Any:
    """Tensor-parallelise ``model`` over ``tp`` ranks; returns ``fully_shard``'s mesh.

    Each block's ``fc1`` column-wise (weight and bias ``Shard(0)``), its ``fc2``
    row-wise (weight ``Shard(1)``, bias ``Replicate()``), the head column-wise
    with a replicated output (13 rows: 7 and 6 per tp rank at tp 2). The mesh is
    ``(dp, tp)``, or with ``hsdp`` ``(replicate, shard, tp)``.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    ws = dist.get_world_size()
    if hsdp:
        names: tuple[str, ...] = ("replicate", "shard", "tp")
        mesh = init_device_mesh("cpu", (2, ws // (2 * tp), tp), mesh_dim_names=names)
        dp = mesh["replicate", "shard"]
    else:
        mesh = init_device_mesh("cpu", (ws // tp, tp), mesh_dim_names=("dp", "tp"))
        dp = mesh["dp"]
    for block in model.blocks:  # type: ignore[union-attr]
        plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
        parallelize_module(block, mesh["tp"], plan)  # type: ignore[arg-type]
    head = {"head": ColwiseParallel(output_layouts=Replicate())}
    parallelize_module(model, mesh["tp"], head)  # type: ignore[arg-type]
    return dp


def dp_rank(case: Case) -> int:
    """This rank's data-parallel index: its rank, or with ``case.tp`` its tp group's."""
    return dist.get_rank() // case.tp if case.tp else dist.get_rank()


def _other_dim_than_tp(param: nn.Parameter) -> Any:
    """A 2-D tp weight cut over dp along the dim tp does not cut (torch's own test's fn)."""
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(param, DTensor) and param.dim() == 2:
        for placement in param.placements:
            if isinstance(placement, Shard):
                return Shard(1 - placement.dim)
    return None


def _dim1_placement(param: nn.Parameter) -> Any:
    from torch.distributed.tensor import Shard

    ws = dist.get_world_size()
    if param.dim() == 2 and param.shape[1] % ws == 0:
        return Shard(1)
    return None


def full(t: Any) -> Tensor:
    """A DTensor (or plain tensor) as a full tensor, detached."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def train(model: nn.Module, case: Case) -> dict[str, list[Any]]:
    """Losses, full gradients and full parameters of every step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    data = batches(STEPS * case.accumulate, rank=dp_rank(case))
    record: dict[str, list[Any]] = {"loss": [], "grads": [], "params": []}
    it = iter(data)
    for _ in range(STEPS):
        for micro in range(case.accumulate):
            last = micro == case.accumulate - 1
            if case.accumulate > 1 and case.all_reduce_only:
                model.set_requires_all_reduce(last)  # type: ignore[operator]
            elif case.accumulate > 1:
                model.set_requires_gradient_sync(last)  # type: ignore[operator]
            x, y = next(it)
            loss = loss_fn(model(x), y)
            loss.backward()
            record["loss"].append(loss.item())
        if case.clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
            record["loss"].append(float(full(norm)))
        step_and_record(model, opt, record)
    return record


def train_plain(model: nn.Module, steps: int = STEPS) -> dict[str, list[Any]]:
    """Losses, full gradients and full parameters of ``steps`` plain AdamW steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    record: dict[str, list[Any]] = {"loss": [], "grads": [], "params": []}
    for x, y in batches(steps):
        loss = loss_fn(model(x), y)
        loss.backward()
        record["loss"].append(loss.item())
        step_and_record(model, opt, record)
    return record


def step_and_record(model: nn.Module, opt: torch.optim.Optimizer, record: dict[str, Any]) -> None:
    """Record the full gradients, step, and record the full parameters."""
    record["grads"].append(
        {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    )
    opt.step()
    opt.zero_grad()
    record["params"].append({n: full(p) for n, p in model.named_parameters()})


def assert_parity(
    results: list[dict[str, tuple[bool, float]]],
    names: list[str],
    world_size: int,
    tolerance_4: Callable[[str], float],
) -> None:
    """Every rank's (equal, worst) per case: bit for bit at 1 and 2 ranks; at 4, where
    gloo's ring and our composed reduce-scatter sum in different orders, within the
    case's tolerance."""
    for rank, per_case in enumerate(results):
        for name in names:
            equal, worst = per_case[name]
            if world_size <= 2:
                assert equal, f"rank {rank}, {name}: differs from torch's by up to {worst:.3g}"
            else:
                bound = tolerance_4(name)
                assert worst <= bound, f"rank {rank}, {name}: differs from torch's by {worst:.3g}"


def compare(a: dict[str, list[Any]], b: dict[str, list[Any]]) -> tuple[bool, float]:
    """(bit for bit equal, largest absolute difference) over everything recorded."""
    equal = a["loss"] == b["loss"]
    worst = max((abs(x - y) for x, y in zip(a["loss"], b["loss"], strict=True)), default=0.0)
    for key in ("grads", "params"):
        for da, db in zip(a[key], b[key], strict=True):
            assert sorted(da) == sorted(db), (key, sorted(da), sorted(db))
            for name in da:
                x, y = da[name].float(), db[name].float()
                same = torch.equal(da[name], db[name]) and da[name].dtype == db[name].dtype
                equal = equal and same
                worst = max(worst, (x - y).abs().max().item() if x.numel() else 0.0)
    return equal, worst


def run_cases(cases: dict[str, Case]) -> dict[str, tuple[bool, float]]:
    """Every case with both implementations; (equal, max difference) per case."""
    out: dict[str, tuple[bool, float]] = {}
    for name, case in cases.items():
        ref = train(build("torch", case), case)
        ours = train(build("ours", case), case)
        out[name] = compare(ref, ours)
    return out
