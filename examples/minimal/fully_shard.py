"""Training with our fully_shard (FSDP2's API): a torch FSDP2 script whose fully_shard
import is switched to ours (the line saying "was torch..."), checkpointed by ckpt.

    torchrun --standalone --nproc-per-node 2 examples/minimal/fully_shard.py
    torchrun --standalone --nproc-per-node 2 examples/minimal/fully_shard.py --steps 80  # resumes

The model and data are fsdp1.py's: a resumed run prints an uninterrupted one's losses.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import ckpt  # ours: atomic, verified checkpoints of sharded state
from fsdp import fully_shard  # ours: was torch.distributed.fsdp


class Block(nn.Module):
    """One residual MLP block: one fully_shard group, gathered and freed as a whole."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.ff = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))  # type: ignore[no-any-return]


def batch(step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1009 + rank)
    x = torch.rand(64, 8, generator=g) * 2 - 1
    return x.to(device), (x * x.roll(1, dims=1)).to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description="train, checkpoint, resume")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default="runs/minimal-fully-shard", help="checkpoints here")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    torch.manual_seed(0)  # the same initial weights on every rank
    blocks = [Block(64) for _ in range(4)]
    model = nn.Sequential(nn.Linear(8, 64), *blocks, nn.Linear(64, 8))
    for block in blocks:
        fully_shard(block, mesh=mesh)  # bottom-up: each block, then the root
    fully_shard(model, mesh=mesh)  # in place: model is now also an FSDPModule
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)

    state = {"model": model, "optim": optim, "step": 0}
    manager = ckpt.CheckpointManager(f"{args.out}/checkpoints", keep_last=2)
    start = manager.load_latest(state) or 0  # every rank reads only its shards
    if dist.get_rank() == 0 and start:
        print(f"resumed from {manager.path(start)}")
    for step in range(start + 1, args.steps + 1):
        x, y = batch(step, dist.get_rank(), device)
        loss = F.mse_loss(model(x), y)
        optim.zero_grad()
        loss.backward()
        optim.step()
        if step % 10 == 0 or step == args.steps:
            state["step"] = step
            manager.save(step, state)
            if dist.get_rank() == 0:
                print(f"step {step} loss {loss.item():.6f}, saved {manager.path(step)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
