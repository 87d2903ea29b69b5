"""Run one fuzz example on its ranks: ours against DDP on the same data, then judge.

Inside each rank, :func:`run_example` trains the reference (a plain copy whose
gradients are averaged as DDP averages them, summed in our reductions' order
(:class:`_RankOrderSum`) and divided as the front end divides: fully_shard sums
then divides, FSDP1 splits the division around the sum)
and then the sharded model under the example's plan and schedule, recording
after every step the losses, the full gradients (fully_shard) and the full
parameters. SGD with momentum, whose update is proportional to the gradient,
so a wrongly scaled gradient shows in the parameters (Adam would hide it).

An example ends one of two ways (:func:`judge`): everything equal (bit for bit,
fp32 or bf16, at 2 and 4 ranks; FSDP1's ``NO_SHARD`` at 4 ranks within
:data:`TOLERANCE_4`, see :func:`tolerance`), or every rank raised a clear error
(an exception raised by our package, not a bare ``AssertionError``) before any
recorded value differed.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tests.fuzz._model import batch, build, loss_fn
from tests.fuzz._space import Example, Fsdp1Plan, FullyShardPlan, Micro, Point, Step, reproduction
from tests.ranks import RankFailure, run_ranks

LR = 0.1
MOMENTUM = 0.5
TOLERANCE_4 = 1e-5
TIMEOUT_S = 60.0
# FullyShardPlan.mp -> (param dtype, reduce dtype); fp32 parameters throughout otherwise
MIXED_PRECISION: dict[str | None, tuple[torch.dtype, torch.dtype] | None] = {
    None: None,
    "bf16": (torch.bfloat16, torch.bfloat16),
    "bf16-fp32": (torch.bfloat16, torch.float32),
}


@dataclasses.dataclass
class Record:
    """What one run recorded; ``error`` is set when it stopped on an exception."""

    losses: list[float] = dataclasses.field(default_factory=list)
    grads: list[dict[str, Tensor]] = dataclasses.field(default_factory=list)
    params: list[dict[str, Tensor]] = dataclasses.field(default_factory=list)
    error: tuple[str, str, bool] | None = None  # (type, message, raised by our package)


def _full_all(named: dict[str, Any]) -> dict[str, Tensor]:
    """Every (``DTensor``) value of ``named`` as a full tensor, with one collective.

    ``DTensor.full_tensor`` costs a collective and an autograd function per
    tensor (half of an example's time). Here every rank packs its local pieces
    into one fp32 vector, one all-gather moves them all, and each full tensor is
    the concatenation of the pieces along its sharded dim in mesh order (each
    rank can tell every other rank's piece shapes: ``Shard(d)`` cuts as
    ``torch.chunk`` does).
    """
    from torch.distributed.tensor import DTensor, Shard

    ws, me = dist.get_world_size(), dist.get_rank()
    names = list(named)
    shapes: list[list[torch.Size]] = [[] for _ in range(ws)]  # per rank, per name
    for n in names:
        t = named[n]
        for r in range(ws):
            shapes[r].append(_piece_shape(t, r) if isinstance(t, DTensor) else t.shape)
    sizes = [sum(s.numel() for s in per_rank) for per_rank in shapes]
    longest = max(sizes, default=0)
    mine = [
        (t.to_local() if isinstance(t, DTensor) else t).detach().reshape(-1).float()
        for t in (named[n] for n in names)
    ]
    buf = torch.zeros(longest, dtype=torch.float32)
    if mine:
        flat = torch.cat(mine)
        buf[: flat.numel()] = flat
    out_buf = torch.empty(ws * longest, dtype=torch.float32)
    dist.all_gather_into_tensor(out_buf, buf)
    pieces: list[dict[str, Tensor]] = []
    for r in range(ws):
        row = out_buf[r * longest : (r + 1) * longest]
        parts = torch.split(row[: sizes[r]], [s.numel() for s in shapes[r]])
        pieces.append({n: part.view(s) for n, part, s in zip(names, parts, shapes[r], strict=True)})
    out: dict[str, Tensor] = {}
    for n in names:
        t = named[n]
        full = pieces[me][n]
        if isinstance(t, DTensor):
            mesh = t.device_mesh
            coordinate = mesh.get_coordinate()
            assert coordinate is not None
            for mesh_dim, placement in enumerate(t.placements):
                if isinstance(placement, Shard):
                    index: list[Any] = list(coordinate)
                    index[mesh_dim] = slice(None)
                    ranks = mesh.mesh[tuple(index)].tolist()
                    full = torch.cat([pieces[r][n] for r in ranks], dim=placement.dim)
        out[n] = full.to(t.dtype).clone()
    return out


def _piece_shape(t: Any, rank: int) -> torch.Size:
    """The shape of ``rank``'s local piece of the ``DTensor`` ``t``."""
    from torch.distributed.tensor import Shard

    mesh = t.device_mesh
    where = (mesh.mesh == rank).nonzero()
    if where.numel() == 0:
        return torch.Size([0])
    coordinate = where[0].tolist()
    shape = list(t.shape)
    for mesh_dim, placement in enumerate(t.placements):
        if isinstance(placement, Shard):
            pieces = torch.empty(shape, device="meta").chunk(mesh.size(mesh_dim), placement.dim)
            index = coordinate[mesh_dim]
            shape[placement.dim] = pieces[index].shape[placement.dim] if index < len(pieces) else 0
    return torch.Size(shape)


def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


# --- the reference ------------------------------------------------------------------------------


class _RankOrderSum:
    """Every rank's contribution summed in the order our reductions add them, so that the
    reference equals ours bit for bit at 4 ranks too.

    On gloo our reduce-scatter is an all-to-all and a local sum of the chunks in rank
    order ([Note: gloo's sharded collectives]): ``((g0 + g1) + g2) + g3`` over the
    shard group; HSDP then all-reduces the two replicas' sums (two terms: any order),
    and a backward without ``set_requires_all_reduce`` keeps its shard-group sum as a
    partial sum for the next. FSDP1's ``NO_SHARD`` all-reduces with gloo's own
    algorithm, which ``dist.all_reduce`` here matches only at 2 ranks.
    """

    def __init__(self, example: Example) -> None:
        ws = dist.get_world_size()
        plan = example.plan
        self.native = isinstance(plan, Fsdp1Plan) and plan.strategy == "NO_SHARD"
        hybrid = plan.hsdp if isinstance(plan, FullyShardPlan) else "HYBRID" in plan.strategy
        self.shard_size = ws // 2 if hybrid else ws
        self.partials: dict[int, list[Tensor]] = {}

    def __call__(self, key: int, local: Tensor, all_reduce: bool = True) -> Tensor | None:
        """The sum of every rank's ``local`` (None: kept as a partial sum)."""
        if self.native:
            total = local.clone()
            dist.all_reduce(total)
            return total
        ws = dist.get_world_size()
        everyone = [torch.empty_like(local) for _ in range(ws)]
        dist.all_gather(everyone, local.contiguous())
        sums = []
        for first in range(0, ws, self.shard_size):
            block = everyone[first].clone()
            for t in everyone[first + 1 : first + self.shard_size]:
                block.add_(t)
            sums.append(block)
        if len(sums) == 1:
            return sums[0]
        kept = self.partials.pop(key, None)
        if kept is not None:
            sums = [s.add_(k) for s, k in zip(sums, kept, strict=True)]
        if not all_reduce:
            self.partials[key] = sums
            return None
        return sums[0] + sums[1]


def _reference(example: Example) -> Record:
    """DDP's result: local gradients accumulated, averaged on every synced micro-batch."""
    from fsdp._runtime._collectives import gradient_divide_factors

    ws = dist.get_world_size()
    pre, post = (1.0, float(ws))
    # FSDP1's NO_SHARD (without CPU offload) keeps the averaged gradient on the
    # parameter, where the next backward adds to it, and all-reduces that sum (as DDP
    # does); the other strategies (and offload) reduce each backward's new gradient
    # and add the result to the one kept.
    reduce_accumulated = False
    if isinstance(example.plan, Fsdp1Plan):
        pre, post = gradient_divide_factors(ws)
        reduce_accumulated = example.plan.strategy == "NO_SHARD" and not example.plan.cpu_offload
    model = build(example.model, example.seed)
    opt = _optimizer(model)
    params = [p for p in model.parameters() if p.requires_grad]
    dtypes = MIXED_PRECISION[example.plan.mp] if isinstance(example.plan, FullyShardPlan) else None
    compute = model if dtypes is None else copy.deepcopy(model).to(dtypes[0])
    summed = _RankOrderSum(example)
    rec = Record()
    for s, step in enumerate(example.steps):
        acc: dict[int, Tensor] = {}
        if dtypes is not None:
            with torch.no_grad():
                for c, m in zip(compute.parameters(), model.parameters(), strict=True):
                    c.copy_(m)
        for k, micro in enumerate(step.micros):
            x, y = batch(example.seed, dist.get_rank(), s, k)
            loss = loss_fn(compute(x), y)
            loss.backward()
            rec.losses.append(loss.item())
            if dtypes is not None:
                _low_precision_reduce(compute, params, micro, dtypes[1], acc=acc, summed=summed)
                continue
            if not micro.sync:
                continue
            for p in params:
                if p.grad is None:
                    continue
                total = summed(id(p), p.grad / pre if pre != 1.0 else p.grad, micro.all_reduce)
                if total is None:  # a partial sum, kept for the backward that all-reduces
                    p.grad = None
                    continue
                g = total / post
                if reduce_accumulated:
                    p.grad = g  # the next backward adds to it, as under DDP
                else:
                    acc[id(p)] = acc[id(p)] + g if id(p) in acc else g
                    p.grad = None
        if not reduce_accumulated:
            for p in params:
                p.grad = acc.get(id(p))
        rec.grads.append(
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        )
        opt.step()
        opt.zero_grad()
        rec.params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return rec


def _low_precision_reduce(
    compute: nn.Module,
    params: list[nn.Parameter],
    micro: Micro,
    reduce_dtype: torch.dtype,
    *,
    acc: dict[int, Tensor],
    summed: _RankOrderSum,
) -> None:
    """fully_shard's order under a ``MixedPrecisionPolicy``: an unsynced gradient is kept
    in the reduce dtype (or on the parameter, in the compute dtype, where the two are
    the same); a synced one is added to it, reduced in the reduce dtype (sum, then
    divide) and added in fp32 to the step's gradient."""
    trainable = [c for c in compute.parameters() if c.requires_grad]
    for c, p in zip(trainable, params, strict=True):
        if c.grad is None:
            continue
        if not micro.sync:
            if c.grad.dtype != reduce_dtype:
                kept = c.__dict__.pop("_kept", None)
                g = c.grad.to(reduce_dtype)
                c.__dict__["_kept"] = g if kept is None else kept + c.grad
                c.grad = None
            continue
        kept = c.__dict__.pop("_kept", None)
        full = c.grad if kept is None else kept + c.grad
        c.grad = None
        total = summed(id(p), full.to(reduce_dtype), micro.all_reduce)
        if total is None:
            continue
        r = total / dist.get_world_size()
        acc[id(p)] = acc[id(p)] + r.float() if id(p) in acc else r.float()


# --- fully_shard --------------------------------------------------------------------------------


def _fully_shard_model(example: Example) -> tuple[nn.Module, dict[str, nn.Module]]:
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    plan = example.plan
    assert isinstance(plan, FullyShardPlan)
    ws = dist.get_world_size()
    if plan.hsdp:
        mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (ws,))
    model = build(example.model, example.seed)
    by_name: dict[str, nn.Module] = {}
    offload = CPUOffloadPolicy() if plan.offload else OffloadPolicy()
    dtypes = MIXED_PRECISION[plan.mp]
    mp = MixedPrecisionPolicy() if dtypes is None else MixedPrecisionPolicy(*dtypes)
    for call, raf in zip(plan.calls, plan.reshard_after_forward, strict=True):
        mods = [model.get_submodule(n) if n else model for n in call]
        fully_shard(
            mods if len(mods) > 1 else mods[0],
            mesh=mesh,
            reshard_after_forward=raf,
            shard_across_replicas=plan.across,
            offload_policy=offload,
            mp_policy=mp,
        )
        by_name[call[0]] = mods[0]
    return model, by_name


