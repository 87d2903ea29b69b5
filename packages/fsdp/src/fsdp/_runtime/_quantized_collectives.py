"""The quantized all-gather and reduce-scatter of :class:`QuantizedCommPolicy`.

Stateless, as ``_collectives.py``: each takes every tensor and the group as
arguments, issues the communication asynchronously and returns a
:class:`PendingCollective` whose ``finish`` dequantizes what arrived after the
wait, so [Note: asynchronous collectives] applies unchanged (on CUDA the
caller's side stream runs the encode before and the decode after).

- :func:`quantized_all_gather_into`: this rank encodes its shard into its row of
  a ``(world_size, nbytes)`` uint8 matrix ([Note: block-wise quantization]), the
  rows are all-gathered in place (on gloo by broadcasts, [Note: gloo's sharded
  collectives]), and every row is decoded into its rank's slot of the output.
- :func:`quantized_reduce_scatter_into`: the padded gradient's ``world_size``
  chunks are encoded (int8 rows, or a bf16 cast), exchanged by one
  ``all_to_all_single`` so that rank ``r`` receives every rank's chunk ``r``,
  then decoded and summed in fp32 in rank order. Each element is quantized
  once, where a ring reduce-scatter of quantized data would requantize a
  partial sum at every hop (qgZ's reason for the all-to-all). A rank's own
  chunk never crosses the wire, so it is neither encoded nor decoded: it
  enters the sum exact (its row of the all-to-all carries nothing of use).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fsdp._runtime._collective_failure import backend_failures
from fsdp._runtime._collectives import PendingCollective, all_gather_into
from fsdp._runtime._quantize import BlockCodec

__all__ = ["quantized_all_gather_into", "quantized_reduce_scatter_into", "wire_bytes"]


def wire_bytes(numel: int, mode: str, block_size: int) -> int:
    """Bytes one tensor of ``numel`` elements occupies on the wire in ``mode``."""
    if mode == "bf16":
        return 2 * numel
    return BlockCodec(numel, block_size).nbytes


def quantized_all_gather_into(
    output: Tensor, shard: Tensor, group: Any, *, rank: int, world_size: int, block_size: int
) -> PendingCollective:
    """Gather every rank's ``shard`` block-quantized to int8 into ``output``.

    ``output`` has ``world_size * shard.numel()`` elements of any floating
    dtype; rank ``r``'s dequantized shard lands at ``r * shard.numel()``.
    ``rank`` is this rank's index in ``group``.
    """
    n = shard.numel()
    codec = BlockCodec(n, block_size)
    wire = torch.empty(world_size, codec.nbytes, dtype=torch.uint8, device=output.device)
    codec.encode(shard.reshape(1, n), wire[rank : rank + 1])
    inner = all_gather_into(wire.view(-1), wire[rank], group)

    def finish() -> None:
        codec.decode(wire, output.view(world_size, n))
        wire.untyped_storage().resize_(0)  # the backend's work may keep the tensor object

    target = f"{output.numel():,} elements as int8 blocks ({wire.numel():,} bytes)"
    return PendingCollective(inner, (output, shard, wire), "all_gather", target, finish)


def quantized_reduce_scatter_into(
    output: Tensor,
    padded: Tensor,
    group: Any,
    *,
    rank: int,
    world_size: int,
    mode: str,
    block_size: int,
) -> PendingCollective:
    """Sum ``padded`` over ranks, each rank's part sent as ``mode`` (``"int8"`` or
    ``"bf16"``), and leave this rank's chunk in ``output`` (summed in fp32, then cast
    to ``output``'s dtype). ``rank`` is this rank's index in ``group``."""
    n = output.numel()
    chunks = padded.view(world_size, n)
    codec = BlockCodec(n, block_size)
    if mode == "bf16":
        send = chunks.to(torch.bfloat16)
    else:
        send = torch.empty(world_size, codec.nbytes, dtype=torch.uint8, device=padded.device)
        codec.encode(chunks[:rank], send[:rank])  # not our own chunk: see the module docstring
        codec.encode(chunks[rank + 1 :], send[rank + 1 :])
    received = torch.empty_like(send)
    target = f"the gradient ({padded.numel():,} elements as {mode} blocks)"
    with backend_failures("reduce_scatter", target):
        work = dist.all_to_all_single(received, send, group=group, async_op=True)

    def finish() -> None:
        exact_dtype = output.dtype == torch.float32
        total = output.view(-1) if exact_dtype else output.new_empty(n, dtype=torch.float32)
        if mode == "bf16":
            for i in range(world_size):
                row = chunks[i] if i == rank else received[i]
                if i == 0:
                    total.copy_(row)
                else:
                    total.add_(row)
        else:
            codec.decode_sum(received, total, exact=(rank, chunks[rank]))
        if not exact_dtype:
            output.view(-1).copy_(total)
        send.untyped_storage().resize_(0)
        received.untyped_storage().resize_(0)

    return PendingCollective(
        work, (output, padded, send, received), "reduce_scatter", target, finish
    )
