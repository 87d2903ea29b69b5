"""Bucket views: each rank's parameters packed into one contiguous tensor per device.

[Note: bucket views]
With ``parameters_as_bucket_view=True`` the trainable parameters that rank ``r``
owns on device ``d`` live back to back in one 1-D tensor ``buckets[d][r]``, and
every such parameter's ``.data`` is a view of it::

    param.data is buckets[d][r][offset : offset + param.numel()].view(param.shape)

The local optimizer updates ``param`` in place, which writes into the bucket, so
after a step the owner broadcasts ``buckets[d][r]`` whole: one collective per
rank and device instead of one per parameter, and no packing copy. The views
survive the step because nothing ever rebinds ``param.data`` except
:meth:`ParamBuckets.build` itself (anything else that does, such as
``module.to()``, detaches a parameter from its bucket).

Frozen parameters stay out of buckets: they are never stepped or sent. When a
parameter's ``requires_grad`` changes the buckets are rebuilt; a parameter
leaving a bucket gets a private copy of its data first, so it does not keep the
old bucket alive or share memory with the new one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from flatparam import FlatParameter

__all__ = ["ParamBuckets"]


class ParamBuckets:
    """Owns the bucket tensors and the views the parameters hold into them."""

    # buckets[device][rank]: 1-D tensor holding rank's trainable parameters on device;
    # None when that rank owns no trainable parameter there (nothing to send)
    buckets: dict[torch.device, list[Tensor | None]]

    def __init__(self) -> None:
        self.buckets = {}

    def build(self, params_per_rank: Sequence[Sequence[Tensor]]) -> None:
        """(Re)pack ``params_per_rank[r]``'s trainable parameters, per device.

        Called at construction, after ``add_param_group`` and whenever the set of
        trainable parameters changes; the parameter values are preserved.
        """
        for params in params_per_rank:
            for p in params:
                if not p.requires_grad and self._in_bucket(p):
                    p.data = p.data.detach().clone()
        world_size = len(params_per_rank)
        buckets: dict[torch.device, list[Tensor | None]] = {}
        for rank, params in enumerate(params_per_rank):
            by_device: dict[torch.device, list[Tensor]] = {}
            for p in params:
                if p.requires_grad:
                    by_device.setdefault(p.device, []).append(p)
            for device, members in by_device.items():
                per_rank = buckets.setdefault(device, [None] * world_size)
                per_rank[rank] = _flatten_into_views(members)
        self.buckets = buckets

    def tensors_of(self, rank: int) -> list[Tensor]:
        """The bucket tensors ``rank`` broadcasts after its step, in device order."""
        return [b[rank] for b in self.buckets.values() if b[rank] is not None]  # type: ignore[misc]

    def _in_bucket(self, param: Tensor) -> bool:
        storage = param.untyped_storage().data_ptr()
        return any(
            b is not None and b.untyped_storage().data_ptr() == storage
            for per_rank in self.buckets.values()
            for b in per_rank
        )


def _flatten_into_views(params: Sequence[Tensor]) -> Tensor:
    """Copy ``params`` into one new flat tensor and make each ``.data`` a view of it."""
    # The FlatParameter is only the packing (its data is the concatenation, laid
    # out as in flatparam's [Note: flat parameter views]); the bucket is its
    # detached data, so the views carry no autograd history.
    flat = FlatParameter(list(params), requires_grad=False)
    bucket = flat.detach()
    for p, view in zip(params, flat.get_param_views(bucket), strict=True):
        p.data = view
    return bucket