def _fully_shard_calls(by_name: dict[str, nn.Module], step: Step, point: Point) -> None:
    for when, name, op in step.calls:
        if when != point:
            continue
        m: Any = by_name[name]
        if op == "unshard":
            m.unshard()
        elif op == "unshard_async":
            m.unshard(async_op=True).wait()
        elif op == "unshard_nowait":
            m.unshard(async_op=True)
        elif op == "reshard":
            m.reshard()


def _run_fully_shard(example: Example, rec: Record) -> None:
    model, by_name = _fully_shard_model(example)
    plan = example.plan
    assert isinstance(plan, FullyShardPlan)
    root: Any = model
    opt = _optimizer(model)
    # The sharded parameters, named once: after an unshard() by hand the modules hold
    # the unsharded ones, which the optimizer does not step.
    named = list(model.named_parameters())
    for s, step in enumerate(example.steps):
        for name, setter, value in step.settings:
            arg = [by_name[v] for v in value] if setter.startswith("set_modules_to") else value  # type: ignore[attr-defined]
            getattr(by_name[name], setter)(arg)
        _fully_shard_calls(by_name, step, "before_forward")
        for k, micro in enumerate(step.micros):
            root.set_requires_gradient_sync(micro.sync)
            if plan.hsdp:
                root.set_requires_all_reduce(micro.all_reduce)
            if micro.last_backward is not None:
                root.set_is_last_backward(micro.last_backward)
            x, y = batch(example.seed, dist.get_rank(), s, k)
            loss = loss_fn(model(x), y)
            if k == len(step.micros) - 1:
                _fully_shard_calls(by_name, step, "after_forward")
            loss.backward()
            rec.losses.append(loss.item())
        _fully_shard_calls(by_name, step, "after_backward")
        rec.grads.append(_full_all({n: p.grad for n, p in named if p.grad is not None}))
        opt.step()
        opt.zero_grad()
        _fully_shard_calls(by_name, step, "after_step")
        rec.params.append(_full_all(dict(named)))


