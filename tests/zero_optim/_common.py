"""Model, data and training loops shared by the distributed zero_optim tests.

Everything runs inside a rank of ``tests.ranks.run_ranks``. The model is tiny
(a few hundred parameters of four different sizes, so the partition is uneven)
and DDP's bucket cap is set so that, after DDP rebuilds its buckets at the end
of the first iteration, there are two gradient buckets: the first iteration
runs with DDP's initial single bucket, the later ones with the rebuilt layout,
which is what the overlap hooks must get right.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817
from torch.optim.lr_scheduler import StepLR

from zero_optim import (
    ZeroRedundancyOptimizer,
    hook_with_zero_step,
    hook_with_zero_step_interleaved,
    hook_with_zero_step_to_owners,
)

# After DDP's rebuild this cap (bytes) splits the model's gradients into two buckets.
BUCKET_CAP_MB = 512 / 2**20
STEPS = 10

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}

# How each variant builds its optimizer; overlap variants also register a hook.
PLAIN = "ddp+plain"
TORCH_ZERO = "torch zero"
TORCH_ZERO_BUCKETS = "torch zero, bucket views"
OURS = "ours"
OURS_BUCKETS = "ours, bucket views"
OURS_OVERLAP = "ours, overlap (hook_with_zero_step)"
OURS_OVERLAP_INTERLEAVED = "ours, overlap (interleaved)"
OURS_OVERLAP_INTERLEAVED_BUCKETS = "ours, overlap (interleaved), bucket views"
OURS_TO_OWNERS = "ours, overlap (reduce to owners)"
VARIANTS = (
    PLAIN,
    TORCH_ZERO,
    TORCH_ZERO_BUCKETS,
    OURS,
    OURS_BUCKETS,
    OURS_OVERLAP,
    OURS_OVERLAP_INTERLEAVED,
    OURS_OVERLAP_INTERLEAVED_BUCKETS,
    OURS_TO_OWNERS,
)
OVERLAP = {
    OURS_OVERLAP: hook_with_zero_step,
    OURS_OVERLAP_INTERLEAVED: hook_with_zero_step_interleaved,
    OURS_OVERLAP_INTERLEAVED_BUCKETS: hook_with_zero_step_interleaved,
    OURS_TO_OWNERS: None,
}


def make_model(seed: int = 0) -> nn.Sequential:
    """The same tiny MLP on every rank (same seed)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 4)
    )


def make_groups(model: nn.Sequential, scenario: str) -> Any:
    """``"simple"``: one group of every parameter. ``"groups"``: two groups with
    different learning rates and a frozen weight inside the second."""
    if scenario == "simple":
        return list(model.parameters())
    first, middle, last = model[0], model[2], model[4]
    middle.weight.requires_grad_(False)
    return [
        {"params": [first.weight, first.bias]},
        {"params": [middle.weight, middle.bias, last.weight, last.bias], "lr_scale": 0.5},
    ]


def scale_group_lrs(opt: torch.optim.Optimizer) -> None:
    """Apply ``lr_scale`` once, as user code editing param_groups would."""
    for group in opt.param_groups:
        group["lr"] = group["lr"] * group.get("lr_scale", 1.0)


def batch(step: int, rank: int, n: int = 4) -> tuple[Tensor, Tensor]:
    """Each rank's own batch for ``step``: different on every rank and step."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def build(
    variant: str, opt_name: str, scenario: str, seed: int = 0
) -> tuple[nn.Sequential, DDP, torch.optim.Optimizer]:
    """Model, DDP wrapper and optimizer for one variant, hook registered if overlapping."""
    model = make_model(seed)
    groups = make_groups(model, scenario)
    ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB)
    cls, kwargs = OPTIMIZERS[opt_name]
    opt: torch.optim.Optimizer
    if variant == PLAIN:
        opt = cls(groups, **kwargs)
    elif variant in (TORCH_ZERO, TORCH_ZERO_BUCKETS):
        opt = TorchZeRO(
            groups, cls, parameters_as_bucket_view=variant == TORCH_ZERO_BUCKETS, **kwargs
        )
    else:
        zero = ZeroRedundancyOptimizer(
            groups,
            cls,
            parameters_as_bucket_view=variant in (OURS_BUCKETS, OURS_OVERLAP_INTERLEAVED_BUCKETS),
            overlap_with_ddp=variant in OVERLAP,
            **kwargs,
        )
        wrapping = OVERLAP.get(variant)
        if wrapping is not None:
            ddp.register_comm_hook(None, wrapping(allreduce_hook, ddp, zero))
        elif variant in OVERLAP:
            ddp.register_comm_hook(None, hook_with_zero_step_to_owners(ddp, zero))
        opt = zero
    scale_group_lrs(opt)
    return model, ddp, opt


def train(
    variant: str,
    opt_name: str,
    scenario: str,
    steps: int = STEPS,
    *,
    first_step: int = 0,
    built: tuple[nn.Sequential, DDP, torch.optim.Optimizer] | None = None,
    on_step: Callable[[int, torch.optim.Optimizer], None] | None = None,
) -> tuple[list[Tensor], torch.optim.Optimizer]:
    """Train ``steps`` steps; return the final parameters and the optimizer.

    ``"groups"`` also runs a StepLR scheduler, whose edits of the wrapper's
    param_groups must reach the local optimizer.
    """
    model, ddp, opt = built if built is not None else build(variant, opt_name, scenario)
    scheduler = StepLR(opt, step_size=3, gamma=0.5) if scenario == "groups" else None
    rank = dist.get_rank()
    with warnings.catch_warnings():
        # the overlapped step runs inside backward, so StepLR never sees opt.step()
        warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
        for step in range(first_step, first_step + steps):
            x, y = batch(step, rank)
            opt.zero_grad()
            F.mse_loss(ddp(x), y).backward()
            if variant not in OVERLAP:
                opt.step()
            if scheduler is not None:
                scheduler.step()
            if on_step is not None:
                on_step(step, opt)
    return [p.detach().clone() for p in model.parameters()], opt


def state_bytes(state: Any) -> int:
    """Bytes of every tensor in an optimizer's state (``opt.state`` or a state dict's)."""
    if isinstance(state, Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(state_bytes(v) for v in state)
    return 0


def assert_same(got: list[Tensor], want: list[Tensor], what: str) -> None:
    """Bitwise equality of two parameter lists, with the worst difference on failure."""
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if not torch.equal(g, w):
            diff = (g - w).abs().max().item()
            raise AssertionError(f"{what}: parameter {i} differs by up to {diff:.3g}")


def assert_close(got: list[Tensor], want: list[Tensor], what: str) -> None:
    """Equality up to float32 rounding (a few ulps), for sums taken in another order."""
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=f"{what}: parameter {i}")
