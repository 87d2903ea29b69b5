"""``torch.compile`` of a model wrapped with ``use_orig_params=True`` trains like DDP.

The FSDP hooks run eagerly (``fsdp._runtime._common.eager_only``), so Dynamo compiles
the blocks' own computation between them: one graph for the two identical
blocks, compiled once (no recompilation in later steps although the gathered
views are new tensors each step). Inductor may fuse differently from eager
mode, so losses and parameters are compared with DDP to 1e-5. One small test:
CPU compilation costs a few seconds per rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

from tests.fsdp._common import Block, batches, full_params, loss_fn, make_net, max_diff, train
from tests.ranks import run_ranks

STEPS = 4


def _rank_compile() -> dict[str, Any]:
    from torch._dynamo.utils import counters

    import fsdp
    import fsdp.wrap

    torch._dynamo.reset()
    data = batches(STEPS)
    ddp = DDP(make_net(n_blocks=2))
    ddp_losses, _ = train(ddp, data)
    model = fsdp.FullyShardedDataParallel(
        make_net(n_blocks=2),
        auto_wrap_policy=fsdp.wrap.ModuleWrapPolicy({Block}),
        use_orig_params=True,
    )
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    graphs = []
    for x, y in data:
        loss = loss_fn(compiled(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        graphs.append(counters["stats"]["unique_graphs"])
    dist.barrier()
    return {
        "loss_vs_ddp": max(abs(a - b) for a, b in zip(losses, ddp_losses, strict=True)),
        "param_vs_ddp": max_diff(full_params(model), full_params(ddp)),
        "graphs_per_step": graphs,
        "changed": max_diff(full_params(model), full_params(make_net(n_blocks=2))),
    }


def test_compile_with_orig_params_trains_like_ddp() -> None:
    for rank, r in enumerate(run_ranks(_rank_compile, 2, timeout=300)):
        where = f"rank {rank}: {r}"
        assert r["changed"] > 1e-3, where
        assert r["loss_vs_ddp"] <= 1e-5, where
        assert r["param_vs_ddp"] <= 1e-5, where
        graphs = r["graphs_per_step"]
        assert graphs[0] >= 1, where  # something was compiled
        assert graphs[-1] == graphs[0], where  # and never recompiled