# --- FSDP1 --------------------------------------------------------------------------------------


def _run_fsdp1(example: Example, rec: Record) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp import BackwardPrefetch, CPUOffload, ShardingStrategy
    from fsdp import FullyShardedDataParallel as FSDP  # noqa: N817

    plan = example.plan
    assert isinstance(plan, Fsdp1Plan)
    ws = dist.get_world_size()
    kwargs: dict[str, Any] = {
        "sharding_strategy": ShardingStrategy[plan.strategy],
        "forward_prefetch": plan.forward_prefetch,
        "backward_prefetch": None
        if plan.backward_prefetch is None
        else BackwardPrefetch[plan.backward_prefetch],
        "limit_all_gathers": plan.limit_all_gathers,
        "use_orig_params": plan.use_orig_params,
        "cpu_offload": CPUOffload(offload_params=plan.cpu_offload),
    }
    if "HYBRID" in plan.strategy:
        kwargs["device_mesh"] = init_device_mesh(
            "cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard")
        )
    model = build(example.model, example.seed)
    by_name: dict[str, nn.Module] = {}
    for name in plan.wrap:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        wrapped = FSDP(parent.get_submodule(child), **kwargs)
        setattr(parent, child, wrapped) if not child.isdigit() else parent.__setitem__(  # type: ignore[operator]
            int(child), wrapped
        )
        by_name[name] = wrapped
    root = FSDP(model, **kwargs)
    by_name[""] = root
    opt = _optimizer(root)

    def calls(step: Step, point: Point) -> None:
        for when, name, _ in step.calls:
            if when == point:
                with FSDP.summon_full_params(by_name[name]):
                    pass

    for s, step in enumerate(example.steps):
        calls(step, "before_forward")
        for k, micro in enumerate(step.micros):
            x, y = batch(example.seed, dist.get_rank(), s, k)
            with contextlib.nullcontext() if micro.sync else root.no_sync():
                loss = loss_fn(root(x), y)
                if k == len(step.micros) - 1:
                    calls(step, "after_forward")
                loss.backward()
            rec.losses.append(loss.item())
        calls(step, "after_backward")
        opt.step()
        opt.zero_grad()
        calls(step, "after_step")
        with FSDP.summon_full_params(root):
            rec.params.append({_clean(n): p.detach().clone() for n, p in root.named_parameters()})


