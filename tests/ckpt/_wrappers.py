"""Models, wrappers and a deterministic training loop for the fsdp/zero_optim ckpt tests.

Every rank trains on the *same* batch at each step, so the averaged gradient is
exactly the per-rank gradient at every world size (sums of 1, 2 or 4 equal values
divided by a power of two are exact): runs at different world sizes and under
different wrappers are then bit-identical, and a resumed run can be compared with
an uninterrupted one with ``==``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

from tests.fsdp._common import SEQ, VOCAB, Block, loss_fn, make_net

WRAPPERS = ("fsdp", "fsdp-orig", "ddp-zero", "ddp", "fully_shard")
LR = 1e-2


def tied_net(seed: int = 0) -> nn.Module:
    """``make_net`` with GPT2's tie: the output head's weight is the embedding's, so
    ``named_parameters()`` yields it as ``emb.weight`` and the state dict holds it under
    ``emb.weight`` and ``head.weight``."""
    net = make_net(seed)
    net.head.weight = net.emb.weight
    return net


def wrap(kind: str, seed: int = 0, tied: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model (same initial weights for a seed; ``tied``: :func:`tied_net`) and its
    optimizer under ``kind``."""
    from fsdp import FullyShardedDataParallel as FSDP  # noqa: N817
    from fsdp.wrap import ModuleWrapPolicy
    from zero_optim import ZeroRedundancyOptimizer

    net = tied_net(seed) if tied else make_net(seed)
    if kind in ("fully_shard", "fully_shard-across"):
        from fsdp import fully_shard

        kwargs = _across_kwargs() if kind.endswith("-across") else {}
        for block in net.blocks:
            fully_shard(block, **kwargs)
        fully_shard(net, **kwargs)
        return net, torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.1)
    if kind in ("fsdp", "fsdp-orig", "fsdp-across"):
        from fsdp import ShardingStrategy

        extra: dict[str, Any] = {}
        if kind == "fsdp-across":
            extra = {
                "device_mesh": _across_kwargs()["mesh"],
                "sharding_strategy": ShardingStrategy.HYBRID_SHARD_ACROSS_REPLICAS,
            }
        model: nn.Module = FSDP(
            net,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            use_orig_params=kind == "fsdp-orig",
            **extra,
        )
        return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    model = DDP(net)
    if kind == "ddp-zero":
        zero = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.AdamW, lr=LR, weight_decay=0.1
        )
        return model, zero
    assert kind == "ddp", kind
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def _across_kwargs() -> dict[str, Any]:
    """Sharded across two replicas (``*-across`` kinds): a (2, world / 2) mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(
        "cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard")
    )
    return {"mesh": mesh, "shard_across_replicas": True}


def batch(step: int) -> tuple[Tensor, Tensor]:
    """The same batch on every rank (see the module docstring)."""
    g = torch.Generator().manual_seed(500 + step)
    return (
        torch.randint(0, VOCAB, (2, SEQ), generator=g),
        torch.randint(0, VOCAB, (2, SEQ), generator=g),
    )


def step(model: nn.Module, optim: torch.optim.Optimizer, i: int) -> float:
    """One training step on batch ``i``; returns the loss (before the update)."""
    x, y = batch(i)
    optim.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    optim.step()
    return float(loss.item())


def train(model: nn.Module, optim: torch.optim.Optimizer, start: int, stop: int) -> list[float]:
    return [step(model, optim, i) for i in range(start, stop)]


def full_weights(model: nn.Module) -> dict[str, Tensor]:
    """Full parameters by unwrapped name (a collective for fsdp)."""
    from tests.fsdp._common import full_params

    return full_params(model)


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def resumes_from(folder: Any, kind: str, losses: list[float], weights: dict[str, Any]) -> bool:
    """Whether a fresh ``kind`` model loading the step-3 checkpoint in ``folder`` with
    ``ckpt.load`` trains steps 3 and 4 to ``losses`` and ends at ``weights``."""
    import ckpt

    model, optim = wrap(kind, seed=9)
    state: dict[str, Any] = {"model": model, "optim": optim, "step": 0}
    ckpt.load(state, folder)
    ok = state["step"] == 3 and train(model, optim, 3, 5) == losses
    return ok and same(full_weights(model), weights)
