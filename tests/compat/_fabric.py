"""Fabric runs (inside ranks) for the compat tests: train, save, resume, continue."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.fsdp._common import Block, batches, loss_fn, make_net

ACCUMULATE = 2
STEPS = 4  # optimizer steps per run; the save comes after SAVE_AT of them
SAVE_AT = 2


def lightning_env() -> None:
    """Tell Lightning the processes exist already (run_ranks made them and the group)."""
    os.environ.update(
        WORLD_SIZE=str(dist.get_world_size()),
        RANK=str(dist.get_rank()),
        LOCAL_RANK=str(dist.get_rank()),
        NODE_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
    )


def plug(how: str) -> None:
    """Put ours behind torch's names: all of them, or only the class (torch's option
    types then reach ours, as a user who switched one import would have it)."""
    import fsdp

    if how == "install":
        import fsdp.torch_compat

        fsdp.torch_compat.install()
    elif how == "class":
        import torch.distributed.fsdp as tfsdp

        # Lightning imports the class from the package and from its defining module.
        _saved_class.append(tfsdp.FullyShardedDataParallel)
        for module in (tfsdp, tfsdp.fully_sharded_data_parallel):
            module.FullyShardedDataParallel = fsdp.FullyShardedDataParallel  # type: ignore[misc]
    else:
        assert how == "torch", how


_saved_class: list[Any] = []


def unplug(how: str) -> None:
    """Torch's own objects back under its names (for the torch reference run)."""
    if how == "install":
        import fsdp.torch_compat

        fsdp.torch_compat.uninstall()
    elif how == "class":
        import torch.distributed.fsdp as tfsdp

        for module in (tfsdp, tfsdp.fully_sharded_data_parallel):
            module.FullyShardedDataParallel = _saved_class[0]  # type: ignore[misc]


def _strategy(kind: str, strategy: str, orig: bool, sd_type: str) -> Any:
    from lightning.fabric.strategies import FSDPStrategy as FabricFSDP
    from lightning.pytorch.strategies import FSDPStrategy as TrainerFSDP

    base = FabricFSDP if kind == "fabric" else TrainerFSDP

    # Lightning refuses its FSDPStrategy without CUDA unless it is a subclass.
    class CPUFSDPStrategy(base):  # type: ignore[misc, valid-type]
        pass

    return CPUFSDPStrategy(
        auto_wrap_policy={Block},
        sharding_strategy=strategy,
        use_orig_params=orig,
        state_dict_type=sd_type,
    )


def train(fabric: Any, model: nn.Module, opt: Any, data: list[Any], steps: range) -> list[float]:
    """Fabric's loop: accumulation without sync but for the last micro-batch, clipping."""
    losses = []
    for i in steps:
        for micro in range(ACCUMULATE):
            x, y = data[i * ACCUMULATE + micro]
            with fabric.no_backward_sync(model, enabled=micro < ACCUMULATE - 1):
                loss = loss_fn(model(x), y)
                fabric.backward(loss)
            losses.append(loss.item())
        fabric.clip_gradients(model, opt, max_norm=0.5)
        opt.step()
        opt.zero_grad()
    return losses


def fabric_run(how: str, strategy: str, orig: bool, sd_type: str, root: str) -> dict[str, Any]:
    """Uninterrupted, then saved at SAVE_AT and resumed into a model seeded otherwise."""
    plug(how)
    lightning_env()
    import lightning as L

    fabric = L.Fabric(
        accelerator="cpu",
        devices=dist.get_world_size(),
        strategy=_strategy("fabric", strategy, orig, sd_type),
    )
    fabric.launch()  # the processes exist (LOCAL_RANK is set): only initialises
    return save_resume_run(fabric, os.path.join(root, f"{strategy}-{orig}-{sd_type}"))