# --- judging ------------------------------------------------------------------------------------


def _ours_raised(exc: BaseException) -> bool:
    import fsdp

    root = os.path.dirname(fsdp.__file__)
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(root) and type(exc) is not AssertionError


def run_example(example: Example) -> tuple[Record, Record]:
    """(reference, ours) on this rank."""
    ref = _reference(example)
    ours = Record()
    try:
        if isinstance(example.plan, FullyShardPlan):
            _run_fully_shard(example, ours)
        else:
            _run_fsdp1(example, ours)
    except Exception as exc:  # judged by the test process
        text = "".join(traceback.format_exception(exc))
        ours.error = (type(exc).__name__, text, _ours_raised(exc))
    return ref, ours


def _pairs(ref: Record, ours: Record) -> Iterator[tuple[str, Tensor | float, Tensor | float]]:
    """Recorded values side by side; a name on one side only pairs with NaN."""
    missing = torch.tensor(float("nan"))
    for i, (a, b) in enumerate(zip(ref.losses, ours.losses, strict=False)):
        yield f"loss {i}", a, b
    for kind, ra, rb in (("grad", ref.grads, ours.grads), ("param", ref.params, ours.params)):
        for s, (da, db) in enumerate(zip(ra, rb, strict=False)):
            for n in sorted(set(da) | set(db)):
                yield f"step {s} {kind} {n}", da.get(n, missing), db.get(n, missing)


