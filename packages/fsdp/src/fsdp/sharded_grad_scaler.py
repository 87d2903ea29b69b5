"""``ShardedGradScaler``: fp16 loss scaling whose skip decision every rank shares.

``torch.amp.GradScaler`` skips ``optimizer.step()`` when the gradients it unscaled hold
an inf or a NaN, and then shrinks the scale. Under FSDP each rank unscales only its own
shard of every gradient, so an overflow that lands in one rank's shard is seen by that
rank alone: it skips the step and halves its scale while the others step and keep
theirs, and from then on the ranks train different models without any error. The
drop-in for ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`` fixes this
with one all-reduce of the found-inf flag in :meth:`ShardedGradScaler.unscale_`, so
every rank skips the same steps and keeps the same scale.

It also unscales fp16 gradients (``MixedPrecision(keep_low_precision_grads=True)``),
which ``GradScaler`` refuses, and gradients on another device than the scale (CPU
offload keeps the sharded gradients on the CPU while the scale lives on the GPU).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import GradScaler, OptState

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(GradScaler):
    """``torch.amp.GradScaler`` for sharded gradients (FSDP), agreeing across ranks.

    Use it exactly as ``GradScaler``::

        scaler = ShardedGradScaler()  # "cuda"; ShardedGradScaler("cpu") on CPU
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).sum()
        scaler.scale(loss).backward()
        scaler.unscale_(optim)  # optional: before clip_grad_norm_
        model.clip_grad_norm_(1.0)
        scaler.step(optim)  # skipped on every rank if any rank found an inf/NaN
        scaler.update()  # the same new scale on every rank

    :meth:`unscale_` (called by :meth:`step` if not called before) is a collective
    over ``process_group``: call it on every rank. Works for fp16 and bf16 gradients,
    on CPU and CUDA.

    Args:
        device: the device type of the scale (``"cuda"`` or ``"cpu"``).
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as
            ``torch.amp.GradScaler``.
        process_group: the ranks that must agree on skipping a step: the group the
            model is sharded over (the default group). ``None`` is the default group.
    """

    def __init__(  # noqa: PLR0917 (torch's ShardedGradScaler signature)
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        backoff_factor: float = 0.5,
        growth_factor: float = 2.0,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: Any = dist.group.WORLD,
    ) -> None:
        super().__init__(
            device,
            init_scale=init_scale,
            backoff_factor=backoff_factor,
            growth_factor=growth_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self.process_group = process_group

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale and agree on inf/NaN across ranks.

        After it, the optimizer's found-inf flag is the sum over every rank of the
        process group, so :meth:`step` skips on all ranks or on none and
        :meth:`update` backs off (or grows) the scale identically everywhere.
        """
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()"
            )
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step()")
        assert self._scale is not None
        inv_scale = self._scale.double().reciprocal().float()
        found_inf = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        # allow_fp16=True: low-precision sharded gradients are unscaled in place.
        per_device = self._unscale_grads_(optimizer, inv_scale, found_inf, True)
        # One flag on the scale's device, summed over ranks. Ranks may hold gradients on
        # different devices (or none at all), so per-device flags cannot be reduced
        # one by one without risking mismatched collectives.
        combined = found_inf.clone()
        for flag in per_device.values():
            combined += flag.to(combined.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(combined, group=self.process_group)
        state["found_inf_per_device"] = {combined.device: combined}
        state["stage"] = OptState.UNSCALED
