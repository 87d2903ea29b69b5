"""Lightning Fabric's ``ModelParallelStrategy`` (FSDP2) runs, inside ranks.

The strategy builds a 2-D device mesh (data parallel x tensor parallel) and hands it
to the user's ``parallelize_fn``, which calls ``fully_shard`` from
``torch.distributed.fsdp``. After ``fsdp.torch_compat.install()`` that name is ours;
``fabric.save`` / ``fabric.load`` then go through torch's
``torch.distributed.checkpoint.state_dict`` functions and DCP on our ``DTensor`` s.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from torch import nn

from tests.compat._fabric import lightning_env, save_resume_run
from tests.fsdp._common import Block


def parallelize(model: nn.Module, device_mesh: Any) -> nn.Module:
    """What a user's ``parallelize_fn`` does: fully_shard each block, then the root."""
    from torch.distributed.fsdp import fully_shard  # ours after install()

    mesh = device_mesh["data_parallel"]
    for module in model.modules():
        if isinstance(module, Block):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def model_parallel_run(impl: str, root: str) -> dict[str, Any]:
    """Uninterrupted, then saved at SAVE_AT and resumed into a model seeded otherwise."""
    import fsdp

    if impl == "ours":
        import fsdp.torch_compat

        fsdp.torch_compat.install()
    lightning_env()
    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy

    try:
        fabric = L.Fabric(
            accelerator="cpu",
            devices=dist.get_world_size(),
            strategy=ModelParallelStrategy(
                parallelize, data_parallel_size=dist.get_world_size(), tensor_parallel_size=1
            ),
        )
        fabric.launch()
        run = save_resume_run(fabric, os.path.join(root, f"model-parallel-{impl}"))
    finally:
        if impl == "ours":
            fsdp.torch_compat.uninstall()
    return {
        "whole": run["whole"],
        "resumed": run["resumed"],
        "ours": issubclass(run["wrapper"], fsdp.FSDPModule),
    }