def tolerance(example: Example) -> float:
    """0 (bit for bit) wherever the reference adds in our order (:class:`_RankOrderSum`):
    everywhere but FSDP1's ``NO_SHARD`` at 4 ranks, where gloo's all-reduce adds in an
    order of its own (two terms add the same either way)."""
    plan = example.plan
    if example.world_size > 2 and isinstance(plan, Fsdp1Plan) and plan.strategy == "NO_SHARD":
        return TOLERANCE_4
    return 0.0


def differences(ref: Record, ours: Record, tol: float) -> list[str]:
    """Every recorded value of ``ours`` that differs from ``ref`` by more than ``tol``
    (prefixes compared: a run that raised recorded fewer)."""
    out = []
    for what, a, b in _pairs(ref, ours):
        ta, tb = torch.as_tensor(a).float(), torch.as_tensor(b).float()
        if ta.shape != tb.shape:
            out.append(f"{what}: shape {tuple(tb.shape)} instead of {tuple(ta.shape)}")
        elif not (torch.equal(ta, tb) or torch.allclose(ta, tb, rtol=tol, atol=tol)):
            worst = (ta - tb).abs().max().item() if ta.numel() else 0.0
            out.append(f"{what}: differs by {worst:.3g}")
    return out


def judge(example: Example, results: list[tuple[Record, Record]]) -> str | None:
    """``None`` if the example ended well, else what went wrong."""
    problems: list[str] = []
    errors = [ours.error for _, ours in results]
    if any(e is not None for e in errors):
        if any(e is None for e in errors):
            problems.append("only some ranks raised")
        for rank, e in enumerate(errors):
            if e is not None and not e[2]:
                problems.append(f"rank {rank} raised an error that is not a clear one:\n{e[1]}")
    for rank, (ref, ours) in enumerate(results):
        diff = differences(ref, ours, tolerance(example))
        if diff:
            problems.append(f"rank {rank}: " + "; ".join(diff[:6]))
    if not problems:
        return None
    return "\n".join(problems)


def check_example(example: Example, note: Callable[[str], None] = print) -> None:
    """Run ``example`` and raise ``AssertionError`` (with a reproduction) if it ended badly."""
    try:
        results = run_ranks(run_example, example.world_size, example, timeout=TIMEOUT_S)
    except RankFailure as failure:
        raise AssertionError(
            f"ranks failed or hung:\n{failure}\n\nreproduce with:\n{reproduction(example)}"
        ) from None
    verdict = judge(example, results)
    if verdict is not None:
        raise AssertionError(f"{verdict}\n\nreproduce with:\n{reproduction(example)}")
    errors = {e[1].strip().splitlines()[-1] for _, ours in results if (e := ours.error) is not None}
    if errors:
        note(f"ended with a clear error on every rank: {sorted(errors)}")
