"""Models, data and training loops shared by the fsdp tests (run inside ranks).

The models are tiny and their sizes odd on purpose, so that flat parameters
need padding at every world size tested (1, 2, 4) and some ranks' shards
start in the middle of a parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn


def use_native_collectives() -> None:
    """In this rank, issue gloo's own all-gather / reduce-scatter (the calls NCCL runs).

    For tests that count those calls; on gloo our FSDP otherwise composes them
    from broadcasts and all-to-alls ([Note: gloo's sharded collectives]), which
    ``tests/fsdp/test_gloo_collectives.py`` checks.
    """
    import fsdp._runtime._collectives

    fsdp._runtime._collectives.GLOO_COMPOSITES = False


VOCAB = 13
DIM = 6
SEQ = 5


class Block(nn.Module):
    """A pre-norm MLP block: the unit an auto-wrap policy picks."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim + 1)
        self.fc2 = nn.Linear(2 * dim + 1, dim)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Net(nn.Module):
    """Embedding, blocks, head, and a (non-trainable) buffer."""

    def __init__(self, n_blocks: int = 3, dim: int = DIM) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n_blocks))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)
        self.register_buffer("scale", torch.tensor(0.75))

    def forward(self, idx: Tensor) -> Tensor:
        h = self.emb(idx) * self.scale
        for b in self.blocks:
            h = b(h)
        return self.head(self.ln_f(h))


def make_net(seed: int = 0, n_blocks: int = 3) -> Net:
    """The same initial model on every rank."""
    torch.manual_seed(seed)
    return Net(n_blocks)


def batches(
    steps: int, batch: int = 3, seed: int = 100, rank: int | None = None
) -> list[tuple[Tensor, Tensor]]:
    """Per-rank data (different on each rank, so averaging matters); ``rank`` (default
    this rank) picks whose, e.g. the data-parallel rank under tensor parallelism."""
    rank = dist.get_rank() if rank is None else rank
    g = torch.Generator().manual_seed(seed + 1000 * rank)
    return [
        (
            torch.randint(0, VOCAB, (batch, SEQ), generator=g),
            torch.randint(0, VOCAB, (batch, SEQ), generator=g),
        )
        for _ in range(steps)
    ]


def loss_fn(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), target.reshape(-1))


def train(
    model: nn.Module,
    data: list[tuple[Tensor, Tensor]],
    *,
    accumulate: int = 1,
    no_sync: bool = False,
    clip: float | None = None,
    clip_fn: Callable[[float], Any] | None = None,
    lr: float = 1e-2,
) -> tuple[list[float], list[float]]:
    """AdamW training; ``accumulate`` micro-batches per step (in no_sync if asked).

    Returns the losses and (if clipping) the total norms returned by the clip.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    losses: list[float] = []
    norms: list[float] = []
    it: Iterator[tuple[Tensor, Tensor]] = iter(data)
    for _ in range(len(data) // accumulate):
        for micro in range(accumulate):
            x, y = next(it)
            last = micro == accumulate - 1
            ctx: AbstractContextManager[Any] = (
                model.no_sync() if (no_sync and not last) else nullcontext()  # type: ignore[operator]
            )
            with ctx:
                loss = loss_fn(model(x), y)
                loss.backward()
            losses.append(loss.item())
        if clip is not None:
            assert clip_fn is not None
            norms.append(float(clip_fn(clip)))
        opt.step()
        opt.zero_grad()
    return losses, norms


def full_params(model: nn.Module) -> dict[str, Tensor]:
    """The full parameters by unwrapped name, for an fsdp, torch-FSDP or DDP model."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    import fsdp

    if isinstance(model, fsdp.FullyShardedDataParallel):
        with fsdp.FullyShardedDataParallel.summon_full_params(model):
            return {n: p.detach().clone() for n, p in model.named_parameters()}
    if isinstance(model, TorchFSDP):
        with TorchFSDP.summon_full_params(model):
            return {
                n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                for n, p in model.named_parameters()
            }
    from torch.distributed.tensor import DTensor

    return {
        n.removeprefix("module."): (p.full_tensor() if isinstance(p, DTensor) else p)
        .detach()
        .clone()
        for n, p in model.named_parameters()
    }


def max_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    """Largest absolute difference between two name->tensor dicts with the same keys."""
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def average_grads(model: nn.Module) -> None:
    """What DDP does to gradients, by hand: the reference for graphs DDP refuses."""
    ws = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= ws


def reference_train(
    model: nn.Module,
    data: list[tuple[Tensor, Tensor]],
    step: Callable[[nn.Module, Tensor, Tensor], Tensor],
) -> list[float]:
    """Train a plain model with by-hand gradient averaging; ``step`` returns the loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for x, y in data:
        loss = step(model, x, y)
        loss.backward()
        average_grads(model)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def fsdp_train(
    model: nn.Module,
    data: list[tuple[Tensor, Tensor]],
    step: Callable[[nn.Module, Tensor, Tensor], Tensor],
) -> list[float]:
    """Train a wrapped model with the same loop as :func:`reference_train`."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for x, y in data:
        loss = step(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
