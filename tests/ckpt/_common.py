"""Tiny models and a deterministic training step shared by the ckpt tests."""

from __future__ import annotations

import torch
from torch import nn


def make_model(seed: int) -> nn.Sequential:
    """A small MLP with a buffer, so buffers round-trip too."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))
    model.register_buffer("scale", torch.rand(3))
    return model


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def batch(step: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch that depends only on (step, rank), so runs can be repeated exactly."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, step: int, rank: int = 0) -> float:
    x, y = batch(step, rank)
    optim.zero_grad()
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    scale = inner.get_buffer("scale")
    loss = ((model(x) * scale - y) ** 2).mean()
    loss.backward()
    optim.step()
    return float(loss.item())


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by name without a DDP prefix, detached copies."""
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return {k: v.detach().clone() for k, v in inner.state_dict().items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k, value in a.items():
        assert torch.equal(value, b[k]), f"{k} differs"


def linear(model: nn.Module, index: int) -> nn.Linear:
    """Layer ``index`` of a ``make_model`` model (typed, for mypy)."""
    layer = model.get_submodule(str(index))
    assert isinstance(layer, nn.Linear)
    return layer
