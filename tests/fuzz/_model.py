"""The fuzzer's model and data (inside ranks): small, with ties, frozen and unused parts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.fuzz._space import ModelSpec

VOCAB = 5
BATCH = 2
SEQ = 3


class FuzzBlock(nn.Module):
    """A residual MLP block whose hidden width may be 1."""

    def __init__(self, dim: int, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, width)
        self.fc2 = nn.Linear(width, dim)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class FuzzNet(nn.Module):
    """Embedding, blocks, final norm, head; ties, frozen modules and an unused Linear as
    :class:`ModelSpec` says."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, spec.dim)
        self.blocks = nn.ModuleList(FuzzBlock(spec.dim, w) for w in spec.widths)
        self.ln_f = nn.LayerNorm(spec.dim)
        self.head = nn.Linear(spec.dim, VOCAB, bias=False)
        if spec.unused:
            self.unused = nn.Linear(spec.dim, spec.dim)
        if spec.tie_head:
            self.head.weight = self.emb.weight
        if spec.tie_blocks:
            self.blocks[1].fc1.weight = self.blocks[0].fc1.weight  # type: ignore[union-attr]
        for name in spec.frozen:
            for p in self.get_submodule(name).parameters():
                p.requires_grad_(False)

    def forward(self, idx: Tensor) -> Tensor:
        h = self.emb(idx)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))


def build(spec: ModelSpec, seed: int) -> FuzzNet:
    """The same initial model on every rank."""
    torch.manual_seed(seed)
    return FuzzNet(spec)


def batch(seed: int, rank: int, step: int, micro: int) -> tuple[Tensor, Tensor]:
    """Token ids and targets, different on each rank, step and micro-batch."""
    g = torch.Generator().manual_seed(seed * 10_007 + rank * 101 + step * 11 + micro)
    idx = torch.randint(VOCAB, (BATCH, SEQ), generator=g)
    return idx, torch.randint(VOCAB, (BATCH, SEQ), generator=g)


def loss_fn(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
