"""What the GPU tests share: the skip, a model big enough for the allocator, bytes."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: run `nox -s gpu` on a GPU machine"
)
needs_2_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2+ GPUs for NCCL across devices"
)

WIDTH = 256  # a 256x256 fp32 weight is 256 KiB: far above the allocator's 512-byte blocks
BLOCK = 512  # the CUDA caching allocator rounds every allocation up to this


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, WIDTH)
        self.fc2 = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, n_blocks: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))
        self.head = nn.Linear(WIDTH, 8)

    def forward(self, x: Tensor) -> Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def make(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def data(steps: int, rank: int, device: torch.device) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [
        (torch.randn(16, WIDTH, generator=g).to(device), torch.randn(16, 8, generator=g).to(device))
        for _ in range(steps)
    ]


def allocated_bytes(tensors: list[Tensor]) -> int:
    """What the caching allocator accounts for these tensors' storages (each once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = -(-s.nbytes() // BLOCK) * BLOCK
    return sum(seen.values())
