"""Training with DDP and our ZeroRedundancyOptimizer: a torch DDP + ZeRO script whose
optimizer import is ours (the line saying "was torch..."), checkpointed by ckpt.

    torchrun --standalone --nproc-per-node 2 examples/minimal/ddp_zero.py
    torchrun --standalone --nproc-per-node 2 examples/minimal/ddp_zero.py --steps 80  # resumes

A small residual MLP learns y[i] = x[i] * x[i-1] on random inputs; each (step, rank)
draws its own batch from a seed, so a resumed run sees the batches an uninterrupted
one would, and prints the same losses.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ckpt  # ours: atomic, verified checkpoints of sharded state
from zero_optim import ZeroRedundancyOptimizer  # ours: was torch.distributed.optim


class Block(nn.Module):
    """One residual MLP block."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.ff = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update: torch.Tensor = self.ff(self.norm(x))
        return x + update


def batch(step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1009 + rank)
    x = torch.rand(64, 8, generator=g) * 2 - 1
    return x.to(device), (x * x.roll(1, dims=1)).to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description="train, checkpoint, resume")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default="runs/minimal-ddp-zero", help="checkpoints go here")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    torch.manual_seed(0)  # the same initial weights on every rank
    net = nn.Sequential(nn.Linear(8, 64), *(Block(64) for _ in range(4)), nn.Linear(64, 8))
    model = DDP(net.to(device), device_ids=[device.index] if cuda else None)
    optim = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=3e-3)

    state = {"model": model, "optim": optim, "step": 0}
    manager = ckpt.CheckpointManager(f"{args.out}/checkpoints", keep_last=2)
    start = manager.load_latest(state) or 0  # each rank: the AdamW moments of its share
    if rank == 0 and start:
        print(f"resumed from {manager.path(start)}")
    for step in range(start + 1, args.steps + 1):
        x, y = batch(step, rank, device)
        loss = F.mse_loss(model(x), y)
        optim.zero_grad()
        loss.backward()
        optim.step()
        if step % 10 == 0 or step == args.steps:
            state["step"] = step
            manager.save(step, state)
            if rank == 0:
                print(f"step {step} loss {loss.item():.6f}, saved {manager.path(step)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