def save_resume_run(fabric: Any, path: str) -> dict[str, Any]:
    """Through ``fabric``: uninterrupted, then saved at SAVE_AT to ``path`` and resumed
    into a model seeded otherwise; the losses of both and the wrapper's class."""
    data = batches(STEPS * ACCUMULATE)

    def setup(seed: int) -> tuple[nn.Module, Any]:
        model = fabric.setup_module(make_net(seed))
        opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
        return model, opt

    model, opt = setup(0)
    whole = train(fabric, model, opt, data, range(STEPS))
    model, opt = setup(0)
    first = train(fabric, model, opt, data, range(SAVE_AT))
    fabric.save(path, {"model": model, "optimizer": opt, "step": SAVE_AT})
    model, opt = setup(1)
    state: dict[str, Any] = {"model": model, "optimizer": opt}
    rest = fabric.load(path, state)
    resumed = train(fabric, model, opt, data, range(rest["step"], STEPS))
    return {"whole": whole, "resumed": first + resumed, "wrapper": type(model._forward_module)}


def torch_reference(strategy: str, orig: bool, trainer: bool = False) -> list[float]:
    """The same training with torch's FSDP1 and no Lightning (what Fabric's calls do;
    with ``trainer``, what the Trainer does: the loss divided by the accumulation)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = TorchFSDP(
        make_net(0),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=ShardingStrategy[strategy],
        use_orig_params=orig,
        device_id=torch.device("cpu"),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = batches(STEPS * ACCUMULATE)
    losses = []
    for i in range(STEPS):
        for micro in range(ACCUMULATE):
            x, y = data[i * ACCUMULATE + micro]
            ctx = model.no_sync() if micro < ACCUMULATE - 1 else torch.enable_grad()
            with ctx:
                loss = loss_fn(model(x), y)
                (loss / ACCUMULATE if trainer else loss).backward()
            losses.append(loss.item())
        model.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
    return losses


def trainer_run(how: str, strategy: str, orig: bool, sd_type: str, root: str) -> dict[str, Any]:
    """Trainer: two epochs uninterrupted, then one epoch, a checkpoint, and a resume
    into a model seeded otherwise for the second."""
    plug(how)
    lightning_env()
    import lightning as L

    data = batches(STEPS * ACCUMULATE)

    class Module(L.LightningModule):  # type: ignore[misc]
        def __init__(self, seed: int) -> None:
            super().__init__()
            self.net = make_net(seed)
            self.losses: list[float] = []

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            loss = loss_fn(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_gradient_clipping(self, *args: Any, **kwargs: Any) -> None:
            # Lightning's FSDP precision plugin refuses gradient_clip_val="norm" (it has no
            # root module at hand); its advice: the root's clip_grad_norm_.
            self.trainer.model.clip_grad_norm_(0.5)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            # The wrapped model's parameters (Lightning's advice under FSDP).
            return torch.optim.AdamW(self.trainer.model.parameters(), lr=1e-2)

    def fit(seed: int, epochs: int, ckpt_path: str | None = None) -> tuple[Any, Any]:
        trainer = L.Trainer(
            accelerator="cpu",
            devices=dist.get_world_size(),
            strategy=_strategy("trainer", strategy, orig, sd_type),
            max_epochs=epochs,
            accumulate_grad_batches=ACCUMULATE,
            use_distributed_sampler=False,
            enable_checkpointing=False,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        module = Module(seed)
        loader = torch.utils.data.DataLoader(data, batch_size=None)
        trainer.fit(module, loader, ckpt_path=ckpt_path)
        return trainer, module

    _, whole = fit(0, 2)
    trainer, first = fit(0, 1)
    path = os.path.join(root, f"trainer-{strategy}-{orig}-{sd_type}")
    trainer.save_checkpoint(path)
    _, resumed = fit(1, 2, ckpt_path=path)
    return {
        "whole": whole.losses,
        "resumed": first.losses + resumed.losses,
        "wrapper": type(trainer.strategy.model),
    }
