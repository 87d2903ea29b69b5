"""Ignored states, frozen units and shared parameters: parity, bytes and collectives.

- Ignored modules/parameters stay plain ``nn.Parameter``s on their modules and
  keep each rank's local gradient: ours matches torch's FSDP1 with the same
  ``ignored_modules``/``ignored_states`` bit for bit, and a plain model whose
  gradients are averaged by hand except the ignored ones.
- A unit whose parameters are all frozen has no gradient (no ``.grad``, no
  unsharded gradient during backward) and no reduction; a frozen unit at the
  bottom of the model is not even gathered again for backward. Counted in
  collective calls and gradient bytes; trained like DDP and torch's FSDP1.
- Parameters shared between modules of one unit (tied embeddings) train as in
  torch's FSDP1, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

from tests.fsdp._common import (
    Block,
    Net,
    batches,
    full_params,
    loss_fn,
    make_net,
    max_diff,
    train,
    use_native_collectives,
)
from tests.fsdp.test_hybrid import record_collectives
from tests.ranks import run_ranks

STEPS = 6
CPU = torch.device("cpu")


def _by_hand(net: nn.Module, data: list[Any], local: set[str]) -> tuple[list[float], nn.Module]:
    """AdamW as in ``train``, gradients averaged over ranks except the ``local`` names."""
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for x, y in data:
        loss = loss_fn(net(x), y)
        loss.backward()
        for name, p in net.named_parameters():
            if p.grad is not None and name not in local:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, net


# ignored case -> (what to ignore, given a fresh Net; the names that stay local)
IGNORED: dict[str, tuple[Callable[[Net], dict[str, Any]], set[str]]] = {
    "module_head": (lambda n: {"ignored_modules": [n.head]}, {"head.weight", "head.bias"}),
    "states_param": (lambda n: {"ignored_states": [n.ln_f.weight]}, {"ln_f.weight"}),
    "states_block": (
        lambda n: {"ignored_states": [n.blocks[1]]},
        {
            f"blocks.1.{k}"
            for k in ("ln.weight", "ln.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
        },
    ),
}


def _wrap(api: Any, wrap_mod: Any, net: nn.Module, classes: set[type[nn.Module]], **kw: Any) -> Any:
    return api.FullyShardedDataParallel(
        net, auto_wrap_policy=wrap_mod.ModuleWrapPolicy(classes), device_id=CPU, **kw
    )


def _ignored_case(name: str, data: list[Any]) -> dict[str, Any]:
    import torch.distributed.fsdp as torch_fsdp
    import torch.distributed.fsdp.wrap as torch_wrap

    import fsdp
    import fsdp.wrap
    from flatparam import FlatParameter

    select, local = IGNORED[name]
    net = make_net()
    ours = _wrap(fsdp, fsdp.wrap, net, {Block}, **select(net))
    plain = {
        n.replace("_fsdp_wrapped_module.", ""): p
        for n, p in ours.named_parameters()
        if not isinstance(p, FlatParameter)
    }
    flat_numel = sum(p.numel() for p in ours.parameters() if isinstance(p, FlatParameter))
    net = make_net()
    theirs = _wrap(torch_fsdp, torch_wrap, net, {Block}, **select(net))
    r: dict[str, Any] = {
        "plain_names": sorted(plain),
        "still_registered": all(type(p) is nn.Parameter for p in plain.values()),
        "flat_numel": flat_numel * dist.get_world_size(),
        "total_numel": sum(p.numel() for p in make_net().parameters()),
        "ignored_numel": sum(p.numel() for p in plain.values()),
    }
    losses, t_losses = train(ours, data)[0], train(theirs, data)[0]
    ref_losses, ref = _by_hand(make_net(), data, local)
    params = full_params(ours)
    r["loss_vs_torch"] = max(abs(a - b) for a, b in zip(losses, t_losses, strict=True))
    r["param_vs_torch"] = max_diff(params, full_params(theirs))
    r["loss_vs_ref"] = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
    r["param_vs_ref"] = max_diff(params, full_params(ref))
    # The ignored parameters differ across ranks (local gradients), the others agree.
    r["params"] = {k: v for k, v in params.items() if k in local}
    return r


def _frozen_net() -> Net:
    net = make_net()
    net.emb.requires_grad_(False)
    net.blocks[0].requires_grad_(False)
    return net


def _frozen_case(data: list[Any]) -> dict[str, Any]:
    import torch.distributed.fsdp as torch_fsdp
    import torch.distributed.fsdp.wrap as torch_wrap

    import fsdp
    import fsdp.wrap

    classes = {Block, nn.Embedding}  # units: emb, blocks.0-2, root (ln_f, head)
    ours = _wrap(fsdp, fsdp.wrap, _frozen_net(), classes)
    theirs = _wrap(torch_fsdp, torch_wrap, _frozen_net(), classes)
    ddp = DDP(_frozen_net())
    losses = train(ours, data)[0]
    r: dict[str, Any] = {
        "loss_vs_torch": max(
            abs(a - b) for a, b in zip(losses, train(theirs, data)[0], strict=True)
        ),
        "loss_vs_ddp": max(abs(a - b) for a, b in zip(losses, train(ddp, data)[0], strict=True)),
        "param_vs_torch": max_diff(full_params(ours), full_params(theirs)),
        "param_vs_ddp": max_diff(full_params(ours), full_params(ddp)),
        "frozen_unchanged": max_diff(
            {k: v for k, v in full_params(ours).items() if k.startswith(("emb.", "blocks.0."))},
            {
                k: v
                for k, v in full_params(_frozen_net()).items()
                if k.startswith(("emb.", "blocks.0."))
            },
        ),
    }
    # One more step, spied: what is communicated and what gradient bytes exist.
    x, y = data[0]
    with record_collectives() as calls:
        loss_fn(ours(x), y).backward()
    states = [s for s in ours._fsdp_state.ctx.states if s.unit is not None]
    frozen = [s.unit for s in states if not s.unit.requires_grad]
    trainable = [s.unit for s in states if s.unit.requires_grad]
    r["n_frozen"], r["n_trainable"] = len(frozen), len(trainable)
    r["frozen_grads"] = [
        u.flat_param.grad is not None or u.compute_param.grad is not None for u in frozen
    ]
    r["grad_bytes"] = sum(
        p.grad.numel() * p.grad.element_size() for p in ours.parameters() if p.grad is not None
    )
    r["trainable_shard_bytes"] = sum(u.flat_param.numel() * 4 for u in trainable)
    r["ops"] = [op for op, _, _ in calls]
    return r


class TiedNet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.head.weight = self.emb.weight


def _tied_case(data: list[Any]) -> dict[str, Any]:
    import torch.distributed.fsdp as torch_fsdp
    import torch.distributed.fsdp.wrap as torch_wrap

    import fsdp
    import fsdp.wrap

    def tied() -> TiedNet:
        torch.manual_seed(0)
        return TiedNet()

    ours = _wrap(fsdp, fsdp.wrap, tied(), {Block})
    theirs = _wrap(torch_fsdp, torch_wrap, tied(), {Block})
    losses = train(ours, data)[0]
    params = full_params(ours)
    with fsdp.FullyShardedDataParallel.summon_full_params(ours):
        still_tied = ours.module.head.weight is ours.module.emb.weight
    return {
        "loss_vs_torch": max(
            abs(a - b) for a, b in zip(losses, train(theirs, data)[0], strict=True)
        ),
        "param_vs_torch": max_diff(params, full_params(theirs)),
        "still_tied": still_tied,
    }


def _rank_all() -> dict[str, Any]:
    use_native_collectives()
    data = batches(STEPS)
    out: dict[str, Any] = {name: _ignored_case(name, data) for name in IGNORED}
    out["frozen"] = _frozen_case(data)
    out["tied"] = _tied_case(data)
    dist.barrier()
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["ws2", "ws4"])
def results(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    return request.param, run_ranks(_rank_all, request.param, timeout=300)


def test_ignored_states(results: tuple[int, list[dict[str, Any]]]) -> None:
    world, per_rank = results
    tol = 0.0 if world == 2 else 1e-5  # DDP-style sums of four (see test_parity.py)
    for name, (_, local) in IGNORED.items():
        for rank, out in enumerate(per_rank):
            r = out[name]
            where = f"rank {rank}, {name}: {r}"
            assert r["plain_names"] == sorted(local), where
            assert r["still_registered"], where
            assert r["flat_numel"] >= r["total_numel"] - r["ignored_numel"], where
            assert r["flat_numel"] < r["total_numel"], where  # ignored ones are not flattened
            assert r["loss_vs_torch"] == 0.0 and r["param_vs_torch"] == 0.0, where
            assert r["loss_vs_ref"] <= tol and r["param_vs_ref"] <= tol, where
        # Unreduced: each rank trained its own copy of the ignored parameters.
        p0, p1 = per_rank[0][name]["params"], per_rank[1][name]["params"]
        assert max_diff(p0, p1) > 1e-4, name


def test_frozen_units(results: tuple[int, list[dict[str, Any]]]) -> None:
    world, per_rank = results
    tol = 0.0 if world == 2 else 1e-5
    for r in (out["frozen"] for out in per_rank):
        assert r["loss_vs_torch"] == 0.0 and r["param_vs_torch"] == 0.0, r
        assert r["loss_vs_ddp"] <= tol and r["param_vs_ddp"] <= tol, r
        assert r["frozen_unchanged"] == 0.0, r
        assert (r["n_frozen"], r["n_trainable"]) == (2, 3), r
        assert r["frozen_grads"] == [False, False], r  # neither a sharded nor an unsharded grad
        assert r["grad_bytes"] == r["trainable_shard_bytes"], r
        # Forward gathers all 5 units; backward re-gathers blocks.1 and blocks.2 only (the
        # root stays gathered, emb and blocks.0 get no backward), and reduces the 3 trainable.
        assert r["ops"].count("all_gather_single") == 5 + 2, r
        assert r["ops"].count("reduce_scatter_single") == 3, r
        assert r["ops"].count("all_reduce") == 0, r


def test_shared_parameters_in_one_unit(results: tuple[int, list[dict[str, Any]]]) -> None:
    for r in (out["tied"] for out in results[1]):
        assert r["loss_vs_torch"] == 0.0 and r["param_vs_torch"] == 0.0, r
        assert r["still_tied"], r
